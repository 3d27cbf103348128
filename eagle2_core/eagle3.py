"""EAGLE-3 draft heads: the module, the public checkpoint format, and drafting with it.

As the reference (SafeAILab/EAGLE) and SGLang's SpecForge publish them: the target's hidden
states entering three of its layers (low, middle, high: 2, L//2, L-3 unless the config
names them; a config names layer outputs, so id i is the input of layer i + 1) are
concatenated and projected by `fc` (3H -> H); one decoder layer (`midlayer`) attends over
[input_layernorm(token embedding), hidden_norm(hidden)] (2H inputs to q/k/v) with the
un-normed hidden as its residual; `norm` and the head's own `lm_head` over a draft
vocabulary (`d2t` / `t2d`, vocab.py) give the draft logits. The output before `norm` is
what the next draft step reads as its hidden. The token embedding is the target's: the
reference trains with it frozen, so a checkpoint's own copy is the same table.

Checkpoint: config.json with `architectures: ["LlamaForCausalLMEagle3"]` and
`draft_vocab_size`; tensors fc.weight, midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,
down}_proj, input_layernorm, hidden_norm, post_attention_layernorm}.weight, norm.weight,
lm_head.weight, d2t, t2d; model.safetensors, or pytorch_model.bin read with
weights_only=True.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from eagle2_core.draft import (
    HELD_OUT_TOP1,
    DraftAttention,
    DraftCache,
    DraftCheckpointError,
    draft_config_for,
    load_weights,
    read_state,
    record_top1,
)
from eagle2_core.kernels import Linear
from eagle2_core.kv import BatchKV
from eagle2_core.layers import MLP, RMSNorm, rotary_for
from eagle2_core.llama import HeadShape, mlp, rms_norm, rope, self_attention
from eagle2_core.model_config import ModelConfig, head_config
from eagle2_core.models import Target
from eagle2_core.vocab import DraftVocab

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Where config.json may name the target layers the features come from.
LAYER_KEYS = ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids")


def reference_layers(num_layers: int) -> tuple[int, int, int]:
    """The reference's low, middle and high layers: their inputs are the features (kept
    inside the model for toy models of fewer than five layers)."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


class Eagle3Layer(nn.Module):
    """The one decoder layer: attention over [norm(embedding), norm(hidden)]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, qkv_bias=False, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, embeds, hidden, rope_angles, cache, mask):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, cache = self.self_attn(x, rope_angles, cache, mask)
        h = hidden + attn
        return h + self.mlp(self.post_attention_layernorm(h)), cache


class Eagle3Head(nn.Module):
    """The trainable EAGLE-3 head; `lift` turns the target's three layers into its hidden."""

    def __init__(self, config: ModelConfig, draft_vocab: DraftVocab, layers: tuple[int, ...]):
        super().__init__()
        self.config = config = ModelConfig.of(config)
        self.layers_used = tuple(layers)
        self.held_out_top1: float | None = None  # recorded in config.json (HELD_OUT_TOP1)
        target_hidden = config.target_hidden_size or config.hidden_size
        self.fc = nn.Linear(len(layers) * target_hidden, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, len(draft_vocab), bias=False)
        self.register_buffer("d2t", draft_vocab.d2t())
        self.register_buffer("t2d", draft_vocab.t2d(config.vocab_size))
        self.rotary = rotary_for(config)

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab.from_mapping(self.d2t)

    def lift(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftCache | None,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, DraftCache]:
        """embeds, hidden [B, q, H] (hidden: lifted features or a previous step's output)."""
        return self.midlayer(embeds, hidden, self.rotary(hidden, positions), cache, mask)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary."""
        return self.lm_head(self.norm(out))


def new_eagle3_head(target, vocab: DraftVocab, seed: int = 0) -> Eagle3Head:
    """A head to train for a target: random layers on the reference's three feature layers;
    its lm_head and final norm start as the target's own (restricted to the draft
    vocabulary), so step 0 begins near the target's distribution."""
    torch.manual_seed(seed)
    target_config = target.config
    config = draft_config_for(target_config)
    head = Eagle3Head(config, vocab, reference_layers(target_config.num_hidden_layers))
    for module in head.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=config.initializer_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    with torch.no_grad():
        lm_head = target.lm_weight
        head.lm_head.weight.copy_(lm_head[vocab.ids.to(lm_head.device)])
        head.norm.weight.copy_(target.lean.norm)
    return head


def save_eagle3(
    head: Eagle3Head, directory: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the head in the public EAGLE-3 layout (what load_eagle3 and SGLang read)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = head.config.replace(target_hidden_size=None).transformers().to_dict()
    config.update(
        architectures=[ARCHITECTURE],
        draft_vocab_size=head.lm_head.out_features,
        # layer outputs, as configs name them: the input of layer i is the output of i - 1
        eagle_aux_hidden_state_layer_ids=[i - 1 for i in head.layers_used],
    )
    record_top1(config, head)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("rotary."):
            continue
        floating = tensor.is_floating_point()
        state[name] = (tensor.detach().to(dtype) if floating else tensor).contiguous()
    save_file(state, str(directory / "model.safetensors"))
    return directory


def is_eagle3(raw: dict) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or [])


