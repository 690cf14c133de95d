"""Fetching a served model's tokenizer from one of its own engine pods' launcher.

With KV events on, the router tokenizes prompts as the engine does (``prompt_tokens``), which needs
the model's ``tokenizer.json`` and ``tokenizer_config.json``. Where discovery names a replica's
launcher port (Kubernetes: the EndpointSlice's ``launcher`` port) and its events port, the files
are fetched from the launcher's ``GET /tokenizer/{name}`` (engine_image/metrics_server.py): at most
one fetch in flight per model; each file bounded by ``contracts.TOKENIZER_MAX_BYTES`` and each
attempt by a timeout; a failed attempt is logged with its reason, counted
(``kvfleet_router_tokenizer_fetches_total{outcome}``) and retried on the next replica after a
capped, jittered backoff. The files go to a private temporary folder only while ``load_tokenizer``
reads them, one model at a time (the chart's /tmp is a small in-memory emptyDir). Nothing here is
ever raised into a request: until the tokenizer is installed, the model is routed by the learned
index, as without one.
"""

from __future__ import annotations

import asyncio
import logging
import random
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp

from kvfleet.contracts import LAUNCHER_TOKENIZER_PATH, TOKENIZER_FILES, TOKENIZER_MAX_BYTES
from kvfleet.router.replicas import DeploymentView, Endpoint

if TYPE_CHECKING:
    from kvfleet.router.metrics import RouterMetrics
    from kvfleet.router.prompt_tokens import PromptTokenizer

log = logging.getLogger(__name__)

REQUIRED_FILE = "tokenizer.json"  # tokenizer_config.json is optional: without it, chat has no template


@dataclass(frozen=True)
class FetchBounds:
    """How long, how much and how often: one attempt's time, one file's bytes, the retry delays."""

    timeout_s: float = 30.0  # both files of one attempt (tens of MB inside a cluster: about a second)
    max_file_bytes: int = TOKENIZER_MAX_BYTES
    retry_first_s: float = 1.0  # doubled after each failure, jittered 0.5-1x, up to retry_max_s
    retry_max_s: float = 120.0  # a model whose replicas never serve one costs one try every ~2 minutes


class FetchError(Exception):
    """One attempt failed: ``outcome`` is the metric label, the message the reason logged."""

    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome


