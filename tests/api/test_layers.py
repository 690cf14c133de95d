"""The API package imports no component: ``kvfleet/*.py`` and ``kvfleet/spec/`` (the API types,
shared helpers and the CLI) may import a component only inside a function (the CLI's commands do,
lazily), never when the module is imported. Otherwise ``import kvfleet.spec`` would drag in the
operator (and the operator's imports), and an arrow would point from the bottom of the house to a
room above it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

# The components, by import name (pyproject's package-dir, plus the subpackages of kvfleet that run
# a component: local mode and the development cluster).
COMPONENTS = (
    "kvfleet.operator",
    "kvfleet.autoscaler",
    "kvfleet.router",
    "kvfleet.weight_cache",
    "kvfleet.engine",
    "kvfleet.engine_image",
    "kvfleet.local",
    "kvfleet.devcluster",
)


def _import_time_nodes(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported: not inside a function or lambda
    (class bodies and module-level if/try blocks run at import time, so they are searched)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child
            stack.append(child)


def _imported_modules(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        prefix = f"{base}.{node.module}" if node.module else base
    else:
        prefix = node.module or ""
    # `from kvfleet import operator` imports the component too: name each imported name as a module.
    return [prefix, *(f"{prefix}.{alias.name}" for alias in node.names)]


def component_imports(source: str, package: str = "kvfleet") -> list[str]:
    """``line: module`` for each component a module of ``package`` imports at import time."""
    found = []
    for node in _import_time_nodes(ast.parse(source)):
        for module in _imported_modules(node, package):
            if any(module == c or module.startswith(c + ".") for c in COMPONENTS):
                found.append(f"{node.lineno}: {module}")
                break
    return found


def _api_modules(repo_root: Path) -> list[Path]:
    """The API package's modules: ``kvfleet/*.py`` and the spec's package, ``kvfleet/spec/``."""
    kvfleet = repo_root / "kvfleet"
    return sorted([*kvfleet.glob("*.py"), *(kvfleet / "spec").glob("*.py")])


def _package_of(module: Path, repo_root: Path) -> str:
    """The package a module's relative imports resolve against (``kvfleet`` or ``kvfleet.spec``)."""
    return ".".join(module.parent.relative_to(repo_root).parts)


def test_api_modules_import_no_component(repo_root: Path) -> None:
    modules = _api_modules(repo_root)
    names = {p.relative_to(repo_root / "kvfleet").as_posix() for p in modules}
    assert {"spec/__init__.py", "spec/deployment.py", "status.py", "crd.py", "cli.py", "contracts.py"} <= names
    offenders = {
        p.relative_to(repo_root).as_posix(): found
        for p in modules
        if (found := component_imports(p.read_text(), _package_of(p, repo_root)))
    }
    assert offenders == {}


def test_the_kube_layer_imports_no_component(repo_root: Path) -> None:
    """kvfleet.kube is a library layer under the operator, the router and the autoscaler: it may
    import kopf and lightkube, never a component."""
    modules = sorted((repo_root / "kvfleet" / "kube").glob("*.py"))
    assert {"client.py", "errors.py", "watch.py", "kopf_login.py"} <= {p.name for p in modules}
    offenders = {p.name: found for p in modules if (found := component_imports(p.read_text(), "kvfleet.kube"))}
    assert offenders == {}


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("from kvfleet.operator.render import render_children\n", ["1: kvfleet.operator.render"]),
        ("import kvfleet.router.server\n", ["1: kvfleet.router.server"]),
        ("from . import engine\n", ["1: kvfleet.engine"]),
        ("from .autoscaler.policy import decide\n", ["1: kvfleet.autoscaler.policy"]),
        ("from kvfleet import local\n", ["1: kvfleet.local"]),
        ("try:\n    import kvfleet.weight_cache\nexcept ImportError:\n    pass\n", ["2: kvfleet.weight_cache"]),
        ("class A:\n    from kvfleet.engine_image import launcher\n", ["2: kvfleet.engine_image"]),
        # Lazy imports inside a function (the CLI's commands) run only when called.
        ("def plan():\n    from kvfleet.operator.planning import plan_children\n", []),
        ("async def f():\n    import kvfleet.router\n", []),
        # The API's own modules and the contracts are not components.
        ("from kvfleet.spec import GROUP\nfrom kvfleet import contracts\nimport kvfleet.status\n", []),
        ("from kvfleet.engines import x\n", []),
    ],
)
def test_the_check_finds_import_time_component_imports(source: str, found: list[str]) -> None:
    assert component_imports(source) == found


def test_the_check_resolves_relative_imports_against_the_modules_package() -> None:
    # kvfleet/spec/engine.py is the spec of the engine, not the engine component.
    assert component_imports("from .engine import EngineSpec\n", "kvfleet.spec") == []
    assert component_imports("from .engine import EngineSpec\n", "kvfleet") == ["1: kvfleet.engine"]
    assert component_imports("from ..engine import core\n", "kvfleet.spec") == ["1: kvfleet.engine"]


# The folders of the product's distribution (pyproject's package-dir): what the wheel and images hold.
PRODUCT_FOLDERS = ("kvfleet", "operator", "autoscaler", "router", "weight_cache", "engine", "engine_image")


def lines_importing_testkit(source: str) -> list[int]:
    """Lines that import kvfleet_testkit anywhere in a module, functions included: the product's
    wheel and images do not carry the testkit, so even a lazy import would fail there."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(n == "kvfleet_testkit" or n.startswith("kvfleet_testkit.") for n in names):
            lines.append(node.lineno)
    return sorted(lines)


def test_product_never_imports_the_testkit(repo_root: Path) -> None:
    files = [p for folder in PRODUCT_FOLDERS for p in sorted((repo_root / folder).rglob("*.py"))]
    assert len(files) > 100
    found = {str(p.relative_to(repo_root)): lines_importing_testkit(p.read_text()) for p in files}
    offenders = {name: lines for name, lines in found.items() if lines}
    assert offenders == {}


def test_the_testkit_check_sees_lazy_imports() -> None:
    source = "import os\n\ndef f():\n    from kvfleet_testkit.engines import start_engine\n\nimport kvfleet_testkit\n"
    assert lines_importing_testkit(source) == [4, 6]
    assert lines_importing_testkit("from kvfleet.free_port import pick_free_port\nimport kvfleet_testkits\n") == []
