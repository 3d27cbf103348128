"""config.json read without transformers: the values LlamaConfig gives, or transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, LlamaConfig

from eagle2_core.model_config import ModelConfig, head_config, load_model_config

FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "eos_token_id",
)

RAWS = [
    {},  # every default
    {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "rope_theta": 1e5},
    {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32, "tie_word_embeddings": True},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "eos_token_id": [1, 2]},
    {"mlp_bias": True, "attention_bias": True, "rms_norm_eps": 1e-5, "vocab_size": 49152},
]


@pytest.mark.parametrize("raw", RAWS)
def test_values_are_llama_configs(raw: dict) -> None:
    ours, theirs = ModelConfig.from_dict({"model_type": "llama", **raw}), LlamaConfig(**raw)
    for name in FIELDS:
        assert getattr(ours, name) == getattr(theirs, name), name
    back = ours.transformers()
    for name in FIELDS:
        assert getattr(back, name) == getattr(theirs, name), name


@pytest.mark.parametrize(
    "raw",
    [
        {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4},
        {"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}},
    ],
)
def test_other_types_and_legacy_scalings_are_read_by_transformers(
    tmp_path: Path, raw: dict
) -> None:
    assert not ModelConfig.readable(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours, theirs = load_model_config(tmp_path), AutoConfig.from_pretrained(tmp_path)
    assert ours.model_type == raw["model_type"]
    for name in ("hidden_size", "rope_parameters", "max_position_embeddings"):
        assert getattr(ours, name) == getattr(theirs, name), name
    if raw["model_type"] == "mistral":  # MistralConfig's own default, not LlamaConfig's
        assert ours.sliding_window == theirs.sliding_window == 4096


def test_a_head_config_keeps_its_other_keys_and_a_legacy_rope() -> None:
    raw = {"hidden_size": 64, "num_attention_heads": 4, "draft_note": "kept"}
    config = head_config(raw)
    assert config.extra == {"draft_note": "kept"}
    assert config.to_dict()["draft_note"] == "kept"
    legacy = head_config({**raw, "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    assert legacy.rope_parameters["rope_type"] == "linear"
    assert legacy.rope_parameters["factor"] == 4.0


def test_replace_keeps_the_rest() -> None:
    config = ModelConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4})
    changed = config.replace(target_hidden_size=128)
    assert changed.target_hidden_size == 128 and changed.head_dim == 16
    assert changed.transformers().target_hidden_size == 128
    assert "target_hidden_size" not in config.to_dict()
