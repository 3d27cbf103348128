"""The lean forward computes transformers' forward: same hidden states, any cache use."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from eagle2_core.llama import LeanLlama, UnsupportedModelError, Writes, attend, forward
from eagle2_core.models import target_from_model
from tests.eagle2_core.tiny import tiny_target, tiny_tokenizer


def small(kind: str):
    common = dict(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    if kind == "qwen2":  # q/k/v biases
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    if kind == "llama3-rope":  # scaled RoPE
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope)).eval()
    return LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True)).eval()


@pytest.mark.parametrize("kind", ["llama-biases", "qwen2", "llama3-rope"])
@torch.inference_mode()
def test_prefill_then_steps_equal_one_transformers_forward(kind):
    model = small(kind)
    target = target_from_model(model, tiny_tokenizer(50), kind)
    ids = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(1))
    want = model.model(input_ids=ids).last_hidden_state
    kv = target.kv()
    kv.add_row(0)
    kv.add_row(0)
    pieces, start = [], 0
    for size in (20, 1, 6, 3):  # a prefill, then steps of several tokens
        kv.reserve_new(size)
        keys, values = kv.layer_views()
        chunk = ids[:, start : start + size]
        positions = torch.arange(start, start + size).expand(2, size)
        causal = torch.ones(size, size, dtype=torch.bool).tril().expand(2, size, size)
        mask = kv.tree_mask(causal)
        pieces.append(forward(target.lean, chunk, positions, keys, values, start, mask)[0])
        kv.commit(start, torch.arange(size).expand(2, size), torch.tensor([size, size]))
        start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), want, rtol=1e-4, atol=1e-4)


def test_unsupported_architectures_are_refused_by_name():
    model = tiny_target().model
    model.config.model_type = "gpt2"
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        LeanLlama.of(model)


def test_attention_without_a_mask_is_causal_after_cached_entries():
    """New tokens written after entries already in the cache, no mask given: each sees the
    cached slots and the new ones up to its own, as the explicit causal mask says (torch's
    is_causal would align them to slot 0)."""
    torch.manual_seed(0)
    b, t, cached, heads, kv_heads, dim = 2, 6, 5, 4, 2, 16
    q = torch.randn(b, t, heads, dim)
    k, v = torch.randn(b, t, kv_heads, dim), torch.randn(b, t, kv_heads, dim)
    keys, values = torch.randn(2, b, kv_heads, 16, dim).unbind(0)
    writes = Writes(cached, None, cached + t)
    mask = writes.causal(writes.slots_of(b, t, q.device))
    want = attend(q, k, v, keys.clone(), values.clone(), writes, mask)
    assert torch.equal(attend(q, k, v, keys.clone(), values.clone(), writes, None), want)
