"""kvfleet.autoscaler: scaling policy, metric sources and actuators."""
