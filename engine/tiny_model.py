"""Build a random-weight Llama model in Hugging Face layout, with a byte-level BPE tokenizer
trained here by ``tokenizers`` on a generated corpus and a ChatML chat template. Nothing is
downloaded; the same arguments give the same files."""

from __future__ import annotations

import json
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SEED_TEXT = (
    "kvfleet runs language models on GPU clusters. The router sends each request to the replica "
    "that already holds its prefix; the autoscaler adds replicas when queues grow and removes them "
    "when traffic stops. Hello, world! What is the capital of France? Paris. 0123456789 "
    "def main():\n    return {'ok': True}\n"
)


@dataclass(frozen=True)
class TinyModelSpec:
    layers: int = 2
    hidden: int = 64
    vocab: int = 1024
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 0  # 0: about 8/3 * hidden, rounded up to 64 (Llama's ratio)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    seed: int = 0
    # Only whole space-led words can be generated: any output then re-tokenizes into the tokens that
    # were generated, so a continuation from the text (stream migration) is exact. Off: any token,
    # byte fragments included, as a random model of a real tokenizer emits.
    words_only: bool = False
    # Safetensors files the weights are split into (with model.safetensors.index.json when > 1),
    # as Hugging Face shards a large checkpoint: contiguous runs of tensors of about equal bytes.
    shards: int = 1

    def __post_init__(self) -> None:
        if self.layers < 1 or self.hidden < 8 or self.heads < 1 or self.kv_heads < 1:
            raise ValueError("layers, heads, kv_heads must be >= 1 and hidden >= 8")
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise ValueError("hidden must split into heads of even size, and heads must be a multiple of kv_heads")
        if self.vocab < 300:
            raise ValueError("vocab must be >= 300 (256 byte tokens plus special tokens and merges)")
        if not 1 <= self.shards <= 999:
            raise ValueError("shards must be in [1, 999]")
        if self.words_only and self.tie_word_embeddings:
            raise ValueError("words_only needs an untied lm_head (its rows of other tokens are zeroed)")

    @property
    def intermediate_size(self) -> int:
        return self.intermediate or -(-(8 * self.hidden // 3) // 64) * 64


def _corpus(vocab: int, seed: int) -> list[str]:
    """Pseudo-words with English-like letter frequencies: enough distinct pairs for ``vocab`` merges."""
    rng = random.Random(seed)  # noqa: S311 - reproducible text, not secrets
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [26 - i for i in range(len(letters))]
    words = ["".join(rng.choices(letters, weights, k=rng.randint(2, 9))) for _ in range(max(2000, vocab // 2))]
    lines = [_SEED_TEXT] * 20
    for _ in range(max(500, vocab // 8)):
        lines.append(" ".join(rng.choice(words) for _ in range(40)))
    return lines


def train_tokenizer(vocab: int, seed: int = 0) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(vocab, seed), trainer)
    return tokenizer


def word_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Tokens that are a space and a lowercase word which encodes back to that one token.

    The byte-level pre-tokenizer splits text before each space, so a run of these tokens encodes
    back into the same tokens, also after a prompt or a chat template's newline."""
    ids = []
    for token, token_id in tokenizer.get_vocab().items():
        if re.fullmatch("\u0120[a-z]+", token) and tokenizer.encode(" " + token[1:]).ids == [token_id]:
            ids.append(token_id)
    return sorted(ids)


def _random_state(spec: TinyModelSpec, generable: list[int] | None = None) -> dict[str, torch.Tensor]:
    # Scaled init (std 1/sqrt(fan_in)) rather than 0.02 so logits are spread out: greedy choices
    # then have clear margins and do not flip on float rounding between batched and single runs.
    gen = torch.Generator().manual_seed(spec.seed)
    head_dim = spec.hidden // spec.heads

    def w(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) / in_f**0.5

    inter = spec.intermediate_size
    state = {"model.embed_tokens.weight": torch.randn(spec.vocab, spec.hidden, generator=gen)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = w(spec.heads * head_dim, spec.hidden)
        state[p + "self_attn.k_proj.weight"] = w(spec.kv_heads * head_dim, spec.hidden)
        state[p + "self_attn.v_proj.weight"] = w(spec.kv_heads * head_dim, spec.hidden)
        state[p + "self_attn.o_proj.weight"] = w(spec.hidden, spec.heads * head_dim)
        state[p + "mlp.gate_proj.weight"] = w(inter, spec.hidden)
        state[p + "mlp.up_proj.weight"] = w(inter, spec.hidden)
        state[p + "mlp.down_proj.weight"] = w(spec.hidden, inter)
        state[p + "input_layernorm.weight"] = torch.ones(spec.hidden)
        state[p + "post_attention_layernorm.weight"] = torch.ones(spec.hidden)
    state["model.norm.weight"] = torch.ones(spec.hidden)
    if not spec.tie_word_embeddings:
        state["lm_head.weight"] = w(spec.vocab, spec.hidden)
    if generable is not None:
        # A zero row has logit 0, below the largest of a few hundred random word logits (each
        # positive with probability 1/2), so greedy decoding never picks it.
        keep = torch.zeros(spec.vocab, dtype=torch.bool)
        keep[generable] = True
        state["lm_head.weight"][~keep] = 0.0
    return state


def _config(spec: TinyModelSpec, eos_ids: list[int]) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.hidden // spec.heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "vocab_size": spec.vocab,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "torch_dtype": "float32",
    }


def _save_weights(state: dict[str, torch.Tensor], folder: Path, shards: int) -> None:
    """``model.safetensors``, or ``shards`` files of contiguous tensors of about equal bytes and
    the index that maps each tensor to its file (Hugging Face's sharded layout)."""
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(state)
    total = sum(t.numel() * t.element_size() for t in state.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    seen = 0
    for name in names:
        size = state[name].numel() * state[name].element_size()
        groups[min(shards - 1, seen * shards // max(1, total))].append(name)
        seen += size
    groups = [g for g in groups if g]
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, start=1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: state[n] for n in group}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_tiny_model(path: Path | str, *, overwrite: bool = False, **kwargs: int | bool) -> Path:
    """Write a random-weight model folder at ``path`` and return it.

    Keyword arguments are :class:`TinyModelSpec` fields (``layers``, ``hidden``, ``vocab``,
    ``heads``, ``kv_heads``, ``intermediate``, ``max_position_embeddings``,
    ``tie_word_embeddings``, ``seed``, ``words_only``, ``shards``). The folder appears whole or not at all.
    """
    spec = TinyModelSpec(**kwargs)  # type: ignore[arg-type]
    target = Path(path)
    occupied = target.is_file() or (target.is_dir() and any(target.iterdir()))
    if occupied and not overwrite:
        raise FileExistsError(f"{target} exists and is not empty (pass overwrite=True to replace it)")
    tokenizer = train_tokenizer(spec.vocab, spec.seed)
    eos_ids = [tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    if None in eos_ids:
        raise RuntimeError("tokenizer training lost a special token")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer.save(str(staging / "tokenizer.json"))
        generable = word_token_ids(tokenizer) if spec.words_only else None
        _save_weights(_random_state(spec, generable), staging, spec.shards)
        config = _config(spec, [int(e) for e in eos_ids if e is not None])
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": spec.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        }
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        generation = {"eos_token_id": eos_ids, "do_sample": False}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
