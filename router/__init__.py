"""kvfleet.router: the OpenAI-compatible, prefix-aware router and its activator."""
