"""Structured output must be exact under speculation: constrained greedy output equals plain
constrained decoding (transformers' forward, the grammar engine's own mask of the output so
far, argmax) in EAGLE-2, EAGLE-1 and vanilla mode, with long accepted branches, and beside
rows of other schemas; a JSON schema's answer fits it (jsonschema); the draft never
proposes a token the grammar forbids on its branch; sampled constrained tokens follow the
target's masked distribution (chi-square)."""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from eagle2_core import grammar
from eagle2_core.config import DecodeConfig
from eagle2_core.controls import ControlError, RowControls, draft_adjust
from eagle2_core.dynamic import DynamicDrafter, FixedPlan, Fresh
from eagle2_core.engine import BatchDecoder, Engine
from eagle2_core.lean_head import LeanHead
from eagle2_core.response_format import grammar_text
from tests.eagle2_core.test_dynamic import prefill
from tests.eagle2_core.test_sampling import chi_square_p, eagle_draws
from tests.eagle2_core.tiny import BYTE_EOS, OracleDrafter, tiny_head, tiny_target

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["answer", "score", "ok", "tags"],
    "additionalProperties": False,
}
FORMATS = {
    "json_schema": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
    "regex": {"type": "regex", "regex": r"(ab|c[0-9]{1,3})+\.(x|yz)"},
    "grammar": {
        "type": "grammar",
        "grammar": 'root ::= "<" item ("," item)? ("," item)? ">"\nitem ::= [a-d] [0-9]?',
    },
}


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target(byte_level=True, seed=5)
    return target, Engine(target, tiny_head(target, seed=6))


def encode(target, text: str) -> list[int]:
    return target.tokenizer.encode(text)


def plain_constrained(target, prompt: list[int], n: int, response_format: dict) -> list[int]:
    """The oracle: one token at a time, transformers' forward over the whole sequence, the
    grammar engine's mask (a fresh llguidance matcher fed the output), argmax."""
    hf = getattr(target.tokenizer, "transformers_tokenizer", target.tokenizer)  # LeanTokenizer's
    tokenizer = llguidance.hf.from_tokenizer(
        hf, n_vocab=target.vocab_size, eos_token=sorted(target.stop_ids)
    )
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(response_format))
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n:
            logits = target.model(torch.tensor([prompt + out])).logits[0, -1].float()
            bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
            logits[bias[: target.vocab_size] == 0] = float("-inf")
            out.append(int(logits.argmax()))
            if out[-1] in target.stop_ids:
                break
            assert matcher.consume_token(out[-1])
    return out


def config(mode: str, name: str, **extra) -> DecodeConfig:
    return DecodeConfig.from_settings(
        mode, {"max_new_tokens": 80, "response_format": FORMATS[name], **extra}
    )


@pytest.mark.parametrize("name", FORMATS)
def test_constrained_greedy_equals_plain_constrained_decoding(tiny, name):
    target, engine = tiny
    for text in ("Say it:", "x"):
        prompt = encode(target, text)
        expected = plain_constrained(target, prompt, 80, FORMATS[name])
        assert expected[-1] in target.stop_ids  # the grammar ended the answer
        for mode in ("eagle2", "eagle1", "vanilla"):
            got = engine.generate(prompt, config(mode, name))
            assert got.token_ids == expected, mode
            assert got.finish_reason == "stop"
        oracle = OracleDrafter(prompt, expected, target.vocab_size)
        got = engine.generate(prompt, config("eagle1", name), drafter=oracle)
        assert got.token_ids == expected and max(got.stats.accept_hist[4:], default=0) > 0
        if name == "json_schema":
            jsonschema.validate(json.loads(got.text), SCHEMA)


def test_rows_of_other_formats_share_a_batch_each_format_compiled_once(monkeypatch):
    target = tiny_target(byte_level=True, seed=5)  # a tokenizer of its own: nothing compiled
    engine = Engine(target, tiny_head(target, seed=6))
    compiled = Counter()

    def counted(response_format: dict) -> str:
        compiled[json.dumps(response_format)] += 1
        return grammar_text(response_format)

    monkeypatch.setattr(grammar, "grammar_text", counted)
    prompts = {"Go": encode(target, "Go"), "Say it:": encode(target, "Say it:")}
    items = [
        ((name, text), prompt, config("eagle2", name))
        for text, prompt in prompts.items()
        for name in FORMATS
    ]
    items.append((("free", "Go"), prompts["Go"], DecodeConfig(max_new_tokens=30)))
    batched = dict(engine.generate_batch(items, batch_size=4))
    for (name, text), prompt, _ in items[:-1]:
        expected = plain_constrained(target, prompt, 80, FORMATS[name])
        assert batched[(name, text)].token_ids == expected, (name, text)
    free = engine.generate(prompts["Go"], items[-1][2])
    assert batched[("free", "Go")].token_ids == free.token_ids
    assert sorted(compiled.values()) == [1] * len(FORMATS)  # six rows, three compiles


