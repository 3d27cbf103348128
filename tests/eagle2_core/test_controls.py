"""Generation controls must be exact on every tree path: greedy output with a control equals
plain decoding with it, where the oracle is transformers' `generate` (repetition penalty,
logit bias as its sequence_bias, min_new_tokens, extra end tokens) or a plain greedy loop
over the target's logits applying OpenAI's definitions (presence and frequency penalties);
in EAGLE-2 (the batch's own drafter), EAGLE-1, plain decoding, and with an oracle drafter
whose long accepted branches make every drafted ancestor count."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from eagle2_core.config import DecodeConfig
from eagle2_core.controls import RowControls, draft_adjust
from eagle2_core.draft import new_draft_head
from eagle2_core.dynamic import DynamicDrafter, FixedPlan, Fresh
from eagle2_core.engine import Engine
from eagle2_core.lean_head import LeanHead
from eagle2_core.processors import History, tree_paths
from eagle2_core.tree import DraftTree
from tests.eagle2_core.test_dynamic import prefill
from tests.eagle2_core.tiny import OracleDrafter, prompts, tiny_head, tiny_target

VOCAB = 16  # small: drafts are accepted often, and outputs repeat, so penalties bite
MODES = ("eagle2", "eagle1", "vanilla")


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target(vocab_size=VOCAB, seed=0, eos=None)  # answers run to their length
    return target, Engine(target, tiny_head(target, seed=2))


def hf_generate(target, prompt: list[int], n: int, eos: list[int] | None = None, **controls):
    """The oracle: transformers' greedy generate with the controls it has."""
    ids = torch.tensor([prompt], device=target.model.device)
    out = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos if eos is not None else sorted(target.stop_ids) or None,
        pad_token_id=0,
        **controls,
    )
    return out[0, len(prompt) :].tolist()


