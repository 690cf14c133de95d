"""Progress subscribers: transfers report to them and never draw anything themselves. Methods are
called from worker threads, so implementations must be thread-safe."""

from __future__ import annotations

import threading
from typing import Protocol


class TransferProgress(Protocol):
    def on_start(self, total_bytes: int, done_bytes: int) -> None:
        """Called once: the bytes the transfer covers and how many are already in place."""

    def on_bytes(self, count: int) -> None:
        """Called as bytes move over the network."""

    def on_file_done(self, path: str, size_bytes: int) -> None:
        """Called when a file is complete and verified."""


class NullProgress:
    def on_start(self, total_bytes: int, done_bytes: int) -> None:
        pass

    def on_bytes(self, count: int) -> None:
        pass

    def on_file_done(self, path: str, size_bytes: int) -> None:
        pass


class CountingProgress:
    """Totals only; handy for callers (and tests) that want numbers, not a bar."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total_bytes = 0
        self.done_at_start_bytes = 0
        self.transferred_bytes = 0
        self.files_done: list[str] = []

    def on_start(self, total_bytes: int, done_bytes: int) -> None:
        with self._lock:
            self.total_bytes = total_bytes
            self.done_at_start_bytes = done_bytes

    def on_bytes(self, count: int) -> None:
        with self._lock:
            self.transferred_bytes += count

    def on_file_done(self, path: str, size_bytes: int) -> None:
        with self._lock:
            self.files_done.append(path)


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def throughput_line(verb: str, moved_bytes: int, elapsed_s: float, extra: str = "") -> str:
    rate = moved_bytes / elapsed_s if elapsed_s > 0 else 0.0
    tail = f", {extra}" if extra else ""
    return f"{verb} {human_bytes(moved_bytes)} in {elapsed_s:.2f} s ({human_bytes(rate)}/s){tail}"
