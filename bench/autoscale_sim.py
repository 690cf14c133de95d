"""Autoscaling simulator: kvfleet's policy against HPA, KEDA, Knative KPA and a clairvoyant oracle.

A time-stepped simulation (dt = 0.1 s) of one deployment behind a router:

- **Replicas** start ``--cold-start-s`` after they are asked for (GPU-time is paid from the ask),
  serve until drained (a replica being removed takes no new requests and finishes its own), and
  cost GPU-hours until they stop.
- **Service model** (per replica, vLLM-style continuous batching with chunked prefill): each engine
  step takes ``t0 + k x decoding + prefill_tokens / P`` seconds; decoding requests get one token
  per step, prefill takes up to ``B - decoding`` tokens per step in arrival order; at most
  ``max_num_seqs`` requests run; KV capacity bounds admission (prompt + output tokens).
  Defaults are Llama-3.1-8B BF16 on one H100 (see docs/benchmarks/autoscaler.md for sources).
- **Router**: a central FIFO; a request goes to the least-loaded ready replica with a free slot,
  waits otherwise, and times out (dropped) after ``--timeout-s`` without a first token slot.
- **Policies** see metrics as their real counterparts would (scrape/poll intervals and windows).
  kvfleet's is the real ``kvfleet.autoscaler.policy.decide``.

Run: ``python bench/autoscale_sim.py`` (defaults take a few minutes on 2 cores);
``--minutes`` sets each trace's length, ``--traces``/``--policies`` select.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from kvfleet.autoscaler.observation import Observation
from kvfleet.autoscaler.policy import PolicyState, decide, initial_state
from kvfleet.spec import AutoscalingSpec

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


# --------------------------------------------------------------------------- service model


@dataclass(frozen=True)
class ServiceModel:
    """One replica: Llama-3.1-8B BF16, vLLM, one H100 80GB (sources in the doc)."""

    step_base_s: float = 0.007  # one decode step at batch 1 (~16 GB of weights read at ~3.35 TB/s, + overhead)
    step_per_seq_s: float = 0.00005  # marginal cost per decoding sequence: 256 seqs -> ~12.9k tok/s
    prefill_tokens_per_s: float = 30_000.0  # 16 GFLOP/token at ~50% of 989 TFLOPS
    max_batched_tokens: int = 8192  # tokens per step (decode + prefill chunk)
    max_num_seqs: int = 256  # vLLM default
    kv_capacity_tokens: int = 430_000  # (80 GB x 0.9 - 16 GB) / 128 KiB per token


@dataclass(frozen=True)
class Workload:
    prompt_mean_tokens: float = 600.0
    output_mean_tokens: float = 200.0


@dataclass(frozen=True)
class SimConfig:
    dt_s: float = 0.1
    cold_start_s: float = 30.0
    timeout_s: float = 60.0
    max_replicas: int = 40
    slo_s: tuple[float, float] = (1.0, 2.0)


# --------------------------------------------------------------------------- traces


def trace_rate(name: str, minutes: float, mu: float) -> Callable[[np.ndarray], np.ndarray]:
    """Arrival rate (req/s) over time for a named trace, scaled to ``mu`` (one replica's SLO rate)."""
    total = minutes * 60.0

    def diurnal(t: np.ndarray) -> np.ndarray:  # one compressed "day": night 0.3 mu, peak 6 mu
        return mu * (0.3 + 5.7 * (1 - np.cos(2 * np.pi * t / total)) / 2)

    def onoff(t: np.ndarray) -> np.ndarray:  # 2 min at 4 mu, 3 min at 0.3 mu
        return np.where((t % 300.0) < 120.0, 4.0 * mu, 0.3 * mu)

    def spike(t: np.ndarray) -> np.ndarray:  # 0.5 mu, then 10x for 6 minutes from 1/3 of the trace
        start = total / 3
        return np.where((t >= start) & (t < start + 360.0), 5.0 * mu, 0.5 * mu)

    def ramp(t: np.ndarray) -> np.ndarray:  # 0.2 mu -> 6 mu over 3/4 of the trace, then flat
        return mu * (0.2 + 5.8 * np.clip(t / (0.75 * total), 0, 1))

    def idle(t: np.ndarray) -> np.ndarray:  # 3 min at 1.5 mu, 9 min of nothing
        return np.where((t % 720.0) < 180.0, 1.5 * mu, 0.0)

    traces = {"diurnal": diurnal, "onoff": onoff, "spike": spike, "ramp": ramp, "idle_gaps": idle}
    return traces[name]


TRACES = ("diurnal", "onoff", "spike", "ramp", "idle_gaps")


def arrivals(rate: Callable[[np.ndarray], np.ndarray], total_s: float, rng: np.random.Generator) -> np.ndarray:
    """Non-homogeneous Poisson arrivals by thinning."""
    grid = np.arange(0.0, total_s, 0.5)
    peak = float(rate(grid).max()) * 1.05 + 1e-9
    n = rng.poisson(peak * total_s)
    t = np.sort(rng.uniform(0.0, total_s, n))
    keep = rng.uniform(0.0, peak, n) < rate(t)
    return t[keep]


# --------------------------------------------------------------------------- cluster simulation


@dataclass
class Replica:
    started_s: float
    ready_s: float
    stopped_s: float | None = None
    draining: bool = False
    running: int = 0
    kv_tokens: int = 0

    def ready(self, now: float) -> bool:
        return self.stopped_s is None and not self.draining and now >= self.ready_s


@dataclass
class Metrics:
    """What the cluster exposes at an instant (engines + router)."""

    now: float
    ready: int
    replicas: int
    running: int
    queue: int
    arrivals_total: int
    kv_util: float
    busy_fraction: float  # share of ready replicas with >= 1 request (DCGM GPU util reads ~100% then)
    ttft_p90_60s: float | None


@dataclass
class Result:
    policy: str
    trace: str
    requests: int
    attain_1s: float
    attain_2s: float
    p99_ttft_s: float
    dropped: int
    gpu_hours: float
    cold_starts: int
    timeline: dict[str, list[float]] = field(default_factory=dict)


class Cluster:
    def __init__(
        self, arr_t: np.ndarray, prompts: np.ndarray, outputs: np.ndarray, model: ServiceModel, cfg: SimConfig
    ) -> None:
        self.m, self.cfg = model, cfg
        n = len(arr_t)
        self.arr_t, self.prompt, self.out = arr_t, prompts, outputs
        self.state = np.zeros(n, np.int8)  # 0 future, 1 queued, 2 prefill, 3 decode, 4 done, 5 dropped
        self.rep = np.full(n, -1, np.int32)
        self.rem_pf = prompts.astype(np.float64).copy()
        self.rem_dec = np.maximum(outputs - 1, 0).astype(np.float64)
        self.first_tok = np.full(n, np.nan)
        self.next_arrival = 0
        self.queue: deque[int] = deque()
        self.active = np.zeros(0, np.int64)
        self.replicas: list[Replica] = []
        self.cold_starts = 0
        self.recent_ttft: deque[tuple[float, float]] = deque()

    # -- scaling
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.stopped_s is None and not r.draining]

    def scale_to(self, desired: int, now: float) -> None:
        desired = max(0, min(desired, self.cfg.max_replicas))
        live = self.live()
        if desired > len(live):
            for _ in range(desired - len(live)):
                self.replicas.append(Replica(started_s=now, ready_s=now + self.cfg.cold_start_s))
                self.cold_starts += 1
        elif desired < len(live):
            # Remove starting replicas first (nothing to drain), then the least loaded.
            victims = sorted(live, key=lambda r: (r.ready_s <= now, r.running))[: len(live) - desired]
            for r in victims:
                r.draining = True
                if r.running == 0:
                    r.stopped_s = now

    # -- one step of dt
    def step(self, now: float) -> None:
        cfg, m = self.cfg, self.m
        end = now + cfg.dt_s
        upto = int(np.searchsorted(self.arr_t, end, side="right"))
        for i in range(self.next_arrival, upto):
            self.queue.append(i)
        self.state[self.next_arrival : upto] = 1
        self.next_arrival = upto
        while self.queue and self.arr_t[self.queue[0]] < now - cfg.timeout_s:
            self.state[self.queue.popleft()] = 5
        ready = [k for k, r in enumerate(self.replicas) if r.ready(now)]
        admitted = []
        while self.queue and ready:
            k = min(ready, key=lambda j: self.replicas[j].running)
            r = self.replicas[k]
            i = self.queue[0]
            need = int(self.prompt[i] + self.out[i])
            if r.running >= m.max_num_seqs or r.kv_tokens + need > m.kv_capacity_tokens:
                break  # the least loaded is full: so are the others
            self.queue.popleft()
            r.running += 1
            r.kv_tokens += need
            self.rep[i] = k
            self.state[i] = 2
            admitted.append(i)
        if admitted:
            self.active = np.concatenate([self.active, np.asarray(admitted, np.int64)])
        if len(self.active):
            self._serve(now)

    def _serve(self, now: float) -> None:
        m, dt = self.m, self.cfg.dt_s
        act = self.active
        nrep = len(self.replicas)
        reps = self.rep[act]
        pf = self.state[act] == 2
        n_dec = np.bincount(reps[~pf], minlength=nrep).astype(np.float64)
        pending = np.bincount(reps[pf], weights=self.rem_pf[act[pf]], minlength=nrep)
        chunk = np.minimum(np.maximum(m.max_batched_tokens - n_dec, 0.0), pending)
        t_step = m.step_base_s + m.step_per_seq_s * n_dec + chunk / m.prefill_tokens_per_s
        steps = dt / t_step
        budget = steps * chunk
        # Prefill in admission order per replica.
        pf_idx = act[pf]
        if len(pf_idx):
            pf_idx = pf_idx[np.lexsort((pf_idx, self.rep[pf_idx]))]
            rr = self.rep[pf_idx]
            rem = self.rem_pf[pf_idx]
            cum = np.cumsum(rem)
            group_total = np.bincount(rr, weights=rem, minlength=nrep)
            group_base = np.concatenate([[0.0], np.cumsum(group_total)[:-1]])
            before = cum - rem - group_base[rr]
            done_pf = before + rem <= budget[rr] + 1e-6
            self.rem_pf[pf_idx] = np.maximum(rem - np.maximum(budget[rr] - before, 0.0), 0.0)
            fin = pf_idx[done_pf]
            if len(fin):
                frac = (before[done_pf] + rem[done_pf]) / np.maximum(budget[rr[done_pf]], 1e-9)
                t_first = now + dt * np.clip(frac, 0.0, 1.0)
                self.first_tok[fin] = t_first
                self.state[fin] = 3
                for tf, i in zip(t_first, fin, strict=True):
                    self.recent_ttft.append((tf, tf - self.arr_t[i]))
        dec = act[~pf]
        if len(dec):
            self.rem_dec[dec] -= steps[self.rep[dec]]
        finished = act[(self.state[act] == 3) & (self.rem_dec[act] <= 0)]
        if len(finished):
            self.state[finished] = 4
            for i in finished:
                r = self.replicas[self.rep[i]]
                r.running -= 1
                r.kv_tokens -= int(self.prompt[i] + self.out[i])
                if r.draining and r.running == 0 and r.stopped_s is None:
                    r.stopped_s = now + dt
            self.active = act[self.state[act] < 4]

    def metrics(self, now: float) -> Metrics:
        ready = [r for r in self.replicas if r.ready(now)]
        while self.recent_ttft and self.recent_ttft[0][0] < now - 60.0:
            self.recent_ttft.popleft()
        p90 = float(np.percentile([x for _, x in self.recent_ttft], 90)) if self.recent_ttft else None
        return Metrics(
            now=now,
            ready=len(ready),
            replicas=len(self.live()),
            running=int(sum(r.running for r in self.replicas if r.stopped_s is None)),
            queue=len(self.queue),
            arrivals_total=self.next_arrival,
            kv_util=float(np.mean([r.kv_tokens / self.m.kv_capacity_tokens for r in ready])) if ready else 0.0,
            busy_fraction=float(np.mean([r.running > 0 for r in ready])) if ready else 0.0,
            ttft_p90_60s=p90,
        )

    def gpu_hours(self, end: float) -> float:
        return sum(((r.stopped_s if r.stopped_s is not None else end) - r.started_s) for r in self.replicas) / 3600


