"""How many connections a server holds per client address, and whether to take one more.

The router's HTTP server (``router/http_server/``) and the engine's front-end guard
(``engine/connection_guard.py``) bound connections the same way: at most ``max_total`` in all and
``max_per_client`` from one address, so one client cannot take every slot from the others. The rule
and its refusal message live here, once; each server keeps its own connection set (it closes them)
and asks this for the counts. Pure and shared: the engine stays a leaf by importing only such
modules of ``kvfleet`` (tests/engine/test_leaf.py).
"""

from __future__ import annotations


class ClientConnections:
    """Connection counts by client address, against two bounds."""

    def __init__(self, max_total: int, max_per_client: int) -> None:
        if max_total < 1 or max_per_client < 1:
            raise ValueError(f"connection limits must be >= 1, got {max_total} and {max_per_client}")
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.per_client: dict[str, int] = {}

    def refusal(self, remote: str, held: int) -> str | None:
        """Why one more connection from ``remote`` is refused while the server holds ``held``, or None."""
        if held >= self.max_total:
            return f"the server holds its limit of {self.max_total} connections"
        if self.per_client.get(remote, 0) >= self.max_per_client:
            return f"{remote} holds the limit of {self.max_per_client} connections per client"
        return None

    def opened(self, remote: str) -> None:
        self.per_client[remote] = self.per_client.get(remote, 0) + 1

    def closed(self, remote: str) -> None:
        count = self.per_client.get(remote, 0) - 1
        if count > 0:
            self.per_client[remote] = count
        else:
            self.per_client.pop(remote, None)
