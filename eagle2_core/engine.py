"""The decoding loop: prefill -> (draft, verify, accept, commit) until a stop.

The same loop runs plain decoding (a root-only tree), EAGLE-1 (static tree) and
EAGLE-2 (dynamic tree), so the three compare on equal terms.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from eagle2_core.draft import (
    DraftCheckpointError,
    DraftHead,
    load_draft,
    new_draft_head,
    shipped_draft,
)
from eagle2_core.drafters import Drafter, EagleDrafter
from eagle2_core.models import Target, encode_chat, forward, load_target
from eagle2_core.tree import DEFAULT_STATIC_TREE, DraftTree, root_only, tree_attention_mask
from eagle2_core.verify import Sampling, choose_token, greedy_accept, sample_accept

MODES = ("eagle2", "eagle1", "vanilla")


class PromptError(ValueError):
    """The prompt cannot be decoded (empty, or longer than the model's context)."""


@dataclass(frozen=True)
class DecodeConfig:
    """What to generate and how; tree parameters as in the EAGLE-2 reference."""

    mode: str = "eagle2"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 10
    depth: int = 5
    total_tokens: int = 60
    static_tree: tuple[tuple[int, ...], ...] = DEFAULT_STATIC_TREE

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if self.total_tokens < 1:
            raise ValueError(f"total_tokens must be >= 1, got {self.total_tokens}")

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p)


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
    target: Target, cache: DynamicCache, tree: DraftTree, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the tree after the context; returns logits [N, V], hidden [N, H]."""
    positions = (tree.depths + context_len).to(target.device)[None]
    mask = None
    if tree.size > 1:
        mask = tree_attention_mask(tree, context_len, target.dtype).to(target.device)
    hidden = forward(target, tree.tokens.to(target.device)[None], positions, cache, mask)[0]
    return target.lm_head(hidden), hidden


def commit(cache: DynamicCache, context_len: int, accepted: list[int]) -> None:
    """Keep the KV entries of the accepted tree nodes after the context; drop the rest."""
    if accepted == list(range(len(accepted))):  # a prefix of the tree: a view, no copy
        end = context_len + len(accepted)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]
        return
    keep = torch.tensor(accepted, device=cache.layers[0].keys.device) + context_len
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[:, :, :context_len], layer.keys[:, :, keep]], dim=2)
        layer.values = torch.cat(
            [layer.values[:, :, :context_len], layer.values[:, :, keep]], dim=2
        )


class Engine:
    """Decodes prompts with a target and (optionally) an EAGLE draft head."""

    def __init__(self, target: Target, draft_head: DraftHead | None = None):
        self.target = target
        self.draft_head = draft_head.to(target.device, target.dtype) if draft_head else None

    def drafter_for(self, config: DecodeConfig) -> Drafter | None:
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
        generator = _generator(config.seed)
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

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        config: DecodeConfig,
        drafter: Drafter | None = None,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """Decode one prompt. A drafter passed in overrides the mode's own."""
        start = time.perf_counter()
        target, stats = self.target, DecodeStats()
        if not prompt_ids:
            raise PromptError("the prompt is empty: there is nothing to continue")
        if len(prompt_ids) >= target.max_context:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context holds "
                f"{target.max_context}; shorten the prompt"
            )
        if config.max_new_tokens == 0:
            return Generation([], "", "length", len(prompt_ids), stats)
        drafter = drafter if drafter is not None else self.drafter_for(config)
        if drafter is not None:
            drafter.reset()
        generator = generator if generator is not None else _generator(config.seed)
        sampling = config.sampling

        prompt = torch.tensor(prompt_ids, device=target.device)
        cache, features, logits = prefill(target, prompt)
        root = choose_token(logits, sampling, generator)
        output, finish = [root], _finish(root, 1, config, target)
        next_tokens = torch.cat([prompt[1:], torch.tensor([root], device=target.device)])
        context_len = len(prompt_ids)
        while finish is None:
            budget = min(config.total_tokens, target.max_context - context_len)
            if budget < 1:
                finish = "context"
                break
            t0 = time.perf_counter()
            if drafter is None:
                tree = root_only(root)
            else:
                tree = drafter.draft(features, next_tokens, context_len, budget)
            t1 = time.perf_counter()
            logits, hidden = verify(target, cache, tree, context_len)
            if sampling.greedy:
                accepted, bonus = greedy_accept(tree, logits)
            else:
                accepted, bonus = sample_accept(tree, logits, sampling, generator)
            commit(cache, context_len, accepted)
            stats.draft_ms += (t1 - t0) * 1000
            stats.verify_ms += (time.perf_counter() - t1) * 1000
            emitted = tree.tokens[accepted[1:]].tolist() + [bonus]
            context_len += len(accepted)
            features = hidden[accepted]
            next_tokens = torch.tensor(emitted, device=target.device)
            root = bonus
            kept = 0
            for token in emitted:
                output.append(token)
                kept += 1
                finish = _finish(token, len(output), config, target)
                if finish is not None:
                    break
            stats.record(tree, accepted, kept)
        stats.total_ms = (time.perf_counter() - start) * 1000
        text = target.tokenizer.decode(output, skip_special_tokens=True)
        return Generation(output, text, finish, len(prompt_ids), stats)


def _finish(token: int, n_out: int, config: DecodeConfig, target: Target) -> str | None:
    if token in target.stop_ids:
        return "stop"
    if n_out >= config.max_new_tokens:
        return "length"
    return None


def _generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else random.getrandbits(63))


def load_engine(
    model: str,
    draft: str | None = None,
    *,
    needs_draft: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Engine:
    """Target + draft by name. draft None = the head shipped for the model alias,
    "random" = an untrained head (for tests: tau near 1), else a checkpoint directory."""
    target = load_target(model, dtype=dtype, device=device)
    if draft is None:
        draft = shipped_draft(model)
        if draft is None:
            if needs_draft:
                raise DraftCheckpointError(
                    f"no draft head is shipped for {model!r}: pass --draft DIR "
                    "(train one with `eagle2-batch train-draft`) or use --mode vanilla"
                )
            return Engine(target)
    if draft == "random":
        head = new_draft_head(target.model.config)
    else:
        head = load_draft(draft, target.model.config)
    return Engine(target, head)
