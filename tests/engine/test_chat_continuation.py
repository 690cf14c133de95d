"""``continue_final_message``: the chat prompt ends inside the final assistant message (vLLM's rule)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine.errors import InvalidRequestError
from kvfleet.engine.protocol import ChatCompletionRequest, parse_request
from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.engine.tokenizer import ModelTokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    model: Path = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", layers=1, hidden=16, vocab=300)
    return ModelTokenizer.from_dir(model)


def test_the_prompt_is_the_new_turn_plus_the_partial_answer(tokenizer: ModelTokenizer) -> None:
    user = [{"role": "user", "content": "hi"}]
    fresh = tokenizer.render_chat(user, add_generation_prompt=True)
    partial = [*user, {"role": "assistant", "content": "Hello, wor"}]
    continued = tokenizer.render_chat(partial, add_generation_prompt=False, continue_final_message=True)
    assert continued == fresh + "Hello, wor"
    # An empty final message continues from the start of the assistant turn.
    empty = tokenizer.render_chat([*user, {"role": "assistant", "content": ""}], continue_final_message=True)
    assert empty == fresh


def test_requests_that_cannot_continue_are_refused_naming_why() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        parse_request(ChatCompletionRequest, body)
    with pytest.raises(InvalidRequestError, match="last message to be the assistant"):
        parse_request(ChatCompletionRequest, {**body, "add_generation_prompt": False})