def fetch_candidates(endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    """The replicas to ask: serving (not draining), publishing events, with a launcher port known."""
    return [e for e in endpoints if not e.draining and e.kv_events_port is not None and e.launcher_port is not None]


def retry_delay_s(failures: int, bounds: FetchBounds, rng: random.Random) -> float:
    """The wait after ``failures`` (>= 1) failed attempts in a row: doubling, capped, jittered 0.5-1x."""
    base = min(bounds.retry_max_s, bounds.retry_first_s * 2 ** min(failures - 1, 30))
    return base * rng.uniform(0.5, 1.0)


def launcher_url(endpoint: Endpoint, name: str) -> str:
    """The replica's launcher URL of tokenizer file ``name`` (plain HTTP, as the launcher serves)."""
    host = urlsplit(endpoint.url).hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{endpoint.launcher_port}{LAUNCHER_TOKENIZER_PATH}{name}"


async def _read_bounded(response: aiohttp.ClientResponse, name: str, max_bytes: int) -> bytes:
    if response.content_length is not None and response.content_length > max_bytes:
        raise FetchError("oversize", f"{name} is {response.content_length} bytes, over {max_bytes}")
    chunks, size = [], 0
    async for chunk in response.content.iter_chunked(256 * 1024):
        size += len(chunk)
        if size > max_bytes:  # a length not announced, or a lie: stop reading at the bound
            raise FetchError("oversize", f"{name} is over {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def fetch_files(session: aiohttp.ClientSession, endpoint: Endpoint, max_bytes: int) -> dict[str, bytes]:
    """The replica's tokenizer files by name (``tokenizer_config.json`` left out where it has none)."""
    files: dict[str, bytes] = {}
    for name in TOKENIZER_FILES:
        async with session.get(launcher_url(endpoint, name), allow_redirects=False) as response:
            if response.status == 404 and name != REQUIRED_FILE:
                continue
            if response.status != 200:
                reason = (await response.content.read(512)).decode(errors="replace").strip()
                outcome = "oversize" if response.status == 413 else "missing" if response.status == 404 else "status"
                raise FetchError(outcome, f"{name}: HTTP {response.status}: {reason}")
            files[name] = await _read_bounded(response, name, max_bytes)
    return files


def load_files(files: dict[str, bytes], cache_tokens: int, tmp_dir: str | None = None) -> PromptTokenizer:
    """Load the fetched files as ``prompt_tokens.load_tokenizer`` loads a mounted folder (blocking).

    Written to a private (0700) temporary folder, removed once loaded: the tokenizer holds what it
    read, and a folder left behind would only fill the router's /tmp."""
    from kvfleet.router.prompt_tokens import TokenizerUnavailableError, load_tokenizer

    try:
        with tempfile.TemporaryDirectory(prefix="kvfleet-tokenizer-", dir=tmp_dir) as folder:
            for name, data in files.items():
                (Path(folder) / name).write_bytes(data)
            try:
                return load_tokenizer(Path(folder), cache_tokens)
            except TokenizerUnavailableError as e:
                raise FetchError("invalid", str(e).replace(folder, "<fetched>")) from None
    except OSError as e:  # a full or read-only temporary folder (the chart's /tmp: tmpSizeLimit)
        size = sum(len(d) for d in files.values())
        where = tmp_dir or tempfile.gettempdir()
        raise FetchError("write", f"cannot write {size} bytes under {where}: {e.strerror or e}") from None


class TokenizerFetcher:
    """Fetches each offered model's tokenizer once, from its own replicas, and hands it to ``install``.

    ``offer`` is called with every new view of a model that has no tokenizer; ``forget`` when the
    model goes. Runs on the event loop; the files are loaded in a worker thread."""

    def __init__(
        self,
        metrics: RouterMetrics,
        install: Callable[[DeploymentView, PromptTokenizer], None],
        cache_tokens: int,
        bounds: FetchBounds | None = None,
        rng: random.Random | None = None,
        tmp_dir: str | None = None,  # where the files are loaded from (None: the system's temporary folder)
    ) -> None:
        self._metrics = metrics
        self._install = install
        self._cache_tokens = cache_tokens
        self._bounds = bounds or FetchBounds()
        self._rng = rng or random.Random()  # noqa: S311 (jitter, no secret)
        self._tmp_dir = tmp_dir
        self._views: dict[str, DeploymentView] = {}  # by model key: the latest view offered
        self._tasks: dict[str, asyncio.Task[None]] = {}  # at most one fetch per model
        self._session: aiohttp.ClientSession | None = None
        self._loading = asyncio.Lock()  # one model's files in the temporary folder at a time

    def offer(self, view: DeploymentView) -> None:
        """The model has no tokenizer: fetch one when some replica can serve it (one fetch at a time)."""
        self._views[view.key] = view
        if view.key not in self._tasks and fetch_candidates(view.endpoints):
            task = asyncio.get_running_loop().create_task(self._fetch(view.key), name=f"tokenizer {view.key}")
            self._tasks[view.key] = task

    def forget(self, key: str) -> None:
        """The model is gone: its fetch stops and nothing is installed for it."""
        self._views.pop(key, None)
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()

    def fetching(self, key: str) -> bool:
        return key in self._tasks

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()

    async def _fetch(self, key: str) -> None:
        failures = 0
        try:
            while True:
                view = self._views.get(key)
                candidates = fetch_candidates(view.endpoints) if view is not None else []
                if view is None or not candidates:
                    return  # no replica to ask now; the next view with one offers the model again
                endpoint = candidates[failures % len(candidates)]  # the next replica after a failure
                try:
                    tokenizer = await self._attempt(endpoint)
                except Exception as e:  # never ends the loop: counted, logged, tried again
                    failure = e if isinstance(e, FetchError) else FetchError("error", repr(e))
                    failures += 1
                    delay_s = retry_delay_s(failures, self._bounds, self._rng)
                    self._metrics.tokenizer_fetches.inc((*view.labels, failure.outcome))
                    where = f"tokenizer of {key} from replica {endpoint.replica_id}"
                    log.warning("%s: %s (%s); next try in %.1fs", where, failure, failure.outcome, delay_s)
                    await asyncio.sleep(delay_s)
                    continue
                view = self._views.get(key)
                if view is not None:
                    self._metrics.tokenizer_fetches.inc((*view.labels, "ok"))
                    log.info("tokenizer of %s fetched from replica %s", key, endpoint.replica_id)
                    self._install(view, tokenizer)
                return
        finally:
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]

    async def _attempt(self, endpoint: Endpoint) -> PromptTokenizer:
        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        bounds = self._bounds
        try:
            async with asyncio.timeout(bounds.timeout_s):
                files = await fetch_files(self._session, endpoint, bounds.max_file_bytes)
        except TimeoutError:
            raise FetchError("timeout", f"no answer within {bounds.timeout_s:g}s") from None
        except aiohttp.ClientError as e:
            raise FetchError("unreachable", f"{type(e).__name__}: {e}") from None
        async with self._loading:
            return await asyncio.to_thread(load_files, files, self._cache_tokens, self._tmp_dir)
