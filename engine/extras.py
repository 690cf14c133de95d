"""The reference engine's own packages (torch, ...) live in the distribution's ``engine`` extra, so
the control plane installs without torch. Commands that need them (``kvfleet engine serve``,
``kvfleet local up``) check first and say how to install them, instead of failing deep in an
import. Imports nothing but click and the standard library: callers run it before torch exists."""

from __future__ import annotations

import importlib.util

import click

# What `pip install 'kvfleet[engine]'` adds (pyproject.toml's engine extra), by import name.
ENGINE_MODULES = ("torch", "safetensors", "tokenizers", "jinja2")
ENGINE_INSTALL_HINT = "pip install 'kvfleet[engine]'"


def missing_engine_modules() -> list[str]:
    """The engine extra's modules this interpreter cannot import."""
    return [name for name in ENGINE_MODULES if importlib.util.find_spec(name) is None]


def require_engine_extra(what: str) -> None:
    """Exit with a usage error naming the missing packages when the engine extra is not installed."""
    missing = missing_engine_modules()
    if missing:
        raise click.ClickException(
            f"{what} needs the reference engine's packages ({', '.join(missing)} not installed): {ENGINE_INSTALL_HINT}"
        )