# --------------------------------------------------------------------------- policies


class Policy:
    name = "policy"
    period_s = 1.0

    def desired(self, now: float, history: list[Metrics], current: int) -> int:
        raise NotImplementedError

    def on_arrival_at_zero(self, now: float, history: list[Metrics], current: int) -> int | None:
        """The router holds a request and no replica exists: a policy with a wake path reacts now."""
        return None


def _window(history: list[Metrics], now: float, seconds: float) -> list[Metrics]:
    return [h for h in history if h.now > now - seconds] or history[-1:]


class Hpa(Policy):
    """Kubernetes HPA on DCGM GPU utilization, target 70%: 15 s sync, 10% tolerance, scale-up at most
    max(4 pods, +100%) per 15 s, scale-down stabilization 300 s; min 1 (HPA cannot reach zero)."""

    name = "hpa_gpu"
    period_s = 15.0

    def __init__(self, max_replicas: int) -> None:
        self.max = max_replicas
        self.recs: deque[tuple[float, int]] = deque()

    def desired(self, now: float, history: list[Metrics], current: int) -> int:
        window = _window(history, now, 30.0)  # the adapter's rate window behind the metric
        util = float(np.mean([h.busy_fraction for h in window]))
        ready = history[-1].ready or current
        ratio = util / 0.7
        rec = current if abs(ratio - 1) <= 0.1 else math.ceil(ready * ratio)
        rec = max(1, min(self.max, rec))
        self.recs.append((now, rec))
        while self.recs[0][0] < now - 300.0:
            self.recs.popleft()
        if rec > current:
            return min(rec, max(current + 4, 2 * current))
        return min(current, max(r for _, r in self.recs))


