"""Greedy EAGLE decoding must equal transformers' own greedy generate, token for token."""

from __future__ import annotations

import pytest

from eagle2_core.config import DecodeConfig
from eagle2_core.drafters import PromptLookupDrafter
from eagle2_core.engine import Engine, PromptError
from tests.eagle2_core.tiny import (
    OracleDrafter,
    device_costs,
    hf_greedy,
    prompts,
    tiny_head,
    tiny_target,
)


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target(eos=None)
    return target, Engine(target, tiny_head(target))


@pytest.mark.parametrize("mode", ["vanilla", "eagle1", "eagle2"])
def test_greedy_equals_generate_with_random_head(tiny, mode):
    target, engine = tiny
    for prompt in prompts(96):
        expected = hf_greedy(target, prompt, 48)
        got = engine.generate(prompt, DecodeConfig(mode=mode, max_new_tokens=48))
        assert got.token_ids == expected
        assert got.finish_reason == "length"
        assert sum(got.stats.accept_hist) == got.stats.n_cycles


@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(mode="eagle2", tree_width=3, tree_depth=2, total_tokens=6),
        DecodeConfig(mode="eagle2", tree_width=1, tree_depth=8, total_tokens=9),
        DecodeConfig(mode="eagle2", tree_width=10, tree_depth=5, total_tokens=2),
    ],
)
def test_greedy_equals_generate_for_tree_shapes(tiny, config):
    target, engine = tiny
    prompt = prompts(96, lengths=(9,))[0]
    config = DecodeConfig(**{**config.__dict__, "max_new_tokens": 40})
    assert engine.generate(prompt, config).token_ids == hf_greedy(target, prompt, 40)


@pytest.mark.parametrize("budget", [60, 5])
def test_greedy_equals_generate_with_oracle_drafter(tiny, budget):
    target, engine = tiny
    for prompt in prompts(96, lengths=(3, 30)):
        expected = hf_greedy(target, prompt, 50)
        drafter = OracleDrafter(prompt, expected, 96)
        config = DecodeConfig(mode="eagle2", max_new_tokens=50, total_tokens=budget)
        got = engine.generate(prompt, config, drafter=drafter)
        assert got.token_ids == expected
        longest = (budget - 1) // 2
        assert max(i for i, n in enumerate(got.stats.accept_hist) if n) == min(6, longest)
        assert got.stats.tau > 3 if budget == 60 else got.stats.tau > 2


def test_prompt_lookup_drafter_is_lossless(tiny):
    target, engine = tiny
    prompt = prompts(96, lengths=(8,))[0] * 4  # repetitive: lookups find matches
    got = engine.generate(prompt, DecodeConfig(max_new_tokens=40), drafter=PromptLookupDrafter())
    assert got.token_ids == hf_greedy(target, prompt, 40)


def test_stops_on_eos_like_generate():
    target = tiny_target(vocab_size=12, eos=1, seed=3)
    engine = Engine(target, tiny_head(target))
    stopped = 0
    for prompt in prompts(12, lengths=(2, 4, 6, 8, 10, 12), seed=5):
        expected = hf_greedy(target, prompt, 60)
        got = engine.generate(prompt, DecodeConfig(max_new_tokens=60, tree_width=4))
        assert got.token_ids == expected
        if expected[-1] == 1:
            stopped += 1
            assert got.finish_reason == "stop"
    assert stopped, "no prompt reached EOS: the test does not exercise stopping"


def test_context_limit_ends_generation_cleanly():
    target = tiny_target(max_positions=40, eos=None)
    engine = Engine(target, tiny_head(target))
    prompt = prompts(96, lengths=(30,))[0]
    got = engine.generate(prompt, DecodeConfig(max_new_tokens=100))
    assert got.finish_reason == "context"
    assert len(prompt) + got.completion_tokens == 41  # the last token needs no cache slot
    assert got.token_ids[:10] == hf_greedy(target, prompt, 10)


def test_edge_prompts(tiny):
    _, engine = tiny
    with pytest.raises(PromptError, match="empty"):
        engine.generate([], DecodeConfig())
    with pytest.raises(PromptError, match="512 tokens but the model's context holds 512"):
        engine.generate([5] * 512, DecodeConfig())
    nothing = engine.generate([5, 6], DecodeConfig(max_new_tokens=0))
    assert (nothing.token_ids, nothing.finish_reason, nothing.stats.n_cycles) == ([], "length", 0)
    one = engine.generate([5, 6], DecodeConfig(max_new_tokens=1))
    assert one.completion_tokens == 1 and one.stats.tau is None


def test_stats_add_up(tiny):
    target, engine = tiny
    prompt = prompts(96, lengths=(10,))[0]
    expected = hf_greedy(target, prompt, 30)
    got = engine.generate(
        prompt, DecodeConfig(max_new_tokens=30), drafter=OracleDrafter(prompt, expected, 96)
    )
    s = got.stats
    assert s.round_tokens == got.completion_tokens - 1  # the prefill gives the first token
    assert sum(k * n for k, n in enumerate(s.accept_hist)) + s.n_cycles >= s.round_tokens
    assert all(a <= t for a, t in zip(s.depth_accepts, s.depth_attempts, strict=True))
    assert s.depth_attempts[0] == s.n_cycles
    assert s.total_ms >= s.draft_ms + s.verify_ms > 0


def test_chat_answers_follow_up_turns_in_order(tiny):
    target, engine = tiny
    target.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}t2"
    turns = engine.chat(
        [{"role": "user", "content": "t5 t6 t7"}], ["t8 t9"], DecodeConfig(max_new_tokens=6)
    )
    assert len(turns) == 2
    second_prompt = [5, 6, 7] + target.tokenizer(turns[0].text)["input_ids"] + [8, 9, 2]
    assert turns[1].prompt_tokens == len(second_prompt)
    assert turns[1].token_ids == hf_greedy(target, second_prompt, 6)


def test_a_batch_drafts_up_to_the_size_where_no_tree_could_pay(tiny):
    """Each node past the first of all rows costs 4 ms on a 10 ms forward: a second node
    could pay for one row (1.8 tokens for 1.4x the time), not for sixteen (1.8 tokens for
    1.9x). Plain decoding never drafts; fixed trees always do."""
    target, _ = tiny
    engine = Engine(target, tiny_head(target))
    engine._costs = device_costs(verify_per_node_ms=4.0, draft_ms=1.0)
    assert engine.drafts_at(1, DecodeConfig())
    assert not engine.drafts_at(16, DecodeConfig())
    assert engine.drafts_at(16, DecodeConfig(total_tokens=8))
    assert not engine.drafts_at(1, DecodeConfig(mode="vanilla"))
