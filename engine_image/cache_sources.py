"""The launcher's weights and artifacts through ``kvfleet.weight_cache`` (S3 and the node cache).

Where a model's weights are in the bucket:

- ``s3://bucket/prefix`` models are pulled from that location (populated with
  ``kvfleet cache populate``: a manifest plus the files);
- ``hf://org/name`` models are served from the deployment's cache bucket at
  ``s3://<cache.bucket>/<cache.prefix>hf/<org>/<name>/<revision or main>`` (``cache_uri_for``); pods
  never reach the Hugging Face hub themselves (a populate job does, once).

Weight-cache errors become :class:`LaunchError` in the ``pull`` phase here, once; artifact errors
become misses (artifacts make a start faster, they never make it fail), and artifacts that are not
signed by a trusted key, or do not match what was signed, are refused with the reason.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from kvfleet.spec import InferenceDeploymentSpec
from kvfleet.weight_cache import (
    ArtifactOffer,
    ChecksumMismatchError,
    DigestMismatchError,
    InvalidLocationError,
    NodeCacheSettings,
    PullSettings,
    S3Settings,
    WeightCacheError,
    describe_artifact,
    make_client,
    pull_artifacts,
    pull_model,
    push_artifacts,
)
from kvfleet.weight_cache.artifact_node import keep_node_copy, restore_node_copy
from kvfleet.weight_cache.artifacts import ArtifactPullResult
from kvfleet.weight_cache.fingerprint import Fingerprint
from kvfleet.weight_cache.progress import TransferProgress
from kvfleet.weight_cache.s3 import S3Client, cache_uri_for
from kvfleet.weight_cache.signing import ArtifactSigner, ArtifactTrust

from .errors import LaunchError
from .launch_spec import LaunchSpec
from .model_pin import pin_refusal
from .settings import LauncherSettings
from .sources import PulledWeights

log = logging.getLogger(__name__)


def weights_location(spec: InferenceDeploymentSpec) -> str:
    """The s3:// location the weights are pulled from (see the module docstring): one layout,
    ``cache_uri_for``'s, shared with everything else that names where an hf:// model is cached."""
    uri = spec.model.uri
    if not uri.startswith(("s3://", "hf://")):
        raise LaunchError("pull", f"{uri} is not pulled through the weight cache (only s3:// and hf:// are)")
    if uri.startswith("hf://") and spec.cache.bucket is None:
        raise LaunchError(
            "pull",
            f"{uri}: hf:// models are served through the weight cache; set spec.cache.bucket and populate it "
            "with `kvfleet cache populate hf://... s3://<bucket>/<prefix>hf/<org>/<name>/<revision or main>`",
        )
    try:
        return cache_uri_for(uri, spec.model.revision, spec.cache)
    except InvalidLocationError as e:
        raise LaunchError("pull", str(e)) from None


def s3_settings(spec: InferenceDeploymentSpec) -> S3Settings:
    """The spec's endpoint and region; credentials come from boto3's chain (the pod's AWS_* env)."""
    return S3Settings(endpoint_url=spec.cache.s3_endpoint, region=spec.cache.region)


def node_cache_settings(spec: InferenceDeploymentSpec) -> NodeCacheSettings:
    limit = spec.cache.node_cache.size_limit
    if not limit:
        return NodeCacheSettings()
    # Imported here: the kubernetes package is slow to import, and most specs set no limit.
    from kubernetes.utils.quantity import parse_quantity

    return NodeCacheSettings(size_limit_bytes=int(parse_quantity(limit)))


