"""kvfleet.operator: the kopf operator that reconciles InferenceDeployments.

This folder is the subpackage ``kvfleet.operator`` (see pyproject's package-dir); it is never
importable as a top-level ``operator``, which would shadow the standard library.
"""
