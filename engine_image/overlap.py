"""Whether the engine starts while the weights are still being pulled: a pure decision with its
reason, logged at every launch.

With overlap the launcher starts the reference engine at once on a folder the pull fills with
verified files (kvfleet.weight_stream): the engine's own start (imports, allocation) and the load
of each shard run while later shards download, instead of after the whole pull. While the pull
runs the launcher watches the engine too (``during_pull``): an engine that exits first stops the
pull at once, and the launch fails in engine_start as it would without overlap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvfleet.spec import InferenceDeploymentSpec


@dataclass(frozen=True)
class OverlapDecision:
    on: bool
    reason: str


def decide_overlap(spec: InferenceDeploymentSpec, *, enabled: bool, artifacts_store: bool) -> OverlapDecision:
    """``enabled``: the launcher's setting; ``artifacts_store``: the launch has an artifact store."""
    if not enabled:
        return OverlapDecision(False, "off in the launcher's settings")
    if spec.engine.kind != "reference":
        # vLLM and SGLang list and open the model folder at start; they cannot wait for shards.
        return OverlapDecision(False, f"{spec.engine.kind} loads a complete model folder")
    if not spec.model.uri.startswith(("s3://", "hf://")):
        return OverlapDecision(False, "a local model is complete already: nothing to overlap")
    if artifacts_store and spec.cache.artifacts.enabled:
        # The artifacts' fingerprint holds the model digest, known only once the pull has begun,
        # and the engine's command names the artifacts directory.
        return OverlapDecision(False, "engine artifacts are on: their fingerprint needs the model first")
    return OverlapDecision(True, "the engine loads each verified shard while later ones download")


@dataclass(frozen=True)
class DuringPull:
    """What the launcher does when the pull or the engine beside it has ended."""

    action: Literal["wait", "go_on", "stop_pull"]
    reason: str


def during_pull(*, pull_ended: bool, engine_returncode: int | None) -> DuringPull:
    """The decision of the watch over a pull with the engine started beside it.

    A pull that ended (well or not) goes its usual way: its failure is the launch's, and an engine
    that died meanwhile is found at once by engine_start's own watch. An engine that exits while the
    pull runs has nothing to load the weights into: the pull is stopped rather than left to run on
    for minutes, and the engine's exit is the failure."""
    if pull_ended:
        return DuringPull("go_on", "the pull ended")
    if engine_returncode is not None:
        return DuringPull("stop_pull", f"the engine exited with code {engine_returncode} during the pull")
    return DuringPull("wait", "the pull runs and the engine is up")
