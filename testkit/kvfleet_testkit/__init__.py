"""Helpers kvfleet's tests and benchmarks share: real local servers (moto's S3 server, KMock's
Kubernetes API extended for the operator) and the processes they start (reference engines).

Not part of the product: it is its own distribution (testkit/pyproject.toml), never in the wheel or
the images, and tests/api/test_layers.py keeps product modules from importing it. Helpers only the
tests use stay in tests/support/.
"""
