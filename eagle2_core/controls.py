"""The generation controls of the rows that have any: each row's processors (processors.py)
and grammar (grammar.py) on its tree's target logits and on its draft. The decoder calls
in here only when a row of its batch has controls; the others' logits are left as they are."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eagle2_core.config import DecodeConfig
from eagle2_core.generation import PromptError
from eagle2_core.models import Target
from eagle2_core.processors import History, process, tree_paths
from eagle2_core.tree import TreeBatch

if TYPE_CHECKING:  # grammar.py loads llguidance's torch helpers, which start torch.compile
    from eagle2_core.grammar import Constraint

# Processes the draft's log-probabilities [B, M, Vd] of nodes whose branches are [B, M, D].
DraftAdjust = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ControlError(PromptError):
    """A request's controls do not fit the model: a token id it does not have, a grammar
    its tokenizer cannot follow. The sample fails with this; its batch goes on."""


@dataclass(frozen=True)
class DraftColumns:
    """The draft vocabulary: its rows' target ids [Vd], and each target id's row [V] (-1
    where it has none)."""

    token_ids: torch.Tensor
    columns: torch.Tensor

    @classmethod
    def of(cls, token_ids: torch.Tensor, vocab_size: int) -> DraftColumns:
        columns = torch.full((vocab_size,), -1, dtype=torch.long, device=token_ids.device)
        columns[token_ids] = torch.arange(token_ids.numel(), device=token_ids.device)
        return cls(token_ids, columns)


class RowControls:
    """One sequence's processors, the history they count and its grammar's state."""

    def __init__(self, config: DecodeConfig, prompt_ids: list[int], target: Target) -> None:
        self.config = config
        self.history = History(prompt_ids, target.vocab_size, target.device)
        self.stops = frozenset(target.stop_ids | set(config.stop_token_ids))
        self.stop_ids = torch.tensor(sorted(self.stops), dtype=torch.long, device=target.device)
        self.constraint: Constraint | None = None
        if config.response_format is not None:
            from eagle2_core.grammar import grammars_for  # only rows with a format pay for it

            try:
                grammars = grammars_for(target.tokenizer, target.vocab_size, target.stop_ids)
                self.constraint = grammars.constraint(config.response_format)
            except ValueError as exc:  # a GrammarError, or a tokenizer llguidance cannot read
                raise ControlError(f"response_format: {exc}") from None

    def logits(self, logits: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        """The processed target logits [M, V] of nodes with branches `paths` [M, D]."""
        out = process(logits, self.config, self.history.branches(paths), self.stop_ids)
        if self.constraint is not None:  # a node never reached keeps its logits: no NaN
            allowed, live = self.constraint.allowed(paths, self.stops)
            out.masked_fill_(~allowed & live[:, None], float("-inf"))
        return out

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
        self, log_probs: torch.Tensor, paths: torch.Tensor, draft: DraftColumns
    ) -> torch.Tensor:
        """The draft's log-probabilities [M, Vd] processed alike, normalised again: the
        draft never proposes a token the grammar forbids on the node's branch."""
        branches = self.history.branches(paths)
        out = process(log_probs, self.config, branches, self.stop_ids, draft.columns)
        if self.constraint is None:
            return out.log_softmax(dim=-1)
        allowed, live = self.constraint.allowed(paths, self.stops)
        out = out.masked_fill(~allowed[:, draft.token_ids], float("-inf")).log_softmax(dim=-1)
        # Nothing below a dead node, nor below one whose allowed tokens the draft vocabulary
        # lacks (its row is all -inf: NaN after log_softmax).
        return out.masked_fill(~live[:, None] | out.isnan(), float("-inf"))

    def commit(self, tokens: list[int]) -> None:
        self.history.add(tokens)
        if self.constraint is not None:
            self.constraint.commit(tokens)


def controls_for(config: DecodeConfig, prompt_ids: list[int], target: Target) -> RowControls | None:
    """A row's controls, None when its config processes nothing (the fast path); raises
    ControlError when they do not fit the model."""
    vocab = target.vocab_size
    for name, ids in (
        ("logit_bias", [t for t, _ in config.logit_bias]),
        ("stop_token_ids", config.stop_token_ids),
    ):
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise ControlError(
                f"{name}: token id {outside[0]} is outside the model's vocabulary "
                f"(ids 0 to {vocab - 1})"
            )
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
    draft = DraftColumns.of(token_ids, vocab_size)

    def adjust(log_probs: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        out = log_probs.clone()
        for row in rows:
            out[row] = controls[row].draft_log_probs(log_probs[row], paths[row], draft)
        return out

    return adjust
