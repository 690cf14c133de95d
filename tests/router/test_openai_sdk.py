"""The official OpenAI Python SDK against the router in front of real reference-engine processes:
what an application written for OpenAI calls (models.list/retrieve, completions and chat,
streaming and not) works unchanged, and the SDK's typed errors carry ``type``, ``param`` and a
string ``code`` for every error the router answers itself, unknown paths and methods included."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import openai
import pytest

from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.router.replicas import StaticReplicaSource
from kvfleet.router.server import RouterServer
from kvfleet.spec import RoutingSpec
from kvfleet_testkit.engines import Engine

from .conftest import running_engines, running_router

# Served names often hold a slash (Hugging Face ids); the SDK puts it into the path unescaped.
SERVED = "acme/tiny-chat"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", layers=2, hidden=64, vocab=1024)
    logs = tmp_path_factory.mktemp("logs")
    with running_engines(model, 2, logs, SERVED, "--kv-blocks", "128") as engines:
        yield engines


@pytest.fixture
async def router(engines: list[Engine]) -> AsyncIterator[RouterServer]:
    source = StaticReplicaSource()
    source.set_deployment(SERVED, routing=RoutingSpec())
    for engine in engines:
        source.add(SERVED, engine.replica_id, engine.url)
    async with running_router(source) as server:
        yield server


def client(router: RouterServer) -> openai.AsyncOpenAI:
    # No retries: every error the SDK sees is the first answer.
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="not-checked", max_retries=0, timeout=60)


@pytest.mark.slow
async def test_models_list_and_retrieve(router: RouterServer) -> None:
    async with client(router) as sdk:
        listed = [m async for m in sdk.models.list()]
        assert [m.id for m in listed] == [SERVED]
        assert listed[0].object == "model" and listed[0].owned_by == "kvfleet"
        assert isinstance(listed[0].created, int) and listed[0].created > 1_600_000_000
        got = await sdk.models.retrieve(SERVED)
        assert (got.id, got.created) == (SERVED, listed[0].created)
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.models.retrieve("acme/nope")
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    assert caught.value.type == "model_not_found" and "'acme/nope'" in caught.value.message


@pytest.mark.slow
async def test_completions_and_chat_streaming_and_not(router: RouterServer) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
    async with client(router) as sdk:
        whole = await sdk.chat.completions.create(model=SERVED, messages=messages, max_tokens=6, temperature=0)
        assert whole.object == "chat.completion" and whole.model == SERVED
        assert whole.usage is not None and whole.usage.completion_tokens == 6
        text = whole.choices[0].message.content
        assert text

        stream = await sdk.chat.completions.create(
            model=SERVED, messages=messages, max_tokens=6, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        # Greedy decoding: the stream through the router is the same text as the whole answer.
        assert "".join(pieces) == text

        completion = await sdk.completions.create(model=SERVED, prompt="Once upon", max_tokens=5, temperature=0)
        assert completion.object == "text_completion" and completion.choices[0].text
        streamed = await sdk.completions.create(
            model=SERVED, prompt="Once upon", max_tokens=5, temperature=0, stream=True
        )
        assert "".join([c.choices[0].text async for c in streamed]) == completion.choices[0].text


@pytest.mark.slow
async def test_errors_are_typed_with_param_and_code(router: RouterServer) -> None:
    async with client(router) as sdk:
        with pytest.raises(openai.NotFoundError) as unknown:
            await sdk.completions.create(model="nope", prompt="x", max_tokens=1)
        # Refused by the engine (a field out of range), relayed by the router unchanged.
        with pytest.raises(openai.BadRequestError) as bad_field:
            await sdk.completions.create(model=SERVED, prompt="x", max_tokens=1, temperature=7)
        with pytest.raises(openai.BadRequestError) as too_long:
            await sdk.completions.create(model=SERVED, prompt=[5] * 4000, max_tokens=1)
    assert (unknown.value.code, unknown.value.param) == ("model_not_found", "model")
    assert (bad_field.value.type, bad_field.value.param, bad_field.value.code) == (
        "invalid_request_error",
        "temperature",
        None,
    )
    assert too_long.value.code == "context_length_exceeded"

    # Paths and methods the router has no route for: the same object, for any client.
    async with aiohttp.ClientSession() as session:
        for method, path, status, code in [
            ("GET", "/v1/embeddings", 404, "unknown_url"),
            ("POST", "/v1/models", 405, "method_not_allowed"),
            ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ]:
            async with session.request(method, router.url + path) as resp:
                assert resp.status == status
                error = (await resp.json())["error"]
            assert error == {"message": error["message"], "type": "invalid_request_error", "param": None, "code": code}
            assert path in error["message"]
