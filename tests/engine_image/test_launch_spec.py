"""spec.json: the contract's format is read; every mistake names the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine_image.errors import SpecError
from kvfleet.engine_image.launch_spec import load_launch_spec, parse_launch_spec

SPEC: dict[str, Any] = {
    "model": {"uri": "file:///models/tiny"},
    "engine": {"kind": "reference"},
    "resources": {"gpus": 0},
}


def test_reads_the_contract_format(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"name": "tiny", "namespace": "ml", "servedName": "tiny-chat", "spec": SPEC}))
    launch = load_launch_spec(path)
    assert (launch.name, launch.namespace, launch.served_name) == ("tiny", "ml", "tiny-chat")
    assert launch.spec.engine.kind == "reference"
    assert launch.spec.engine.enable_prefix_caching  # defaults filled


def test_served_name_defaults_to_the_spec_then_the_name() -> None:
    assert parse_launch_spec({"name": "tiny", "spec": SPEC}).served_name == "tiny"
    spec = {**SPEC, "model": {"uri": "file:///m", "servedName": "chat"}}
    assert parse_launch_spec({"name": "tiny", "spec": spec}).served_name == "chat"


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ([], "must be a JSON object"),
        ({"spec": SPEC}, "lacks name"),
        ({"name": "x", "spec": SPEC, "sepc": {}}, "unknown keys ['sepc']"),
        ({"name": "", "spec": SPEC}, "name:"),
        ({"name": "x", "spec": {**SPEC, "engine": {"kind": "reference", "dtype": "fp4"}}}, "spec.engine.dtype"),
        ({"name": "x", "spec": {**SPEC, "resources": {"gpus": 0, "gpuz": 1}}}, "spec.resources.gpuz"),
        ({"name": "x", "spec": {**SPEC, "model": {"uri": "ftp://x"}}}, "spec.model.uri"),
    ],
)
def test_mistakes_name_the_field(doc: Any, needle: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_launch_spec(doc)
    assert needle in str(err.value)
    assert err.value.one_line().startswith("kvfleet launcher failed in phase spec: ")
    assert err.value.exit_code == 2


def test_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        load_launch_spec(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_launch_spec(bad)
