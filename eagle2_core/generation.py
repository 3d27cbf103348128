"""What decoding hands back: a completion and the acceptance statistics that explain its
speed, shared by every decoding mode."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from eagle2_core.logprobs import TokenLogprob


class PromptError(ValueError):
    """The prompt cannot be decoded (empty, or longer than the model's context)."""


@dataclass
class DecodeStats:
    """Per-sample acceptance statistics; a cycle is one draft + verify round."""

    n_cycles: int = 0
    round_tokens: int = 0  # tokens emitted by the rounds (the prefill's first token excluded)
    tree_nodes: int = 0  # nodes verified, root included, summed over the cycles
    accept_hist: list[int] = field(default_factory=list)  # [k] = cycles accepting k drafts
    depth_attempts: list[int] = field(default_factory=list)  # [d-1] = cycles offering depth d
    depth_accepts: list[int] = field(default_factory=list)  # [d-1] = cycles accepting depth d
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0

    @property
    def tau(self) -> float | None:
        """Average acceptance length: tokens per verify pass (accepted drafts + 1)."""
        return self.round_tokens / self.n_cycles if self.n_cycles else None

    @property
    def mean_tree_size(self) -> float | None:
        """Nodes verified per cycle (the tree size the rounds chose)."""
        return self.tree_nodes / self.n_cycles if self.n_cycles else None

    @classmethod
    def summed(cls, stats: Iterable[DecodeStats]) -> DecodeStats:
        """Several generations' counters as one (a conversation's turns, a benchmark's
        mode, a tau measurement): its tau and tree size are theirs together."""
        total = cls()
        for s in stats:
            total.add(s)
        return total

    def add(self, other: DecodeStats) -> None:
        self.n_cycles += other.n_cycles
        self.round_tokens += other.round_tokens
        self.tree_nodes += other.tree_nodes
        for summed, values in (
            (self.accept_hist, other.accept_hist),
            (self.depth_attempts, other.depth_attempts),
            (self.depth_accepts, other.depth_accepts),
        ):
            summed.extend([0] * (len(values) - len(summed)))
            for i, v in enumerate(values):
                summed[i] += v
        self.draft_ms += other.draft_ms
        self.verify_ms += other.verify_ms
        self.total_ms += other.total_ms

    def record(self, nodes: int, accepted: int, offered: int, emitted: int) -> None:
        """One cycle: a tree of `nodes` nodes, `accepted` drafts taken, depths 1..offered
        present along the accepted path, `emitted` tokens kept."""
        self.n_cycles += 1
        self.round_tokens += emitted
        self.tree_nodes += nodes
        _bump(self.accept_hist, accepted)
        for depth in range(1, offered + 1):
            _bump(self.depth_attempts, depth - 1)
            if depth <= accepted:
                _bump(self.depth_accepts, depth - 1)
        while len(self.depth_accepts) < len(self.depth_attempts):
            self.depth_accepts.append(0)


def _bump(counts: list[int], index: int) -> None:
    counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += 1


@dataclass
class Generation:
    """One completion with its statistics."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length" (max_new_tokens) or "context" (model full)
    prompt_tokens: int
    stats: DecodeStats
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        ms = self.stats.total_ms
        return self.completion_tokens / (ms / 1000) if ms > 0 else 0.0


def seeded_generator(seed: int | None) -> torch.Generator:
    """A generator for one sequence: seeded for reproducible sampling, else random."""
    return torch.Generator().manual_seed(seed if seed is not None else random.getrandbits(63))
