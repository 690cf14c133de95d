"""Whether the engine starts while the weights are still being pulled: a pure decision with its
reason, logged at every launch.

With overlap the launcher starts the reference engine at once on a folder the pull fills with
verified files (kvfleet.weight_stream): the engine's own start (imports, allocation) and the load
of each shard run while later shards download, instead of after the whole pull."""

from __future__ import annotations

from dataclasses import dataclass

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