class Keda(Policy):
    """KEDA Prometheus scaler on vllm:num_requests_waiting (threshold 5 per replica, AverageValue):
    30 s polling, activation from zero when waiting > 0, cooldown 300 s to zero; the HPA below it
    keeps its 300 s scale-down stabilization."""

    name = "keda_queue"
    period_s = 30.0

    def __init__(self, max_replicas: int) -> None:
        self.max = max_replicas
        self.recs: deque[tuple[float, int]] = deque()
        self.last_active = 0.0

    def desired(self, now: float, history: list[Metrics], current: int) -> int:
        h = history[-1]
        waiting = h.queue
        if waiting > 0 or h.running > 0:
            self.last_active = now
        if current == 0:
            return 1 if waiting > 0 else 0
        if now - self.last_active >= 300.0:
            return 0
        rec = max(1, min(self.max, math.ceil(waiting / 5.0)))
        self.recs.append((now, rec))
        while self.recs[0][0] < now - 300.0:
            self.recs.popleft()
        if rec > current:
            return min(rec, max(current + 4, 2 * current))
        return min(current, max(r for _, r in self.recs))


class Kpa(Policy):
    """Knative KPA with its defaults: concurrency target 100 x 70% = 70 per replica, stable window
    60 s, panic window 6 s (10%), panic at 200%, max scale-down rate 2, scale to zero after the stable
    window of no traffic plus a 30 s grace; the activator wakes it on the first request."""

    name = "knative_kpa"
    period_s = 2.0

    def __init__(self, max_replicas: int) -> None:
        self.max = max_replicas
        self.panic_until = -1.0
        self.idle_since: float | None = None

    def desired(self, now: float, history: list[Metrics], current: int) -> int:
        target = 70.0
        stable = float(np.mean([h.running + h.queue for h in _window(history, now, 60.0)]))
        panic = float(np.mean([h.running + h.queue for h in _window(history, now, 6.0)]))
        want_stable, want_panic = math.ceil(stable / target), math.ceil(panic / target)
        ready = max(history[-1].ready, 1)
        if want_panic / ready >= 2.0:
            self.panic_until = now + 60.0
        if stable == 0 and panic == 0:
            self.idle_since = self.idle_since if self.idle_since is not None else now
            if now - self.idle_since >= 30.0:
                return 0
        else:
            self.idle_since = None
        want = max(want_panic, current) if now < self.panic_until else want_stable
        want = max(want, math.ceil(current / 2.0))
        return max(1, min(self.max, want))

    def on_arrival_at_zero(self, now: float, history: list[Metrics], current: int) -> int | None:
        return 1  # the activator pokes the autoscaler


