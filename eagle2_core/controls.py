"""The generation controls of the rows that have any: each row's processors (processors.py)
on its tree's target logits and on its draft. The decoder calls in here only when a row of
its batch has controls; the others' logits are left as they are."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from eagle2_core.config import DecodeConfig
from eagle2_core.models import Target
from eagle2_core.processors import History, process, tree_paths
from eagle2_core.tree import TreeBatch

# Processes the draft's log-probabilities [B, M, Vd] of nodes whose branches are [B, M, D].
DraftAdjust = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class RowControls:
    """One sequence's processors and the history they count."""

    def __init__(self, config: DecodeConfig, prompt_ids: list[int], target: Target) -> None:
        self.config = config
        self.history = History(prompt_ids, target.vocab_size, target.device)
        stops = sorted(target.stop_ids | set(config.stop_token_ids))
        self.stop_ids = torch.tensor(stops, dtype=torch.long, device=target.device)

    def logits(self, logits: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        """The processed target logits [M, V] of nodes with branches `paths` [M, D]."""
        return process(logits, self.config, self.history.branches(paths), self.stop_ids)

    def first_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed target logits [V] of the prompt's last position (nothing drafted)."""
        no_branch = torch.zeros(1, 0, dtype=torch.long, device=logits.device)
        return self.logits(logits[None], no_branch)[0]

    def tree_logits(
        self, logits: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor
    ) -> torch.Tensor:
        """The processed target logits of one tree's nodes [N, V]."""
        return self.logits(logits, tree_paths(tokens, ancestors))

    def draft_log_probs(
        self, log_probs: torch.Tensor, paths: torch.Tensor, columns: torch.Tensor
    ) -> torch.Tensor:
        """The draft's log-probabilities [M, Vd] processed alike (`columns`: each target
        id's draft-vocabulary row, -1 for none), normalised again."""
        branches = self.history.branches(paths)
        processed = process(log_probs, self.config, branches, self.stop_ids, columns)
        return processed.log_softmax(dim=-1)

    def commit(self, tokens: list[int]) -> None:
        self.history.add(tokens)


def controls_for(config: DecodeConfig, prompt_ids: list[int], target: Target) -> RowControls | None:
    """A row's controls, None when its config processes nothing (the fast path)."""
    return RowControls(config, prompt_ids, target) if config.processed else None


def process_trees(
    logits: torch.Tensor, trees: TreeBatch, controls: Sequence[RowControls | None]
) -> torch.Tensor:
    """The target logits of every row's tree [B, N, V], each controlled row's processed (a
    new fp32 tensor: the raw logits stay for logprobs)."""
    out = logits.to(torch.float32, copy=True)
    for row, row_controls in enumerate(controls):
        if row_controls is not None:
            out[row] = row_controls.tree_logits(
                logits[row], trees.tokens[row], trees.ancestors[row]
            )
    return out


def draft_adjust(
    controls: Sequence[RowControls | None], token_ids: torch.Tensor, vocab_size: int
) -> DraftAdjust | None:
    """The dynamic drafter's hook for the controlled rows of a batch (None: no row has
    controls); `token_ids` [Vd] are the draft vocabulary's target ids."""
    rows = [row for row, c in enumerate(controls) if c is not None]
    if not rows:
        return None
    columns = torch.full((vocab_size,), -1, dtype=torch.long, device=token_ids.device)
    columns[token_ids] = torch.arange(token_ids.numel(), device=token_ids.device)

    def adjust(log_probs: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        out = log_probs.clone()
        for row in rows:
            out[row] = controls[row].draft_log_probs(log_probs[row], paths[row], columns)
        return out

    return adjust
