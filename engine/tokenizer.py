"""Tokenizer (``tokenizer.json`` through the ``tokenizers`` library) and chat template
(``tokenizer_config.json``'s ``chat_template``, rendered by jinja2's immutable sandbox because
templates ship with models we did not write)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvfleet.engine.errors import InvalidRequestError, ModelLoadError


def _raise_exception(message: str) -> None:
    # Templates call raise_exception() to reject conversations they cannot render.
    raise InvalidRequestError(f"chat template: {message}", param="messages")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    _template: jinja2.Template | None = field(default=None, repr=False)

    @classmethod
    def from_dir(cls, model_dir: Path, config_eos_ids: tuple[int, ...] = ()) -> ModelTokenizer:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no tokenizer.json (a tokenizers-library tokenizer is required)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception on a malformed file
            raise ModelLoadError(f"{path}: cannot load tokenizer: {e}") from e
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ModelLoadError(f"{config_path}: cannot read: {e}") from e
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: take the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        eos_token = _token_text(config.get("eos_token"))
        eos_ids = set(config_eos_ids)
        eos_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
        if eos_id is not None:
            eos_ids.add(eos_id)
        return cls(
            tokenizer=tokenizer,
            chat_template=template if isinstance(template, str) else None,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=eos_token,
            eos_token_ids=tuple(sorted(eos_ids)),
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The chat as prompt text. ``continue_final_message``: cut after the final message's content, so
        generation continues it (what transformers' ``apply_chat_template`` and vLLM do)."""
        text = self._render(messages, add_generation_prompt=add_generation_prompt and not continue_final_message)
        if not continue_final_message:
            return text
        final = str(messages[-1].get("content") or "")
        if not final:
            # Nothing to continue from: the start of an assistant turn is what the template renders for it.
            text = self._render(messages[:-1], add_generation_prompt=True)
            return text
        at = text.rfind(final)
        if at < 0:
            raise InvalidRequestError(
                "continue_final_message: the chat template does not render the final message's text as is",
                param="messages",
            )
        return text[: at + len(final)]

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat_template in tokenizer_config.json; use /v1/completions", param="messages"
            )
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ModelLoadError(f"chat_template does not compile: {e}") from e
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed to render: {e}", param="messages") from e


class IncrementalDetokenizer:
    """Text of a growing token list, emitted as deltas. ``tokenizers``' ``DecodeStream`` decodes only
    a short window behind the newest token (the prefix/read offsets of vLLM's and TGI's
    detokenizers), so a token costs the same at the 1,000th as at the first: decoding the whole
    list for every token kept a batch-32 decode step on an H200 ~1.6 ms in output handling, serial
    with the GPU. A trailing U+FFFD means a character is still incomplete: it is held back until the
    next token completes it, as a whole-list decode did. ``flush`` decodes the whole list once."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=True)
        self.token_ids: list[int] = []
        self.text = ""

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._tokenizer.tokenizer, token_id)
            except Exception:  # the stream refuses a window whose text its prefix does not start (Rust error)
                self._stream = None  # this sequence decodes its whole list from here, as before
            else:
                if delta is None:
                    return ""
                self.text += delta
                return str(delta)
        full = self._tokenizer.decode(self.token_ids)
        return "" if full.endswith("\ufffd") else self._advance(full)

    def flush(self) -> str:
        """Whatever is left at the end, incomplete characters included."""
        return self._advance(self._tokenizer.decode(self.token_ids))

    def _advance(self, full: str) -> str:
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return delta
