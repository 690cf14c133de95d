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


# OpenAI's error ``type`` for an engine error whose own type is not one of OpenAI's (vLLM writes its
# exception's class name, ``BadRequestError``), by the answer's HTTP status.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
# A context overflow gets OpenAI's code for it (clients look for it to shorten and retry).
_CONTEXT_OVERFLOW = ("maximum context length", "context length is")


def _is_openai_type(value: object) -> bool:
    """OpenAI's error types are snake_case words (``invalid_request_error``), never class names."""
    return isinstance(value, str) and bool(value) and value == value.lower() and " " not in value


def openai_error_body(status: int, payload: object) -> dict[str, Any] | None:
    """An engine's JSON error answer in OpenAI's shape (message and param kept; ``type`` OpenAI's,
    from the status where the engine's is not; ``code`` a string or null), or None where ``payload``
    is not an error body or is OpenAI's shape already (then passed on as it came)."""
    if not isinstance(payload, dict) or not isinstance(error := payload.get("error"), dict):
        return None
    message, kind, param, code = (error.get(k) for k in ("message", "type", "param", "code"))
    fine = (
        isinstance(message, str)
        and _is_openai_type(kind)
        and (param is None or isinstance(param, str))
        and (code is None or isinstance(code, str))
    )
    if fine:
        return None
    text = message if isinstance(message, str) else str(message if message is not None else "")
    if not _is_openai_type(kind):
        kind = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    if not isinstance(code, str):
        code = "context_length_exceeded" if any(s in text.lower() for s in _CONTEXT_OVERFLOW) else None
    return error_body(text, str(kind), param=param if isinstance(param, str) else None, code=code)
