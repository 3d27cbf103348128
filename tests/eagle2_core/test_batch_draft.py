"""Drafting all rows at once must grow, for every row, the tree it would grow alone."""

from __future__ import annotations

import torch

from eagle2_core.batch_draft import BatchEagleDrafter
from eagle2_core.drafters import EagleDrafter
from eagle2_core.engine import prefill
from tests.eagle2_core.tiny import prompts, tiny_head, tiny_target


def test_batched_trees_equal_per_row_trees_over_rounds():
    target = tiny_target(eos=None)
    head = tiny_head(target)
    batch = BatchEagleDrafter(head, target, top_k=4, depth=3)
    alone, rows = [], []
    for prompt in prompts(96, lengths=(1, 17, 6)):
        ids = torch.tensor(prompt)
        _, features, logits = prefill(target, ids)
        next_tokens = torch.cat([ids[1:], logits.argmax()[None]])
        drafter = EagleDrafter(head, target, top_k=4, depth=3)
        drafter.reset()
        alone.append(drafter)
        batch.add(features, next_tokens)
        rows.append((features, next_tokens, len(prompt)))
    g = torch.Generator().manual_seed(0)
    for round_ in range(3):
        budgets = [12, 2, 7] if round_ else [12, 1, 7]
        got = batch.draft(*[list(x) for x in zip(*rows, strict=True)], budgets)
        for drafter, (features, next_tokens, context_len), budget, tree in zip(
            alone, rows, budgets, got, strict=True
        ):
            want = drafter.draft(features, next_tokens, context_len, budget)
            assert tree.tokens.tolist() == want.tokens.tolist()
            assert tree.parents == want.parents
            assert torch.allclose(tree.scores, want.scores, rtol=1e-4, atol=1e-4)
        # Commit 1-3 tokens per row (features of any origin: the drafter only reads them).
        rows = [
            (
                torch.randn(n, target.hidden_size, generator=g),
                torch.randint(2, 96, (n,), generator=g),
                context_len + n,
            )
            for n, (_, _, context_len) in zip((3, 1, 2), rows, strict=True)
        ]
    batch.keep_rows([0, 2])
    assert batch.rows == 2