class Kvfleet(Policy):
    """kvfleet's real policy (``decide``), on metrics scraped every 5 s, deciding every 2 s; the router
    wakes it at once when a request arrives at zero replicas."""

    name = "kvfleet"
    period_s = 2.0

    def __init__(self, spec: AutoscalingSpec, scrape_s: float = 5.0, name: str = "kvfleet") -> None:
        self.name = name
        self.spec = spec
        self.scrape_s = scrape_s
        self.state: PolicyState | None = None
        self.reasons: dict[str, int] = {}

    def _observe(self, now: float, history: list[Metrics], wake: bool) -> Observation:
        scraped = [h for h in history if h.now <= now - (now % self.scrape_s)] or history[:1]
        h = scraped[-1]
        old = [x for x in history if x.now <= h.now - 60.0]
        base = old[-1] if old else history[0]
        rate = (h.arrivals_total - base.arrivals_total) / max(h.now - base.now, 1.0)
        return Observation(
            sampled_at_s=h.now,
            ready_replicas=h.ready,
            engine_concurrency=float(h.running),
            router_in_flight=float(h.running),
            queue_depth=float(h.queue),
            arrival_rate_rps=rate,
            kv_cache_utilization=h.kv_util if h.ready else None,
            ttft_p90_s=h.ttft_p90_60s,
            wake_requested=wake,
        )

    def _decide(self, now: float, history: list[Metrics], current: int, wake: bool) -> int:
        if self.state is None:
            self.state = initial_state(current, now)
        self.state = replace(self.state, desired_replicas=current)
        d = decide(self._observe(now, history, wake), self.state, self.spec, now)
        self.state = d.state
        self.reasons[d.reason] = self.reasons.get(d.reason, 0) + 1
        return d.desired_replicas

    def desired(self, now: float, history: list[Metrics], current: int) -> int:
        return self._decide(now, history, current, wake=False)

    def on_arrival_at_zero(self, now: float, history: list[Metrics], current: int) -> int | None:
        return self._decide(now, history, current, wake=True)


