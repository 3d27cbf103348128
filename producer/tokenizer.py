"""A model's tokenizer and context length as the producer needs them: from its files only,
since the producer never loads weights (job creation's prompt-length check, export's
token texts)."""

from __future__ import annotations

from typing import Any

from eagle2_core.model_config import load_model_config
from eagle2_core.registry import ModelLoadError, resolve_model
from eagle2_core.tokenizer import load_tokenizer
from producer.jobs import JobError, one_line
from producer.prompt_length import TokenCounter, prompt_token_counter

ContextCheck = tuple[TokenCounter, int]


def _tokenizer_and_config(model: str) -> tuple[Any, Any]:
    try:
        source = resolve_model(model)
        tokenizer = load_tokenizer(source)
        config = load_model_config(source)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise JobError(f"cannot load the tokenizer of model {model!r}: {one_line(exc)}") from exc
    return tokenizer, config


def model_tokenizer(model: str) -> Any:
    """The model's tokenizer."""
    return _tokenizer_and_config(model)[0]


def context_check(model: str) -> ContextCheck:
    """(prompt token counter, context length) from the model's tokenizer and config."""
    tokenizer, config = _tokenizer_and_config(model)
    max_context = int(config.max_position_embeddings)
    return prompt_token_counter(tokenizer, max_context), max_context
