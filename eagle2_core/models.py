"""Load a target model and tokenizer; run one forward over tokens on a KV cache.

A target is any Hugging Face Llama-family causal LM (Llama, Mistral, Qwen2), named by
a built-in alias, a local directory, a GGUF file or a Hub id. Nothing is downloaded
unless the caller allows it. Decoding runs the lean forward of llama.py over weights
prepared once at load; the transformers model stays for `generate` (the oracle and the
benchmarks' baseline) and for training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from eagle2_core import cpu_kernels
from eagle2_core.kernels import Linear
from eagle2_core.kv import RaggedKV
from eagle2_core.llama import LeanLlama, forward
from eagle2_core.registry import DEFAULT_MODEL, END_OF_TURN_TOKENS, ModelLoadError, resolve_model
from eagle2_core.tokenizer import load_tokenizer


@dataclass
class Target:
    """A loaded target model with what decoding needs to know about it."""

    model: PreTrainedModel
    tokenizer: object
    name: str
    stop_ids: frozenset[int]
    max_context: int
    lean: LeanLlama = field(init=False, repr=False)
    head: Linear = field(init=False, repr=False)  # the lm_head, prepared

    def __post_init__(self) -> None:
        self.lean = LeanLlama.of(self.model)
        self.head = Linear.of(self.model.get_output_embeddings())

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.lean.embed)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def kv(self) -> RaggedKV:
        """An empty KV cache for this model's layers (each row's entries from its slot 0)."""
        lean = self.lean
        shape = lean.shape
        return RaggedKV(len(lean.layers), shape.kv_heads, shape.dim, self.dtype, self.device)


def stop_token_ids(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    """EOS ids from the generation config and tokenizer, plus end-of-turn tokens in the vocab."""
    ids: set[int] = set()
    eos = model.generation_config.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return frozenset(ids)


def load_target(
    name: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    allow_download: bool = False,
    trust_remote_code: bool = False,
) -> Target:
    """Load a target by alias, directory, GGUF file or Hub id (Hub only with allow_download)."""
    source = resolve_model(name)
    try:
        tokenizer = load_tokenizer(
            source, allow_download=allow_download, trust_remote_code=trust_remote_code
        )
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            local_files_only=not allow_download,
            trust_remote_code=trust_remote_code,
        )
    except OSError as exc:
        hint = "" if allow_download else " (downloads are off: pass --allow-download to fetch it)"
        raise ModelLoadError(f"cannot load model {name!r}: {exc}{hint}") from exc
    model.to(device).eval()
    if torch.device(device).type == "cpu":
        cpu_kernels.kernel()  # compiled (once per machine) before anything is timed
    return target_from_model(model, tokenizer, name)


def target_from_model(model: PreTrainedModel, tokenizer, name: str) -> Target:
    """Wrap an already loaded model (tests build tiny random ones in code)."""
    return Target(
        model=model.eval(),
        tokenizer=tokenizer,
        name=name,
        stop_ids=stop_token_ids(model, tokenizer),
        max_context=model.config.max_position_embeddings,
    )


def final_hidden_states(target: Target, ids: torch.Tensor) -> torch.Tensor:
    """The final-norm hidden states [B, T, H] of whole sequences [B, T] under causal
    attention (training reads these as the head's features)."""
    return layer_hidden_states(target, ids, ())[0]


def layer_hidden_states(
    target: Target, ids: torch.Tensor, layers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As final_hidden_states, plus the states entering the given layers, concatenated
    [B, T, len(layers) * H] (None for no layers): an EAGLE-3 head's features.

    Through the lean forward over a scratch cache (right padding needs no mask: a real
    token never sees a later pad); on 2 CPU cores ~6% faster than transformers' forward
    for the 4k-token batches feature extraction runs.
    """
    lean = target.lean
    b, t = ids.shape
    shape = (len(lean.layers), b, lean.shape.kv_heads, t, lean.shape.dim)
    keys = torch.empty(shape, dtype=target.dtype, device=ids.device)
    values = torch.empty_like(keys)
    positions = torch.arange(t, device=ids.device).expand(b, -1)
    return forward(lean, ids, positions, keys, values, 0, None, layers)
