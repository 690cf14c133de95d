"""Benchmark: kvfleet's control plane at platform scale (10, 100 and 1,000 InferenceDeployments).

On the real control plane (`kvfleet dev cluster`'s etcd, kube-apiserver, controller-manager,
scheduler and kwok GPU nodes; no real node), per deployment count N:

1. floor: N plain Deployments of the same engine pods (3 replicas of 1 GPU; the pod template the
   operator renders, under labels of their own) created at once: each one's create-to-ready time,
   then a template change to all of them at once and the time until all are rolled (what the kwok
   nodes and the Kubernetes controllers themselves allow); with --minimal-floor, first the same for
   bare one-container pods;
2. the operator, the autoscaler and routers running as local processes with the tokens of the
   chart's own ServiceAccounts (the chart's RBAC, installed by helm); N InferenceDeployments over
   up to 50 namespaces, with N/10 invalid ones among them: each valid one's apply-to-Ready time,
   and each invalid one's time to Degraded=InvalidSpec and its Event;
3. a steady-state window: API requests per minute by component and verb, from the API server's
   audit log (a policy that records only the kvfleet ServiceAccounts), watches counted apart; CPU
   seconds per minute and peak RSS of each component (from /proc);
4. a spec change to all N at once: time until every one is rolled and Ready, peak requests/s;
5. a new router's time until it lists every model and endpoint;
6. the operator killed (-9) while one deployment changes, and started again: time until it has
   acted on that change, and the requests it made catching up;
7. a watch resumed from an expired resourceVersion (410 Gone): the relist's time and requests;
8. bad input: a namespace deleted with 50 deployments in it (time until it and every child is
   gone), and 500 replicas asked of a GPU product the cluster has 300 of (what status says);
9. in process, no cluster: the autoscaler's tick over N deployments with 3 replicas' metrics each,
   and a router's pick latency and memory with N models and 3N endpoints.

    .venv/bin/python bench/scale.py --deployments 1000 --window-s 600 --baseline-window-s 0 --phase-timeout-s 900
    .venv/bin/python bench/scale.py --deployments 10 100 --window-s 60 --baseline-window-s 30 --phase-timeout-s 300 \
        --minimal-floor

(1,000 took 27-30 minutes of this 2-core machine left to it, the 10-minute steady window included;
10 and 100 5-6 minutes each: docs/benchmarks/scale.md. At 1,000 the window of the operator reading
by GET (the baseline, ~2 minutes with its restarts) and the bare-pod floor (~3 minutes) are left
out to stay within 30 minutes; both are measured at 10 and 100.)

Results merge by deployment count into docs/benchmarks/scale.json, rendered to scale.md and
scale.png, after every phase (a run stopped part-way keeps what it measured, marked ``partial``).
Every phase is bounded (``--phase-timeout-s``); a phase that times out is recorded as such, not
retried. The phases are modules of bench/platform_scale/, one each.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/platform_scale, when run as a script

from platform_scale.run import main


def _stop(signum: int, frame: FrameType | None) -> None:
    # SIGTERM as Ctrl-C: the run's cleanup (its control plane and components) runs either way;
    # a plain SIGTERM left them running and the next run shared the cores with them.
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop)
    main(__doc__ or "")
