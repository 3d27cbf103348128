"""Logprobs of the chosen tokens, as OpenAI returns them: the target's raw distribution
(the log-softmax of its logits before temperature and processors, vLLM's default), with
the k most likely tokens of each position. Verification has already computed the logits
of every accepted position, so under speculation they cost a log-softmax per token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle2_core.config import DecodeConfig


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's logprob and the position's most likely tokens."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]

    def to_json(self) -> dict[str, object]:
        """The stored form: a `logprobs` list item (workers/parquet_sink.py's struct)."""
        return {
            "token_id": self.token_id,
            "logprob": self.logprob,
            "top_ids": list(self.top_ids),
            "top_logprobs": list(self.top_logprobs),
        }


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """logits [n, V] of n positions (raw), the tokens chosen there [n], `top` alternatives."""
    log_probs = logits.float().log_softmax(dim=-1)
    chosen = log_probs.gather(1, tokens[:, None])[:, 0].tolist()
    ids = tokens.tolist()
    if top == 0:
        return [TokenLogprob(t, lp, (), ()) for t, lp in zip(ids, chosen, strict=True)]
    best = log_probs.topk(min(top, log_probs.shape[-1]), dim=-1)
    return [
        TokenLogprob(t, lp, tuple(top_ids), tuple(top_lps))
        for t, lp, top_ids, top_lps in zip(
            ids, chosen, best.indices.tolist(), best.values.tolist(), strict=True
        )
    ]


def path_logprobs(
    logits: torch.Tensor,
    nodes: torch.Tensor,
    emitted: torch.Tensor,
    lengths: list[int],
    configs: list[DecodeConfig],
) -> list[list[TokenLogprob] | None] | None:
    """One verify round's logprobs: for each row that asks for them, those of its emitted
    tokens (emitted [B, W]), each read at its accepted node's raw logits (logits [B, N, V],
    nodes [B, W]); None when no row asks."""
    if not any(config.logprobs for config in configs):
        return None
    out: list[list[TokenLogprob] | None] = []
    for row, config in enumerate(configs):
        n = lengths[row]
        if not config.logprobs:
            out.append(None)
            continue
        at = logits[row, nodes[row, :n]]
        out.append(token_logprobs(at, emitted[row, :n], config.top_logprobs))
    return out
