"""Every engine field of the spec, with each allowed value that applies on CPU (``engine.kind: vllm``,
``resources.gpus: 0``), against vLLM's own checks: the launcher's command (``render_vllm``, as the
pod runs it) goes through vLLM's server argument parser, ``validate_parsed_serve_args`` and
``create_engine_config`` -- everything ``vllm.entrypoints.openai.api_server`` checks before it starts
the engine core -- in one vLLM interpreter (tests/vllm/vllm_config_check.py) for the whole matrix.

What kvfleet accepts, vLLM accepts; what vLLM refuses, ``kvfleet validate`` refuses first, naming the
field. One exception, and the test pins it: ``maxModelLen`` above the checkpoint's own limit
(``max_position_embeddings``) is a property of the model, which ``kvfleet validate`` cannot read;
vLLM refuses it at start naming ``max_model_len``.

Checked by config validation only (no weights loaded, nothing served): dtype, kvCacheDtype,
quantization (awq, gptq and compressed-tensors against a copy of the tiny model whose config.json
declares that method's quantization_config, as such a checkpoint does; fp8 is vLLM's online
quantization of an unquantized checkpoint), enablePrefixCaching false, maxModelLen,
gpuMemoryUtilization (ignored on CPU: the KV cache is sized from resources.memory), the drain
timeout, KV events off. Checked by a serving start as well: the common combination -- dtype float32,
maxModelLen 512, prefix caching and KV events on, the drain timeout -- through the launcher
(test_vllm_launcher.py) and local mode (test_vllm_local.py, which reads the events)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine_image.engine_args import RenderInputs, render_vllm
from kvfleet.local.models import VLLM_TINY_MODEL
from kvfleet.spec import InferenceDeploymentSpec
from kvfleet.validation import validate_spec
from tests.vllm.vllm_config_check import RESULT_PREFIX

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
CHECK_SCRIPT = Path(__file__).with_name("vllm_config_check.py")
CHECK_TIMEOUT_S = 600.0  # vLLM's import (~30 s alone) and ~30 config checks, on 2 shared cores
MODEL_MAX_LEN = 2048  # the tiny model's max_position_embeddings (its default)

# The quantization_config a checkpoint of each method carries (the tiny model's shapes divide the
# group size); vLLM reads it at config time and refuses the method without it.
CHECKPOINT_QUANTIZATION: dict[str, dict[str, Any]] = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
            }
        },
        "ignore": ["lm_head"],
    },
}

# (case id, engine fields, routing fields); every field at a value other than its default, one at a time.
ACCEPTED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    *[(f"dtype-{v}", {"dtype": v}, {}) for v in ("auto", "float16", "bfloat16", "float32")],
    *[(f"kvCacheDtype-{v}", {"kvCacheDtype": v}, {}) for v in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")],
    *[(f"quantization-{v}", {"quantization": v}, {}) for v in ("fp8", *CHECKPOINT_QUANTIZATION)],
    ("enablePrefixCaching-false", {"enablePrefixCaching": False}, {}),
    *[(f"maxModelLen-{v}", {"maxModelLen": v}, {}) for v in (1, 512, MODEL_MAX_LEN)],
    ("tensorParallelSize-1", {"tensorParallelSize": 1}, {}),
    ("gpuMemoryUtilization-0.5", {"gpuMemoryUtilization": 0.5}, {}),
    ("maxRequestSeconds-3600", {"maxRequestSeconds": 3600}, {}),
    ("kvEvents-off", {}, {"kvEvents": {"enabled": False}}),
    ("launcher-test-combination", {"dtype": "float32", "maxModelLen": 512}, {}),
]
# Values the spec allows that vLLM refuses: kvfleet refuses them for engine.kind vllm, naming the field.
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("quantization-bitsandbytes", {"quantization": "bitsandbytes"}, "spec.engine.quantization"),
    ("quantization-marlin", {"quantization": "marlin"}, "spec.engine.quantization"),
]
# The model-dependent limit kvfleet cannot check (see the module docstring).
BEYOND_MODEL = ("maxModelLen-beyond-the-model", {"maxModelLen": 2 * MODEL_MAX_LEN}, "max_model_len")


def _spec(engine: dict[str, Any], routing: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "model": {"uri": "s3://models-bucket/tiny"},
        "engine": {"kind": "vllm", **engine},
        "resources": {"gpus": 0, "memory": "4Gi"},
        "routing": routing or {},
    }


def _argv(spec: InferenceDeploymentSpec, model: Path) -> tuple[list[str], dict[str, str]]:
    """The launcher's vLLM command for the spec (less the interpreter and module), and its environment."""
    max_request = spec.engine.max_request_seconds or 600
    command = render_vllm(
        spec, RenderInputs(model_path=model, served_name="tiny", port=8000, drain_timeout_s=float(max_request))
    )
    assert command.argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server"), command.argv
    return list(command.argv[3:]), dict(command.env)


