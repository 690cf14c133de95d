"""bench/scale.py's parts, one module per phase of a run (the entry point and its doc are
bench/scale.py): ``objects`` (manifests, readiness, figures), ``cluster`` (the control plane's
plumbing and kvfleet's processes), ``audit`` (requests from the API server's audit log), then the
phases in the order a run takes them: ``floor``, ``apply``, ``steady``, ``change``, ``restart``,
``bad_input``; ``in_process`` (the autoscaler's tick and a router's pick, no cluster), ``run``
(one scale, every phase, results saved after each) and ``report`` (scale.md and scale.png)."""