class CacheWeights:
    """Pulls s3:// and hf:// models into the node cache, holding a lease while the engine serves."""

    def __init__(self, node_cache_root: Path, client: S3Client | None = None, settings: PullSettings | None = None):
        self._root = node_cache_root
        self._client = client
        self._settings = settings

    def pull(self, launch: LaunchSpec, progress: TransferProgress) -> PulledWeights:
        return self._pull(launch, progress, None)

    def pull_streaming(
        self, launch: LaunchSpec, progress: TransferProgress, stream_link: Path, stop: threading.Event | None = None
    ) -> PulledWeights:
        """As ``pull``, while ``stream_link`` fills with each file the moment its sha256 matched;
        ``stop`` ends the download early (``pull_model``)."""
        return self._pull(launch, progress, stream_link, stop)

    def _pull(
        self,
        launch: LaunchSpec,
        progress: TransferProgress,
        stream_link: Path | None,
        stop: threading.Event | None = None,
    ) -> PulledWeights:
        spec = launch.spec
        location = weights_location(spec)
        settings = self._settings or PullSettings(
            allow_pickle=spec.model.allow_pickle, verify_on_hit=spec.cache.node_cache.verify_on_hit
        )
        try:
            pulled = pull_model(
                location,
                self._root,
                settings,
                node_cache_settings=node_cache_settings(spec),
                s3=s3_settings(spec),
                client=self._client,
                progress=progress,
                expected_digest=launch.pinned_digest,
                stream_link=stream_link,
                stop=stop,
            )
        except DigestMismatchError as e:
            # Refused on the manifest, before a byte of the other weights was fetched or loaded.
            raise LaunchError("pull", pin_refusal(e.found, e.expected, location)) from e
        except ChecksumMismatchError as e:
            raise LaunchError("pull", f"checksum failed for {location}: {e}") from e
        except WeightCacheError as e:
            raise LaunchError("pull", f"{location}: {e}") from e
        fetched = pulled.result.downloaded_bytes if pulled.result is not None else 0
        check = pulled.check
        detail: dict[str, object] = {
            "verify": check.mode,
            "verifySeconds": round(check.seconds, 4),
            "hashedBytes": check.hashed_bytes,
        }
        if check.refused_count:
            detail.update(refusedFiles=check.refused_count, refused=list(check.reasons))
        return PulledWeights(
            path=pulled.path,
            digest=pulled.digest,
            source="node-cache" if pulled.hit else "s3",
            bytes_fetched=fetched,
            release=pulled.release,
            check=detail,
            refused_files=check.refused_count,
        )


class CacheArtifacts:
    """Artifacts under ``s3://<cache.bucket>/<cache.artifacts.prefix>``, signed node copies under
    ``node_root``; loaded only when signed by a key in ``trust`` (weight_cache/signing.py)."""

    def __init__(
        self,
        client: S3Client,
        location: str,
        trust: ArtifactTrust,
        node_root: Path,
        signer: ArtifactSigner | None = None,
    ) -> None:
        self._client = client
        self._location = location
        self._trust = trust
        self._node_root = node_root
        self._signer = signer

    @classmethod
    def for_spec(
        cls, spec: InferenceDeploymentSpec, settings: LauncherSettings, client: S3Client | None = None
    ) -> CacheArtifacts | None:
        if not spec.cache.artifacts.enabled or spec.cache.bucket is None:
            return None
        location = f"s3://{spec.cache.bucket}/{spec.cache.artifacts.prefix}"
        try:
            trust = ArtifactTrust.from_file(settings.artifact_keys_path)
            signer = None
            if settings.artifact_signing_key_path is not None:
                signer = ArtifactSigner.from_file(settings.artifact_signing_key_path)
        except WeightCacheError as e:
            raise LaunchError("artifacts", str(e)) from e
        return cls(client or make_client(s3_settings(spec)), location, trust, settings.artifacts_dir, signer)

    @property
    def can_push(self) -> bool:
        return self._signer is not None

    def restore_local(self, fp: Fingerprint, dest: Path) -> ArtifactPullResult:
        try:
            return restore_node_copy(self._node_root, fp, self._trust, dest)
        except (WeightCacheError, OSError) as e:
            raise LaunchError("artifacts", f"node copy of {fp.key}: {e}") from e

    def describe(self, fp: Fingerprint) -> ArtifactOffer:
        return describe_artifact(self._client, self._location, fp, trust=self._trust)

    def fetch(self, fp: Fingerprint, dest: Path, offer: ArtifactOffer) -> ArtifactPullResult:
        def keep(tar: Path, verified: ArtifactOffer) -> None:
            keep_node_copy(self._node_root, fp, tar, verified)

        try:
            result = pull_artifacts(self._client, self._location, fp, dest, trust=self._trust, offer=offer, keep=keep)
        except WeightCacheError as e:
            raise LaunchError("artifacts", str(e)) from e
        if not result.hit:
            log.info("artifacts %s: miss (%s)", fp.key, result.reason)
        return result

    def push(self, fp: Fingerprint, src: Path, build_seconds: float | None) -> None:
        if self._signer is None:
            raise LaunchError("serve", "artifact push needs a signing key; this launcher holds none")

        def keep(tar: Path, signed: ArtifactOffer) -> None:
            keep_node_copy(self._node_root, fp, tar, signed)

        try:
            push_artifacts(
                self._client, src, self._location, fp, signer=self._signer, build_seconds=build_seconds, keep=keep
            )
        except WeightCacheError as e:
            raise LaunchError("serve", f"artifact push failed: {e}") from e
