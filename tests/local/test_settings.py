"""Local mode's process settings per deployment."""

from __future__ import annotations

from kvfleet.local.settings import ProcessSettings, for_longest_request


def test_a_deployment_drains_as_long_as_its_longest_request() -> None:
    base = ProcessSettings(drain_wait_s=120.0, term_grace_s=30.0)
    assert for_longest_request(base, 3600).drain_wait_s == 3600.0
    assert for_longest_request(base, 3600).term_grace_s == 30.0
    assert for_longest_request(base, None) is base
