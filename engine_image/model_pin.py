"""The model digest the deployment pinned: one file the operator's pin ConfigMap puts in the pod.

The operator writes the digest the first Ready pod of a model served (operator/pin.py); the file is
empty until then, and absent outside Kubernetes (local mode, a bare ``kvfleet engine launch``). The
launcher reads it at each start, so a pin written after the pod was created still holds on restart.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvfleet import contracts

from .errors import LaunchError

DEFAULT_PIN_PATH = Path(contracts.PIN_MOUNT_DIR) / contracts.PIN_KEY
MAX_PIN_BYTES = 1024  # a digest is 64 characters; anything much longer is not one
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def read_pin(path: Path) -> str | None:
    """The pinned digest, or None when nothing is pinned (no file, or an empty one).

    Raises ``LaunchError`` (phase pull) when the file holds something that is not a sha256 digest:
    a pin that cannot be read must stop the launch, never be taken as "no pin"."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_PIN_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise LaunchError("pull", f"cannot read the pinned model digest at {path}: {e.strerror or e}") from e
    text = raw.decode("utf-8", "replace").strip()
    if not text:
        return None
    if len(raw) > MAX_PIN_BYTES or not _DIGEST.match(text):
        shown = text[:80] + ("..." if len(text) > 80 else "")
        raise LaunchError("pull", f"the pinned model digest at {path} is not a sha256 hex digest: {shown!r}")
    return text


def pin_refusal(served: str, pinned: str, where: str) -> str:
    """The one reason every refusal of other weights gives (the launcher's log and exit line)."""
    return (
        f"{where}: model digest is {served}, but this deployment pinned {pinned} (status.modelDigest); "
        "refusing to load other weights. Restore the pinned model at this location, or change spec.model "
        "(uri or revision) to start a new pin"
    )
