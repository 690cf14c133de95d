"""The output processor: a sampled token becomes a request's output. It detokenizes incrementally,
applies the stop conditions (EOS, stop token ids, ``max_tokens``, the context length, stop strings)
and decides how much text may be sent, holding back what could still become the start of a stop
string. Pure bookkeeping over the tokenizer: no tensors, no pool, no metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.engine.request import RequestOutput
from kvfleet.engine.sequence import Sequence
from kvfleet.engine.tokenizer import IncrementalDetokenizer, ModelTokenizer


@dataclass(eq=False)
class _TextState:
    seq: Sequence
    detok: IncrementalDetokenizer
    text: str = ""
    sent_chars: int = 0
    pending_tokens: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: ModelTokenizer, eos_ids: frozenset[int], max_model_len_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len_tokens = max_model_len_tokens
        self._states: dict[str, _TextState] = {}

    def add_request(self, seq: Sequence) -> None:
        self._states[seq.request_id] = _TextState(seq, IncrementalDetokenizer(self.tokenizer))

    def process_token(self, seq: Sequence, token: int) -> RequestOutput:
        """The output for ``token``, already appended to ``seq``; a finished one drops its state."""
        t, p = self._states[seq.request_id], seq.params
        reason: str | None = None
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        else:
            t.text += t.detok.add(token)
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len_tokens):
            reason = "length"
        if reason is not None:
            t.text += t.detok.flush()
        if p.stop:
            # Search only where a new match can start: the last delta plus a stop string's length.
            window = max(len(s) for s in p.stop)
            search_from = max(0, t.sent_chars - window)
            hits = [i for i in (t.text.find(s, search_from) for s in p.stop) if i >= 0]
            if hits:
                t.text = t.text[: min(hits)]
                reason = "stop"
        t.pending_tokens.append(token)
        if reason is None:
            return self._output(t, self._emit(t, holdback=max((len(s) for s in p.stop), default=1) - 1), None)
        del self._states[seq.request_id]
        return self._output(t, self._emit(t, holdback=0), reason)

    def abort(self, request_id: str) -> RequestOutput | None:
        """The final output of an aborted request (text held back is dropped); None when unknown."""
        t = self._states.pop(request_id, None)
        return None if t is None else self._output(t, "", "abort")

    @staticmethod
    def _emit(t: _TextState, holdback: int) -> str:
        """Text not yet sent, keeping back what could still become the start of a stop string."""
        upto = max(t.sent_chars, len(t.text) - holdback)
        delta = t.text[t.sent_chars : upto]
        t.sent_chars = upto
        return delta

    @staticmethod
    def _output(t: _TextState, delta: str, reason: str | None) -> RequestOutput:
        tokens = tuple(t.pending_tokens)
        t.pending_tokens.clear()
        return RequestOutput(
            request_id=t.seq.request_id,
            text_delta=delta,
            new_token_ids=tokens,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=t.seq.num_prompt_tokens,
            completion_tokens=t.seq.num_output_tokens,
            cached_tokens=t.seq.num_cached_prompt_tokens,
        )
