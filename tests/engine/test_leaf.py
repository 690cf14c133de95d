"""The engine is a leaf: no module of ``kvfleet.engine`` imports another kvfleet component (the
launcher, local mode, the router, ...). The only kvfleet modules outside it that it may import
are the pure shared contracts listed here, and they in turn import nothing of kvfleet."""

from __future__ import annotations

import ast
from pathlib import Path

import kvfleet.engine

ENGINE_DIR = Path(kvfleet.engine.__file__).parent
# Names and wire shapes the engine shares with the router and the autoscaler (metric names, OpenAI's
# error bodies), and the streamed model folder it shares with the weight pull: no kvfleet imports.
SHARED_CONTRACTS = frozenset(
    {
        "kvfleet.client_connections",
        "kvfleet.contracts",
        "kvfleet.openai_shape",
        "kvfleet.token_bucket",
        "kvfleet.weight_stream",
    }
)
DYNAMIC_IMPORTS = frozenset({"import_module", "__import__"})


def _is_engine(module: str) -> bool:
    return module == "kvfleet.engine" or module.startswith("kvfleet.engine.")


def kvfleet_imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) of every kvfleet module ``source`` imports; relative imports resolved against
    ``package`` (the importing module's package); ``importlib.import_module("kvfleet...")`` counts."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if module == "kvfleet":  # `from kvfleet import contracts` imports the module kvfleet.contracts
                found += [(node.lineno, f"kvfleet.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in DYNAMIC_IMPORTS and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return [(line, m) for line, m in found if m == "kvfleet" or m.startswith("kvfleet.")]


def upward_imports(source: str, package: str = "kvfleet.engine") -> list[str]:
    """The imports of ``source`` that leave the engine for anything but a shared contract."""
    return [
        f"line {line}: {module}"
        for line, module in kvfleet_imports(source, package)
        if not _is_engine(module) and module not in SHARED_CONTRACTS
    ]


def test_the_checker_catches_every_way_out() -> None:
    caught = upward_imports(
        "import os\n"
        "from kvfleet.engine_image.launch_cli import launch\n"  # a prefix of the engine's name is not the engine
        "import kvfleet.router.proxy\n"
        "from kvfleet import spec\n"
        "from .. import cli\n"
        "from ..local.models import EngineLaunch\n"
        "def f():\n"
        "    from kvfleet.extras import require_engine_extra\n"
        "    importlib.import_module('kvfleet.operator.cli')\n"
    )
    assert caught == [
        "line 2: kvfleet.engine_image.launch_cli",
        "line 3: kvfleet.router.proxy",
        "line 4: kvfleet.spec",
        "line 5: kvfleet.cli",
        "line 6: kvfleet.local.models",
        "line 8: kvfleet.extras",
        "line 9: kvfleet.operator.cli",
    ]
    allowed = (
        "from kvfleet.engine.block_pool import BlockPool\nfrom . import sampling\nfrom kvfleet.openai_shape import x\n"
    )
    assert upward_imports(allowed) == []


def test_the_engine_imports_no_other_component() -> None:
    modules = sorted(ENGINE_DIR.rglob("*.py"))
    assert len(modules) > 20, "the walk must see the engine's modules"
    found = {}
    for path in modules:
        package = ".".join(["kvfleet.engine", *path.relative_to(ENGINE_DIR).parent.parts])
        bad = upward_imports(path.read_text(), package)
        if bad:
            found[str(path.relative_to(ENGINE_DIR))] = bad
    assert found == {}, f"the engine is a leaf; these imports point up: {found}"


def test_the_shared_contracts_are_leaves_too() -> None:
    for module in SHARED_CONTRACTS:
        path = Path(kvfleet.__file__).parent / (module.removeprefix("kvfleet.").replace(".", "/") + ".py")
        assert path.exists(), module
        assert kvfleet_imports(path.read_text(), "kvfleet") == [], f"{module} must import nothing of kvfleet"


def _imports_and_attributes(name: str) -> tuple[set[str], set[str]]:
    tree = ast.parse((ENGINE_DIR / f"{name}.py").read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    return imported, attributes


def test_each_layer_reaches_only_the_one_below() -> None:
    """vLLM v1's layering: the scheduler reaches KV blocks only through the KV-cache manager; the
    model runner and the output processor never touch the pool; only the runner holds tensors."""
    imported, attributes = _imports_and_attributes("scheduler")
    assert "kvfleet.engine.block_pool" not in imported and "pool" not in attributes
    assert "torch" not in imported
    for name in ("model_runner", "output_processor"):
        imported, attributes = _imports_and_attributes(name)
        assert "kvfleet.engine.block_pool" not in imported and "pool" not in attributes, name
        assert "kvfleet.engine.kv_cache_manager" not in imported, name
    imported, _ = _imports_and_attributes("output_processor")
    assert "torch" not in imported and "kvfleet.engine.metrics" not in imported


def test_engine_modules_stay_small() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in ENGINE_DIR.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n >= 400} == {}
