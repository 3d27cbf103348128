"""The Llama building blocks the draft heads train with: RMSNorm, the gated MLP, RoPE.

The same parameters and the same arithmetic as transformers' `LlamaRMSNorm`, `LlamaMLP`
and `LlamaRotaryEmbedding` (tests/eagle2_core/test_layers.py holds them to those bit for
bit), without importing `modeling_llama`: that import pulls in transformers' modeling
stack (torch._dynamo, torch.distributed, scipy), ~1.8 s of every command's start on the
2-core VMs, for three small modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle2_core.model_config import ModelConfig

# RoPE types whose frequencies change with the sequence's length: transformers' module.
DYNAMIC_ROPE = ("dynamic", "longrope")


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"activation {config.hidden_act!r} is not supported (silu only)")
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary(nn.Module):
    """(x, positions [B, T]) -> cos, sin [B, T, D] in x's dtype, for a config's static RoPE
    (default, linear, llama3, yarn, ...: transformers' own frequency functions)."""

    def __init__(self, config) -> None:
        super().__init__()
        parameters = config.rope_parameters
        self.rope_type = parameters["rope_type"]
        if self.rope_type == "default":
            dim = getattr(config, "head_dim", None) or (
                config.hidden_size // config.num_attention_heads
            )
            exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
            inv_freq, self.scaling = 1.0 / (parameters["rope_theta"] ** exponents), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            rope_init = ROPE_INIT_FUNCTIONS[self.rope_type]
            inv_freq, self.scaling = rope_init(ModelConfig.of(config).transformers())
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        freqs = positions[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        return (
            (angles.cos() * self.scaling).to(x.dtype),
            (angles.sin() * self.scaling).to(x.dtype),
        )


def rotary_for(config) -> nn.Module:
    """The RoPE module of a config: ours, or transformers' for the dynamic kinds."""
    if config.rope_parameters["rope_type"] in DYNAMIC_ROPE:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding(ModelConfig.of(config).transformers())
    return Rotary(config)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it (rotate_half of the two halves)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rotate_heads(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q, k [B, heads, T, D] from cos, sin [B, T, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return rotate(q, cos, sin), rotate(k, cos, sin)
