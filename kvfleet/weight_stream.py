"""A model folder that fills while an engine loads it: the contract between the weight pull (which
writes it) and the reference engine (which reads it), so the engine starts before the pull ends.

The folder holds only files whose sha256 matched the manifest in this pull: the pull hardlinks each
file in as soon as it is verified and renamed into place in the node cache (``publish``), so a name
is either absent or a complete, verified file; partial and unverified bytes never appear here.
Before any file, the writer lists every path the folder will hold (``LISTING``), so the reader
knows what to wait for. A pull that fails stops its engine (the launcher does); a reader whose
next file does not come within its bound fails naming the file.

Dependency-free (no boto3, no torch): the engine imports it at start-up.
"""

import json
import os
import stat
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

# Names the writer uses for itself; a model file never starts with ".kvfleet-" (the weight cache
# reserves the prefix, weight_cache/safety.py).
LISTING = ".kvfleet-stream.json"
# Names being written; a reader opens only listed names, never these.
TMP_PREFIX = ".tmp-"
MAX_LISTED_FILES = 10_000
MAX_LISTING_BYTES = 4 << 20


class StreamError(Exception):
    """The folder cannot be loaded: a file did not arrive in time, or the listing is not one this
    reader accepts. The message names the file."""


def _safe_relative(path: str) -> str:
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or any(p in ("", ".", "..") for p in parts)
        or any(ord(c) < 32 for c in path)
    ):
        raise StreamError(f"{path!r} is not a relative path inside the model folder")
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class StreamWriter:
    """The pull's side, called under the model's lock: ``reset`` to what is verified now, then
    ``publish`` each file the moment it is verified."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def reset(self, files: Sequence[str], verified: Mapping[str, Path]) -> None:
        """Keep only names that are the very files in ``verified`` (relative path -> the file whose
        sha256 just matched); drop everything else (a link to a file refused since, a leftover),
        then list ``files``, every path the folder will hold."""
        if len(files) > MAX_LISTED_FILES:
            raise StreamError(f"{len(files)} files: more than {MAX_LISTED_FILES}")
        listed = [_safe_relative(p) for p in files]
        self.directory.mkdir(parents=True, exist_ok=True)
        for root, _dirs, names in os.walk(self.directory):
            for name in names:
                entry = Path(root) / name
                relative = entry.relative_to(self.directory).as_posix()
                source = verified.get(relative)
                if source is None or not _same_file(entry, source):
                    entry.unlink()
        _write_atomic(self.directory / LISTING, json.dumps({"files": listed}).encode())

    def publish(self, relative: str, verified: Path) -> None:
        """Hardlink ``verified`` (a file whose sha256 just matched, in the node cache) in as
        ``relative``: the name appears atomically with every byte behind it. Same filesystem only.
        A name that already is this file is left alone (a link would change its ctime, which the
        node cache's ``stat`` check reads)."""
        target = self.directory.joinpath(*_safe_relative(relative).split("/"))
        if _same_file(target, verified):
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(verified, target, follow_symlinks=False)  # the name appears whole, or not at all
            return
        except FileExistsError:
            pass  # another file under this name (a concurrent puller's, or stale): replace it atomically
        tmp = target.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex[:8]}")
        os.link(verified, tmp, follow_symlinks=False)
        os.replace(tmp, target)


def _same_file(a: Path, b: Path) -> bool:
    try:
        sa, sb = a.lstat(), b.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(sa.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def expose(link: Path, directory: Path) -> None:
    """Point ``link`` (the path an engine was started with) at ``directory``, atomically."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex[:8]}")
    os.symlink(directory, tmp, target_is_directory=True)
    os.replace(tmp, link)


class StreamReader:
    """The engine's side: wait (bounded) for the listing, then for each file it needs.

    ``arrival_timeout_s`` bounds each wait: the listing, then every file counted from the moment
    the previous wait ended, so a pull that is moving never times out while one that stalls does."""

    def __init__(
        self,
        directory: Path,
        arrival_timeout_s: float,
        *,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        stopped: Callable[[], bool] = lambda: False,
    ) -> None:
        if not 0 < arrival_timeout_s <= 86_400:
            raise ValueError("arrival_timeout_s must be in (0, 86400]")
        self.directory = directory
        self.arrival_timeout_s = arrival_timeout_s
        self.poll_s = poll_s
        self._clock = clock
        self._sleep = sleep
        self._stopped = stopped  # the engine is stopping: give up the wait at the next poll
        self._files: tuple[str, ...] | None = None

    def _wait(self, relative: str) -> Path:
        path = self.directory.joinpath(*relative.split("/"))
        deadline = self._clock() + self.arrival_timeout_s
        while True:
            try:
                st = path.lstat()
            except (FileNotFoundError, NotADirectoryError):
                st = None  # the folder itself appears once the pull holds the model's lock
            if st is not None:
                if not stat.S_ISREG(st.st_mode):
                    raise StreamError(f"{relative}: not a regular file in {self.directory}")
                return path
            if self._stopped():
                raise StreamError(f"stopped while waiting for {relative}")
            if self._clock() >= deadline:
                raise StreamError(
                    f"{relative} did not arrive in {self.directory} within {self.arrival_timeout_s:g} s "
                    "(the weight pull is stalled or gone)"
                )
            self._sleep(self.poll_s)

    def files(self) -> tuple[str, ...]:
        """Every path the folder will hold (waits for the listing)."""
        if self._files is None:
            listing = self._wait(LISTING)
            raw = listing.read_bytes()
            if len(raw) > MAX_LISTING_BYTES:
                raise StreamError(f"{LISTING}: larger than {MAX_LISTING_BYTES} bytes")
            try:
                files = json.loads(raw)["files"]
            except (ValueError, KeyError, TypeError) as e:
                raise StreamError(f"{LISTING}: not a file listing: {e}") from e
            if not isinstance(files, list) or len(files) > MAX_LISTED_FILES:
                raise StreamError(f"{LISTING}: 'files' must be a list of at most {MAX_LISTED_FILES} paths")
            self._files = tuple(_safe_relative(f) for f in files if isinstance(f, str))
        return self._files

    def wait_for(self, relative: str) -> Path:
        """The path of ``relative`` once it is in the folder (complete and verified)."""
        if relative not in self.files():
            raise StreamError(f"{relative}: not among the model's files ({len(self.files())} listed)")
        return self._wait(relative)

    def wait_for_all(self, *, exclude_suffix: str | None = None) -> None:
        """Wait for every listed file, or all but those ending in ``exclude_suffix`` (the small
        files an engine reads before its weights: config, tokenizer, the shard index)."""
        for relative in self.files():
            if exclude_suffix is None or not relative.endswith(exclude_suffix):
                self._wait(relative)