def _quantized_copy(model: Path, method: str, root: Path) -> Path:
    """The tiny model with ``method``'s quantization_config in config.json (no weights are read)."""
    copy = root / f"model-{method}"
    shutil.copytree(model, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = CHECKPOINT_QUANTIZATION[method]
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def _vllm_checks(argvs: list[list[str]], env: dict[str, str], cwd: Path) -> list[dict[str, Any]]:
    """vLLM's own checks of every argv, in one interpreter started from a neutral directory."""
    done = subprocess.run(
        [sys.executable, str(CHECK_SCRIPT)],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **env, "PYTHONSAFEPATH": "1"},
        timeout=CHECK_TIMEOUT_S,
        check=False,
    )
    results = [
        json.loads(line[len(RESULT_PREFIX) :]) for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)
    ]
    assert done.returncode == 0 and len(results) == len(argvs), (
        done.returncode,
        done.stdout[-3000:],
        done.stderr[-3000:],
    )
    return results


def test_every_engine_field_kvfleet_accepts_passes_vllms_checks(vllm_installed: None, tmp_path: Path) -> None:
    from kvfleet.engine.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", **VLLM_TINY_MODEL)
    config = json.loads((model / "config.json").read_text())
    assert config["max_position_embeddings"] == MODEL_MAX_LEN

    cases: list[tuple[str, list[str], dict[str, str]]] = []  # (case id, argv, environment)
    for case_id, engine, routing in ACCEPTED:
        spec, problems = validate_spec(_spec(engine, routing))
        assert spec is not None, (case_id, [str(p) for p in problems])
        method = engine.get("quantization")
        path = _quantized_copy(model, method, tmp_path) if method in CHECKPOINT_QUANTIZATION else model
        cases.append((case_id, *_argv(spec, path)))
    by_id = {case_id: argv for case_id, argv, _ in cases}
    assert "--kv-events-config" in by_id["dtype-auto"] and "--kv-events-config" not in by_id["kvEvents-off"]
    env = cases[0][2]
    assert all(case[2] == env for case in cases)  # one interpreter serves them all
    for case_id, engine, field in REFUSED:
        spec, problems = validate_spec(_spec(engine))
        assert spec is None and [p.path for p in problems] == [field], (case_id, problems)
        # vLLM refuses it too: render what the spec would have run, past kvfleet's check.
        accepted = InferenceDeploymentSpec.model_validate(_spec({}))
        bypassed = accepted.model_copy(update={"engine": accepted.engine.model_copy(update=engine)})
        cases.append((case_id, _argv(bypassed, model)[0], env))
    beyond_id, beyond_engine, vllm_name = BEYOND_MODEL
    beyond, problems = validate_spec(_spec(beyond_engine))
    assert beyond is not None, problems
    cases.append((beyond_id, _argv(beyond, model)[0], env))

    checked = _vllm_checks([argv for _, argv, _ in cases], env, tmp_path)
    results = dict(zip([case_id for case_id, _, _ in cases], checked, strict=True))
    for case_id, result in results.items():
        print(f"{case_id}: {'ok' if result['ok'] else result['error'][:200]}")

    refused_by_vllm = {case_id: r["error"] for case_id, r in results.items() if not r["ok"]}
    expected_refusals = {case_id for case_id, _, _ in REFUSED} | {beyond_id}
    assert set(refused_by_vllm) == expected_refusals, refused_by_vllm
    for case_id, _, _ in REFUSED:
        assert "Unknown quantization method" in refused_by_vllm[case_id], refused_by_vllm[case_id]
    assert vllm_name in refused_by_vllm[beyond_id], refused_by_vllm[beyond_id]


def test_tensor_parallelism_on_cpu_is_refused_naming_the_field() -> None:
    """tensorParallelSize > 1 with gpus 0 never reaches vLLM: kvfleet refuses it, naming the field."""
    spec, problems = validate_spec(_spec({"tensorParallelSize": 2}))
    assert spec is None and [p.path for p in problems] == ["spec.engine.tensorParallelSize"], problems