def _layers(raw: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs are the features. A config names layer outputs (as
    SGLang reads it: the output of layer i is the input of layer i + 1)."""
    for where in (raw, raw.get("eagle_config") or {}):
        for key in LAYER_KEYS:
            if where.get(key):
                return tuple(int(i) + 1 for i in where[key])
    return reference_layers(num_layers)


def load_eagle3(directory: Path, raw: dict, target_config) -> Eagle3Head:
    """An EAGLE-3 checkpoint (raw: its config.json) checked against the target's config."""
    raw = dict(raw)
    layers = _layers(raw, target_config.num_hidden_layers)
    draft_vocab_size = raw.pop("draft_vocab_size", None)
    held_out_top1 = raw.pop(HELD_OUT_TOP1, None)
    raw.pop("eagle_config", None)
    for key in (
        "architectures",
        "model_type",
        "torch_dtype",
        "dtype",
        "transformers_version",
        *LAYER_KEYS,
    ):
        raw.pop(key, None)
    config = head_config(raw)
    if config.vocab_size != target_config.vocab_size:
        raise DraftCheckpointError(
            f"EAGLE-3 head {directory} has vocabulary size {config.vocab_size} but the target "
            f"has {target_config.vocab_size}: it was trained for another model"
        )
    if max(layers) >= target_config.num_hidden_layers:
        raise DraftCheckpointError(
            f"EAGLE-3 head {directory} reads the output of target layer {max(layers) - 1} but "
            f"the target has {target_config.num_hidden_layers} layers (features come from "
            f"layers 0..{target_config.num_hidden_layers - 2})"
        )
    state = read_state(directory)
    for name in ("d2t", "t2d", "lm_head.weight", "fc.weight"):
        if name not in state:
            raise DraftCheckpointError(f"EAGLE-3 head {directory} has no {name}")
    vocab = DraftVocab.from_mapping(state["d2t"], state["t2d"])
    if draft_vocab_size is not None and draft_vocab_size != len(vocab):
        raise DraftCheckpointError(
            f"EAGLE-3 head {directory}: draft_vocab_size {draft_vocab_size} but d2t holds "
            f"{len(vocab)} tokens"
        )
    target_hidden = state["fc.weight"].shape[1] // len(layers)
    if target_hidden != target_config.hidden_size:
        raise DraftCheckpointError(
            f"EAGLE-3 head {directory} reads {len(layers)} x {target_hidden} features but the "
            f"target's hidden size is {target_config.hidden_size}"
        )
    head = Eagle3Head(config.replace(target_hidden_size=target_hidden), vocab, layers)
    head.held_out_top1 = held_out_top1
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    dtype = state["fc.weight"].dtype
    return load_weights(head, state, directory, "EAGLE-3").to(dtype).eval()


@dataclass
class LeanEagle3:
    """An EAGLE-3 head at inference: prepared weights, the interface of LeanHead."""

    fc: Linear
    input_norm: torch.Tensor
    hidden_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    norm: torch.Tensor
    lm_head: Linear
    rotary: nn.Module
    eps: float
    shape: HeadShape
    embed: torch.Tensor
    token_ids: torch.Tensor  # [N] target id of each draft-vocabulary row
    feature_layers: tuple[int, ...]

    @classmethod
    def of(cls, head: Eagle3Head, target: Target) -> LeanEagle3:
        layer, attn = head.midlayer, head.midlayer.self_attn
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        return cls(
            fc=Linear.of(head.fc),
            input_norm=layer.input_layernorm.weight.detach(),
            hidden_norm=layer.hidden_norm.weight.detach(),
            qkv=Linear.stack([p.weight for p in projections], [p.bias for p in projections]),
            o=Linear.of(attn.o_proj),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=Linear.stack(
                [layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight],
                [layer.mlp.gate_proj.bias, layer.mlp.up_proj.bias],
            ),
            down=Linear.of(layer.mlp.down_proj),
            norm=head.norm.weight.detach(),
            lm_head=Linear.of(head.lm_head),
            rotary=head.rotary,
            eps=head.config.rms_norm_eps,
            shape=HeadShape(attn.n_heads, attn.n_kv_heads, attn.head_dim),
            embed=target.lean.embed,
            token_ids=head.vocab.ids.to(target.device),
            feature_layers=head.layers_used,
        )

    @property
    def vocab_size(self) -> int:
        return self.token_ids.shape[0]

    def kv(self) -> BatchKV:
        return BatchKV(1, self.shape.kv_heads, self.shape.dim, self.embed.dtype, self.embed.device)

    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """The target's three layers [.., 3H] -> the head's hidden [.., H]."""
        return self.fc(features.to(self.embed.dtype))

    def step(self, tokens, hidden, positions, keys, values, start, mask) -> torch.Tensor:
        """As LeanHead.step, hidden being lifted features or a previous step's output."""
        embeds = torch.nn.functional.embedding(tokens, self.embed)
        hidden = hidden.to(embeds.dtype)
        x = torch.cat(
            [
                rms_norm(embeds, self.input_norm, self.eps),
                rms_norm(hidden, self.hidden_norm, self.eps),
            ],
            dim=-1,
        )
        angles = rope(self.rotary, hidden, positions)
        h = hidden + self_attention(
            x, self.qkv, self.o, self.shape, angles, keys[0], values[0], start, mask
        )
        return h + mlp(rms_norm(h, self.post_norm, self.eps), self.gate_up, self.down)

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.lm_head(rms_norm(out, self.norm, self.eps)).float(), dim=-1)
