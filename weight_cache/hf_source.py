"""hf://org/name@revision sources, through huggingface_hub (where the hub is reachable).

The revision is resolved to a commit first, so the manifest records exactly what was uploaded;
only accepted file types are downloaded (pickle ones only when allowed). The token comes from
huggingface_hub's own configuration (HF_TOKEN, its token file) or a mounted file, never a flag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvfleet.weight_cache.errors import InvalidLocationError, SourceUnavailableError
from kvfleet.weight_cache.safety import ALLOWED_NAMES, ALLOWED_SUFFIXES, PICKLE_SUFFIXES

REPO_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
REVISION_PATTERN = re.compile(r"^[A-Za-z0-9._/-]{1,128}$")


@dataclass(frozen=True)
class HfSnapshot:
    path: Path
    repo_id: str
    revision: str  # the resolved commit


def parse_hf_uri(uri: str) -> tuple[str, str | None]:
    """``hf://org/name[@revision]`` -> (repo id, revision or None)."""
    if not uri.startswith("hf://"):
        raise InvalidLocationError(f"{uri!r}: expected hf://org/name[@revision]")
    repo_id, _, revision = uri[len("hf://") :].partition("@")
    if not REPO_ID_PATTERN.match(repo_id) or ".." in repo_id:
        raise InvalidLocationError(f"{uri!r}: {repo_id!r} is not a Hugging Face repo id (org/name)")
    if revision and (not REVISION_PATTERN.match(revision) or ".." in revision):
        raise InvalidLocationError(f"{uri!r}: {revision!r} is not a valid revision")
    return repo_id, revision or None


def allow_patterns(*, allow_pickle: bool) -> list[str]:
    suffixes = sorted(ALLOWED_SUFFIXES | (PICKLE_SUFFIXES if allow_pickle else frozenset()))
    return [f"*{s}" for s in suffixes] + sorted(ALLOWED_NAMES)


def fetch_hf_snapshot(
    uri: str,
    into: Path,
    *,
    allow_pickle: bool,
    endpoint: str | None = None,
    token_file: Path | None = None,
    timeout_s: float = 10.0,
) -> HfSnapshot:
    repo_id, revision = parse_hf_uri(uri)
    try:
        import huggingface_hub
    except ImportError as e:
        raise SourceUnavailableError(f"{uri}: hf:// sources need huggingface_hub (pip install 'kvfleet[hf]')") from e
    token: str | None = token_file.read_text().strip() if token_file is not None else None
    where = endpoint or "the default Hugging Face endpoint (HF_ENDPOINT or huggingface.co)"
    try:
        api = huggingface_hub.HfApi(endpoint=endpoint, token=token)
        commit = api.model_info(repo_id, revision=revision, timeout=timeout_s).sha
        if commit is None:
            raise SourceUnavailableError(f"{uri}: the hub did not say which commit {revision or 'main'} is")
        local = huggingface_hub.snapshot_download(
            repo_id,
            revision=commit,
            local_dir=into,
            allow_patterns=allow_patterns(allow_pickle=allow_pickle),
            endpoint=endpoint,
            token=token,
            etag_timeout=timeout_s,
        )
    except SourceUnavailableError:
        raise
    except Exception as e:  # the hub's errors (HTTP, auth, not found, offline) all mean "cannot read it"
        raise SourceUnavailableError(f"{uri}: cannot download from {where}: {type(e).__name__}: {e}") from e
    return HfSnapshot(path=Path(str(local)), repo_id=repo_id, revision=commit)
