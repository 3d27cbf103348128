"""Drafting all rows at once must grow, for every row, the tree the reference grows alone."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import pad

from eagle2_core.dynamic import DynamicDrafter, FixedPlan, Fresh
from eagle2_core.lean_head import LeanHead
from eagle2_core.llama import forward
from eagle2_core.tree import select
from eagle2_core.vocab import DraftVocab
from tests.eagle2_core.reference import ReferenceDrafter
from tests.eagle2_core.tiny import prompts, tiny_head, tiny_target


def prefill(target, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [L, H] of a prompt and the token after each (the last: the argmax)."""
    kv = target.kv()
    keys, values = kv.add_row(len(prompt))
    ids = torch.tensor(prompt)
    features, _ = forward(target.lean, ids[None], torch.arange(len(prompt))[None], keys, values, 0)
    root = target.lm_head(features[0, -1]).argmax()
    return features[0], torch.cat([ids[1:], root[None]])


@pytest.mark.parametrize("budget", [None, 20, 64])  # rows join one by one, or padded groups
@pytest.mark.parametrize("vocab_size", [None, 40])
def test_batched_trees_equal_reference_trees_over_rounds(vocab_size, budget):
    target = tiny_target(eos=None)
    head = tiny_head(target)
    vocab = None
    if vocab_size is not None:  # a draft vocabulary of every other token and a few more
        ids = sorted({*range(0, 96, 2), *range(1, 20, 3)})[:vocab_size]
        vocab = DraftVocab(torch.tensor(ids))
    lean = LeanHead.of(head, target, vocab)
    batch = DynamicDrafter(lean, depth=3)
    alone, rows, fresh = [], [], []
    for prompt in prompts(96, lengths=(1, 17, 6)):
        features, next_tokens = prefill(target, prompt)
        drafter = ReferenceDrafter(head, target, 4, 3, None if vocab is None else vocab.ids)
        alone.append(drafter)
        if budget is None:
            batch.add_rows([(features, next_tokens)], budget=0)
        rows.append((features, next_tokens, len(prompt)))
        fresh.append((features[-1:], next_tokens[-1:]))
    if budget is not None:
        batch.add_rows([(f, t) for f, t, _ in rows], budget)
    assert batch.kv.lengths.tolist() == [0, 16, 5]
    g = torch.Generator().manual_seed(0)
    for round_ in range(3):
        budgets = [12, 2, 7] if round_ else [12, 1, 7]
        width = max(len(t) for _, t in fresh)
        batched = Fresh(
            torch.stack([pad(f, (0, 0, 0, width - len(f))) for f, _ in fresh]),
            torch.stack([pad(t, (0, width - len(t))) for _, t in fresh]),
            torch.tensor([len(t) for _, t in fresh]),
        )
        contexts = torch.tensor([c for _, _, c in rows])
        pool, max_depth = batch.draft(batched, contexts, FixedPlan(width=4, depth=3))
        trees = select(pool, batched.roots(), budgets, max_depth)
        for b, (drafter, (features, next_tokens, context_len), budget) in enumerate(
            zip(alone, rows, budgets, strict=True)
        ):
            want = drafter.draft(features, next_tokens, context_len, budget)
            got = trees.row(b)
            assert got.tokens.tolist() == want.tokens.tolist()
            assert got.parents == want.parents
            # path log-probs through two implementations summing in other orders (up to
            # 2e-3 apart on this random model)
            assert torch.allclose(got.scores, want.scores, rtol=1e-3, atol=1e-3)
            assert torch.equal(trees.ancestors[b, : got.size, : got.size], want.ancestor_mask)
            if vocab is not None:
                assert set(got.tokens[1:].tolist()) <= set(vocab.ids.tolist())
        # Commit 1-3 tokens per row (features of any origin: the drafter only reads them).
        rows = [
            (
                torch.randn(n, target.hidden_size, generator=g),
                torch.randint(2, 96, (n,), generator=g),
                context_len + n,
            )
            for n, (_, _, context_len) in zip((3, 1, 2), rows, strict=True)
        ]
        fresh = [(f, t) for f, t, _ in rows]
    assert batch.remove_rows([0]) == [2, 1]
    assert batch.rows == 2
