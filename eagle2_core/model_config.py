"""A Llama model's config as decoding and the draft heads read it.

config.json's fields with `LlamaConfig`'s defaults, read without transformers: importing
its `configuration_llama` pulls in its activations, hub kernels and torch.distributed
(~0.7 s of every command's start on the 2-core VMs, for a dict of numbers). Where our
reading could differ from transformers' (another model type, whose class has other
defaults; a legacy `rope_scaling`, which transformers rewrites), transformers reads it.
`transformers()` gives its config object where one is needed (RoPE scalings, saving).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# config.json keys that describe the file, not the model (a head's checkpoint has them).
DESCRIPTIVE = ("architectures", "torch_dtype", "dtype", "transformers_version")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as query heads
    head_dim: int | None = None  # None: hidden_size / heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default"})
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    use_sliding_window: bool = True
    eos_token_id: int | list[int] | None = 2
    target_hidden_size: int | None = None  # an EAGLE-3 head's: the target's hidden size
    extra: dict = field(default_factory=dict)  # every other key, kept for to_dict

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        rope = {"rope_theta": 10000.0, **self.rope_parameters}
        object.__setattr__(self, "rope_parameters", rope)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """A Llama config.json's dict, read as LlamaConfig reads it (see `readable`)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "rope_parameters"}
        known = {k: v for k, v in raw.items() if k in names}
        rope = raw.get("rope_parameters") or {
            "rope_type": "default",
            "rope_theta": raw.get("rope_theta", 10000.0),
        }
        dropped = names | set(DESCRIPTIVE) | {"rope_parameters", "rope_theta"}
        extra = {k: v for k, v in raw.items() if k not in dropped}
        return cls(**known, rope_parameters=dict(rope), extra=extra)

    @classmethod
    def of(cls, config: Any) -> ModelConfig:
        """From transformers' config object (or one of ours, as it is)."""
        if isinstance(config, ModelConfig):
            return config
        raw = config.to_dict()
        if getattr(config, "target_hidden_size", None):
            raw["target_hidden_size"] = config.target_hidden_size
        return cls.from_dict(raw)

    @staticmethod
    def readable(raw: dict[str, Any]) -> bool:
        """Whether from_dict reads this dict as transformers would: a Llama config
        without a legacy rope_scaling or code of its own."""
        return (
            raw.get("model_type", "llama") == "llama"
            and not raw.get("rope_scaling")
            and "auto_map" not in raw
        )

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields and every other key it was read with."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        extra = values.pop("extra")
        if values["target_hidden_size"] is None:
            del values["target_hidden_size"]
        return {**extra, **values}

    def transformers(self) -> Any:
        """transformers' LlamaConfig of the same values."""
        from transformers import LlamaConfig

        values = self.to_dict()
        values.pop("model_type")
        target_hidden = values.pop("target_hidden_size", None)
        config = LlamaConfig(**values)
        if target_hidden is not None:
            config.target_hidden_size = target_hidden
        return config


def read_model_config(raw: dict[str, Any], read_by_transformers) -> ModelConfig:
    """ModelConfig of a config.json dict: ours where `readable`, else through
    `read_by_transformers()` (which returns transformers' config object)."""
    if ModelConfig.readable(raw):
        return ModelConfig.from_dict(raw)
    return ModelConfig.of(read_by_transformers())


def head_config(raw: dict[str, Any]) -> ModelConfig:
    """A draft head's config.json dict, its file keys removed (its layer is a Llama one)."""

    def through_transformers() -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(**raw)

    return read_model_config(raw, through_transformers)


def load_model_config(directory: Path | str, trust_remote_code: bool = False) -> ModelConfig:
    """The config of a model directory (config.json)."""

    def through_transformers() -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(
            directory, local_files_only=True, trust_remote_code=trust_remote_code
        )

    path = Path(directory) / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {"model_type": "unknown"}
    return read_model_config(raw, through_transformers)
