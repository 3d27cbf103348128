"""EAGLE-2 sampling must leave the target's output distribution unchanged.

The oracle is exact: the joint distribution of the first two tokens, computed from the
target's logits with transformers' own warpers (temperature, top-k, top-p, min-p) and
processors (repetition penalty, sequence bias; presence and frequency penalties as OpenAI
defines them), compared with EAGLE-2 draws by a chi-square test. The second token's
distribution depends on the first through the penalties, so a drafted first token must be
counted on its branch for the draws to match.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from eagle2_core.config import DecodeConfig
from eagle2_core.engine import BatchDecoder, Engine
from eagle2_core.tree import DraftTree
from tests.eagle2_core.tiny import tiny_head, tiny_target

VOCAB = 8
PROMPT = [3, 5, 2, 7]


def exact_first(
    target, temperature: float, top_p: float, length: int = 2, **controls
) -> dict[tuple[int, ...], float]:
    """P(x1 .. x_length | prompt) from the target alone, via HF's processors and warpers in
    generate's order (OpenAI's penalties after the repetition penalty, as vLLM's)."""

    def probs(generated: list[int]) -> torch.Tensor:
        ids = torch.tensor([PROMPT + generated], device=target.device)
        logits = target.model(ids).logits[:, -1].float()
        if controls.get("logit_bias"):
            bias = {(t,): b for t, b in controls["logit_bias"]}
            logits = SequenceBiasLogitsProcessor(bias)(ids, logits)
        if controls.get("repetition_penalty", 1.0) != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(controls["repetition_penalty"])(ids, logits)
        for token, count in Counter(generated).items():
            logits[0, token] -= count * controls.get("frequency_penalty", 0.0)
            logits[0, token] -= controls.get("presence_penalty", 0.0)
        logits = TemperatureLogitsWarper(temperature)(None, logits)
        if controls.get("top_k"):
            logits = TopKLogitsWarper(controls["top_k"])(None, logits)
        if top_p < 1:
            logits = TopPLogitsWarper(top_p)(None, logits)
        if controls.get("min_p"):
            logits = MinPLogitsWarper(controls["min_p"])(None, logits)
        return logits.softmax(-1)[0]

    with torch.no_grad():
        exact: dict[tuple[int, ...], float] = {(): 1.0}
        for _ in range(length):
            exact = {
                prefix + (x,): p * float(q)
                for prefix, p in exact.items()
                for x, q in enumerate(probs(list(prefix)))
            }
        return exact


class WideDrafter:
    """Proposes many siblings per level in a fixed arbitrary order, so that candidates are
    accepted and rejected often and the multi-candidate rule is exercised at every rank."""

    def reset(self) -> None:
        pass

    def draft(self, features, next_tokens, context_len, budget) -> DraftTree:
        tokens, parents = [int(next_tokens[-1])], [-1]
        for first in (6, 0, 3, 5):
            tokens.append(first)
            parents.append(0)
            node = len(tokens) - 1
            for second in (5, 7, 0):
                tokens.append(second)
                parents.append(node)
        scores = -torch.arange(len(tokens), dtype=torch.float)  # index order = score order
        return DraftTree(torch.tensor(tokens), tuple(parents), scores)


def eagle_draws(
    engine: Engine, config: DecodeConfig, n: int, drafter=None, prompt: list[int] = PROMPT
) -> tuple[Counter, int, int]:
    """Counts of the outputs (x1 .. x_max_new_tokens) over n seeds, how many draws
    accepted a drafted token and how many had a round that accepted none.

    Drawn 100 sequences at a time (each with its own seeded generator): batching is part
    of what must preserve the distribution.
    """
    counts: Counter = Counter()
    accepted = rejected = 0
    decoder = BatchDecoder(engine)
    for seed in range(n):
        config_n = DecodeConfig(**{**config.__dict__, "seed": seed})
        decoder.add(seed, prompt, config_n, drafter=drafter)
        if decoder.active < 100 and seed < n - 1:
            continue
        while not decoder.idle:
            for _, out in decoder.step():
                counts[tuple(out.token_ids)] += 1
                accepted += len(out.stats.accept_hist) > 1
                rejected += out.stats.accept_hist[0] > 0
    return counts, accepted, rejected


