"""The real default model on held-out prompts (MT-bench), with generation controls: greedy
output with a repetition penalty equals transformers' generate with it, and with OpenAI's
penalties and logit_bias a plain greedy loop applying their definitions, in EAGLE-2 and
vanilla mode; logprobs are transformers' fp32 log-softmax."""

from __future__ import annotations

import pytest
import torch

from eagle2_core.config import DecodeConfig
from eagle2_core.registry import encode_chat
from tests.eagle2_core.test_controls import openai_greedy
from tests.eagle2_core.test_logprobs import check
from tests.eagle2_core.test_smollm2 import FIXED_TREE, engine, first_turns  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

TOKENS = 48


@pytest.fixture(scope="module")
def prompts(engine):  # noqa: F811
    tokenizer = engine.target.tokenizer
    return [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in first_turns(3)]


def test_repetition_penalty_equals_generate(engine, prompts):  # noqa: F811
    target = engine.target
    for ids in prompts:
        prompt = torch.tensor([ids], device=target.device)
        out = target.model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=TOKENS,
            do_sample=False, repetition_penalty=1.3, eos_token_id=sorted(target.stop_ids),
        )  # fmt: skip
        expected = out[0, len(ids) :].tolist()
        for mode in ("eagle2", "vanilla"):
            config = DecodeConfig(
                mode=mode, max_new_tokens=TOKENS, total_tokens=FIXED_TREE, repetition_penalty=1.3
            )
            assert engine.generate(ids, config).token_ids == expected, mode


def test_openai_penalties_and_logit_bias_equal_their_definitions(engine, prompts):  # noqa: F811
    target, ids = engine.target, prompts[0]
    space = target.tokenizer.encode(" the")[0]
    expected = openai_greedy(target, ids, TOKENS, 0.4, 0.6, {space: -100.0})
    controls = dict(presence_penalty=0.4, frequency_penalty=0.6, logit_bias=((space, -100.0),))
    for mode in ("eagle2", "vanilla"):
        config = DecodeConfig(mode=mode, max_new_tokens=TOKENS, total_tokens=FIXED_TREE, **controls)
        assert engine.generate(ids, config).token_ids == expected, mode


def test_logprobs_are_the_fp32_log_softmax(engine, prompts):  # noqa: F811
    for ids in prompts[:2]:
        config = DecodeConfig(
            max_new_tokens=TOKENS, total_tokens=FIXED_TREE, logprobs=True, top_logprobs=3
        )
        check(engine.target, ids, engine.generate(ids, config), 3)
