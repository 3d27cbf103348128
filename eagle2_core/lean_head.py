"""The draft head at inference: prepared weights, the draft vocabulary, one step function.

`DraftHead` (draft.py) is the trainable module and the checkpoint format; drafting runs
this instead. Its products go through `kernels.Linear` (a draft step multiplies 1-10 rows
per sequence, the case those kernels are for), and its lm_head covers only the draft
vocabulary (vocab.py): the target's lm_head rows of those tokens for an EAGLE-1/2 head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle2_core.draft import DraftHead
from eagle2_core.kernels import Linear
from eagle2_core.kv import BatchKV
from eagle2_core.llama import HeadShape, mlp, rms_norm, rope, self_attention
from eagle2_core.models import Target
from eagle2_core.vocab import DraftVocab


@dataclass
class LeanHead:
    """What a draft step needs: the head's layer, the target's embedding table and the
    lm_head over the draft vocabulary (token_ids maps its rows to target ids)."""

    fc: Linear
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    rotary: torch.nn.Module
    eps: float
    shape: HeadShape
    embed: torch.Tensor
    lm_head: Linear
    token_ids: torch.Tensor  # [N] target id of each draft-vocabulary row

    @classmethod
    def of(cls, head: DraftHead, target: Target, vocab: DraftVocab | None) -> LeanHead:
        layer = head.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        device = target.device
        if vocab is None:
            lm_head = target.head
            token_ids = torch.arange(target.vocab_size, device=device)
        else:
            weight = target.lm_weight
            token_ids = vocab.ids.to(device)
            lm_head = Linear(weight[token_ids])
        return cls(
            fc=Linear.of(head.fc),
            qkv=Linear.stack([p.weight for p in projections], [p.bias for p in projections]),
            o=Linear.of(attn.o_proj),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=Linear.stack(
                [mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias]
            ),
            down=Linear.of(mlp.down_proj),
            rotary=head.rotary,
            eps=head.config.rms_norm_eps,
            shape=HeadShape(attn.n_heads, attn.n_kv_heads, attn.head_dim),
            embed=target.lean.embed,
            lm_head=lm_head,
            token_ids=token_ids,
        )

    feature_layers = ()  # the head reads the target's final-norm states (no inner layers)

    @property
    def vocab_size(self) -> int:
        return self.token_ids.shape[0]

    def lift(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as the head's step reads them (as they are, for EAGLE-1/2;
        an EAGLE-3 head projects three layers)."""
        return features

    def kv(self) -> BatchKV:
        """An empty cache for the head's one layer."""
        return BatchKV(1, self.shape.kv_heads, self.shape.dim, self.embed.dtype, self.embed.device)

    def step(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """tokens (target ids) [B, T], features [B, T, H], positions [B, T] -> the head's
        output states [B, T, H]; keys/values [1, B, kv_heads, S, D] get the new entries at
        slots start.. (see llama.attend for the mask)."""
        embeds = torch.nn.functional.embedding(tokens, self.embed)
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        angles = rope(self.rotary, x, positions)
        # EAGLE's draft layer has no input norm
        h = x + self_attention(
            x, self.qkv, self.o, self.shape, angles, keys[0], values[0], start, mask
        )
        return h + mlp(rms_norm(h, self.post_norm, self.eps), self.gate_up, self.down)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities over the draft vocabulary [..., N] (fp32)."""
        return torch.log_softmax(self.lm_head(hidden).float(), dim=-1)
