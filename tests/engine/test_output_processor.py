"""The output processor alone: a real tokenizer (the tiny model's), tokens fed by hand, no model."""

from __future__ import annotations

from pathlib import Path

from kvfleet.engine.output_processor import OutputProcessor
from kvfleet.engine.request import RequestOutput
from kvfleet.engine.sampling import SamplingParams
from kvfleet.engine.sequence import Sequence
from kvfleet.engine.tokenizer import ModelTokenizer

EOS = 1000  # a token id the tests declare as EOS


def feed(tiny_model_dir: Path, tokens: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Feed ``tokens`` as if sampled one per step, until the processor says the request finished."""
    tokenizer = ModelTokenizer.from_dir(tiny_model_dir)
    processor = OutputProcessor(tokenizer, frozenset({EOS}), max_model_len_tokens=64)
    seq = Sequence("r", [5, 6, 7], params, 0.0)
    processor.add_request(seq)
    outputs = []
    for token in tokens:
        seq.token_ids.append(token)
        outputs.append(processor.process_token(seq, token))
        if outputs[-1].finished:
            break
    return outputs


def words(tiny_model_dir: Path, text: str) -> list[int]:
    return ModelTokenizer.from_dir(tiny_model_dir).encode(text, add_special_tokens=False)


def test_text_arrives_in_deltas_and_max_tokens_ends_it(tiny_model_dir: Path) -> None:
    tokens = words(tiny_model_dir, " the cat sat on the mat")
    outputs = feed(tiny_model_dir, tokens, SamplingParams(max_tokens=len(tokens)))
    assert [o.new_token_ids for o in outputs] == [(t,) for t in tokens]
    assert "".join(o.text_delta for o in outputs) == " the cat sat on the mat"
    assert [o.finish_reason for o in outputs] == [None] * (len(tokens) - 1) + ["length"]
    assert outputs[-1].prompt_tokens == 3 and outputs[-1].completion_tokens == len(tokens)


def test_eos_and_stop_token_ids_end_it_without_their_text(tiny_model_dir: Path) -> None:
    tokens = words(tiny_model_dir, " the cat")
    outputs = feed(tiny_model_dir, [*tokens, EOS, *tokens], SamplingParams(max_tokens=20))
    assert outputs[-1].finish_reason == "stop" and outputs[-1].new_token_ids == (EOS,)
    assert "".join(o.text_delta for o in outputs) == " the cat"
    ignored = feed(tiny_model_dir, [*tokens, EOS], SamplingParams(max_tokens=20, ignore_eos=True))
    assert ignored[-1].finished is False, "ignore_eos: EOS is an ordinary token"
    stop_id = tokens[-1]
    outputs = feed(tiny_model_dir, tokens, SamplingParams(max_tokens=20, stop_token_ids=(stop_id,)))
    assert outputs[-1].finish_reason == "stop" and "cat" not in "".join(o.text_delta for o in outputs)


def test_a_stop_string_is_cut_and_its_start_held_back(tiny_model_dir: Path) -> None:
    tokens = words(tiny_model_dir, " the cat sat on the mat")
    outputs = feed(tiny_model_dir, tokens, SamplingParams(max_tokens=20, stop=(" on",)))
    assert outputs[-1].finish_reason == "stop"
    assert "".join(o.text_delta for o in outputs) == " the cat sat"
    # While running, the last len(" on") - 1 = 2 characters are held back: they could start " on".
    tokenizer = ModelTokenizer.from_dir(tiny_model_dir)
    sent = ""
    for i, o in enumerate(outputs[:-1]):
        sent += o.text_delta
        so_far = tokenizer.decode(tokens[: i + 1])
        assert sent == so_far[: max(0, len(so_far) - 2)], (i, sent, so_far)


def test_an_abort_ends_it_with_no_text(tiny_model_dir: Path) -> None:
    processor = OutputProcessor(ModelTokenizer.from_dir(tiny_model_dir), frozenset(), max_model_len_tokens=64)
    seq = Sequence("r", [5], SamplingParams(), 0.0)
    processor.add_request(seq)
    aborted = processor.abort("r")
    assert aborted is not None and aborted.finish_reason == "abort" and aborted.text_delta == ""
    assert processor.abort("r") is None, "an unknown request aborts nothing"


def test_the_windowed_detokenizer_matches_decoding_the_whole_list(tiny_model_dir: Path) -> None:
    """The stream decodes a short window; at every token its text must equal what decoding the whole
    list gives (the previous algorithm, kept here as the oracle): random ids, so byte fragments that
    split characters and special tokens (skipped) come up too."""
    import random

    from kvfleet.engine.tokenizer import IncrementalDetokenizer

    tokenizer = ModelTokenizer.from_dir(tiny_model_dir)
    vocab = tokenizer.tokenizer.get_vocab_size()
    specials = [tokenizer.tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    rng = random.Random(0)
    fragments = 0
    for trial in range(40):
        ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(vocab) for _ in range(60)]
        detok = IncrementalDetokenizer(tokenizer)
        oracle_text, oracle_sent, streamed = "", "", ""
        for n, token in enumerate(ids, 1):
            streamed += detok.add(token)
            full = tokenizer.decode(ids[:n])
            if full.endswith("\ufffd"):
                fragments += 1
            else:
                oracle_sent += full[len(oracle_text) :] if full.startswith(oracle_text) else ""
                oracle_text = full
            assert streamed == oracle_sent, f"trial {trial}, token {n}"
        full = tokenizer.decode(ids)
        oracle_sent += full[len(oracle_text) :] if full.startswith(oracle_text) else ""
        assert streamed + detok.flush() == oracle_sent, f"trial {trial}: flush"
    assert fragments > 0, "the random ids never split a character: the test proves less than it says"
