"""The engine's error tree. Each class maps to one HTTP status at the server boundary
(``server.py``); the engine core raises only these."""

from __future__ import annotations


class EngineError(Exception):
    """Base of everything the engine raises on purpose."""


class ModelLoadError(EngineError):
    """The model folder cannot be served (missing files, unsupported architecture, pickled weights)."""


class DeviceUnavailableError(EngineError):
    """The requested device (``cuda``) is not usable on this machine."""


class RequestError(EngineError):
    """A request the engine refuses; ``status`` is the HTTP status, ``param`` the offending field."""

    status = 400
    error_type = "invalid_request_error"
    # OpenAI's machine-readable code for the few cases its SDKs and clients look for.
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(RequestError):
    """Malformed or out-of-range input (400)."""


class PromptTooLongError(InvalidRequestError):
    """Prompt (plus the tokens to generate) does not fit the model's context or the KV pool (400)."""

    code = "context_length_exceeded"


class UnknownModelError(RequestError):
    """The ``model`` field names a model this server does not serve (404)."""

    status = 404
    error_type = "not_found_error"
    code = "model_not_found"


class OverloadedError(RequestError):
    """The waiting queue is at its bound (429 with Retry-After)."""

    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DrainingError(RequestError):
    """The server is shutting down and admits nothing new (503 with Retry-After)."""

    status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(EngineError):
    """The engine's step loop stopped because of an internal error; requests cannot be served."""
