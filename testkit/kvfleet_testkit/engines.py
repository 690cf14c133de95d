"""Reference-engine processes (``kvfleet engine serve``) on free loopback ports, started and
stopped as the router's tests and benchmarks need them."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvfleet.free_port import pick_free_port
from kvfleet.local.models import EngineLaunch

from .processes import stop_process


@dataclass
class Engine:
    """A real reference-engine process (``kvfleet engine serve``)."""

    replica_id: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """Sample name -> value summed over labels (``vllm:prefix_cache_hits_total``, ...)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def stop(self) -> None:
        stop_process(self.proc)


def start_engine(model_dir: Path, replica_id: str, log_dir: Path, served: str, *args: str) -> Engine:
    port = pick_free_port()
    log = log_dir / f"engine-{replica_id}.log"
    cmd = EngineLaunch(replica_id, served, model_dir, ("--threads", "1", *args), {}).argv(port)
    with log.open("wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    engine = Engine(replica_id, port, proc, log)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(engine.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return engine
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            engine.stop()
            raise RuntimeError(f"engine {replica_id} did not become healthy:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)
