"""kvfleet.weight_cache: S3 weight cache, node cache and engine artifacts.

The engine launcher uses this API; the ``kvfleet cache`` and ``kvfleet artifacts`` commands are a
thin layer over it::

    from kvfleet.weight_cache import pull_model, fingerprint, detect_accelerator, pull_artifacts

    with pull_model("s3://bucket/models/llama", Path("/var/cache/kvfleet")) as model:
        fp = fingerprint(engine_name="vllm", engine_version=vllm.__version__, model_digest=model.digest,
                         accelerator=detect_accelerator(), tensor_parallel_size=1, dtype="bfloat16",
                         engine_args=argv)
        pull_artifacts(client, "s3://bucket/artifacts", fp, compile_cache_dir,
                       trust=ArtifactTrust.from_file(Path("/etc/kvfleet/artifact-keys.pem")))
"""

from kvfleet.weight_cache.artifacts import (
    ArtifactOffer,
    ArtifactPullResult,
    ArtifactPushResult,
    describe_artifact,
    pull_artifacts,
    push_artifacts,
)
from kvfleet.weight_cache.download import FetchedManifest, PullResult, fetch_manifest, pull_to_dir
from kvfleet.weight_cache.errors import (
    ArtifactError,
    ChecksumMismatchError,
    DigestMismatchError,
    DisallowedFileError,
    DiskFullError,
    InvalidLocationError,
    LockTimeoutError,
    ManifestError,
    NodeCacheError,
    NodeCacheFullError,
    ObjectChangedError,
    PullStoppedError,
    SourceUnavailableError,
    TransferError,
    UnsafePathError,
    WeightCacheError,
)
from kvfleet.weight_cache.fingerprint import Accelerator, Fingerprint, detect_accelerator, fingerprint
from kvfleet.weight_cache.manifest import Manifest, ManifestFile
from kvfleet.weight_cache.populate import PopulateResult, populate
from kvfleet.weight_cache.pull import PulledModel, pull_model
from kvfleet.weight_cache.s3 import S3Uri, make_client
from kvfleet.weight_cache.settings import NodeCacheSettings, PopulateSettings, PullSettings, S3Settings
from kvfleet.weight_cache.signing import ArtifactSigner, ArtifactTrust

__all__ = [
    "Accelerator",
    "ArtifactError",
    "ArtifactOffer",
    "ArtifactPullResult",
    "ArtifactPushResult",
    "ArtifactSigner",
    "ArtifactTrust",
    "ChecksumMismatchError",
    "DigestMismatchError",
    "DisallowedFileError",
    "DiskFullError",
    "FetchedManifest",
    "Fingerprint",
    "InvalidLocationError",
    "LockTimeoutError",
    "Manifest",
    "ManifestError",
    "ManifestFile",
    "NodeCacheError",
    "NodeCacheFullError",
    "NodeCacheSettings",
    "ObjectChangedError",
    "PopulateResult",
    "PopulateSettings",
    "PullResult",
    "PullSettings",
    "PullStoppedError",
    "PulledModel",
    "S3Settings",
    "S3Uri",
    "SourceUnavailableError",
    "TransferError",
    "UnsafePathError",
    "WeightCacheError",
    "describe_artifact",
    "detect_accelerator",
    "fetch_manifest",
    "fingerprint",
    "make_client",
    "populate",
    "pull_artifacts",
    "pull_model",
    "pull_to_dir",
    "push_artifacts",
]
