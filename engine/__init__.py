"""kvfleet.engine: the CPU/CUDA reference engine with a paged KV cache and prefix caching."""
