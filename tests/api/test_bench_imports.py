"""Every name a benchmark imports from the product still exists, in every function of it.

Benchmarks are run by hand, and most import the product inside ``main`` (so ``--help`` is fast),
so neither ``--help`` nor importing the script would notice a module a refactor moved or a class it
renamed: the benchmark would break the next time someone runs it for a figure. This walks every
import statement of ``bench/**/*.py`` and resolves it against the installed product.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
PRODUCT = ("kvfleet", "kvfleet_testkit")


def _product_imports(path: Path) -> Iterator[tuple[int, str, str | None]]:
    """(line, module, name or None) for each import of the product, wherever it stands."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in PRODUCT:
                for alias in node.names:
                    yield node.lineno, node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PRODUCT:
                    yield node.lineno, alias.name, None


@pytest.mark.parametrize("script", sorted(BENCH.rglob("*.py")), ids=lambda p: str(p.relative_to(BENCH)))
def test_every_product_import_of_a_benchmark_resolves(script: Path) -> None:
    missing = []
    for line, module_name, name in _product_imports(script):
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            missing.append(f"{script.name}:{line}: import {module_name}: {e}")
            continue
        if name is not None and name != "*" and not hasattr(module, name):
            try:
                importlib.import_module(f"{module_name}.{name}")  # a submodule imported by name
            except ImportError:
                missing.append(f"{script.name}:{line}: {module_name} has no {name}")
    assert not missing, "\n".join(missing)


def test_the_walk_finds_imports_inside_functions() -> None:
    # The benchmarks' imports mostly sit inside main(): the walk must see them, or the test passes vacuously.
    found = [m for script in BENCH.rglob("*.py") for _, m, _ in _product_imports(script)]
    assert len(found) > 30 and "kvfleet.router.picking" in found, found
