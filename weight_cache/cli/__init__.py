"""``kvfleet cache`` and ``kvfleet artifacts``: a thin command-line layer over the weight cache's
Python API, one module per command group (``cache``, ``artifacts``) and what they share
(``common``: errors to exit codes, S3 options, the progress bar)."""

from __future__ import annotations

from kvfleet.weight_cache.cli.artifacts import artifacts
from kvfleet.weight_cache.cli.cache import cache

__all__ = ["artifacts", "cache"]
