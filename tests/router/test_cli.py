"""``kvfleet router serve`` as a real process: serves, drains on SIGTERM, rejects bad settings by field."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .conftest import Backend

KVFLEET = [sys.executable, "-c", "from kvfleet.cli import main; main()"]


def test_serve_routes_and_stops_cleanly_on_sigterm(backends: list[Backend], free_port: int, tmp_path: Path) -> None:
    settings = tmp_path / "router.yaml"
    settings.write_text("max_attempts: 2\nprefix_index_blocks_per_replica: 1024\n")
    proc = subprocess.Popen(
        [*KVFLEET, "router", "serve", "--port", str(free_port), "--settings", str(settings)]
        + [f"--replica=tiny={b.url}" for b in backends[:2]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{free_port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else b""
                assert time.monotonic() < deadline, "router did not start"
                time.sleep(0.1)
        request = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps({"model": "tiny", "prompt": "hi"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200
            assert json.loads(resp.read())["replica"] in {"r0", "r1"}
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
            assert [m["id"] for m in json.loads(resp.read())["data"]] == ["tiny"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_settings_and_arguments_are_named(tmp_path: Path) -> None:
    settings = tmp_path / "bad.yaml"
    settings.write_text("max_attempts: 0\nno_such_field: 1\n")
    result = subprocess.run(
        [*KVFLEET, "router", "serve", "--settings", str(settings), "--replica", "m=http://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "max_attempts" in result.stderr and "no_such_field" in result.stderr
    result = subprocess.run(
        [*KVFLEET, "router", "serve", "--replica", "m=ftp://nowhere"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "http(s)://host:port" in result.stderr
    result = subprocess.run([*KVFLEET, "router", "serve"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--kubernetes" in result.stderr


def test_kv_events_flags_become_settings() -> None:
    import click
    import pytest

    from kvfleet.router.cli import load_settings, parse_tokenizers

    tokenizers = parse_tokenizers(("llama=/var/lib/kvfleet/tokenizers/llama", "qwen=/t/q"))
    settings = load_settings(
        None, {"kv_events_port": 5557, "kv_events_announced_only": True, "kv_events_tokenizers": tokenizers}
    )
    assert settings.kv_events_port == 5557 and settings.kv_events_announced_only
    assert settings.kv_events_tokenizers == {"llama": "/var/lib/kvfleet/tokenizers/llama", "qwen": "/t/q"}
    assert settings.kv_events_replay, "the engines' replay sockets are asked unless turned off"
    assert not load_settings(None, {"kv_events_port": 5557, "kv_events_replay": False}).kv_events_replay
    assert settings.kv_events_fetch_tokenizers, "unlisted models' tokenizers are fetched unless turned off"
    off = load_settings(None, {"kv_events_port": 5557, "kv_events_fetch_tokenizers": False})
    assert not off.kv_events_fetch_tokenizers
    with pytest.raises(click.BadParameter, match="expected MODEL=DIR"):
        parse_tokenizers(("llama",))
    with pytest.raises(click.BadParameter, match="'llama' is given twice"):
        parse_tokenizers(("llama=/a", "llama=/b"))
    with pytest.raises(click.BadParameter, match=r"kv_events_tokenizers: .*only used with kv_events_port"):
        load_settings(None, {"kv_events_tokenizers": tokenizers})


def test_peer_load_flags_become_settings_and_a_missing_key_is_named(tmp_path: Path) -> None:
    base = [*KVFLEET, "router", "serve", "--replica", "m=http://127.0.0.1:1", "--peer-load-port", "7400"]
    result = subprocess.run(
        [*base, "--peer-load-peer", "routers.kvfleet-system.svc:7400"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "peer_load_key_file: required" in result.stderr
    result = subprocess.run(
        [*base, "--peer-load-key-file", "/k", "--peer-load-peer", "no-port"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "'no-port' is not host:port" in result.stderr
