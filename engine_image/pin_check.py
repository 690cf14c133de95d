"""Build-time guard for the GPU images: installing kvfleet must not change the engine's packages.

``python3 -m kvfleet.engine_image.pin_check BEFORE AFTER`` compares two ``pip freeze`` outputs and
fails naming every package whose version changed or disappeared; packages only in AFTER are fine
(kvfleet may add what the launcher needs, never move what vLLM or SGLang pinned).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# PEP 503 normalisation, so "PyYAML" and "pyyaml" are one package.
_NORMALISE = re.compile(r"[-_.]+")


def parse_freeze(text: str) -> dict[str, str]:
    """``name==version`` lines of a freeze; editable or URL installs keep their whole line as version."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "==" in line:
            name, version = line.split("==", 1)
        elif " @ " in line:
            name, version = line.split(" @ ", 1)
        else:
            continue
        out[_NORMALISE.sub("-", name.strip()).lower()] = version.strip()
    return out


def changed_packages(
    before: str, after: str, ignore: frozenset[str] = frozenset({"kvfleet"})
) -> dict[str, tuple[str, str | None]]:
    """Packages of ``before`` whose version differs in ``after`` (None: removed)."""
    old, new = parse_freeze(before), parse_freeze(after)
    return {
        name: (version, new.get(name))
        for name, version in old.items()
        if name not in ignore and new.get(name) != version
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python3 -m kvfleet.engine_image.pin_check BEFORE_FREEZE AFTER_FREEZE", file=sys.stderr)
        return 2
    changed = changed_packages(Path(argv[0]).read_text(), Path(argv[1]).read_text())
    for name, (was, now) in sorted(changed.items()):
        print(f"pin_check: {name} changed from {was} to {now or '(removed)'}", file=sys.stderr)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
