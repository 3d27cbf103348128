"""The EAGLE draft head and its public checkpoint format.

fc(cat(embedding, feature)) -> one Llama decoder layer without input norm; the
target's lm_head turns its output into draft logits. Parameter names match the
public EAGLE checkpoints (fc.*, layers.0.self_attn.*, layers.0.mlp.*,
layers.0.post_attention_layernorm.weight) so their heads load unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from eagle2_core.layers import MLP, RMSNorm, rotary_for, rotate_heads
from eagle2_core.model_config import ModelConfig, head_config

# config.json's key for a head's held-out top-1 agreement with its target (train-draft
# writes it; other tools ignore an unknown key)
HELD_OUT_TOP1 = "held_out_top1"


class DraftCheckpointError(ValueError):
    """A draft checkpoint is unreadable or does not fit the target."""


@dataclass
class DraftCache:
    """Keys and values of the draft layer, [B, kv_heads, T, head_dim] (training and the
    tests' reference drafter; decoding runs lean_head.py over a BatchKV)."""

    keys: torch.Tensor
    values: torch.Tensor


class DraftAttention(nn.Module):
    """Self-attention of a draft layer; q/k/v read in_features (2H for EAGLE-3)."""

    def __init__(self, config: ModelConfig, qkv_bias: bool, in_features: int | None = None):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        h, d = config.hidden_size, self.head_dim
        inputs = in_features or h
        self.q_proj = nn.Linear(inputs, self.n_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(inputs, self.n_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(inputs, self.n_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: DraftCache | None,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, DraftCache]:
        b, q_len, _ = x.shape
        q = self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, q_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate_heads(q, k, *rope)
        if cache is not None:
            k = torch.cat([cache.keys, k], dim=2)
            v = torch.cat([cache.values, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, q_len, -1)
        return self.o_proj(out), DraftCache(k, v)


class DraftLayer(nn.Module):
    """A Llama decoder layer whose input norm is the identity (as in EAGLE)."""

    def __init__(self, config: ModelConfig, qkv_bias: bool):
        super().__init__()
        self.self_attn = DraftAttention(config, qkv_bias)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, rope, cache, mask):
        attn, cache = self.self_attn(x, rope, cache, mask)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), cache


class DraftHead(nn.Module):
    """Predicts the target's next feature from (token embedding, current feature)."""

    def __init__(self, config: ModelConfig, fc_bias: bool = True, qkv_bias: bool = False):
        super().__init__()
        self.config = config = ModelConfig.of(config)
        self.fc_bias = fc_bias
        self.qkv_bias = qkv_bias
        self.held_out_top1: float | None = None  # recorded in config.json (HELD_OUT_TOP1)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([DraftLayer(config, qkv_bias)])
        self.rotary = rotary_for(config)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftCache | None,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, DraftCache]:
        """embeds, features [B, q, H]; positions [B, q]; mask [B, 1, q, cached + q] (float)."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        rope = self.rotary(x, positions)
        return self.layers[0](x, rope, cache, mask)


def draft_config_for(target_config, **overrides) -> ModelConfig:
    """A one-layer config matching the target's sizes (for new heads)."""
    target = ModelConfig.of(target_config)
    fields = dict(
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps,
        vocab_size=target.vocab_size,
        max_position_embeddings=target.max_position_embeddings,
        rope_parameters=dict(target.rope_parameters),
        hidden_act=target.hidden_act,
        num_hidden_layers=1,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def new_draft_head(target_config, seed: int = 0, fc_bias: bool = False) -> DraftHead:
    """A randomly initialised head for a target (the starting point of training)."""
    torch.manual_seed(seed)
    config = draft_config_for(target_config)
    head = DraftHead(
        config, fc_bias=fc_bias, qkv_bias=getattr(target_config, "attention_bias", False)
    )
    for module in head.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=config.initializer_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return head


def save_draft(
    head: DraftHead,
    directory: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    card: str | None = None,
) -> Path:
    """Write config.json + model.safetensors in the public EAGLE format."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = head.config.transformers().to_dict()
    config.update(bias=head.fc_bias, qkv_bias=head.qkv_bias, architectures=["LlamaForCausalLM"])
    record_top1(config, head)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = {
        k: v.detach().to(dtype).contiguous()
        for k, v in head.state_dict().items()
        if not k.startswith("rotary.")
    }
    save_file(state, str(directory / "model.safetensors"))
    if card is not None:
        (directory / "README.md").write_text(card)
    return directory


def record_top1(config: dict, head: nn.Module) -> None:
    """Into a head's config.json: its held-out top-1 agreement with the target, where
    known. The planner bounds what the head could bring by it (plan.accept_ceiling)."""
    if head.held_out_top1 is not None:
        config[HELD_OUT_TOP1] = round(float(head.held_out_top1), 4)


def read_state(directory: Path) -> dict[str, torch.Tensor]:
    """A head's tensors: model.safetensors first, else pytorch_model.bin (weights only)."""
    try:
        return _read_files(directory)
    except DraftCheckpointError:
        raise
    except Exception as exc:
        raise DraftCheckpointError(f"draft weights in {directory} are unreadable: {exc}") from exc


def read_config(directory: str | Path) -> dict:
    """A head's config.json as a dict."""
    config_path = Path(directory) / "config.json"
    if not config_path.exists():
        raise DraftCheckpointError(f"draft checkpoint {directory} has no config.json")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise DraftCheckpointError(f"{config_path} is not valid JSON: {exc}") from exc


def _read_files(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / "model.safetensors").exists():
        return load_file(str(directory / "model.safetensors"))
    if (directory / "pytorch_model.bin").exists():
        try:
            return torch.load(
                directory / "pytorch_model.bin", map_location="cpu", weights_only=True
            )
        except Exception as exc:  # pickle errors come in many types
            raise DraftCheckpointError(
                f"{directory}/pytorch_model.bin is unreadable: {exc}"
            ) from exc
    raise DraftCheckpointError(
        f"{directory} holds no model.safetensors or pytorch_model.bin draft weights"
    )


def load_draft(directory: str | Path, target_config=None) -> DraftHead:
    """Load a head in the public EAGLE format; check that it fits the target if given."""
    directory = Path(directory)
    raw = read_config(directory)
    fc_bias = raw.pop("bias", True)
    qkv_bias = raw.pop("qkv_bias", False)
    held_out_top1 = raw.pop(HELD_OUT_TOP1, None)
    for key in ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version"):
        raw.pop(key, None)
    config = head_config(raw)
    if target_config is not None:
        _check_fits(config, raw.get("vocab_size"), target_config, directory)
    state = read_state(directory)
    head = DraftHead(config, fc_bias=fc_bias, qkv_bias=qkv_bias)
    head.held_out_top1 = held_out_top1
    dtype = next(iter(state.values())).dtype if state else torch.float32
    return load_weights(head, state, directory, "EAGLE").to(dtype).eval()


def load_weights(head: nn.Module, state: dict, directory: Path, layout: str) -> nn.Module:
    """Put a checkpoint's tensors into head, or say which names do not fit the layout. The
    rotary tables are computed, and the token embedding is the target's own table."""
    state = {k: v for k, v in state.items() if k != "embed_tokens.weight"}
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise DraftCheckpointError(
            f"draft weights in {directory} do not match the {layout} layout: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return head


def _check_fits(
    config: ModelConfig, vocab_size: int | None, target_config, directory: Path
) -> None:
    if config.hidden_size != target_config.hidden_size:
        raise DraftCheckpointError(
            f"draft {directory} has hidden size {config.hidden_size} but the target has "
            f"{target_config.hidden_size}: it was trained for another model"
        )
    target_vocab = target_config.vocab_size
    if vocab_size is not None and vocab_size != target_vocab:
        raise DraftCheckpointError(
            f"draft {directory} has vocabulary size {vocab_size} but the target has "
            f"{target_vocab}: it was trained for another model"
        )
