"""One sequence in flight in a BatchDecoder: its state, the prompt it may share, and
when and where its output ends (the stop rules every decoding mode shares)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from eagle2_core.config import DecodeConfig
from eagle2_core.controls import RowControls
from eagle2_core.drafters import Drafter
from eagle2_core.generation import DecodeStats, Generation
from eagle2_core.logprobs import TokenLogprob
from eagle2_core.models import Target
from eagle2_core.verify import Uniforms


@dataclass
class Sequence:
    """One sequence in flight: its settings, its drafter, and where decoding stands."""

    key: Hashable
    config: DecodeConfig
    drafter: Drafter | None  # its own drafter (None: the batch's EAGLE-2, or root only)
    uniforms: Uniforms  # one per output position, from the sequence's generator
    prompt_len: int
    stats: DecodeStats
    output: list[int]
    context_len: int  # tokens in the target's cache (the newest token is not yet there)
    features: torch.Tensor | None  # for its own drafter: features of the tokens committed
    next_tokens: torch.Tensor | None  # since its last draft, and the token after each
    finish: str | None = None
    controls: RowControls | None = None  # its logits processors (None: it has none)
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for


@dataclass(frozen=True)
class Joining:
    """A sequence added to a batch and waiting for the next step's prefill."""

    key: Hashable
    prompt_ids: list[int]
    config: DecodeConfig
    drafter: Drafter | None
    generator: torch.Generator
    controls: RowControls | None
    stats: DecodeStats
    dynamic: bool  # drafts with the batch's EAGLE-2 head


@dataclass(frozen=True)
class Prefill:
    """The newest prompt prefilled, kept so that a sequence added next with the same prompt
    (the n completions of one request) copies that row's cache instead of running the
    target over the prompt again: the same numbers, a copy instead of a forward."""

    key: Hashable  # the sequence whose cache row holds the prompt
    prompt_ids: list[int]
    last_hidden: torch.Tensor  # [H] the final state at the prompt's last token
    features: torch.Tensor  # [T, F] what the draft head reads of the prompt


@dataclass
class SharedPrefix:
    """Leading tokens that the prompts of a join share (a chat template's system prompt),
    run through the target once: each new row's first slots copy its cache, and only the
    rest of its prompt is prefilled. Kept for later joins: their prompts that extend it
    copy it too."""

    ids: list[int]
    keys: torch.Tensor  # [layers, 1, kv_heads, T, D]
    values: torch.Tensor
    features: torch.Tensor  # [T, F] what the draft head reads of them


def decoded_text(seq: Sequence, target: Target) -> str:
    """The output as text; a stop_token_ids token that ended it is not part of it (vLLM's
    rule; the model's own end tokens are special and decode to nothing)."""
    output = seq.output
    if output and output[-1] in seq.config.stop_token_ids:
        output = output[:-1]
    return target.tokenizer.decode(output, skip_special_tokens=True)


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first stop string starts in text, or None."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None


def stop_window(stops: tuple[str, ...]) -> int:
    """Tokens at the end of an output that must hold any stop string overlapping its
    newest token: one that ends there starts at most len(stop) - 1 characters earlier,
    and a token carries at least one character, except a byte-level piece of a character
    (up to 4 per character) or a special token that decodes to nothing. So 4 tokens per
    character, plus slack, cover it; and the window's first token, whose decoded form can
    lose a leading space, is never part of a match that can end the output."""
    return 4 * max(len(stop) for stop in stops) + 8


def finish_reason(seq: Sequence, target: Target) -> str | None:
    """Why the sequence ends after its newest token, or None. A stop string may span
    tokens: it is looked for in the decoded tail of the output (stop_window), not the
    whole text, so checking every token costs the same at token 10 and token 4,000; rows
    without one pay nothing."""
    if seq.output[-1] in target.stop_ids or seq.output[-1] in seq.config.stop_token_ids:
        return "stop"
    stops = seq.config.stop
    if stops:
        tail = seq.output[-stop_window(stops) :]
        if first_stop(target.tokenizer.decode(tail, skip_special_tokens=True), stops) is not None:
            return "stop"
    if len(seq.output) >= seq.config.max_new_tokens:
        return "length"
    return None


def completion(seq: Sequence, target: Target) -> Generation:
    """A finished sequence's completion: its text ends before its first stop string."""
    text = decoded_text(seq, target)
    cut = first_stop(text, seq.config.stop)
    text = text[:cut] if cut is not None else text
    return Generation(seq.output, text, seq.finish, seq.prompt_len, seq.stats, seq.logprobs)
