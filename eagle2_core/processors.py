"""Logits processors: the controls that change the target's distribution before a token is
chosen (logit_bias, the repetition, presence and frequency penalties, min_tokens), exact at
every node of a draft tree.

A node's distribution predicts the token after its branch: the committed output, then the
drafted tokens from the root's child down to the node itself. So each node is processed
with the tokens on its own branch (`Branches`): its penalties count its ancestors in the
tree as generated, exactly as plain decoding counts them once it has taken that branch.
Verification applies this to the target's logits, so greedy output is plain decoding with
the same processors and sampling draws from the processed distribution; drafting applies
it to the draft's log-probabilities, so the draft proposes what the processed target picks.

Order, as transformers' and vLLM's: logit_bias, repetition penalty, presence and frequency
penalties, min_tokens' ban on stop tokens; temperature, top-k, top-p and min-p follow in
verify.target_probs. Everything here is a tensor operation over one row's nodes; rows
without any of these controls never come here (DecodeConfig.processed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle2_core.config import DecodeConfig


@dataclass(frozen=True)
class Branches:
    """The histories of M nodes, over the token ids that occur in any of them."""

    ids: torch.Tensor  # [H] sorted token ids: in the prompt, generated, or on a branch
    seen: torch.Tensor  # [M, H] bool: in the prompt or generated on the node's branch
    counts: torch.Tensor  # [M, H] float: times generated on the node's branch
    generated: torch.Tensor  # [M] long: tokens generated before the one the node predicts


class History:
    """One sequence's tokens as the processors count them: the ids its prompt holds (the
    repetition penalty's, as transformers and vLLM count them) and how often each was
    generated (the presence and frequency penalties', as OpenAI counts them)."""

    def __init__(self, prompt_ids: list[int], vocab_size: int, device: torch.device) -> None:
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.prompt_seen[prompt[prompt < vocab_size]] = True
        self.counts = torch.zeros(vocab_size, device=device)
        self.generated = 0

    def add(self, tokens: list[int]) -> None:
        """Tokens the sequence has generated (committed)."""
        index = torch.tensor(tokens, dtype=torch.long, device=self.counts.device)
        self.counts.index_add_(0, index, torch.ones(len(tokens), device=self.counts.device))
        self.generated += len(tokens)

    def branches(self, paths: torch.Tensor) -> Branches:
        """The histories of nodes whose branches beyond the output are `paths` [M, D]
        (token ids, -1 past a branch's end)."""
        valid = paths >= 0
        present = (self.prompt_seen | (self.counts > 0)).nonzero()[:, 0]
        ids = torch.unique(torch.cat([present, paths[valid]]))
        size = ids.numel()
        index = torch.where(valid, torch.searchsorted(ids, paths.clamp(min=0)), size)
        on_branch = torch.zeros(paths.shape[0], size + 1, device=paths.device)
        on_branch.scatter_add_(1, index, valid.float())
        counts = self.counts[ids][None] + on_branch[:, :size]
        seen = self.prompt_seen[ids][None] | (counts > 0)
        return Branches(ids, seen, counts, self.generated + valid.sum(dim=1))


def tree_paths(tokens: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """Each node's branch below the root of one tree: tokens [N], ancestors [N, N] (node i
    sees node j, itself included) -> [N, N] token ids, -1 off the branch. The root is the
    output's newest token, already counted."""
    on_branch = ancestors.clone()
    on_branch[:, 0] = False
    return torch.where(on_branch, tokens[None], -1)


def penalize(
    logits: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    repetition: float,
    presence: float,
    frequency: float,
) -> torch.Tensor:
    """The penalties on the logits of the history's ids [M, H]: a seen token's logit divided
    by `repetition` when positive, multiplied when negative (transformers'
    RepetitionPenaltyLogitsProcessor); then minus frequency x count and presence x
    (count > 0) (OpenAI's definition)."""
    if repetition != 1.0:
        penalized = torch.where(logits < 0, logits * repetition, logits / repetition)
        logits = torch.where(seen, penalized, logits)
    if presence != 0.0 or frequency != 0.0:
        logits = logits - frequency * counts - presence * (counts > 0).float()
    return logits


def process(
    logits: torch.Tensor,
    config: DecodeConfig,
    branches: Branches,
    stop_ids: torch.Tensor,
    columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """The processed logits of M nodes [M, C] (a new fp32 tensor). `stop_ids` are the ids
    min_tokens holds back (the model's end tokens and the line's stop_token_ids);
    `columns` maps a token id to its column ([V] long, -1 where the id has none: a draft
    vocabulary), None when column c is token c."""
    out = logits.float().clone()

    def place(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the columns of ids that have one, which of ids they are)."""
        if columns is None:
            return ids, torch.ones_like(ids, dtype=torch.bool)
        where = columns[ids]
        return where[where >= 0], where >= 0

    if config.logit_bias:
        ids = torch.tensor([t for t, _ in config.logit_bias], device=out.device)
        bias = torch.tensor([b for _, b in config.logit_bias], device=out.device)
        where, kept = place(ids)
        out[:, where] += bias[kept]
    if config.repetition_penalty != 1.0 or config.presence_penalty or config.frequency_penalty:
        where, kept = place(branches.ids)
        out[:, where] = penalize(
            out[:, where],
            branches.seen[:, kept],
            branches.counts[:, kept],
            config.repetition_penalty,
            config.presence_penalty,
            config.frequency_penalty,
        )
    if config.min_tokens > 0:
        early = (branches.generated < config.min_tokens).nonzero()[:, 0]
        where, _ = place(stop_ids)
        out[early[:, None], where[None]] = float("-inf")
    return out