def chi_square_p(counts: Counter, exact: dict, n: int) -> float:
    """p-value, bins with tiny expected counts pooled so the test is valid."""
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for key, p in exact.items():
        if p * n >= 5:
            observed.append(counts[key])
            expected.append(p * n)
        else:
            rest_o += counts[key]
            rest_e += p * n
    if rest_e == 0:  # tokens outside the top-p nucleus: never allowed
        if rest_o:
            return 0.0
    else:
        observed.append(rest_o)
        expected.append(rest_e)
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.parametrize(
    "temperature,top_p,wide,dtype",
    [
        (1.0, 1.0, False, torch.float32),
        (1.0, 1.0, True, torch.float32),
        (1.5, 0.95, True, torch.float32),
        # bf16: the oracle is the bf16 target's own distribution (transformers' forward in
        # bf16); the acceptance rule keeps it whatever the verify pass rounds
        (1.0, 1.0, False, torch.bfloat16),
        (1.5, 0.95, True, torch.bfloat16),
    ],
)
def test_eagle2_sampling_matches_target_distribution(temperature, top_p, wide, dtype):
    target = tiny_target(vocab_size=VOCAB, eos=None, seed=11, dtype=dtype)
    engine = Engine(target, tiny_head(target, seed=4))
    config = DecodeConfig(
        max_new_tokens=2,
        temperature=temperature,
        top_p=top_p,
        tree_width=3,
        tree_depth=2,
        total_tokens=8,
    )
    n = 2000
    exact = exact_first(target, temperature, top_p)
    counts, accepted, rejected = eagle_draws(engine, config, n, WideDrafter() if wide else None)
    assert sum(counts.values()) == n
    assert chi_square_p(counts, exact, n) > 1e-3
    assert accepted and rejected  # drafts were both accepted and rejected


@pytest.mark.parametrize(
    "controls,wide",
    [
        ({"top_k": 3}, True),
        ({"min_p": 0.2}, True),
        ({"repetition_penalty": 1.8}, True),
        ({"frequency_penalty": 1.5}, True),
        ({"presence_penalty": 1.0, "frequency_penalty": 0.8, "logit_bias": ((2, 1.5),)}, False),
        ({"repetition_penalty": 0.6, "top_k": 5, "min_p": 0.05}, True),
    ],
)
def test_sampling_with_controls_matches_the_processed_distribution(controls, wide):
    target = tiny_target(vocab_size=VOCAB, eos=None, seed=11)
    engine = Engine(target, tiny_head(target, seed=4))
    """Three tokens: the third is drawn at a node whose drafted parent (the second) the
    penalties must count."""
    config = DecodeConfig(
        max_new_tokens=3, temperature=1.0, tree_width=3, tree_depth=2, total_tokens=8, **controls
    )
    n = 3000
    exact = exact_first(target, 1.0, 1.0, length=3, **controls)
    plain = exact_first(target, 1.0, 1.0, length=3)
    assert max(abs(exact[k] - plain[k]) for k in exact) > 0.02  # the controls matter
    counts, accepted, rejected = eagle_draws(engine, config, n, WideDrafter() if wide else None)
    assert chi_square_p(counts, exact, n) > 1e-3
    assert accepted and rejected


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_output_is_plain_sampling_with_the_same_seed(top_p):
    """Each position draws from its own uniform, so a seed gives the same tokens whatever
    was drafted: EAGLE-2 (auto and fixed trees, alone or batched), EAGLE-1 and plain
    decoding agree token for token."""
    target = tiny_target(vocab_size=24, eos=None, seed=2)
    engine = Engine(target, tiny_head(target, seed=3))
    base = dict(max_new_tokens=40, temperature=0.8, top_p=top_p, tree_width=4, tree_depth=3)
    prompt = [3, 9, 4, 1]
    for seed in range(3):
        plain = engine.generate(prompt, DecodeConfig(mode="vanilla", seed=seed, **base))
        assert len(set(plain.token_ids)) > 5  # really sampled
        for mode, total in (("eagle2", "auto"), ("eagle2", 7), ("eagle1", "auto")):
            config = DecodeConfig(mode=mode, seed=seed, total_tokens=total, **base)
            assert engine.generate(prompt, config).token_ids == plain.token_ids, (mode, total)
        items = [(i, prompt, DecodeConfig(seed=seed + 10 * i, **base)) for i in range(4)]
        batched = dict(engine.generate_batch(items, batch_size=4))
        assert batched[0].token_ids == plain.token_ids
