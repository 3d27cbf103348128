"""The real default model: EAGLE greedy output equals transformers' greedy generate."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from eagle2_core.bench import hf_generate
from eagle2_core.config import DecodeConfig
from eagle2_core.draft import DraftCheckpointError
from eagle2_core.engine import load_engine
from eagle2_core.registry import encode_chat
from tests.eagle2_core.tiny import DEVICE

pytestmark = pytest.mark.slow

SHARED = Path(__file__).resolve().parents[3] / "shared"
MT_BENCH = SHARED / "benchmarks" / "mt_bench" / "question.jsonl"
FALLBACK_PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Explain the difference between a list and a tuple in Python.",
    "What are the main causes of the French Revolution?",
    "Write a limerick about a cat who loves math.",
    "How do vaccines train the immune system?",
]


def first_turns(n: int) -> list[str]:
    """MT-bench first turns when shared/ sits beside the checkout, else fixed prompts."""
    if MT_BENCH.exists():
        lines = MT_BENCH.read_text().splitlines()
        return [json.loads(line)["turns"][0] for line in itertools.islice(lines, n)]
    return FALLBACK_PROMPTS[:n]


# For tests of what decodes under controls or a grammar, not of the planner: a fixed tree
# drafts in every EAGLE-2 round and needs no cost table (the identity tests here measure
# it, with the planner that sizes each round's tree by it).
FIXED_TREE = 10


@pytest.fixture(scope="module")
def engine():
    try:
        return load_engine("smollm2-135m", None, device=DEVICE)
    except DraftCheckpointError:  # no shipped head yet: an untrained one must be lossless too
        return load_engine("smollm2-135m", "random", device=DEVICE)


@pytest.fixture(scope="module")
def cases(engine):
    """(prompt ids, transformers' greedy output) per question, computed once."""
    config = DecodeConfig(max_new_tokens=64)
    cases = []
    for question in first_turns(5):
        ids = encode_chat(engine.target.tokenizer, [{"role": "user", "content": question}])
        cases.append((ids, hf_generate(engine.target, ids, config)))
    return cases


def test_greedy_equals_generate_on_mt_bench(engine, cases):
    """EAGLE-1 (static tree, one prompt at a time) on two prompts; EAGLE-2 on all five,
    three at a time (continuous batching; decoding alone is a batch of one)."""
    for ids, expected in cases[:2]:
        got = engine.generate(ids, DecodeConfig(mode="eagle1", max_new_tokens=64))
        assert got.token_ids == expected, engine.target.tokenizer.decode(ids)
    items = [(i, ids, DecodeConfig(max_new_tokens=64)) for i, (ids, _) in enumerate(cases)]
    got = dict(engine.generate_batch(items, batch_size=3))
    for i, (ids, expected) in enumerate(cases):
        assert got[i].token_ids == expected, engine.target.tokenizer.decode(ids)
        assert got[i].completion_tokens == len(expected) >= 1
