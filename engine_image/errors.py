"""The launcher's error tree: every failure names the phase it happened in and why.

A pod's log is where an operator looks first, so each failure ends the launcher with exactly one
line of the form ``kvfleet launcher failed in phase <phase>: <why>`` and a non-zero exit code.
"""

from __future__ import annotations

from typing import Literal

# The phases of a launch, in order. "spec" (reading spec.json) and "metrics" (binding the endpoint)
# come before the timed cold-start phases; "serve" is the engine running after it was ready.
Phase = Literal["spec", "metrics", "pull", "artifacts", "engine_start", "first_ready", "serve"]
TIMED_PHASES: tuple[Phase, ...] = ("pull", "artifacts", "engine_start", "first_ready")

# Exit codes of the launcher itself; an engine that exits after becoming ready keeps its own code.
EXIT_BAD_SPEC = 2
EXIT_PHASE_FAILED = 3


class LaunchError(Exception):
    """A launch that cannot go on; ``phase`` says where, the message says why."""

    exit_code = EXIT_PHASE_FAILED

    def __init__(self, phase: Phase, reason: str) -> None:
        super().__init__(reason)
        self.phase: Phase = phase
        self.reason = reason

    def one_line(self) -> str:
        # Multi-line causes (an engine's traceback) would split the failure over log lines.
        reason = " ".join(self.reason.split())
        return f"kvfleet launcher failed in phase {self.phase}: {reason}"


class SpecError(LaunchError):
    """spec.json is missing, not JSON, or not a valid InferenceDeployment spec."""

    exit_code = EXIT_BAD_SPEC

    def __init__(self, reason: str) -> None:
        super().__init__("spec", reason)


class EngineExitedError(LaunchError):
    """The engine process ended before it became ready."""

    def __init__(self, phase: Phase, returncode: int, tail: str) -> None:
        why = f"engine exited with code {returncode} before it was ready"
        super().__init__(phase, f"{why}; last output: {tail}" if tail else why)
        self.returncode = returncode
