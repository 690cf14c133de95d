"""The folder a weight pull fills while the engine loads it (kvfleet.weight_stream): the reader waits
for each file within its bound, names what did not come, and never takes anything but a regular
file the writer linked in; the engine's loader reads shards as they land. Real files, real threads."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from kvfleet.engine.errors import ModelLoadError
from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.engine.weights import load_state_dict
from kvfleet.weight_stream import LISTING, StreamError, StreamReader, StreamWriter, expose


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_file_that_does_not_arrive_fails_naming_it(tmp_path: Path) -> None:
    writer = StreamWriter(tmp_path / "stream")
    writer.reset(["config.json", "model.safetensors"], {})
    clock = FakeClock()
    reader = StreamReader(writer.directory, 30, clock=clock, sleep=clock.sleep)
    assert reader.files() == ("config.json", "model.safetensors")
    with pytest.raises(StreamError, match=r"model.safetensors did not arrive in .* within 30 s"):
        reader.wait_for("model.safetensors")
    assert 30 <= clock.now <= 30.1


def test_a_folder_that_never_appears_fails_on_its_listing(tmp_path: Path) -> None:
    clock = FakeClock()
    reader = StreamReader(tmp_path / "link" / "model", 5, clock=clock, sleep=clock.sleep)
    with pytest.raises(StreamError, match=rf"{LISTING} did not arrive"):
        reader.files()


def test_a_stop_ends_the_wait_at_once(tmp_path: Path) -> None:
    writer = StreamWriter(tmp_path / "stream")
    writer.reset(["a.safetensors"], {})
    clock = FakeClock()
    reader = StreamReader(writer.directory, 3600, clock=clock, sleep=clock.sleep, stopped=lambda: clock.now > 1)
    with pytest.raises(StreamError, match=r"stopped while waiting for a\.safetensors"):
        reader.wait_for("a.safetensors")
    assert clock.now < 2


@pytest.mark.parametrize("path", ["../escape.safetensors", "/etc/passwd", "a/./b", "a\\b", ""])
def test_a_listing_naming_a_path_outside_the_folder_is_refused(tmp_path: Path, path: str) -> None:
    (tmp_path / LISTING).write_text(json.dumps({"files": ["config.json", path]}))
    with pytest.raises(StreamError, match="is not a relative path inside the model folder"):
        StreamReader(tmp_path, 1).files()
    with pytest.raises(StreamError, match="is not a relative path inside the model folder"):
        StreamWriter(tmp_path / "w").reset([path], {})


def test_a_symlink_in_place_of_a_file_is_refused(tmp_path: Path) -> None:
    writer = StreamWriter(tmp_path / "stream")
    writer.reset(["model.safetensors"], {})
    (tmp_path / "elsewhere").write_bytes(b"x")
    (writer.directory / "model.safetensors").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StreamError, match=r"model\.safetensors: not a regular file"):
        StreamReader(writer.directory, 1).wait_for("model.safetensors")


def test_reset_keeps_only_the_very_files_verified_now(tmp_path: Path) -> None:
    """A name left from an earlier pull that is not the file just verified (a file refused since,
    a stray) is dropped before the folder is shown to an engine; the verified one stays as it is."""
    cache = tmp_path / "cache"
    cache.mkdir()
    good, refused = cache / "a.safetensors", cache / "b.safetensors"
    good.write_bytes(b"good")
    refused.write_bytes(b"refused")
    writer = StreamWriter(tmp_path / "stream")
    writer.reset(["a.safetensors", "b.safetensors"], {})
    writer.publish("a.safetensors", good)
    writer.publish("b.safetensors", refused)
    (writer.directory / "stray.safetensors").write_bytes(b"planted")
    ctime = good.stat().st_ctime_ns
    writer.publish("a.safetensors", good)  # already this file: left alone (no new link, same ctime)
    assert good.stat().st_ctime_ns == ctime

    writer.reset(["a.safetensors", "b.safetensors"], {"a.safetensors": good})
    assert sorted(p.name for p in writer.directory.iterdir()) == [LISTING, "a.safetensors"]
    assert os.path.samefile(writer.directory / "a.safetensors", good)


def test_the_loader_reads_each_shard_as_it_lands_and_the_result_equals_a_complete_load(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", layers=4, hidden=128, shards=3)
    files = sorted(p.name for p in model.iterdir())
    writer = StreamWriter(tmp_path / "stream")
    writer.reset(files, {})
    link = tmp_path / "engine" / "model"
    expose(link, writer.directory)
    small = [f for f in files if not f.endswith(".safetensors")]
    for name in small:
        writer.publish(name, model / name)
    shards = [f for f in files if f.endswith(".safetensors")]
    loaded: dict[str, object] = {}
    reader = StreamReader(link, 30, poll_s=0.01)
    loading = threading.Thread(target=lambda: loaded.update(load_state_dict(link, reader)))
    loading.start()
    for name in shards:  # one at a time, the loader behind them
        time.sleep(0.2)
        assert loading.is_alive()
        writer.publish(name, model / name)
    loading.join(timeout=30)
    assert not loading.is_alive()
    complete = load_state_dict(model)
    assert loaded.keys() == complete.keys()
    assert all(bool((loaded[k] == complete[k]).all()) for k in complete)  # type: ignore[attr-defined]


def test_the_loader_fails_clearly_when_a_shard_never_comes(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", layers=2, hidden=64, shards=2)
    files = sorted(p.name for p in model.iterdir())
    writer = StreamWriter(tmp_path / "stream")
    writer.reset(files, {})
    for name in files:
        if name != "model-00002-of-00002.safetensors":
            writer.publish(name, model / name)
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors did not arrive .* within 0\.3 s"):
        load_state_dict(writer.directory, StreamReader(writer.directory, 0.3, poll_s=0.01))
