"""OpenAI's wire shapes that the router and the reference engine both answer with.

Errors are ``{"error": {"message", "type", "param", "code"}}`` on every path, 404 and 405
included: ``type`` is the error's class, ``param`` the request field at fault (or null) and
``code`` a machine-readable string (or null), as OpenAI's API and SDKs have them (the SDKs read
``error.code`` and ``error.param``). The HTTP status is the response's own, not repeated in the body.
"""

from __future__ import annotations

from typing import Any

OWNED_BY = "kvfleet"


def error_object(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": error_type, "param": param, "code": code}


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": error_object(message, error_type, param=param, code=code)}


def not_found_body(method: str, path: str) -> dict[str, Any]:
    """An unknown path, worded as OpenAI words it."""
    return error_body(f"Invalid URL ({method} {path})", "invalid_request_error", code="unknown_url")


def method_not_allowed_body(method: str, path: str, allowed: str) -> dict[str, Any]:
    return error_body(
        f"{method} is not allowed on {path}; use {allowed}", "invalid_request_error", code="method_not_allowed"
    )


def model_object(model_id: str, *, created_unix_s: int, root: str | None = None) -> dict[str, Any]:
    """One entry of ``GET /v1/models`` and the answer of ``GET /v1/models/{id}``."""
    root = root or model_id
    return {"id": model_id, "object": "model", "created": created_unix_s, "owned_by": OWNED_BY, "root": root}
