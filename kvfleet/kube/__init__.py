"""The router's and the autoscaler's one Kubernetes client, on lightkube.

- ``backoff``: jittered exponential back-off that honours ``Retry-After`` (pure).
- ``client``: ``KubeClient``, one kept connection pool per process: lightkube loads the
  configuration (in-cluster service account, kubeconfig contexts, tokens, ``tokenFile`` re-read on
  401, exec plugins, client certificates, TLS) and builds the HTTP client; this module maps paths
  and errors (``KubeError`` tree, ``Retry-After`` read once here).
- ``watch``: ``ResourceWatch``, list once then watch with resourceVersion resume and bookmarks;
  410 Gone relists, every other failure resumes from the last version after a jittered back-off.
  Consumers get one call per changed object, never the whole store.
"""
