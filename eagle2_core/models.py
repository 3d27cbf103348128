"""Load a target model and tokenizer; run one forward over tokens on a KV cache.

A target is any Hugging Face Llama-family causal LM (Llama, Mistral, Qwen2), named by
a built-in alias, a local directory, a GGUF file or a Hub id. Nothing is downloaded
unless the caller allows it. Decoding runs the lean forward of llama.py over weights
read straight from the checkpoint's safetensors: building transformers' model
(`from_pretrained`, and importing its modeling code) took ~2.5 s of every command's
start on the 2-core VMs. The transformers model is loaded only where it is asked for:
`generate` (the oracle and the benchmarks' baseline) and training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from eagle2_core import cpu_kernels
from eagle2_core.greedy_head import ScreenedHead
from eagle2_core.kernels import Linear
from eagle2_core.kv import RaggedKV
from eagle2_core.llama import LeanLlama, forward
from eagle2_core.model_config import ModelConfig, load_model_config
from eagle2_core.registry import DEFAULT_MODEL, END_OF_TURN_TOKENS, ModelLoadError, resolve_model
from eagle2_core.tokenizer import load_tokenizer

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass
class Target:
    """A loaded target model with what decoding needs to know about it."""

    tokenizer: object
    name: str
    config: ModelConfig
    lean: LeanLlama
    lm_weight: torch.Tensor  # [V, H], the lm_head as stored (training scores through it)
    stop_ids: frozenset[int]
    max_context: int
    source: Path | str | None = None  # where `model` loads from when first asked for
    _model: torch.nn.Module | None = field(default=None, repr=False)
    head: Linear = field(init=False, repr=False)  # the lm_head, prepared

    def __post_init__(self) -> None:
        self.head = Linear(self.lm_weight)

    @cached_property
    def screened(self) -> ScreenedHead | None:
        """fp32 greedy tokens via bf16 (greedy_head.py), prepared at the first greedy
        round: its bf16 copy took ~40 ms that training and other loads never use."""
        return ScreenedHead.of(self.lm_weight)

    @property
    def model(self) -> torch.nn.Module:
        """transformers' model of the same weights (loaded on first use: decoding never
        needs it)."""
        if self._model is None:
            from transformers import AutoModelForCausalLM

            self._model = (
                AutoModelForCausalLM.from_pretrained(
                    self.source, dtype=self.dtype, local_files_only=True
                )
                .to(self.device)
                .eval()
            )
        return self._model

    @property
    def device(self) -> torch.device:
        return self.lm_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_weight.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.lean.embed)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of lm_head(hidden) per position, without every logit where it can
        (an fp32 head on a CPU with fast bf16 products: greedy_head.py)."""
        if self.screened is not None:
            return self.screened.tokens(hidden)
        return cpu_kernels.greedy_tokens(self.lm_head(hidden))

    def kv(self) -> RaggedKV:
        """An empty KV cache for this model's layers (each row's entries from its slot 0)."""
        lean = self.lean
        shape = lean.shape
        return RaggedKV(len(lean.layers), shape.kv_heads, shape.dim, self.dtype, self.device)


def stop_token_ids(eos: int | list[int] | None, tokenizer) -> frozenset[int]:
    """EOS ids from the generation config (eos) and tokenizer, plus end-of-turn tokens in
    the vocab."""
    ids: set[int] = set()
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for token in END_OF_TURN_TOKENS:  # looked up one by one: the whole vocab took 25 ms
        found = tokenizer.convert_tokens_to_ids(token)
        if found is not None and tokenizer.convert_ids_to_tokens(found) == token:  # not unk
            ids.add(found)
    return frozenset(ids)


def read_weights(directory: Path) -> dict[str, torch.Tensor] | None:
    """A model directory's tensors from its safetensors (one file or an index of shards);
    None where it has none (pytorch_model.bin: transformers loads those)."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        return None
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(directory / shard)))
    return state


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
        state = read_weights(source) if isinstance(source, Path) else None
        if state is None:  # a Hub id or .bin weights: through transformers
            return _from_pretrained(
                source, tokenizer, name, dtype, device, allow_download, trust_remote_code
            )
        config = load_model_config(source, trust_remote_code)
    except OSError as exc:
        hint = "" if allow_download else " (downloads are off: pass --allow-download to fetch it)"
        raise ModelLoadError(f"cannot load model {name!r}: {exc}{hint}") from exc
    # each weight cast and moved as it is prepared (the stacked ones while they are stacked)
    state = _tied(state, config)
    lean = LeanLlama.from_state(state, config, dtype, device)
    tied = state[LM_HEAD] is state[EMBED]
    _compile_kernels(device)
    generation = source / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    if eos is None:
        eos = config.eos_token_id
    return Target(
        tokenizer=tokenizer,
        name=name,
        config=config,
        lean=lean,
        lm_weight=lean.embed if tied else state[LM_HEAD].to(device=device, dtype=dtype),
        stop_ids=stop_token_ids(eos, tokenizer),
        max_context=config.max_position_embeddings,
        source=source,
    )


def _tied(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A tied checkpoint stores the embedding and the lm_head once, under either name."""
    if getattr(config, "tie_word_embeddings", False):
        table = state.get(EMBED, state.get(LM_HEAD))
        state = {**state, EMBED: table, LM_HEAD: table}
    for needed in (EMBED, LM_HEAD):
        if state.get(needed) is None:
            raise ModelLoadError(f"the checkpoint has no {needed}")
    return state


def _compile_kernels(device: str) -> None:
    if torch.device(device).type == "cpu":
        cpu_kernels.kernel()  # compiled (once per machine) before anything is timed


def _from_pretrained(
    source, tokenizer, name, dtype, device, allow_download, trust_remote_code
) -> Target:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        source,
        dtype=dtype,
        local_files_only=not allow_download,
        trust_remote_code=trust_remote_code,
    )
    model.to(device).eval()
    _compile_kernels(device)
    return target_from_model(model, tokenizer, name)


def target_from_model(model: torch.nn.Module, tokenizer, name: str) -> Target:
    """Wrap an already loaded transformers model (tests build tiny random ones in code)."""
    model.eval()
    return Target(
        tokenizer=tokenizer,
        name=name,
        config=ModelConfig.of(model.config),
        lean=LeanLlama.of(model),
        lm_weight=model.get_output_embeddings().weight.detach(),
        stop_ids=stop_token_ids(model.generation_config.eos_token_id, tokenizer),
        max_context=model.config.max_position_embeddings,
        _model=model,
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
