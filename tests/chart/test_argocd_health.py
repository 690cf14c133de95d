"""The Argo CD health check (Lua) maps InferenceDeployment conditions to Argo CD health.

Run with Lua 5.1, the language version of gopher-lua, which Argo CD embeds; the cases are Argo
CD's own resource-customization test format (health_test.yaml + testdata/).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa.lua51 as lua51
import pytest
import yaml

from kvfleet.spec import InferenceDeploymentSpec
from kvfleet.status import InferenceDeploymentStatus

from .conftest import CHART, REPO_ROOT

ARGOCD = CHART / "argocd"
SCRIPT = (ARGOCD / "health.lua").read_text()
CASES = yaml.safe_load((ARGOCD / "health_test.yaml").read_text())["tests"]


def to_lua(runtime: lua51.LuaRuntime, value: Any) -> Any:
    """Python -> Lua the way Argo CD hands objects to scripts: maps and arrays become tables."""
    if isinstance(value, dict):
        return runtime.table_from({k: to_lua(runtime, v) for k, v in value.items()})
    if isinstance(value, list):
        return runtime.table_from([to_lua(runtime, v) for v in value])
    return value


def health(obj: dict[str, Any]) -> dict[str, str]:
    runtime = lua51.LuaRuntime(unpack_returned_tuples=True)
    runtime.globals().obj = to_lua(runtime, obj)
    result = runtime.execute(SCRIPT)
    return dict(result.items())


@pytest.mark.parametrize("case", CASES, ids=[Path(c["inputPath"]).stem for c in CASES])
def test_health_of_sample_statuses(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((ARGOCD / case["inputPath"]).read_text())
    # The samples are objects the operator could really write: spec and status parse with the API types.
    InferenceDeploymentSpec.model_validate(obj["spec"])
    if "status" in obj:
        InferenceDeploymentStatus.model_validate(obj["status"])
    assert health(obj) == case["healthStatus"]


def test_every_sample_is_a_case() -> None:
    samples = {p.name for p in (ARGOCD / "testdata").glob("*.yaml")}
    assert samples == {Path(c["inputPath"]).name for c in CASES}
    assert {c["healthStatus"]["status"] for c in CASES} == {"Healthy", "Progressing", "Degraded"}


def test_script_uses_only_lua51() -> None:
    # Lua 5.2+ syntax that gopher-lua would refuse at load time.
    for construct in ("goto ", "//", "<const>", "<close>", "utf8."):
        assert construct not in SCRIPT


def test_docs_carry_the_script_verbatim() -> None:
    doc = (REPO_ROOT / "docs" / "argocd.md").read_text()
    indented = "\n".join(("    " + line) if line else "" for line in SCRIPT.rstrip("\n").splitlines())
    assert indented in doc, "docs/argocd.md's argocd-cm example must embed charts/kvfleet/argocd/health.lua"