def test_a_grammar_the_tokenizer_cannot_follow_fails_its_row_and_the_batch_goes_on(tiny):
    """The producer compiles each line's format without a tokenizer; one that still fails
    with it (here: never checked), or a tokenizer the grammar engine cannot read, fails
    that sample, naming the field, and changes nothing."""
    target, engine = tiny
    prompt = encode(target, "Go")
    decoder = BatchDecoder(engine)
    decoder.add("good", prompt, config("eagle2", "regex"))
    bad = DecodeConfig.from_settings(
        "eagle2", {"max_new_tokens": 8, "response_format": {"type": "regex", "regex": "(a"}}
    )
    with pytest.raises(ControlError, match="^response_format: "):
        decoder.add("bad", prompt, bad)
    unreadable = Engine(tiny_target())  # its tokenizer has no decoder llguidance can read
    with pytest.raises(ControlError, match="^response_format: "):
        BatchDecoder(unreadable).add("other", [3, 4], config("vanilla", "regex"))
    done = {}
    while not decoder.idle:
        done.update(decoder.step())
    assert list(done) == ["good"]
    assert done["good"].token_ids == plain_constrained(target, prompt, 80, FORMATS["regex"])


@pytest.mark.parametrize("name", FORMATS)
def test_the_draft_never_proposes_a_token_the_grammar_forbids_on_its_branch(tiny, name):
    """Every drafted node with a finite score is allowed on its branch, and every other
    is not (a level where the grammar allows fewer tokens than the tree is wide)."""
    target, _ = tiny
    lean = LeanHead.of(tiny_head(target, seed=6), target, None)
    prompt = encode(target, "Say it:")
    features, next_tokens = prefill(target, prompt)
    controls = RowControls(config("eagle2", name), prompt, target)
    root = int(controls.first_logits(target.lm_head(features[-1])).argmax())
    next_tokens[-1] = root
    controls.commit([root])
    drafter = DynamicDrafter(lean, depth=5)
    drafter.add_rows([(features, next_tokens)], budget=0)
    fresh = Fresh(features[None, -1:], next_tokens[None, -1:], torch.ones(1, dtype=torch.long))
    adjust = draft_adjust([controls], lean.token_ids, target.vocab_size)
    pool, _ = drafter.draft(fresh, torch.tensor([len(prompt)]), FixedPlan(4, 5), adjust)
    tokenizer = llguidance.hf.from_tokenizer(target.tokenizer, eos_token=BYTE_EOS)
    grammar = grammar_text(FORMATS[name])
    tokens, parents = pool.tokens[0].tolist(), pool.parents[0].tolist()
    finite = pool.scores[0].isfinite().tolist()
    assert sum(finite) >= 6  # a real node at every level at least
    for node, ok in enumerate(finite):
        branch, up = [], node
        while up >= 0:
            branch.insert(0, tokens[up])
            up = parents[up]
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        assert matcher.consume_token(root)
        allowed = all(matcher.consume_token(t) for t in branch)
        assert allowed == ok, (node, branch)  # forbidden branches only where scores are -inf


def test_sampling_under_a_grammar_keeps_the_masked_distribution(tiny):
    """Three tokens of `[abc][abc]` then the end: the draws match the target's softmax
    over the allowed tokens at each position (the second given the first)."""
    target, engine = tiny
    prompt = encode(target, "Pick:")
    regex = {"type": "regex", "regex": "[abc][abc]"}
    letters = encode(target, "abc")

    def probs(generated: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + generated])).logits[0, -1].float()
        allowed = letters if len(generated) < 2 else [BYTE_EOS]
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return masked.softmax(-1)

    exact = {
        (a, b, BYTE_EOS): float(probs([])[a] * probs([a])[b]) for a in letters for b in letters
    }
    settings = {"max_new_tokens": 5, "temperature": 1.0, "total_tokens": 6, "tree_width": 3}
    config = DecodeConfig.from_settings("eagle2", {**settings, "response_format": regex})
    n = 1800
    counts, accepted, _ = eagle_draws(engine, config, n, prompt=prompt)
    assert sum(counts.values()) == n and set(counts) <= set(exact)
    assert chi_square_p(counts, exact, n) > 1e-3
    assert accepted > n // 10  # the grammar-masked draft is accepted
