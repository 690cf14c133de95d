"""Coverage-guided fuzz target (atheris) for the router's HTTP front end: bytes in, split into reads,
through llhttp and the server's own bounds and framing checks, to the handler.

It checks that no input makes the server raise, and that whatever the server writes back is
well-formed HTTP/1.1 (read with h11 as a client would). Run it longer with
``scripts/fuzz-front-end [libFuzzer flags]``; tests/router/test_front_end_fuzz.py runs a short one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

with atheris.instrument_imports():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import httptools  # noqa: F401 - instrumented with the server
    from support.front_end_harness import check_responses, serve_bytes

    from kvfleet.router import http_server  # noqa: F401


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    cuts = fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 4), 0, 4096)
    raw = fdp.ConsumeBytes(fdp.remaining_bytes())
    pieces, at = [], 0
    for cut in sorted(cuts):
        if at < cut < len(raw):
            pieces.append(raw[at:cut])
            at = cut
    pieces.append(raw[at:])
    served = serve_bytes(pieces)
    check_responses(served.output)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
