"""kvfleet: LLM serving on GPU Kubernetes clusters."""

__version__ = "0.1.0"
