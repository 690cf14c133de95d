"""make-tiny-model: a complete Hugging Face folder, a working tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfleet.cli import cli
from kvfleet.engine.tiny_model import make_tiny_model
from kvfleet.engine.tokenizer import IncrementalDetokenizer, ModelTokenizer


def test_folder_layout_and_config(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 64, 1024)


def test_tokenizer_round_trips_any_text_and_has_the_vocab(tiny_model_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(tiny_model_dir)
    assert tok.tokenizer.get_vocab_size() == 1024
    text = "Hello, wörld! 你好 😀 def f(x): return x"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.eos_token_ids == (tok.tokenizer.token_to_id("<|im_end|>"),)


def test_chat_template_renders_chatml(tiny_model_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(tiny_model_dir)
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.tokenizer.token_to_id("<|im_start|>")


def test_incremental_detokenizer_holds_back_split_characters(tiny_model_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(tiny_model_dir)
    ids = tok.encode("a😀b")
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == "a😀b"
    assert all("\ufffd" not in d for d in deltas), "no replacement characters for a split emoji"


def test_same_seed_same_files_and_no_clobbering(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=3)
    b = make_tiny_model(tmp_path / "b", seed=3)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    with pytest.raises(FileExistsError):
        make_tiny_model(a)
    make_tiny_model(a, overwrite=True, seed=4)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no staging leftovers"


def test_cli_builds_a_model(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["engine", "make-tiny-model", str(tmp_path / "m"), "--layers", "1", "--hidden", "32", "--vocab", "512"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["hidden_size"] == 32
    bad = CliRunner().invoke(cli, ["engine", "make-tiny-model", str(tmp_path / "x"), "--hidden", "30", "--heads", "4"])
    assert bad.exit_code != 0 and "heads" in bad.output


def test_words_only_output_re_tokenizes_into_the_generated_tokens(tmp_path: Path) -> None:
    """What greedy decoding emits encodes back into the same ids, after a prompt too: a continuation
    from the text alone then sees exactly the tokens the model produced."""
    from kvfleet.engine.sampling import SamplingParams

    from .conftest import make_core, run_to_completion

    model_dir = make_tiny_model(tmp_path / "w", layers=1, hidden=32, vocab=512, words_only=True)
    tok = ModelTokenizer.from_dir(model_dir)
    prompts = {
        "completion": "Request 1 about GPUs:",
        "chat": tok.render_chat([{"role": "user", "content": "Say 3."}]),
    }
    ids = {name: tok.encode(text, add_special_tokens=False) for name, text in prompts.items()}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    generated = run_to_completion(make_core(model_dir), ids, params)
    for name, prompt in prompts.items():
        text = tok.decode(generated[name])
        assert tok.encode(prompt + text, add_special_tokens=False) == ids[name] + generated[name], name
        assert len(set(generated[name])) > 3, "the model is not stuck on one token"


def test_words_only_needs_an_untied_head(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="words_only"):
        make_tiny_model(tmp_path / "w", words_only=True, tie_word_embeddings=True)
