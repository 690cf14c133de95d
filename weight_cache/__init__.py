"""kvfleet.weight_cache: S3 weight cache, node cache and engine artifacts."""
