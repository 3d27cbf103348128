"""Turn a GGUF model into a plain fp32 safetensors directory once, so every later load is a
fast, ordinary transformers load (the registry caches the result)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer


def dequantise_gguf(directory: Path, gguf_file: str, cached: Path) -> Path:
    """Dequantise a GGUF once into the safetensors directory `cached` and return it."""
    cache_name = cached.name
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