class Oracle(Policy):
    """Clairvoyant: knows the arrival rate ahead; keeps ceil(max rate over the next cold start plus a
    margin / mu) replicas, asks for them one cold start early, and drops them the moment they are
    not needed."""

    name = "oracle"
    period_s = 1.0

    def __init__(self, rate: Callable[[np.ndarray], np.ndarray], mu: float, cold_start_s: float) -> None:
        self.rate, self.mu, self.cold = rate, mu, cold_start_s

    def desired(self, now: float, history: list[Metrics], current: int) -> int:
        ahead = self.rate(np.arange(now, now + self.cold + 10.0, 1.0))
        need = float(ahead.max())
        return 0 if need <= 0 else math.ceil(need / self.mu)


# --------------------------------------------------------------------------- running


def simulate(
    policy: Policy,
    arr_t: np.ndarray,
    prompts: np.ndarray,
    outputs: np.ndarray,
    total_s: float,
    model: ServiceModel,
    cfg: SimConfig,
    start_replicas: int,
    trace: str,
    record_every_s: float = 5.0,
) -> Result:
    cluster = Cluster(arr_t, prompts, outputs, model, cfg)
    cluster.scale_to(start_replicas, -cfg.cold_start_s)  # warm at t = 0
    history: list[Metrics] = []
    timeline: dict[str, list[float]] = {"t": [], "replicas": [], "ready": [], "queue": []}
    next_decision = 0.0
    n_steps = round(total_s / cfg.dt_s)
    for s in range(n_steps):
        now = s * cfg.dt_s
        if s % round(1.0 / cfg.dt_s) == 0:
            history.append(cluster.metrics(now))
            if len(history) > 400:
                del history[:100]
        current = len(cluster.live())
        arriving = cluster.next_arrival < len(arr_t) and arr_t[cluster.next_arrival] < now + cfg.dt_s
        if current == 0 and history and (cluster.queue or arriving):
            woken = policy.on_arrival_at_zero(now, history, current)
            if woken:
                cluster.scale_to(woken, now)
        if now >= next_decision and history:
            cluster.scale_to(policy.desired(now, history, len(cluster.live())), now)
            next_decision = now + policy.period_s
        cluster.step(now)
        if s % round(record_every_s / cfg.dt_s) == 0:
            h = history[-1]
            timeline["t"].append(now)
            timeline["replicas"].append(len(cluster.live()))
            timeline["ready"].append(h.ready)
            timeline["queue"].append(len(cluster.queue))
    arrived = cluster.next_arrival
    ttft = cluster.first_tok[:arrived] - arr_t[:arrived]
    # Requests still waiting at the end are judged by how long they have waited so far.
    unfinished = np.where(np.isnan(ttft), total_s - arr_t[:arrived], ttft)
    dropped = int((cluster.state[:arrived] == 5).sum())
    slo1, slo2 = cfg.slo_s
    return Result(
        policy=policy.name,
        trace=trace,
        requests=arrived,
        attain_1s=float((np.nan_to_num(ttft, nan=np.inf) <= slo1).mean()) if arrived else 1.0,
        attain_2s=float((np.nan_to_num(ttft, nan=np.inf) <= slo2).mean()) if arrived else 1.0,
        p99_ttft_s=float(np.percentile(np.where(cluster.state[:arrived] == 5, cfg.timeout_s, unfinished), 99))
        if arrived
        else 0.0,
        dropped=dropped,
        gpu_hours=cluster.gpu_hours(total_s),
        cold_starts=cluster.cold_starts,
        timeline=timeline,
    )


