"""Local mode (``kvfleet local``): InferenceDeployments served on this machine, engines as child
processes behind the router, scaled by the autoscaler's own decisions. docs/local.md maps the modules."""
