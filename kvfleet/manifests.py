"""Read InferenceDeployments out of manifest files (several YAML documents per file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvfleet.resource import InferenceDeployment, is_inference_deployment, iter_documents
from kvfleet.validation import Problem, validate_object


@dataclass
class LoadResult:
    """The valid deployments of a file, and the problems of the invalid ones by document."""

    deployments: list[InferenceDeployment] = field(default_factory=list)
    problems: list[tuple[str, list[Problem]]] = field(default_factory=list)


def load_deployments(path: Path) -> LoadResult:
    """Validate every InferenceDeployment document in ``path``; other kinds are skipped."""
    result = LoadResult()
    try:
        docs = list(iter_documents(path))
    except yaml.YAMLError as e:
        result.problems.append(("", [Problem("(yaml)", str(e))]))
        return result
    for index, doc in docs:
        if not is_inference_deployment(doc):
            continue
        deployment, problems = validate_object(doc)
        name = doc.get("metadata", {}).get("name", "?") if isinstance(doc.get("metadata"), dict) else "?"
        if problems:
            result.problems.append((f"#{index} ({name})", problems))
        elif deployment is not None:
            result.deployments.append(deployment)
    if not docs:
        result.problems.append(("", [Problem("(file)", "no YAML documents found")]))
    elif not result.deployments and not result.problems:
        result.problems.append(
            ("", [Problem("(file)", "no InferenceDeployment (apiVersion kvfleet.io/v1alpha1) found")])
        )
    return result
