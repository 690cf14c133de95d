"""A real Kubernetes node beside the local control plane: containerd, runc and the CNI plugins
from Debian, kubelet and kube-proxy built from the control plane's own Kubernetes pin
(tools/node/build.sh), all inside a network and mount namespace made for it, so nothing of the
host changes (no host iptables rules, sysctls, or files under /var/lib, /var/log, /run).

``settings`` (what the node is), ``config`` (each component's files and command line, pure),
``namespace`` (the process that holds the namespaces), ``forward`` (host loopback ports into
the namespace), ``cgroups`` (the kubelet's cgroup root: made, emptied, removed), ``images``
(loading OCI images into containerd), ``binaries`` (where the node's binaries come from),
``lifecycle`` (the start and stop sequence).
"""