def workload(n: int, w: Workload, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    prompts = np.clip(rng.lognormal(np.log(w.prompt_mean_tokens) - 0.18, 0.6, n), 16, 8000).astype(np.int64)
    outputs = np.clip(rng.exponential(w.output_mean_tokens, n), 1, 2000).astype(np.int64)
    return prompts, outputs


def calibrate(
    model: ServiceModel, w: Workload, cfg: SimConfig, seed: int, fractions: tuple[float, ...] = (0.7,)
) -> tuple[float, dict[float, float]]:
    """mu: the highest Poisson rate one always-ready replica serves with TTFT p99 <= 1 s (bisection),
    and the mean concurrency it holds at each fraction of mu (the per-replica targets a user would
    read off this calibration: 0.7 is Knative's 70%)."""

    def run(rate: float, seconds: float = 120.0) -> tuple[float, float]:
        rng = np.random.default_rng(seed)
        arr = np.sort(rng.uniform(0, seconds, rng.poisson(rate * seconds)))
        p, o = workload(len(arr), w, rng)
        cl = Cluster(arr, p, o, model, replace(cfg, timeout_s=1e9))
        cl.scale_to(1, -1e9)
        conc = []
        for s in range(int(seconds / cfg.dt_s)):
            cl.step(s * cfg.dt_s)
            if s % 10 == 0 and s * cfg.dt_s > 20:
                conc.append(cl.replicas[0].running + len(cl.queue))
        ttft = cl.first_tok[: cl.next_arrival] - arr[: cl.next_arrival]
        ttft = np.where(np.isnan(ttft), seconds - arr[: cl.next_arrival], ttft)
        return float(np.percentile(ttft[arr[: cl.next_arrival] > 20], 99)), float(np.mean(conc))

    lo, hi = 0.5, 200.0
    for _ in range(12):
        mid = (lo + hi) / 2
        p99, _ = run(mid)
        lo, hi = (mid, hi) if p99 <= 1.0 else (lo, mid)
    return lo, {f: run(f * lo)[1] for f in fractions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="length of each trace")
    ap.add_argument("--cold-start-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--policies", default="hpa_gpu,keda_queue,knative_kpa,kvfleet,kvfleet_70,kvfleet_steady,oracle")
    ap.add_argument(
        "--target-fraction",
        type=float,
        default=0.825,
        help="kvfleet's targetConcurrencyPerReplica: the concurrency one replica holds at this share of mu",
    )
    ap.add_argument("--holdout-seeds", default="13,17", help="seeds not used for tuning ('' for none)")
    ap.add_argument("--holdout-policies", default="knative_kpa,kvfleet,kvfleet_70,oracle")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)

    model, w = ServiceModel(), Workload()
    cfg = SimConfig(cold_start_s=args.cold_start_s)
    started = time.perf_counter()
    fraction = args.target_fraction
    mu, concs = calibrate(model, w, cfg, args.seed, (0.7, fraction))
    conc, conc_70 = concs[fraction], concs[0.7]
    print(
        f"calibration: one replica meets TTFT p99 <= 1 s up to {mu:.1f} req/s; it holds {conc_70:.1f} at 0.7 mu, "
        f"{conc:.1f} at {fraction:g} mu"
    )
    target = max(1.0, round(conc, 1))
    spec = AutoscalingSpec(
        min_replicas=0,
        max_replicas=cfg.max_replicas,
        target_concurrency_per_replica=target,
        scale_to_zero_after_seconds=120,
        scale_down_delay_seconds=60,
        window_seconds=60,
        panic_window_seconds=6,
        cold_start_seconds=cfg.cold_start_s,
        ttft_slo_seconds=1.0,
    )
    # The same policy with a deployment tuned to hold capacity through short lulls (bursty traffic):
    # four minutes before a scale-down, ten idle minutes before zero.
    steady_spec = spec.model_copy(update={"scale_down_delay_seconds": 240.0, "scale_to_zero_after_seconds": 600.0})
    # The same deployment with the target at 0.7 mu (Knative's 70%), the spec of earlier results.
    spec_70 = spec.model_copy(update={"target_concurrency_per_replica": max(1.0, round(conc_70, 1))})
    total_s = args.minutes * 60.0

    def run_seed(seed: int, policies: list[str]) -> list[Result]:
        out: list[Result] = []
        for trace in args.traces.split(","):
            rate = trace_rate(trace, args.minutes, mu)
            rng = np.random.default_rng([seed, zlib.crc32(trace.encode())])  # stable across runs
            arr_t = arrivals(rate, total_s, rng)
            prompts, outputs = workload(len(arr_t), w, rng)
            start = max(1, math.ceil(float(rate(np.array([0.0]))[0]) / mu))
            for name in policies:
                policy: Policy = {
                    "hpa_gpu": lambda: Hpa(cfg.max_replicas),
                    "keda_queue": lambda: Keda(cfg.max_replicas),
                    "knative_kpa": lambda: Kpa(cfg.max_replicas),
                    "kvfleet": lambda: Kvfleet(spec),
                    "kvfleet_70": lambda: Kvfleet(spec_70, name="kvfleet_70"),
                    "kvfleet_steady": lambda: Kvfleet(steady_spec, name="kvfleet_steady"),
                    "oracle": lambda rate=rate: Oracle(rate, mu, cfg.cold_start_s),
                }[name]()
                t0 = time.perf_counter()
                r = simulate(policy, arr_t, prompts, outputs, total_s, model, cfg, start, trace)
                out.append(r)
                print(
                    f"seed {seed:3d} {trace:10s} {name:14s} attain@1s {r.attain_1s:7.2%} @2s {r.attain_2s:7.2%} "
                    f"p99 {r.p99_ttft_s:6.2f}s GPU-h {r.gpu_hours:6.2f} cold {r.cold_starts:4d} "
                    f"dropped {r.dropped:5d} ({time.perf_counter() - t0:.1f}s)",
                    flush=True,
                )
        return out

    results = run_seed(args.seed, args.policies.split(","))
    # Seeds not looked at while the policy was tuned: the same traces with other arrivals and
    # request sizes, kvfleet against the oracle and the closest baseline.
    holdout: dict[int, list[Result]] = {}
    for seed in (int(x) for x in args.holdout_seeds.split(",") if x):
        holdout[seed] = run_seed(seed, [p for p in args.holdout_policies.split(",") if p])
    elapsed = time.perf_counter() - started
    write_outputs(results, holdout, args, mu, concs, target, spec, steady_spec, model, w, cfg, elapsed)
    return 0


