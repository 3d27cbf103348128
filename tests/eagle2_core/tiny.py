"""Tiny random Llama targets and draft heads built in code (no weights on disk)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eagle2_core.draft import DraftHead, new_draft_head
from eagle2_core.models import Target, target_from_model


def tiny_tokenizer(vocab_size: int, eos: int | None = 1) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose tokens are t0..t{V-1}; t<eos> is EOS."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos_token = f"t{eos}" if eos is not None else None
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos_token, unk_token="t0")


def tiny_target(
    vocab_size: int = 96,
    seed: int = 0,
    max_positions: int = 512,
    eos: int | None = 1,
    hidden: int = 64,
    layers: int = 2,
) -> Target:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=eos,
        bos_token_id=0,
        pad_token_id=0,
        initializer_range=0.5,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos
    return target_from_model(model, tiny_tokenizer(vocab_size, eos), "tiny-llama")


def tiny_head(target: Target, seed: int = 1) -> DraftHead:
    head = new_draft_head(target.model.config, seed=seed)
    for p in head.parameters():  # larger weights: a random head that still varies its guesses
        p.data.mul_(5.0)
    return head.eval()
