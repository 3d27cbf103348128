"""The decoding loop: prefill -> (draft, verify, accept, commit) until a stop.

The same loop runs plain decoding (a root-only tree), EAGLE-1 (static tree) and
EAGLE-2 (dynamic tree), so the three compare on equal terms.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from eagle2_core.batch_draft import BatchEagleDrafter
from eagle2_core.config import DecodeConfig
from eagle2_core.draft import DraftHead, load_draft, new_draft_head
from eagle2_core.drafters import Drafter, EagleDrafter
from eagle2_core.kv import BatchKV
from eagle2_core.models import Target, forward, load_target
from eagle2_core.registry import DraftUnavailableError, draft_source, encode_chat
from eagle2_core.tree import DraftTree, root_only
from eagle2_core.verify import choose_token, greedy_accept, sample_accept

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """The prompt cannot be decoded (empty, or longer than the model's context)."""


@dataclass
class DecodeStats:
    """Per-sample acceptance statistics; a cycle is one draft + verify round."""

    n_cycles: int = 0
    round_tokens: int = 0  # tokens emitted by the rounds (the prefill's first token excluded)
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

    def record(self, tree: DraftTree, accepted: list[int], emitted: int) -> None:
        self.n_cycles += 1
        self.round_tokens += emitted
        _bump(self.accept_hist, len(accepted) - 1)
        for depth, node in enumerate(accepted, start=1):
            if not tree.children[node]:
                break
            _bump(self.depth_attempts, depth - 1)
            if depth < len(accepted):
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

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        ms = self.stats.total_ms
        return self.completion_tokens / (ms / 1000) if ms > 0 else 0.0


def prefill(
    target: Target, prompt: torch.Tensor
) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """Run the prompt [L]; returns the cache, its features [L, H] and last logits [V]."""
    cache = DynamicCache(config=target.model.config)
    positions = torch.arange(len(prompt), device=target.device)[None]
    hidden = forward(target, prompt[None], positions, cache)[0]
    return cache, hidden, target.lm_head(hidden[-1])


def verify(
    target: Target, kv: BatchKV, trees: list[DraftTree], context_lens: list[int]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One target forward over every row's tree after its context.

    Returns each row's logits [n_b, V] (lm_head on real nodes only) and hidden [B, N, H].
    """
    n = max(t.size for t in trees)
    tokens = torch.zeros(len(trees), n, dtype=torch.long)
    positions = torch.zeros(len(trees), n, dtype=torch.long)
    for row, (tree, context_len) in enumerate(zip(trees, context_lens, strict=True)):
        tokens[row, : tree.size] = tree.tokens
        positions[row, : tree.size] = tree.depths + context_len
        positions[row, tree.size :] = context_len
    mask = kv.tree_mask(trees, target.dtype)
    device = target.device
    hidden = forward(target, tokens.to(device), positions.to(device), kv.cache, mask)
    real = torch.cat([hidden[row, : tree.size] for row, tree in enumerate(trees)])
    logits = target.lm_head(real).split([t.size for t in trees])
    return list(logits), hidden


class Engine:
    """Decodes prompts with a target and (optionally) an EAGLE draft head."""

    def __init__(self, target: Target, draft_head: DraftHead | None = None):
        self.target = target
        self.draft_head = draft_head.to(target.device, target.dtype) if draft_head else None

    def drafter_for(self, config: DecodeConfig) -> Drafter | None:
        """A per-sequence drafter for the mode (EAGLE-2 rows of a batch draft together)."""
        if config.mode == "vanilla":
            return None
        if self.draft_head is None:
            raise ValueError(f"mode {config.mode} needs a draft head; none is loaded")
        static = config.static_tree if config.mode == "eagle1" else None
        return EagleDrafter(self.draft_head, self.target, config.top_k, config.depth, static)

    def chat(
        self, messages: list[dict], followups: list[str], config: DecodeConfig
    ) -> list[Generation]:
        """Answer the conversation, then each follow-up turn after the previous answer."""
        generator = seeded_generator(config.seed)
        conversation = list(messages)
        turns = []
        for followup in [None, *followups]:
            if followup is not None:
                conversation += [
                    {"role": "assistant", "content": turns[-1].text},
                    {"role": "user", "content": followup},
                ]
            ids = encode_chat(self.target.tokenizer, conversation)
            turns.append(self.generate(ids, config, generator=generator))
        return turns

    def generate(
        self,
        prompt_ids: list[int],
        config: DecodeConfig,
        drafter: Drafter | None = None,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """Decode one prompt. A drafter passed in overrides the mode's own."""
        decoder = BatchDecoder(self)
        decoder.add(None, prompt_ids, config, drafter, generator)
        while True:
            for _, generation in decoder.step():
                return generation

    def generate_batch(
        self, items: Iterable[tuple[Hashable, list[int], DecodeConfig]], batch_size: int
    ) -> Iterator[tuple[Hashable, Generation]]:
        """Decode (key, prompt_ids, config) items, up to batch_size at once, yielding each
        (key, generation) as it finishes; the next item joins in its place."""
        decoder, pending = BatchDecoder(self), iter(items)
        while True:
            while decoder.active < batch_size and (item := next(pending, None)) is not None:
                decoder.add(*item)
            if decoder.idle:
                return
            yield from decoder.step()


@dataclass
class _Sequence:
    """One sequence in flight: its settings, its drafter, and where decoding stands."""

    key: Hashable
    config: DecodeConfig
    drafter: Drafter | None  # its own drafter, if it does not draft with a group
    group: tuple[int, int] | None  # (top_k, depth) of the batched EAGLE-2 drafter it uses
    generator: torch.Generator
    prompt_len: int
    stats: DecodeStats
    output: list[int]
    context_len: int  # tokens in the target's cache (the newest token is not yet there)
    features: torch.Tensor  # target features of the tokens committed since the last draft
    next_tokens: torch.Tensor  # the token after each of those; the last is the next root
    finish: str | None = None


class BatchDecoder:
    """Decodes many sequences at once: every round drafts each sequence's own tree, then
    verifies all trees in one batched target forward.

    Callers `add` sequences whenever they like (continuous batching) and call `step`
    for one round; finished sequences leave the batch. Each sequence is decoded exactly
    as it would be alone (its own tree, acceptance, cache length, stop and generator).
    Time is attributed per sequence: its prefill and drafting, plus the batched verify
    round split in proportion to its tree size.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.kv: BatchKV | None = None
        self.rows: list[_Sequence] = []
        self.finished: list[tuple[Hashable, Generation]] = []
        self.groups: dict[tuple[int, int], BatchEagleDrafter] = {}

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def idle(self) -> bool:
        return not self.rows and not self.finished

    @torch.inference_mode()
    def add(
        self,
        key: Hashable,
        prompt_ids: list[int],
        config: DecodeConfig,
        drafter: Drafter | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        """Prefill a prompt and join the batch; raises PromptError for an undecodable one."""
        start = time.perf_counter()
        target = self.engine.target
        if not prompt_ids:
            raise PromptError("the prompt is empty: there is nothing to continue")
        if len(prompt_ids) >= target.max_context:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context holds "
                f"{target.max_context}; shorten the prompt"
            )
        stats = DecodeStats()
        if config.max_new_tokens == 0:
            self.finished.append((key, Generation([], "", "length", len(prompt_ids), stats)))
            return
        group = None
        if drafter is None and config.mode == "eagle2" and self.engine.draft_head is not None:
            group = (config.top_k, config.depth)
        elif drafter is None:
            drafter = self.engine.drafter_for(config)
        if drafter is not None:
            drafter.reset()
        generator = generator if generator is not None else seeded_generator(config.seed)
        prompt = torch.tensor(prompt_ids, device=target.device)
        cache, features, logits = prefill(target, prompt)
        root = choose_token(logits, config.sampling, generator)
        seq = _Sequence(
            key=key,
            config=config,
            drafter=drafter,
            group=group,
            generator=generator,
            prompt_len=len(prompt_ids),
            stats=stats,
            output=[root],
            context_len=len(prompt_ids),
            features=features,
            next_tokens=torch.cat([prompt[1:], torch.tensor([root], device=target.device)]),
            finish=_finish(root, 1, config, target),
        )
        stats.total_ms += (time.perf_counter() - start) * 1000
        if seq.finish is not None:
            self._retire(seq)
            return
        if self.kv is None:
            self.kv = BatchKV(cache, len(prompt_ids))
        else:
            self.kv.add(cache, len(prompt_ids))
        if group is not None:
            if group not in self.groups:
                self.groups[group] = BatchEagleDrafter(self.engine.draft_head, target, *group)
            self.groups[group].add(seq.features, seq.next_tokens)
        self.rows.append(seq)

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, Generation]]:
        """One draft + verify round for every sequence; returns those that finished."""
        if self.rows:
            self._round()
        finished, self.finished = self.finished, []
        return finished

    def _round(self) -> None:
        target = self.engine.target
        for seq in self.rows:
            if target.max_context - seq.context_len < 1:
                seq.finish = "context"
        self._drop_finished()
        if not self.rows:
            return
        trees = self._draft()
        t1 = time.perf_counter()
        logits, hidden = verify(target, self.kv, trees, [s.context_len for s in self.rows])
        decisions = []
        for seq, tree, row_logits in zip(self.rows, trees, logits, strict=True):
            if seq.config.sampling.greedy:
                decisions.append(greedy_accept(tree, row_logits))
            else:
                decisions.append(
                    sample_accept(tree, row_logits, seq.config.sampling, seq.generator)
                )
        self.kv.commit([accepted for accepted, _ in decisions])
        round_ms = (time.perf_counter() - t1) * 1000
        total_nodes = sum(t.size for t in trees)
        for row, (seq, tree, (accepted, bonus)) in enumerate(
            zip(self.rows, trees, decisions, strict=True)
        ):
            share = round_ms * tree.size / total_nodes
            seq.stats.verify_ms += share
            seq.stats.total_ms += share
            emitted = tree.tokens[accepted[1:]].tolist() + [bonus]
            seq.context_len += len(accepted)
            seq.features = hidden[row, accepted]
            seq.next_tokens = torch.tensor(emitted, device=target.device)
            kept = 0
            for token in emitted:
                seq.output.append(token)
                kept += 1
                seq.finish = _finish(token, len(seq.output), seq.config, target)
                if seq.finish is not None:
                    break
            seq.stats.record(tree, accepted, kept)
        self._drop_finished()

    def _draft(self) -> list[DraftTree]:
        """Every row's tree: each group's rows in one batched draft, the others alone.
        A group's drafting time is shared evenly by its rows."""
        target = self.engine.target
        trees: list[DraftTree | None] = [None] * len(self.rows)
        for seq_index, seq in enumerate(self.rows):
            if seq.group is None:
                t0 = time.perf_counter()
                budget = min(seq.config.total_tokens, target.max_context - seq.context_len)
                if seq.drafter is None:
                    trees[seq_index] = root_only(int(seq.next_tokens[-1]))
                else:
                    trees[seq_index] = seq.drafter.draft(
                        seq.features, seq.next_tokens, seq.context_len, budget
                    )
                _add_draft_ms(seq, (time.perf_counter() - t0) * 1000)
        for group, drafter in self.groups.items():
            members = [i for i, seq in enumerate(self.rows) if seq.group == group]
            seqs = [self.rows[i] for i in members]
            t0 = time.perf_counter()
            group_trees = drafter.draft(
                [s.features for s in seqs],
                [s.next_tokens for s in seqs],
                [s.context_len for s in seqs],
                [min(s.config.total_tokens, target.max_context - s.context_len) for s in seqs],
            )
            share = (time.perf_counter() - t0) * 1000 / len(seqs)
            for i, seq, tree in zip(members, seqs, group_trees, strict=True):
                trees[i] = tree
                _add_draft_ms(seq, share)
        return trees

    def _drop_finished(self) -> None:
        keep = [i for i, seq in enumerate(self.rows) if seq.finish is None]
        if len(keep) == len(self.rows):
            return
        for seq in self.rows:
            if seq.finish is not None:
                self._retire(seq)
        for group in list(self.groups):
            members = [seq for seq in self.rows if seq.group == group]
            kept = [i for i, seq in enumerate(members) if seq.finish is None]
            if kept:
                self.groups[group].keep_rows(kept)
            else:
                del self.groups[group]
        self.rows = [self.rows[i] for i in keep]
        if keep:
            self.kv.keep_rows(keep)
        else:
            self.kv = None

    def _retire(self, seq: _Sequence) -> None:
        text = self.engine.target.tokenizer.decode(seq.output, skip_special_tokens=True)
        generation = Generation(seq.output, text, seq.finish, seq.prompt_len, seq.stats)
        self.finished.append((seq.key, generation))


def _add_draft_ms(seq: _Sequence, ms: float) -> None:
    seq.stats.draft_ms += ms
    seq.stats.total_ms += ms


def _finish(token: int, n_out: int, config: DecodeConfig, target: Target) -> str | None:
    if token in target.stop_ids:
        return "stop"
    if n_out >= config.max_new_tokens:
        return "length"
    return None


def seeded_generator(seed: int | None) -> torch.Generator:
    """A generator for one sequence: seeded for reproducible sampling, else random."""
    return torch.Generator().manual_seed(seed if seed is not None else random.getrandbits(63))


def load_head(target: Target, source: Path | None) -> DraftHead:
    """The head at `source` (checked against the target), or an untrained one for None."""
    if source is not None:
        return load_draft(source, target.model.config)
    log.warning(
        "USING A RANDOM, UNTRAINED DRAFT HEAD for %s: outputs are correct but nothing is "
        "sped up (tau ~ 1). This is for testing only: pass a trained head.",
        target.name,
    )
    return new_draft_head(target.model.config)


def load_engine(
    model: str,
    draft: str | None = None,
    *,
    needs_draft: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Engine:
    """Target + draft by name (see draft_source); without needs_draft a model with no
    shipped head loads without one."""
    try:
        source = draft_source(model, draft)
    except DraftUnavailableError:
        if needs_draft:
            raise
        return Engine(load_target(model, dtype=dtype, device=device))
    target = load_target(model, dtype=dtype, device=device)
    return Engine(target, load_head(target, source))
