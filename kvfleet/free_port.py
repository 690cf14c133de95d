"""A free TCP port on a local address, for servers kvfleet starts on this machine (local mode's
engines and Prometheus, the development cluster's control plane) and for the tests and benchmarks
that start real servers."""

from __future__ import annotations

import socket


def pick_free_port_pair(host: str = "127.0.0.1", attempts: int = 20) -> int:
    """A port ``p`` with ``p + 1`` free too (an engine's KV events and their replay socket), by the same
    rule as ``pick_free_port``: free now, not reserved."""
    for _ in range(attempts):
        port = pick_free_port(host)
        if port >= 65_535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise OSError(f"no two consecutive free ports on {host} in {attempts} attempts")


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free now; another process may bind it before the caller does, so a
    caller that cannot bear that retries on a bind error."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