def openai_greedy(target, prompt, n, presence=0.0, frequency=0.0, bias=None) -> list[int]:
    """A plain greedy loop applying OpenAI's definitions to the full forward's logits:
    mu[j] - c[j] * frequency - (c[j] > 0) * presence + logit_bias[j], c counting the
    generated tokens only."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            ids = torch.tensor([prompt + out], device=target.model.device)
            logits = target.model(ids).logits[0, -1].float()
            for token, b in (bias or {}).items():
                logits[token] += b
            for token, count in Counter(out).items():
                logits[token] -= count * frequency + presence
            out.append(int(logits.argmax()))
            if out[-1] in target.stop_ids:
                break
    return out


def decode_everywhere(engine, prompt, expected, **controls) -> None:
    """Greedy output with `controls` equals `expected` in every mode, with an oracle
    drafter (long accepted branches) and in a batch beside rows without controls."""
    n = len(expected) + 4
    for mode in MODES:
        config = DecodeConfig(mode=mode, max_new_tokens=n, **controls)
        assert engine.generate(prompt, config).token_ids[: len(expected)] == expected, mode
    config = DecodeConfig(mode="eagle1", max_new_tokens=n, **controls)
    oracle = OracleDrafter(prompt, expected, VOCAB)
    got = engine.generate(prompt, config, drafter=oracle)
    assert got.token_ids[: len(expected)] == expected
    deepest = max(i for i, c in enumerate(got.stats.accept_hist) if c)
    assert deepest >= min(3, len(expected) - 1)  # long branches were accepted
    plain = DecodeConfig(max_new_tokens=n)
    items = [(0, prompt, plain), (1, prompt, DecodeConfig(max_new_tokens=n, **controls))]
    items += [(2, prompt[:3], plain)]
    batched = dict(engine.generate_batch(items, batch_size=3))
    assert batched[1].token_ids[: len(expected)] == expected
    assert batched[0].token_ids == engine.generate(prompt, plain).token_ids


@pytest.mark.parametrize("penalty", [1.3, 2.0, 0.7])
def test_repetition_penalty_equals_generate(tiny, penalty):
    target, engine = tiny
    changed = 0
    for prompt in prompts(VOCAB, lengths=(5, 20, 11)):
        expected = hf_generate(target, prompt, 30, repetition_penalty=penalty)
        changed += expected != hf_generate(target, prompt, 30)
        decode_everywhere(engine, prompt, expected, repetition_penalty=penalty)
    assert changed  # the penalty changes answers


@pytest.mark.parametrize(
    "presence,frequency,bias",
    [(1.5, 0.0, None), (0.0, 1.2, None), (-0.5, 0.6, None), (0.0, 0.0, {5: 3.0, 11: -100.0})],
)
def test_presence_frequency_and_logit_bias_equal_openai_definitions(
    tiny, presence, frequency, bias
):
    target, engine = tiny
    changed = 0
    for prompt in prompts(VOCAB, lengths=(5, 20, 11)):
        expected = openai_greedy(target, prompt, 30, presence, frequency, bias)
        changed += expected != openai_greedy(target, prompt, 30)
        pairs = tuple(sorted((bias or {}).items()))
        decode_everywhere(
            engine,
            prompt,
            expected,
            presence_penalty=presence,
            frequency_penalty=frequency,
            logit_bias=pairs,
        )
    assert changed  # the controls change answers


def test_logit_bias_min_tokens_and_stop_token_ids_equal_generate(tiny):
    """logit_bias is transformers' one-token sequence_bias; min_tokens its min_new_tokens
    (the end tokens held back until then); stop_token_ids end tokens that stay in
    token_ids but not in the text."""
    target, engine = tiny
    prompt = prompts(VOCAB, lengths=(7,))[0]
    bias = {1: 6.0, 9: 5.0}  # biased up, the end tokens would end the answer at once
    sequence_bias = {(t,): b for t, b in bias.items()}
    assert hf_generate(target, prompt, 30, eos=[1, 9], sequence_bias=sequence_bias) == [9]
    expected = hf_generate(
        target, prompt, 30, eos=[1, 9], sequence_bias=sequence_bias, min_new_tokens=6
    )
    assert len(expected) == 7 and expected[-1] in (1, 9)
    controls = dict(logit_bias=tuple(bias.items()), min_tokens=6, stop_token_ids=(1, 9))
    decode_everywhere(engine, prompt, expected, **controls)
    got = engine.generate(prompt, DecodeConfig(max_new_tokens=30, **controls))
    assert got.finish_reason == "stop" and got.token_ids == expected
    assert got.text == target.tokenizer.decode(expected[:-1], skip_special_tokens=True)


@pytest.mark.parametrize("mode", ["eagle2", "vanilla"])
@pytest.mark.parametrize("warper", [{"top_k": 1}, {"min_p": 1.0}])
def test_top_k_1_and_min_p_1_sample_the_greedy_answer(tiny, mode, warper):
    target, engine = tiny
    for prompt in prompts(VOCAB, lengths=(5, 20)):
        greedy = engine.generate(prompt, DecodeConfig(mode="vanilla", max_new_tokens=30))
        for seed in range(3):
            config = DecodeConfig(
                mode=mode, max_new_tokens=30, temperature=1.0, seed=seed, **warper
            )
            assert engine.generate(prompt, config).token_ids == greedy.token_ids


def test_a_nodes_history_counts_its_own_branch():
    """tree_paths + History.branches against counting each node's branch by hand."""
    tokens = torch.tensor([4, 7, 2, 7, 4, 9, 7])
    parents = (-1, 0, 0, 1, 3, 2, 4)
    tree = DraftTree(tokens, parents, torch.zeros(7))
    history = History(prompt_ids=[3, 9, 3], vocab_size=12, device=torch.device("cpu"))
    history.add([5, 4, 5])  # the root (4) is the last of them
    got = history.branches(tree_paths(tokens, tree.ancestor_mask))
    for node in range(7):
        branch, up = [], node
        while up > 0:
            branch.append(int(tokens[up]))
            up = parents[up]
        counts = Counter([5, 4, 5] + branch)
        for h, token in enumerate(got.ids.tolist()):
            assert got.counts[node, h] == counts[token]
            assert bool(got.seen[node, h]) == (token in counts or token in (3, 9))
        assert got.generated[node] == 3 + len(branch)


def test_the_draft_proposes_what_the_processed_target_allows():
    """With EOS biased to +100 and held back by min_tokens, a row's draft pool holds EOS
    exactly at the depths where its branch has generated enough: the draft is processed
    along each node's own branch."""
    target = tiny_target(seed=3)
    head = new_draft_head(target.model.config, seed=1)  # unscaled: a bias of 100 dominates
    lean = LeanHead.of(head, target, None)
    prompt = prompts(96, lengths=(9,))[0]
    features, next_tokens = prefill(target, prompt)
    drafter = DynamicDrafter(lean, depth=4)
    drafter.add_rows([(features, next_tokens)], budget=0)
    config = DecodeConfig(logit_bias=((1, 100.0),), min_tokens=3)
    controls = RowControls(config, prompt, target)
    controls.commit([int(next_tokens[-1])])  # the root: one token generated
    fresh = Fresh(features[None, -1:], next_tokens[None, -1:], torch.ones(1, dtype=torch.long))
    adjust = draft_adjust([controls], lean.token_ids, target.vocab_size)
    pool, _ = drafter.draft(fresh, torch.tensor([len(prompt)]), FixedPlan(4, 4), adjust)
    eos_depths = set(pool.depths[pool.tokens == 1].tolist())
    # a node at depth d predicts after 1 + d generated tokens: EOS from depth 3 on
    assert eos_depths == {3, 4, 5}