def _rows(results: list[Result]) -> list[dict[str, object]]:
    oracle = {r.trace: r for r in results if r.policy == "oracle"}
    rows: list[dict[str, object]] = []
    for r in results:
        o = oracle.get(r.trace)
        rows.append(
            {
                **{k: v for k, v in asdict(r).items() if k != "timeline"},
                "gpu_hours_vs_oracle": (r.gpu_hours / o.gpu_hours) if o and o.gpu_hours else None,
            }
        )
    return rows


def _table(rows: list[dict[str, object]], seed_column: bool = False) -> list[str]:
    head = "| seed " if seed_column else ""
    lines = [
        head + "| trace | policy | TTFT<=1s | TTFT<=2s | p99 TTFT (s) | GPU-hours | x oracle | cold starts | dropped |",
        ("|---" if seed_column else "") + "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = row["gpu_hours_vs_oracle"]
        lines.append(
            (f"| {row['seed']} " if seed_column else "")
            + f"| {row['trace']} | {row['policy']} | {row['attain_1s']:.2%} | {row['attain_2s']:.2%} | "
            f"{row['p99_ttft_s']:.2f} | {row['gpu_hours']:.2f} | {'' if ratio is None else f'{ratio:.2f}'} | "
            f"{row['cold_starts']} | {row['dropped']} |"
        )
    return lines


def write_outputs(results, holdout, args, mu, concs, target, spec, steady_spec, model, w, cfg, elapsed) -> None:  # type: ignore[no-untyped-def]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows = _rows(results)
    holdout_rows = [{"seed": seed, **row} for seed, rs in holdout.items() for row in _rows(rs)]
    payload = {
        "command": "python bench/autoscale_sim.py " + " ".join(sys.argv[1:]),
        "minutes_per_trace": args.minutes,
        "seed": args.seed,
        "elapsed_s": round(elapsed, 1),
        "mu_req_per_s": mu,
        "target_fraction_of_mu": args.target_fraction,
        "concurrency_at_fraction_of_mu": {str(f): c for f, c in concs.items()},
        "kvfleet_spec": spec.to_wire(),
        "kvfleet_steady_spec": steady_spec.to_wire(),
        "service_model": asdict(model),
        "workload": asdict(w),
        "sim": asdict(cfg),
        "results": rows,
        "holdout_results": holdout_rows,
    }
    (out / "autoscaler.json").write_text(json.dumps(payload, indent=2))
    lines = _table(rows)
    if holdout_rows:
        lines += ["", f"Held-out seeds {args.holdout_seeds} (not used while tuning):", "", *_table(holdout_rows, True)]
    (out / "autoscaler_table.md").write_text("\n".join(lines) + "\n")
    if args.no_plots:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for trace in dict.fromkeys(r.trace for r in results):
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        for r in (x for x in results if x.trace == trace):
            t = np.asarray(r.timeline["t"]) / 60
            ax1.step(t, r.timeline["replicas"], where="post", label=r.policy, linewidth=1.2)
            ax2.plot(t, r.timeline["queue"], label=r.policy, linewidth=1.0)
        ax1.set_ylabel("replicas (asked for)")
        ax2.set_ylabel("router queue")
        ax2.set_xlabel("minutes")
        ax1.set_title(f"trace: {trace} (cold start {cfg.cold_start_s:g} s)")
        ax1.legend(ncol=6, fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"autoscaler_{trace}.png", dpi=90)
        plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
