"""A real Kubernetes control plane on this machine, from upstream binaries built from Go modules."""
