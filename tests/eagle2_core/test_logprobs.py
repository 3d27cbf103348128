"""Logprobs are the target's raw distribution at every output position: the log-softmax of
transformers' own fp32 forward over prompt + output, whichever node of which tree the
token was accepted at, and before any processor or temperature."""

from __future__ import annotations

import pytest
import torch

from eagle2_core.config import DecodeConfig
from eagle2_core.engine import Engine
from tests.eagle2_core.tiny import OracleDrafter, hf_greedy, prompts, tiny_head, tiny_target

VOCAB = 16


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target(vocab_size=VOCAB, seed=0, eos=None)
    return target, Engine(target, tiny_head(target, seed=2))


def raw_log_softmax(target, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: the oracle's log-softmax at the position of each output token."""
    ids = torch.tensor([prompt + output], device=target.model.device)
    with torch.no_grad():
        logits = target.model(ids).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) + len(output) - 1]


def check(target, prompt, generation, top: int) -> None:
    assert len(generation.logprobs) == len(generation.token_ids)
    oracle = raw_log_softmax(target, prompt, generation.token_ids)
    for position, entry in enumerate(generation.logprobs):
        assert entry.token_id == generation.token_ids[position]
        want = oracle[position]
        assert abs(entry.logprob - float(want[entry.token_id])) < 1e-3
        best = want.topk(top)
        assert len(entry.top_ids) == top
        assert torch.allclose(torch.tensor(entry.top_logprobs), best.values, atol=1e-3)
        for token, value in zip(entry.top_ids, entry.top_logprobs, strict=True):
            assert abs(value - float(want[token])) < 1e-3


@pytest.mark.parametrize("mode", ["eagle2", "eagle1", "vanilla"])
@pytest.mark.parametrize(
    "controls",
    [{}, {"repetition_penalty": 1.5, "temperature": 0.9, "seed": 3, "top_k": 4}],
)
def test_logprobs_are_the_targets_raw_log_softmax(tiny, mode, controls):
    target, engine = tiny
    for prompt in prompts(VOCAB, lengths=(4, 19)):
        config = DecodeConfig(
            mode=mode, max_new_tokens=24, logprobs=True, top_logprobs=3, **controls
        )
        check(target, prompt, engine.generate(prompt, config), 3)


def test_logprobs_along_long_accepted_branches_and_in_a_batch(tiny):
    target, engine = tiny
    prompt = prompts(VOCAB, lengths=(9,))[0]
    expected = hf_greedy(target, prompt, 30)
    config = DecodeConfig(mode="eagle1", max_new_tokens=30, logprobs=True, top_logprobs=3)
    got = engine.generate(prompt, config, drafter=OracleDrafter(prompt, expected, VOCAB))
    assert got.token_ids == expected and max(got.stats.accept_hist[3:], default=0) > 0
    check(target, prompt, got, 3)
    items = [
        (0, prompt, DecodeConfig(max_new_tokens=30)),
        (1, prompt, DecodeConfig(max_new_tokens=30, logprobs=True)),
        (2, prompt[:4], DecodeConfig(max_new_tokens=30, logprobs=True, top_logprobs=20)),
    ]
    batched = dict(engine.generate_batch(items, batch_size=3))
    assert batched[0].logprobs is None
    check(target, prompt, batched[1], 0)
    check(target, prompt[:4], batched[2], min(VOCAB, 20))
