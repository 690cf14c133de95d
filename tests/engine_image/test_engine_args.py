"""Argument rendering is a pure function of the spec: table tests, one row per field and engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine.kv_events import KVEventsConfig
from kvfleet.engine_image.engine_args import (
    ReferenceEngineSizing,
    RenderError,
    RenderInputs,
    render_engine_command,
)
from kvfleet.spec import InferenceDeploymentSpec

MODEL = Path("/var/cache/kvfleet/models/abc")
ART = Path("/var/cache/kvfleet/artifacts/f00")


def make_spec(kind: str, **engine: Any) -> InferenceDeploymentSpec:
    gpus = engine.pop("gpus", 0 if kind == "reference" else engine.get("tensorParallelSize", 1))
    return InferenceDeploymentSpec.model_validate(
        {"model": {"uri": "s3://bucket-a/m"}, "engine": {"kind": kind, **engine}, "resources": {"gpus": gpus}}
    )


def inputs(artifacts: Path | None = None, **kw: Any) -> RenderInputs:
    return RenderInputs(model_path=MODEL, served_name="llama", port=8000, artifacts_dir=artifacts, **kw)


def flag_value(argv: tuple[str, ...], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


# (engine kind, engine fields, flag, expected value; None means the flag must be absent)
VALUE_CASES = [
    ("vllm", {}, "--port", "8000"),
    ("vllm", {}, "--host", "0.0.0.0"),
    ("vllm", {}, "--served-model-name", "llama"),
    ("vllm", {"tensorParallelSize": 4}, "--tensor-parallel-size", "4"),
    ("vllm", {"maxModelLen": 8192}, "--max-model-len", "8192"),
    ("vllm", {}, "--max-model-len", None),
    ("vllm", {"dtype": "bfloat16"}, "--dtype", "bfloat16"),
    ("vllm", {"kvCacheDtype": "fp8"}, "--kv-cache-dtype", "fp8"),
    ("vllm", {"quantization": "awq"}, "--quantization", "awq"),
    ("vllm", {}, "--quantization", None),
    ("vllm", {"gpuMemoryUtilization": 0.85}, "--gpu-memory-utilization", "0.85"),
    ("vllm", {}, "--kv-cache-memory-bytes", None),
    # On CPU vLLM reads the utilization as a share of the whole machine: the KV cache is sized in
    # bytes from the pod's memory instead (a quarter of it; 1 GiB when unset).
    ("vllm", {"gpus": 0}, "--gpu-memory-utilization", None),
    ("vllm", {"gpus": 0}, "--kv-cache-memory-bytes", str(1 << 30)),
    ("sglang", {}, "--model-path", str(MODEL)),
    ("sglang", {"tensorParallelSize": 2}, "--tp-size", "2"),
    ("sglang", {"maxModelLen": 4096}, "--context-length", "4096"),
    ("sglang", {"kvCacheDtype": "fp8"}, "--kv-cache-dtype", "fp8_e4m3"),
    ("sglang", {"kvCacheDtype": "fp8_e5m2"}, "--kv-cache-dtype", "fp8_e5m2"),
    ("sglang", {"gpuMemoryUtilization": 0.8}, "--mem-fraction-static", "0.8"),
    ("sglang", {"quantization": "fp8"}, "--quantization", "fp8"),
    ("sglang", {}, "--served-model-name", "llama"),
    ("reference", {}, "--model", str(MODEL)),
    ("reference", {}, "--device", "cpu"),
    ("reference", {"gpus": 1}, "--device", "cuda"),
    ("reference", {"dtype": "float32"}, "--dtype", "float32"),
    # Sizes the spec does not carry are left to the engine unless the launcher's settings give them.
    ("reference", {}, "--block-size", None),
    ("reference", {}, "--kv-blocks", None),
    ("reference", {}, "--max-num-seqs", None),
    ("reference", {"maxModelLen": 2048}, "--max-model-len", "2048"),
    ("reference", {}, "--served-model-name", "llama"),
]


@pytest.mark.parametrize(("kind", "engine", "flag", "expected"), VALUE_CASES)
def test_flag_values(kind: str, engine: dict[str, Any], flag: str, expected: str | None) -> None:
    command = render_engine_command(make_spec(kind, **engine), inputs())
    assert flag_value(command.argv, flag) == expected


# (engine kind, prefix caching on?, flag that must be present, flag that must be absent)
PREFIX_CASES = [
    ("vllm", True, "--enable-prefix-caching", "--no-enable-prefix-caching"),
    ("vllm", False, "--no-enable-prefix-caching", "--enable-prefix-caching"),
    ("sglang", False, "--disable-radix-cache", None),
    ("reference", False, "--no-enable-prefix-caching", None),
]


@pytest.mark.parametrize(("kind", "enabled", "present", "absent"), PREFIX_CASES)
def test_prefix_caching(kind: str, enabled: bool, present: str, absent: str | None) -> None:
    argv = render_engine_command(make_spec(kind, enablePrefixCaching=enabled), inputs()).argv
    assert present in argv
    if absent:
        assert absent not in argv


@pytest.mark.parametrize("kind", ["sglang", "reference"])
def test_prefix_caching_on_is_the_engine_default(kind: str) -> None:
    argv = render_engine_command(make_spec(kind), inputs()).argv
    assert "--disable-radix-cache" not in argv
    assert "--no-enable-prefix-caching" not in argv


def test_vllm_cpu_kv_cache_from_memory() -> None:
    spec = InferenceDeploymentSpec.model_validate(
        {"model": {"uri": "s3://bucket-a/m"}, "engine": {"kind": "vllm"}, "resources": {"gpus": 0, "memory": "8Gi"}}
    )
    command = render_engine_command(spec, inputs())
    assert flag_value(command.argv, "--kv-cache-memory-bytes") == str(2 << 30)
    # Spawned engine processes must not import a working directory's operator/ as the stdlib's.
    assert command.env["PYTHONSAFEPATH"] == "1"


def test_vllm_finishes_requests_on_sigterm() -> None:
    # vLLM's --shutdown-timeout defaults to 0: abort everything in flight on SIGTERM.
    argv = render_engine_command(make_spec("vllm"), inputs(drain_timeout_s=599.5)).argv
    assert flag_value(argv, "--shutdown-timeout") == "600"
    assert "--shutdown-timeout" not in render_engine_command(make_spec("vllm"), inputs()).argv
    own = render_engine_command(make_spec("vllm", extraArgs=["--shutdown-timeout=5"]), inputs(drain_timeout_s=60)).argv
    assert "--shutdown-timeout" not in own and own[-1] == "--shutdown-timeout=5"


def test_vllm_cpu_kv_cache_left_to_extra_args() -> None:
    command = render_engine_command(
        make_spec("vllm", gpus=0, extraArgs=["--kv-cache-memory-bytes=1000000000"]), inputs()
    )
    assert [a for a in command.argv if a.startswith("--kv-cache-memory-bytes")] == [
        "--kv-cache-memory-bytes=1000000000"
    ]


@pytest.mark.parametrize(
    ("kind", "program"),
    [
        ("vllm", ("python3", "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL))),
        ("sglang", ("python3", "-m", "sglang.launch_server")),
        ("reference", ("kvfleet", "engine", "serve")),
    ],
)
def test_program(kind: str, program: tuple[str, ...]) -> None:
    argv = render_engine_command(make_spec(kind), inputs()).argv
    assert argv[: len(program)] == program


@pytest.mark.parametrize("kind", ["vllm", "sglang", "reference"])
def test_extra_args_come_last(kind: str) -> None:
    extra = ["--seed", "7", "--enforce-eager"]
    argv = render_engine_command(make_spec(kind, extraArgs=extra), inputs()).argv
    assert list(argv[-3:]) == extra


def test_reference_sizing_flags_left_to_extra_args() -> None:
    sizing = ReferenceEngineSizing(block_size_tokens=16, kv_blocks=1024, max_num_seqs=16)
    spec = make_spec("reference", extraArgs=["--kv-blocks=64", "--block-size", "8"])
    argv = render_engine_command(spec, inputs(reference=sizing)).argv
    assert argv.count("--block-size") == 1 and "--kv-blocks" not in argv
    assert argv[-2:] == ("--block-size", "8")
    assert flag_value(argv, "--max-num-seqs") == "16"


@pytest.mark.parametrize(
    ("sizing", "max_model_len", "kv_blocks"),
    [
        # 32768 tokens / 16 per block (the engine's default block) = 2048 blocks: one full sequence fits.
        (ReferenceEngineSizing(kv_blocks=1024), 32768, "2048"),
        (ReferenceEngineSizing(kv_blocks=1024), 2048, "1024"),
        (ReferenceEngineSizing(kv_blocks=10, block_size_tokens=4), 100, "25"),
        (ReferenceEngineSizing(), 32768, None),
    ],
)
def test_reference_kv_blocks_fit_one_full_context(
    sizing: ReferenceEngineSizing, max_model_len: int, kv_blocks: str | None
) -> None:
    argv = render_engine_command(make_spec("reference", maxModelLen=max_model_len), inputs(reference=sizing)).argv
    assert flag_value(argv, "--kv-blocks") == kv_blocks


# (engine kind, environment variable, expected value, with an artifacts dir?)
ENV_CASES = [
    ("vllm", "VLLM_CACHE_ROOT", f"{ART}/vllm", True),
    ("vllm", "TORCHINDUCTOR_CACHE_DIR", f"{ART}/inductor", True),
    ("vllm", "TRITON_CACHE_DIR", f"{ART}/triton", True),
    ("vllm", "DG_JIT_CACHE_DIR", f"{ART}/deep_gemm", True),
    ("sglang", "TORCHINDUCTOR_CACHE_DIR", f"{ART}/inductor", True),
    ("sglang", "TRITON_CACHE_DIR", f"{ART}/triton", True),
    # The reference engine points Inductor at <artifacts>/reference/inductor itself (compile_cache.py).
    ("reference", "TORCHINDUCTOR_CACHE_DIR", None, True),
    ("vllm", "VLLM_CACHE_ROOT", None, False),
    ("reference", "TORCHINDUCTOR_CACHE_DIR", None, False),
]


@pytest.mark.parametrize(("kind", "name", "expected", "with_artifacts"), ENV_CASES)
def test_artifact_environment(kind: str, name: str, expected: str | None, with_artifacts: bool) -> None:
    command = render_engine_command(make_spec(kind), inputs(ART if with_artifacts else None))
    assert command.env.get(name) == expected


def test_reference_artifacts_flag() -> None:
    argv = render_engine_command(make_spec("reference"), inputs(ART)).argv
    assert flag_value(argv, "--artifacts-dir") == f"{ART}/reference"
    assert "--artifacts-dir" not in render_engine_command(make_spec("reference"), inputs()).argv


def test_reference_drains_as_long_as_the_launcher_waits() -> None:
    # The engine must not give up on in-flight requests before the pod's drain budget is spent.
    argv = render_engine_command(make_spec("reference"), inputs(drain_timeout_s=3600.0)).argv
    assert flag_value(argv, "--drain-timeout") == "3600"
    assert "--drain-timeout" not in render_engine_command(make_spec("reference"), inputs()).argv
    own = make_spec("reference", extraArgs=["--drain-timeout", "5"])
    assert render_engine_command(own, inputs(drain_timeout_s=3600.0)).argv.count("--drain-timeout") == 1


# What the reference engine cannot do is an error naming the spec field, never a silent change.
@pytest.mark.parametrize(
    ("engine", "field"),
    [
        ({"quantization": "awq", "gpus": 1}, "spec.engine.quantization"),
        ({"kvCacheDtype": "fp8"}, "spec.engine.kvCacheDtype"),
        ({"tensorParallelSize": 2, "gpus": 2}, "spec.engine.tensorParallelSize"),
    ],
)
def test_reference_refuses_what_it_cannot_do(engine: dict[str, Any], field: str) -> None:
    with pytest.raises(RenderError) as err:
        render_engine_command(make_spec("reference", **engine), inputs())
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")


def test_notes_say_why_a_field_had_no_effect() -> None:
    command = render_engine_command(make_spec("sglang", kvCacheDtype="fp8"), inputs())
    assert any("fp8_e4m3" in note for note in command.notes)
    command = render_engine_command(make_spec("reference", gpus=1, gpuMemoryUtilization=0.5), inputs())
    assert any("gpuMemoryUtilization" in note for note in command.notes)
    assert render_engine_command(make_spec("vllm"), inputs()).notes == ()


@pytest.mark.parametrize("bad", [{"block_size_tokens": 0}, {"kv_blocks": 0}, {"max_num_seqs": 10_000}])
def test_reference_sizing_bounds(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        ReferenceEngineSizing(**bad)


def test_reference_runs_through_the_given_interpreter() -> None:
    command = ("/opt/venv/bin/python", "-m", "kvfleet.cli")
    argv = render_engine_command(make_spec("reference"), inputs(kvfleet_command=command)).argv
    assert argv[:5] == (*command, "engine", "serve")


def spec_with(kind: str, routing: dict[str, Any] | None = None, **engine: Any) -> InferenceDeploymentSpec:
    base = make_spec(kind, **engine).to_wire()
    return InferenceDeploymentSpec.model_validate({**base, "routing": routing or {}})


@pytest.mark.parametrize("kind", ["vllm", "reference"])
def test_kv_events_published_by_default_on_the_pods_port(kind: str) -> None:
    argv = render_engine_command(spec_with(kind), inputs(kv_events_port=6001)).argv
    config = json.loads(flag_value(argv, "--kv-events-config") or "{}")
    # vLLM's KVEventsConfig fields; the reference engine parses the same JSON (engine/kv_events.py).
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:6001",
        "replay_endpoint": "tcp://*:6002",  # the pod's kv-replay port: a router that joins late asks it
        "topic": "",
    }
    assert KVEventsConfig.from_json(flag_value(argv, "--kv-events-config") or "").enabled


@pytest.mark.parametrize(
    ("kind", "routing", "engine"),
    [
        ("vllm", {"kvEvents": {"enabled": False}}, {}),  # turned off
        ("reference", {"kvEvents": {"enabled": False}}, {}),
        ("vllm", {}, {"enablePrefixCaching": False}),  # no prefix cache: nothing to report
        ("sglang", {}, {}),  # no vLLM-format publisher
    ],
)
def test_kv_events_absent(kind: str, routing: dict[str, Any], engine: dict[str, Any]) -> None:
    spec = spec_with(kind, routing, **engine)
    assert not spec.publishes_kv_events
    assert "--kv-events-config" not in render_engine_command(spec, inputs()).argv


def test_kv_events_config_from_extra_args_is_used_as_given() -> None:
    own = '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","topic":"t"}'
    command = render_engine_command(spec_with("vllm", extraArgs=["--kv-events-config", own]), inputs())
    assert command.argv.count("--kv-events-config") == 1 and flag_value(command.argv, "--kv-events-config") == own
    assert any("--kv-events-config" in note and "5557" in note for note in command.notes)


def test_launcher_ports_are_distinct_and_the_events_port_reaches_the_engine() -> None:
    from kvfleet.engine_image.settings import LauncherSettings

    assert LauncherSettings().kv_events_port == 5557  # the operator's kv-events container port
    with pytest.raises(ValueError, match=r"engine_port, metrics_port, kv_events_port and kv_events_port \+ 1"):
        LauncherSettings(kv_events_port=8000)
    with pytest.raises(ValueError, match=r"kv_events_port \+ 1 \(the events' replay\) must differ"):
        LauncherSettings(kv_events_port=7999)  # its replay socket would take the engine's port
    with pytest.raises(ValueError, match=r"kv_events_port \+ 1 \(the events' replay\)"):
        LauncherSettings(kv_events_port=65535)
    with pytest.raises(ValueError, match="kv_events_port"):
        LauncherSettings(kv_events_port=0)


@pytest.mark.parametrize("dp", [["--data-parallel-size", "2"], ["--data-parallel-size=4"], ["-dp", "2"]])
def test_data_parallel_engines_publish_no_events_and_say_why(dp: list[str]) -> None:
    """vLLM offsets each data-parallel rank's events and replay ports by the rank: rank 1 would take rank 0's
    replay port and a router reads one events port per pod, so such a pod publishes none (and names none)."""
    spec = spec_with("vllm", extraArgs=dp)
    assert spec.engine.data_parallel_size > 1 and not spec.publishes_kv_events
    command = render_engine_command(spec, inputs())
    assert "--kv-events-config" not in command.argv
    assert any("--data-parallel-size" in note and "not published" in note for note in command.notes)
    one = spec_with("vllm", extraArgs=["--data-parallel-size", "1"])
    assert one.engine.data_parallel_size == 1 and one.publishes_kv_events


def test_vllms_cpu_build_compiles_without_aot_so_its_restored_inductor_cache_is_used() -> None:
    # vLLM 0.32.0's CPU build cannot load its own AOT-compiled function back (docs/engine_image.md).
    cpu = render_engine_command(make_spec("vllm", gpus=0), inputs(ART)).env
    assert cpu.get("VLLM_USE_AOT_COMPILE") == "0" and cpu["TORCHINDUCTOR_CACHE_DIR"].startswith(str(ART))
    assert "VLLM_USE_AOT_COMPILE" not in render_engine_command(make_spec("vllm"), inputs(ART)).env  # GPUs: vLLM's way
    assert "VLLM_USE_AOT_COMPILE" not in render_engine_command(make_spec("vllm", gpus=0), inputs()).env
