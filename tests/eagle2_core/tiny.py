"""Tiny random Llama targets and draft heads built in code (no weights on disk).

EAGLE2_TEST_DEVICE=cuda puts the targets on a GPU (benchmarks/gpu_check.sh runs the
identity tests that way); the default is the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eagle2_core import cost
from eagle2_core.cost import TREE_GRID, WIDTH_GRID, CostModel
from eagle2_core.draft import DraftHead, new_draft_head
from eagle2_core.models import Target, target_from_model
from eagle2_core.tree import DraftTree

DEVICE = os.environ.get("EAGLE2_TEST_DEVICE", "cpu")


def tiny_tokenizer(vocab_size: int, eos: int | None = 1) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose tokens are t0..t{V-1}; t<eos> is EOS."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos_token = f"t{eos}" if eos is not None else None
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos_token, unk_token="t0")


BYTE_EOS = 256  # byte_tokenizer's end token, after the 256 bytes


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of one token per byte (GPT-2's alphabet) and an end token: any
    text, JSON included, can be written with it (structured output tests)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(alphabet)} | {"<eos>": BYTE_EOS}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def tiny_target(
    vocab_size: int = 96,
    seed: int = 0,
    max_positions: int = 512,
    eos: int | None = 1,
    hidden: int = 64,
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    byte_level: bool = False,
    tied: bool = False,
) -> Target:
    """A random Llama over t0..t{V-1}, or with `byte_level` over byte_tokenizer's 257;
    `tied`: its lm_head is its embedding table."""
    if byte_level:
        vocab_size, eos = BYTE_EOS + 1, BYTE_EOS
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
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).eval().to(DEVICE, dtype)
    model.generation_config.eos_token_id = eos
    tokenizer = byte_tokenizer() if byte_level else tiny_tokenizer(vocab_size, eos)
    return target_from_model(model, tokenizer, "tiny-llama")


def save_target(target: Target, directory: Path, deduplicate: bool = False) -> Path:
    """The model and tokenizer as transformers saves them, or (deduplicate) as gguf.py
    does: a tied table stored once, under one of its two names."""
    model = target.model
    model.save_pretrained(directory)
    if deduplicate:
        (directory / "model.safetensors").unlink()
        save_model(model, str(directory / "model.safetensors"))
    target.tokenizer.save_pretrained(directory)
    return directory


def tiny_head(target: Target, seed: int = 1) -> DraftHead:
    head = new_draft_head(target.model.config, seed=seed)
    for p in head.parameters():  # larger weights: a random head that still varies its guesses
        p.data.mul_(5.0)
    return head.eval()


def hf_greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: transformers' generate, greedy, with the same stop tokens."""
    ids = torch.tensor([prompt], device=target.model.device)
    out = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(target.stop_ids) or None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def prompts(vocab: int, lengths=(1, 5, 23, 70), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


class OracleDrafter:
    """Knows the greedy continuation: proposes it as the best branch, beside wrong siblings,
    so acceptances are long and every acceptance path of the verifier is exercised."""

    def __init__(self, prompt: list[int], continuation: list[int], vocab: int, depth: int = 6):
        self.sequence = prompt + continuation
        self.vocab, self.depth = vocab, depth
        self.committed = 0

    def reset(self) -> None:
        self.committed = 0

    def draft(self, features, next_tokens, context_len, budget) -> DraftTree:
        root_pos = context_len  # the root sits at this position of the sequence
        future = self.sequence[root_pos + 1 : root_pos + 1 + self.depth]
        tokens, parents = [int(next_tokens[-1])], [-1]
        parent = 0
        for i, token in enumerate(future):
            if len(tokens) + 2 > budget:
                break
            wrong = (token + 1 + i) % self.vocab
            tokens += [wrong, token]  # the wrong sibling first in index order
            parents += [parent, parent]
            parent = len(tokens) - 1
        scores = torch.tensor([0.0] + [-(i + 1) / 2 for i in range(len(tokens) - 1)])
        # the true child scores higher than its wrong sibling
        for node in range(1, len(tokens), 2):
            scores[node] -= 0.25
        return DraftTree(torch.tensor(tokens), tuple(parents), scores)


def device_costs(verify_per_node_ms: float, draft_ms: float) -> CostModel:
    """A cost table of 1 and 16 rows: a forward costs 10 ms plus verify_per_node_ms for
    each node past the first of all rows; a draft step draft_ms."""
    batches = [1, 16]
    return CostModel(
        key="test",
        measured_at=0.0,
        batch_grid=batches,
        tree_grid=list(TREE_GRID),
        verify_ms=[[10.0 + verify_per_node_ms * (b * n - 1) for n in TREE_GRID] for b in batches],
        width_grid=list(WIDTH_GRID),
        draft_ms=[[draft_ms] * len(WIDTH_GRID) for _ in batches],
        key_ms=0.0,
    )


def kept(table: CostModel, directory: Path) -> CostModel:
    """`table` as the cache keeps a measured one: written to its file and read back (such
    a table learns from the rounds that beat it; a made-up one does not)."""
    path = directory / f"{table.key}.json"
    path.write_text(table.to_json())
    return cost._read(path)
