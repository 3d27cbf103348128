"""Our Llama blocks against transformers' own modules: the same outputs, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from eagle2_core.layers import MLP, RMSNorm, Rotary, rotary_for, rotate_heads

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},
}


def config(rope: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters=rope,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rotary_gives_transformers_cos_sin_and_rotation(rope: str, dtype: torch.dtype) -> None:
    cfg = config(ROPES[rope])
    ours, theirs = Rotary(cfg), LlamaRotaryEmbedding(cfg)
    assert ours.rope_type == rope
    x = torch.randn(2, 5, 64, dtype=dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4], [900, 1500, 2047, 3000, 4095]])
    cos, sin = ours(x, positions)
    expected_cos, expected_sin = theirs(x, positions)
    assert cos.dtype == dtype
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
    q, k = torch.randn(2, 4, 5, 16, dtype=dtype), torch.randn(2, 2, 5, 16, dtype=dtype)
    ours_q, ours_k = rotate_heads(q, k, cos, sin)
    their_q, their_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(ours_q, their_q) and torch.equal(ours_k, their_k)


def test_dynamic_rope_keeps_transformers_module() -> None:
    """Its frequencies follow the sequence's length: transformers' module does that."""
    cfg = config({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert isinstance(rotary_for(cfg), LlamaRotaryEmbedding)
    assert isinstance(rotary_for(config(ROPES["default"])), Rotary)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_mlp_match_transformers(dtype: torch.dtype) -> None:
    cfg = config(ROPES["default"])
    torch.manual_seed(0)
    theirs_norm, theirs_mlp = LlamaRMSNorm(64, eps=1e-5), LlamaMLP(cfg)
    with torch.no_grad():
        theirs_norm.weight.normal_()
    ours_norm, ours_mlp = RMSNorm(64, eps=1e-5), MLP(cfg)
    ours_norm.load_state_dict(theirs_norm.state_dict())
    ours_mlp.load_state_dict(theirs_mlp.state_dict())  # the same parameter names
    x = torch.randn(3, 7, 64)
    for ours, theirs in ((ours_norm, theirs_norm), (ours_mlp, theirs_mlp)):
        ours, theirs = ours.to(dtype), theirs.to(dtype)
        assert torch.equal(ours(x.to(dtype)), theirs(x.to(dtype)))


def test_mlp_refuses_another_activation() -> None:
    cfg = config(ROPES["default"])
    cfg.hidden_act = "gelu"
    with pytest.raises(ValueError, match="gelu"):
        MLP(cfg)
