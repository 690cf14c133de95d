"""Where local engines' weights come from, and refusals that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.local.models import LocalModelError, engine_launch, resolve_model
from kvfleet.resource import InferenceDeployment


def deployment(uri: str, *, tiny: bool = False, **spec: object) -> InferenceDeployment:
    annotations = {"kvfleet.io/make-tiny-model": "true"} if tiny else {}
    return InferenceDeployment.model_validate(
        {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "tiny", "annotations": annotations},
            "spec": {"model": {"uri": uri}, "engine": {"kind": "reference"}, "resources": {"gpus": 0}, **spec},
        }
    )


def test_relative_file_uri_resolves_from_cwd(tmp_path: Path) -> None:
    (tmp_path / "models" / "m").mkdir(parents=True)
    assert resolve_model(deployment("file://models/m"), tmp_path, tmp_path).path == tmp_path / "models" / "m"


def test_missing_path_builds_tiny_model_only_when_annotated(tmp_path: Path) -> None:
    built: list[Path] = []
    with pytest.raises(LocalModelError, match=r"spec.model.uri: .* does not exist"):
        resolve_model(deployment("file://m"), tmp_path, tmp_path, make_tiny=built.append)
    assert built == []
    resolved = resolve_model(deployment("file://m", tiny=True), tmp_path, tmp_path, make_tiny=built.append)
    assert built == [tmp_path / "m"] and resolved.path == tmp_path / "m"


def test_cluster_only_sources_are_refused(tmp_path: Path) -> None:
    with pytest.raises(LocalModelError, match=r"spec.model.uri: pvc:// models need a cluster"):
        resolve_model(deployment("pvc://claim/model"), tmp_path, tmp_path)


def test_engine_command_and_refusals(tmp_path: Path) -> None:
    d = deployment("file:///m", engine={"kind": "reference", "extraArgs": ["--max-num-seqs=8"]})
    argv = engine_launch(d, Path("/m")).argv(1234)
    assert argv[1:5] == ["-m", "kvfleet.cli", "engine", "serve"]
    assert argv[argv.index("--port") + 1] == "1234" and argv[argv.index("--model") + 1] == "/m"
    assert argv[argv.index("--served-model-name") + 1] == "tiny" and argv[-1] == "--max-num-seqs=8"
    secret = deployment(
        "file:///m",
        engine={
            "kind": "reference",
            "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
        },
    )
    with pytest.raises(LocalModelError, match=r"spec.engine.env\[0\].valueFrom"):
        engine_launch(secret, Path("/m"))


def test_cpu_quantity_sets_engine_threads() -> None:
    from kvfleet.local.models import cpu_threads

    assert [cpu_threads(q) for q in ("1", "500m", "2.5", None, "1k")] == [1, 1, 3, None, None]
    d = deployment("file:///m", resources={"gpus": 0, "cpu": "2"}, engine={"kind": "reference", "maxModelLen": 512})
    argv = engine_launch(d, Path("/m")).argv(1)
    assert argv[argv.index("--threads") + 1] == "2" and argv[argv.index("--max-model-len") + 1] == "512"


def test_engines_publish_kv_events_on_loopback_where_the_router_can_tokenize(tmp_path: Path) -> None:
    import json

    from kvfleet.local.routing import local_router_settings
    from kvfleet.router.settings import RouterSettings

    with_tokenizer = tmp_path / "with"
    with_tokenizer.mkdir()
    (with_tokenizer / "tokenizer.json").write_text("{}")
    launch = engine_launch(deployment("file:///m"), with_tokenizer)
    assert launch.kv_events
    argv = launch.argv(1234, 5600)
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    # Loopback, which the reference engine binds: the events (prompts' token ids) stay on this machine.
    assert config["endpoint"] == "tcp://127.0.0.1:5600" and config["enable_kv_cache_events"] is True
    assert "--kv-events-config" not in launch.argv(1234)  # no events port given: none published
    # No tokenizer for the router, events off in the spec, or the user's own config: none of ours.
    without = [
        engine_launch(deployment("file:///m"), tmp_path),
        engine_launch(deployment("file:///m", routing={"kvEvents": {"enabled": False}}), with_tokenizer),
        engine_launch(
            deployment("file:///m", engine={"kind": "reference", "extraArgs": ["--kv-events-config={}"]}),
            with_tokenizer,
        ),
    ]
    assert [w.kv_events for w in without] == [False, False, False]
    base = RouterSettings(port=0)
    settings = local_router_settings(base, [deployment("file:///m")], {"tiny": launch})
    assert settings.kv_events_tokenizers == {"tiny": str(with_tokenizer)}
    assert settings.kv_events_announced_only and settings.kv_events_port is not None
    assert local_router_settings(base, [deployment("file:///m")], {"tiny": without[0]}) == base
