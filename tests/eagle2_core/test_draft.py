"""Draft heads load and save in the public EAGLE checkpoint format."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle2_core.draft import (
    HELD_OUT_TOP1,
    DraftCheckpointError,
    load_draft,
    new_draft_head,
    save_draft,
)
from tests.eagle2_core.tiny import tiny_target

H, HEADS, KV, FFN, VOCAB = 64, 4, 2, 128, 96


def head_output(head, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    embeds, features = torch.randn(2, 1, 5, H, generator=g)
    positions = torch.arange(5)[None]
    mask = torch.full((5, 5), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        return head(embeds, features, positions, None, mask)[0]


def public_state(fc_bias: bool, qkv_bias: bool, with_embeddings: bool) -> dict[str, torch.Tensor]:
    """Random weights under exactly the key names public EAGLE checkpoints use."""
    g = torch.Generator().manual_seed(7)
    hd = H // HEADS
    shapes = {
        "fc.weight": (H, 2 * H),
        "layers.0.self_attn.q_proj.weight": (HEADS * hd, H),
        "layers.0.self_attn.k_proj.weight": (KV * hd, H),
        "layers.0.self_attn.v_proj.weight": (KV * hd, H),
        "layers.0.self_attn.o_proj.weight": (H, HEADS * hd),
        "layers.0.mlp.gate_proj.weight": (FFN, H),
        "layers.0.mlp.up_proj.weight": (FFN, H),
        "layers.0.mlp.down_proj.weight": (H, FFN),
        "layers.0.post_attention_layernorm.weight": (H,),
    }
    if fc_bias:
        shapes["fc.bias"] = (H,)
    if qkv_bias:
        shapes.update(
            {
                "layers.0.self_attn.q_proj.bias": (HEADS * hd,),
                "layers.0.self_attn.k_proj.bias": (KV * hd,),
                "layers.0.self_attn.v_proj.bias": (KV * hd,),
            }
        )
    if with_embeddings:
        shapes["embed_tokens.weight"] = (VOCAB, H)
    return {k: torch.randn(*s, generator=g) * 0.1 for k, s in shapes.items()}


def write_public(directory, state, config_extra: dict, use_bin: bool) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "torch_dtype": "float16",
    }
    config.update(config_extra)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if use_bin:
        torch.save(state, directory / "pytorch_model.bin")
    else:
        save_file(state, str(directory / "model.safetensors"))


def test_round_trip_keeps_weights_and_outputs(tmp_path):
    target = tiny_target()
    head = new_draft_head(target.model.config, seed=3, fc_bias=True)
    save_draft(head, tmp_path / "head", dtype=torch.float32, card="# card\n")
    loaded = load_draft(tmp_path / "head", target.model.config)
    assert loaded.fc_bias and (tmp_path / "head" / "README.md").read_text() == "# card\n"
    for (name, a), (_, b) in zip(
        head.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert torch.allclose(head_output(head), head_output(loaded))


def test_the_held_out_agreement_travels_with_the_head(tmp_path):
    """train-draft records it; the planner bounds the head's drafting by it. A head that
    records none (a public checkpoint) loads without it."""
    target = tiny_target()
    head = new_draft_head(target.model.config, seed=3)
    save_draft(head, tmp_path / "plain")
    assert HELD_OUT_TOP1 not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert load_draft(tmp_path / "plain", target.model.config).held_out_top1 is None
    head.held_out_top1 = 0.41237
    save_draft(head, tmp_path / "trained")
    assert load_draft(tmp_path / "trained", target.model.config).held_out_top1 == 0.4124


def test_bf16_save_is_small_and_close(tmp_path):
    target = tiny_target()
    head = new_draft_head(target.model.config, seed=3)
    save_draft(head, tmp_path / "head")  # bf16 by default
    loaded = load_draft(tmp_path / "head", target.model.config)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert torch.allclose(head_output(head), head_output(loaded.float()), atol=0.05)


@pytest.mark.parametrize(
    "fc_bias,qkv_bias,use_bin,with_embeddings,extra",
    [
        (True, False, True, True, {}),  # Vicuna-style .bin, fc bias absent from config = true
        (False, False, False, False, {"bias": False}),  # Llama-3 style, no fc bias
        (True, True, False, False, {"qkv_bias": True}),  # Qwen2 style
        (
            False,
            False,
            True,
            False,
            {
                "bias": False,
                "rope_theta": 500000.0,
                "rope_scaling": {
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                    "rope_type": "llama3",
                },
            },
        ),  # Llama-3.1
    ],
)
def test_loads_public_format(tmp_path, fc_bias, qkv_bias, use_bin, with_embeddings, extra):
    state = public_state(fc_bias, qkv_bias, with_embeddings)
    write_public(tmp_path, state, extra, use_bin)
    target = tiny_target(vocab_size=VOCAB)
    head = load_draft(tmp_path, target.model.config)
    assert head.fc_bias == fc_bias and head.qkv_bias == qkv_bias
    loaded = head.state_dict()
    for key, value in state.items():
        if key != "embed_tokens.weight":
            assert torch.equal(loaded[key], value), key
    if "rope_scaling" in extra:
        assert head.rotary.rope_type == "llama3"
    assert torch.isfinite(head_output(head)).all()


def test_mismatched_head_is_refused_with_a_clear_error(tmp_path):
    write_public(tmp_path, public_state(True, False, False), {}, use_bin=False)
    wider = tiny_target(hidden=128)
    with pytest.raises(DraftCheckpointError, match="hidden size 64 but the target has 128"):
        load_draft(tmp_path, wider.model.config)
    other_vocab = tiny_target(vocab_size=50)
    with pytest.raises(DraftCheckpointError, match="vocabulary size 96 but the target has 50"):
        load_draft(tmp_path, other_vocab.model.config)


def test_corrupt_or_incomplete_checkpoints_are_refused(tmp_path):
    with pytest.raises(DraftCheckpointError, match="no config.json"):
        load_draft(tmp_path)
    write_public(tmp_path, public_state(True, False, False), {}, use_bin=True)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(DraftCheckpointError, match="unreadable"):
        load_draft(tmp_path)
    state = public_state(True, False, False)
    del state["layers.0.mlp.up_proj.weight"]
    write_public(tmp_path / "partial", state, {}, use_bin=False)
    with pytest.raises(DraftCheckpointError, match="missing"):
        load_draft(tmp_path / "partial")
