"""How talking to a replica fails, as one tree: what was sent, and whether a wait ran out.

Its own module because it is the client's contract with the rest of the router: ``forward.py`` maps
these to answers and metrics in one place (``upstream_failure``) and never needs the pool's insides.
"""

from __future__ import annotations


class UpstreamIOError(Exception):
    """Talking to a replica failed."""

    is_timeout = False  # a wait ran out (as opposed to a refusal or a broken connection)


class UpstreamPoolTimeoutError(UpstreamIOError):
    """Every connection the pool may hold to the replica stayed in use for ``pool_wait_timeout_s``:
    nothing was sent."""

    is_timeout = True


class UpstreamConnectError(UpstreamIOError):
    """No connection could be made: nothing was sent."""


class UpstreamConnectTimeoutError(UpstreamConnectError):
    """The TCP (or TLS) connect took longer than ``connect_timeout_s``: nothing was sent."""

    is_timeout = True


class UpstreamClosedError(UpstreamIOError):
    """The connection closed or broke before the response was complete."""


class UpstreamTimeoutError(UpstreamIOError):
    """The replica sent nothing for longer than the read timeout."""

    is_timeout = True
