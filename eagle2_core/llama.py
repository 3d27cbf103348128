"""A lean forward for Llama-family targets: one function over prepared weights.

transformers' `LlamaModel` runs ~25 small ops per layer through module hooks, mask
builders and a cache object that concatenates on every step; on the 2-core dev CPU that
left a 1-token forward of SmolLM2-135M at 46 ms for ~14 ms of weight traffic. This
forward reads the same weights (q|k|v and gate|up stacked into one product each, see
`kernels.Linear`), straight from a checkpoint's tensors (no transformers model is built to
decode), writes keys and values in place into a `BatchKV`, and computes RoPE as
transformers does (layers.py: every rope scaling transformers knows works). The same
arithmetic per output element; on a CPU the decoding attention and the norms run in
cpu_kernels, which add up in their own order, and greedy output stays identical to
`generate` (tests/eagle2_core/test_engine.py and test_smollm2.py check it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle2_core import cpu_kernels
from eagle2_core.kernels import Linear
from eagle2_core.kv import PrefixReads, RowStarts
from eagle2_core.layers import rotary_for, rotate

SUPPORTED = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The target's architecture is not one the lean forward implements."""


@dataclass(frozen=True)
class HeadShape:
    """Attention heads: query heads, key/value heads (fewer under GQA), head size."""

    heads: int
    kv_heads: int
    dim: int


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass
class LeanLlama:
    """The weights and sizes one forward needs."""

    embed: torch.Tensor  # [V, H]
    layers: list[Layer]
    norm: torch.Tensor
    rotary: torch.nn.Module  # (x, positions) -> cos, sin
    eps: float
    shape: HeadShape

    @classmethod
    def of(cls, model: torch.nn.Module) -> LeanLlama:
        """From a transformers model (tests build tiny random ones in code)."""
        return cls.from_state(model.state_dict(), model.config)

    @classmethod
    def from_state(
        cls,
        state: dict[str, torch.Tensor],
        config,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> LeanLlama:
        """From a checkpoint's tensors, named as transformers' Llama names them
        (model.layers.N.self_attn.q_proj.weight, ...), and the model's config; each cast
        to `dtype` and moved to `device` as it is prepared (None: as they are)."""
        check_supported(config)

        def raw(name: str) -> torch.Tensor:
            return state[f"model.{name}.weight"].detach()

        def weight(name: str) -> torch.Tensor:
            return raw(name).to(device=device, dtype=dtype)

        def bias(name: str) -> torch.Tensor | None:
            value = state.get(f"model.{name}.bias")
            return value.to(device=device, dtype=dtype) if value is not None else None

        def stacked(prefix: str, names: tuple[str, ...]) -> Linear:
            return Linear.stack(
                [raw(f"{prefix}.{n}") for n in names],
                [bias(f"{prefix}.{n}") for n in names],
                dtype,
                device,
            )

        def linear(name: str) -> Linear:
            return Linear(weight(name), bias(name))

        layers = [
            Layer(
                input_norm=weight(f"layers.{i}.input_layernorm"),
                qkv=stacked(f"layers.{i}.self_attn", ("q_proj", "k_proj", "v_proj")),
                o=linear(f"layers.{i}.self_attn.o_proj"),
                post_norm=weight(f"layers.{i}.post_attention_layernorm"),
                gate_up=stacked(f"layers.{i}.mlp", ("gate_proj", "up_proj")),
                down=linear(f"layers.{i}.mlp.down_proj"),
            )
            for i in range(config.num_hidden_layers)
        ]
        heads = config.num_attention_heads
        return cls(
            embed=weight("embed_tokens"),
            layers=layers,
            norm=weight("norm"),
            rotary=rotary_for(config),
            eps=config.rms_norm_eps,
            shape=HeadShape(
                heads,
                config.num_key_value_heads or heads,
                getattr(config, "head_dim", None) or config.hidden_size // heads,
            ),
        )


def check_supported(config) -> None:
    """Refuse a config the lean forward would compute wrongly."""
    if config.model_type not in SUPPORTED or config.hidden_act != "silu":
        raise UnsupportedModelError(
            f"model type {config.model_type!r} (activation {config.hidden_act!r}) is not "
            f"supported: the engine runs {', '.join(SUPPORTED)} models"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        if config.sliding_window < config.max_position_embeddings:
            raise UnsupportedModelError(
                f"sliding-window attention ({config.sliding_window} tokens) is not supported"
            )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream x plus a block's output, and the next block's input: its
    RMSNorm (on a CPU one pass over the rows instead of seven small ops)."""
    if cpu_kernels.norms(x):
        return cpu_kernels.add_rms_norm(x, delta, weight, eps)
    if delta is not None:
        x = x + delta
    return x, rms_norm(x, weight, eps)


@dataclass(frozen=True)
class Writes:
    """Where a forward writes its new keys and values: slots start.. of every row (an int),
    or each row's own slots (RaggedKV: slots [B, T], with rows [B, 1] to index them), and
    how many slots attention then reads."""

    start: int
    slots: torch.Tensor | None
    span: int
    chunks: tuple[tuple[int, int, int], ...] = ()  # (first row, end row, span): RowStarts
    rows: torch.Tensor | None = None

    def slots_of(self, b: int, t: int, device: torch.device) -> torch.Tensor:
        """Each row's new slots [B, T] on `device` (the cache's)."""
        if self.slots is not None:
            return self.slots
        return (self.start + torch.arange(t, device=device)).expand(b, t)

    def causal(self, slots: torch.Tensor) -> torch.Tensor:
        """The mask of mask=None: each new token sees its row's slots up to its own."""
        seen = torch.arange(self.span, device=slots.device)[None, None] <= slots[:, :, None]
        return seen[:, None]

    @classmethod
    def of(cls, start: int | RowStarts, b: int, t: int, device) -> Writes:
        if isinstance(start, int):
            return cls(start, None, start + t)
        slots = start.starts.to(device)[:, None] + torch.arange(t, device=device)[None]
        rows = torch.arange(b, device=device)[:, None]
        return cls(0, slots, start.span, start.chunks, rows)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    writes: Writes,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Write k, v [B, T, kv_heads, D] into the layer's cache [B, kv_heads, S, D] where
    `writes` says and attend q [B, T, heads, D] over its first span slots; returns
    [B, T, heads * D]. mask [B, 1, T, span] bool (True = visible); None = causal (each new
    token sees its row's slots up to its own). With chunks, each chunk of rows reads only up
    to its own span: rows of different lengths do not all pay for the longest (attention
    reads every slot it is given, masked or not, and at a batch's size that read is most
    of its time)."""
    b, t, heads, dim = q.shape
    if writes.slots is None:
        keys[:, :, writes.start : writes.span] = k.transpose(1, 2)
        values[:, :, writes.start : writes.span] = v.transpose(1, 2)
    else:  # an indexed put: scatter_ into a bf16 cache copied all of it on the CPU
        keys.transpose(1, 2)[writes.rows, writes.slots] = k
        values.transpose(1, 2)[writes.rows, writes.slots] = v
    span = writes.span
    if mask is None and span > t:  # causal after entries already cached: is_causal is not
        mask = writes.causal(writes.slots_of(b, t, q.device))
    q = q.transpose(1, 2)
    if mask is None:
        out = F.scaled_dot_product_attention(
            q, keys[:, :, :span], values[:, :, :span], is_causal=True, enable_gqa=True
        )
    elif not writes.chunks:
        out = _sdpa(q, keys[:, :, :span], values[:, :, :span], mask)
    else:
        out = torch.empty_like(q)
        for a, z, rows_span in writes.chunks:
            out[a:z] = _sdpa(
                q[a:z],
                keys[a:z, :, :rows_span],
                values[a:z, :, :rows_span],
                mask[a:z, :, :, :rows_span],
            )
    return out.transpose(1, 2).reshape(b, t, heads * dim)


def _sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """torch's kernel: in fp32 the arithmetic transformers' `generate` does."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def rope(rotary: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor):
    """cos, sin [B, T, 1, D] for positions [B, T], broadcast over heads."""
    cos, sin = rotary(x, positions)
    return cos[:, :, None], sin[:, :, None]


def self_attention(
    x: torch.Tensor,
    qkv: Linear,
    o: Linear,
    shape: HeadShape,
    angles: tuple[torch.Tensor, torch.Tensor],
    keys: torch.Tensor,
    values: torch.Tensor,
    writes: Writes | int,
    mask: torch.Tensor | None,
    prefix: cpu_kernels.Prefix | None = None,
) -> torch.Tensor:
    """The attention block of x [B, T, H] (already normalised): one q|k|v product, RoPE on
    q and k together, the cache write (see `attend`; an int writes slots start..start+T
    of every row), the output projection. `prefix`: where the CPU kernel may read the
    rows' shared prefix (cpu_kernels.decode_attention)."""
    b, t, _ = x.shape
    if isinstance(writes, int):
        writes = Writes(writes, None, writes + t)
    heads, kv_heads, dim = shape.heads, shape.kv_heads, shape.dim
    mixed = qkv(x)
    if cpu_kernels.attends(x, t, dim):  # on a CPU: one pass
        slots = writes.slots_of(b, t, x.device)
        mask = mask if mask is not None else writes.causal(slots)
        return o(cpu_kernels.rope_attend(mixed, angles, keys, values, slots, mask, heads, prefix))
    qk = rotate(mixed[..., : (heads + kv_heads) * dim].view(b, t, heads + kv_heads, dim), *angles)
    v = mixed[..., (heads + kv_heads) * dim :].view(b, t, kv_heads, dim)
    return o(attend(qk[:, :, :heads], qk[:, :, heads:], v, keys, values, writes, mask))


def mlp(x: torch.Tensor, gate_up: Linear, down: Linear) -> torch.Tensor:
    return down(cpu_kernels.silu_mul(gate_up(x)))


def forward(
    model: LeanLlama,
    ids: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int | RowStarts,
    mask: torch.Tensor | None = None,
    layers: tuple[int, ...] = (),
    prefix: PrefixReads | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids, positions [B, T] -> (final-norm hidden states [B, T, H], the hidden states
    entering the given layers concatenated [B, T, len(layers) * H], or None for no layers:
    an EAGLE-3 head's features).

    keys, values [layers, B, kv_heads, S, D] (`BatchKV.layer_views`): the new entries go to
    slots start..start+T, or for a RaggedKV's RowStarts after each row's own entries.
    mask: see `attend`; None = causal (each new token sees its row's slots up to its own).
    prefix: a prompt prefix the rows copied (RaggedKV.prefix_reads), read shared.
    """
    x = F.embedding(ids, model.embed)
    angles = rope(model.rotary, x, positions)
    writes = Writes.of(start, ids.shape[0], ids.shape[1], ids.device)
    captured = {}
    tokens = ids.shape[1]
    if mask is None and (writes.span > tokens or cpu_kernels.attends(x, tokens, model.shape.dim)):
        # once for all layers, not per layer
        mask = writes.causal(writes.slots_of(*ids.shape, ids.device))
    norms = [layer.input_norm for layer in model.layers[1:]] + [model.norm]
    x, h = add_rms_norm(x, None, model.layers[0].input_norm, model.eps)
    for index, (layer, following) in enumerate(zip(model.layers, norms, strict=True)):
        if index in layers:
            captured[index] = x
        shared = (prefix.keys[index], prefix.values[index], prefix.lens) if prefix else None
        attended = self_attention(
            h, layer.qkv, layer.o, model.shape, angles, keys[index], values[index], writes, mask,
            shared,
        )  # fmt: skip
        x, h = add_rms_norm(x, attended, layer.post_norm, model.eps)
        x, h = add_rms_norm(x, mlp(h, layer.gate_up, layer.down), following, model.eps)
    features = torch.cat([captured[i] for i in layers], dim=-1) if layers else None
    return h, features
