"""An engine's JSON error answer in OpenAI's shape (kvfleet.openai_shape.openai_error_body)."""

from __future__ import annotations

import pytest

from kvfleet.openai_shape import openai_error_body


@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        # vLLM 0.32.0: the exception's class name and the status as an integer code.
        (
            400,
            {
                "message": "temperature must be non-negative, got -1.0.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            {
                "message": "temperature must be non-negative, got -1.0.",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            },
        ),
        (
            404,
            {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model", "code": 404},
            {"message": "The model `x` does not exist.", "type": "not_found_error", "param": "model", "code": None},
        ),
        (
            500,
            {"message": "boom", "type": "InternalServerError", "param": None, "code": 500},
            {"message": "boom", "type": "server_error", "param": None, "code": None},
        ),
        # A non-string param is dropped, a string code kept.
        (
            400,
            {"message": "m", "type": "BadRequestError", "param": ["prompt"], "code": "too_long"},
            {"message": "m", "type": "invalid_request_error", "param": None, "code": "too_long"},
        ),
    ],
    ids=["vllm-400", "vllm-404", "vllm-500", "odd-param"],
)
def test_engine_errors_take_openais_types_and_codes(
    status: int, error: dict[str, object], expected: dict[str, object]
) -> None:
    assert openai_error_body(status, {"error": error}) == {"error": expected}


def test_openai_shaped_and_non_error_bodies_are_left_alone() -> None:
    shaped = {"error": {"message": "m", "type": "invalid_request_error", "param": "n", "code": None}}
    assert openai_error_body(400, shaped) is None
    assert openai_error_body(400, {"error": "a string"}) is None
    assert openai_error_body(400, [1, 2]) is None
    assert openai_error_body(200, {"choices": []}) is None
