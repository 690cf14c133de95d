"""moto's S3 server on a free loopback port (real HTTP for real boto3), for the tests and benchmarks that need S3."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from moto.server import ThreadedMotoServer

from kvfleet.free_port import pick_free_port


@contextmanager
def moto_s3_server() -> Iterator[str]:
    """Start the server; yields its endpoint URL and stops it on the way out."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    port = pick_free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
