"""``artifacts.json``: the engine's word that its artifacts directory is complete.

The launcher pushes ``--artifacts-dir`` to the bucket only once this file exists; it is written
after the compile (before the engine reports healthy) and after the runtime-weights save, which
runs in the background, has finished. It says what the directory holds, so an engine that built
nothing (compile off, no runtime weights) is not pushed as an empty artifact.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.engine.compiled_forward import CompileResult

log = logging.getLogger(__name__)

READY_FILE = "artifacts.json"


def _write(directory: Path, doc: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-{os.getpid()}-{READY_FILE}"
    tmp.write_text(json.dumps(doc, sort_keys=True))
    os.replace(tmp, directory / READY_FILE)


def mark_artifacts_ready(directory: Path, compiled: CompileResult | None, saving: threading.Thread | None) -> None:
    """Write ``artifacts.json`` now, or once ``saving`` finishes (on a daemon thread: never delays readiness)."""
    doc: dict[str, Any] = {
        "compile": None
        if compiled is None
        else {"seconds": round(compiled.seconds, 4), "cacheHit": compiled.cache_hit, "mode": compiled.mode},
        "runtimeWeights": saving is not None or (directory / "runtime.json").exists(),
    }
    doc["empty"] = doc["compile"] is None and not doc["runtimeWeights"]
    if saving is None:
        _write(directory, doc)
        return

    def after_save() -> None:
        saving.join()
        try:
            _write(directory, doc)
        except OSError as e:
            log.warning("cannot mark artifacts in %s ready: %s", directory, e)

    threading.Thread(target=after_save, name="artifacts-ready", daemon=True).start()
