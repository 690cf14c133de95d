"""What every ``kvfleet cache`` and ``kvfleet artifacts`` command shares: weight-cache errors
printed as one line naming the file or field (exit 1; invalid settings exit 2), the S3 connection
options, and the progress bar drawn on stderr from the transfer's progress events."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import ValidationError
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from kvfleet.weight_cache.errors import WeightCacheError
from kvfleet.weight_cache.settings import S3Settings

F = TypeVar("F", bound=Callable[..., Any])


class RichProgress:
    """A bytes/s progress bar on stderr (stdout keeps the result lines for scripts)."""

    def __init__(self, description: str) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
            redirect_stdout=False,
        )
        self._description = description
        self._task: TaskID | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def on_start(self, total_bytes: int, done_bytes: int) -> None:
        with self._lock:
            self._task = self._progress.add_task(self._description, total=total_bytes, completed=done_bytes)

    def on_bytes(self, count: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, count)

    def on_resumed(self, count: int) -> None:
        self.on_bytes(count)

    def on_file_done(self, path: str, size_bytes: int) -> None:
        pass


def friendly_errors(func: F) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ValidationError as e:
            for err in e.errors():
                where = ".".join(str(p) for p in err["loc"]) or "settings"
                click.echo(f"error: {where}: {err['msg']}", err=True)
            sys.exit(2)
        except WeightCacheError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def s3_options(func: F) -> F:
    func = click.option(
        "--credentials-dir",
        type=click.Path(file_okay=False, path_type=Path),
        help="Mounted Secret directory with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY files "
        "(default: boto3's standard chain).",
    )(func)
    func = click.option("--region", help="S3 region (default: boto3's standard configuration).")(func)
    func = click.option(
        "--endpoint-url", help="S3 endpoint; overrides AWS_ENDPOINT_URL and boto3's configuration files."
    )(func)
    return func


def s3_settings(endpoint_url: str | None, region: str | None, credentials_dir: Path | None) -> S3Settings:
    return S3Settings(endpoint_url=endpoint_url, region=region, credentials_dir=credentials_dir)
