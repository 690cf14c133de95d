"""Sampling filters and parameters, with hand-checkable numbers."""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet.engine.sampling import SamplingParams, filter_top_k_top_p, sample

NEG = float("-inf")


def test_top_k_keeps_the_k_largest() -> None:
    out = filter_top_k_top_p(torch.tensor([1.0, 4.0, 3.0, 2.0]), top_k=2, top_p=1.0)
    assert out.tolist() == [NEG, 4.0, 3.0, NEG]


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]
    logits = torch.tensor([math.log(p) for p in probs])
    kept = filter_top_k_top_p(logits, top_k=0, top_p=0.8)
    # 0.5 + 0.3 reaches 0.8: the rest is dropped; the top token is always kept.
    assert [x != NEG for x in kept.tolist()] == [False, True, False, True]
    only_top = filter_top_k_top_p(logits, top_k=0, top_p=0.1)
    assert [x != NEG for x in only_top.tolist()] == [False, True, False, False]


def test_greedy_rows_take_the_argmax_and_seeds_reproduce() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.2, 0.1, 0.3]])
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=1.0, seed=3)
    first = sample(logits, [greedy, hot], [None, torch.Generator().manual_seed(3)])
    second = sample(logits, [greedy, hot], [None, torch.Generator().manual_seed(3)])
    assert first[0] == 1
    assert first == second
    # top_k=1 makes sampling deterministic: always the largest logit.
    assert sample(logits[1:], [SamplingParams(temperature=1.5, top_k=1)], [torch.Generator()]) == [2]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_bad_parameters_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
