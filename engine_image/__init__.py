"""kvfleet.engine_image: engine container images and the launcher that is their entrypoint."""
