"""Structured output at decoding: the tokens each tree node may take under a line's
`response_format` (response_format.py gives its grammar).

A grammar is compiled once per distinct format and tokenizer (`Grammars`), and each
sequence gets a copy of its compiled matcher (`Constraint`). The matcher follows the
committed output; a node's mask is the matcher's after the drafted tokens of the node's own
branch, consumed and rolled back again, so drafting and verification see exactly the
tokens plain constrained decoding would allow there. BENCHMARKS.md, "Structured output", says why
llguidance and what a mask costs.
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from eagle2_core.response_format import GrammarError, grammar_text

# Compiled grammars a worker keeps, the least recently used dropped past this: every line of
# a job may bring its own schema, and a compile costs a millisecond or two (BENCHMARKS.md).
MAX_COMPILED = 1024


class Grammars:
    """One tokenizer's compiled grammars, each distinct response_format compiled once."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        # llguidance takes transformers' class only (a LeanTokenizer holds one)
        tokenizer = getattr(tokenizer, "transformers_tokenizer", tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(stop_ids)
        )
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def constraint(self, response_format: str) -> Constraint:
        """A fresh matcher for `response_format` (its canonical JSON text); raises
        GrammarError when it does not compile for this tokenizer."""
        compiled = self._compiled.get(response_format)
        if compiled is None:
            grammar = grammar_text(json.loads(response_format))
            compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise GrammarError(compiled.get_error())
            self._compiled[response_format] = compiled
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(response_format)
        return Constraint(compiled.deep_copy(), self.vocab_size)


_GRAMMARS: weakref.WeakKeyDictionary[Any, Grammars] = weakref.WeakKeyDictionary()


def grammars_for(tokenizer: Any, vocab_size: int, stop_ids: frozenset[int]) -> Grammars:
    """The tokenizer's Grammars, built on first use (llguidance reads the vocabulary once:
    seconds for a 49k-token one) and kept while the tokenizer lives."""
    if tokenizer not in _GRAMMARS:
        _GRAMMARS[tokenizer] = Grammars(tokenizer, vocab_size, stop_ids)
    return _GRAMMARS[tokenizer]


class Constraint:
    """One sequence's grammar state: the committed output consumed."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def commit(self, tokens: list[int]) -> None:
        """Tokens the sequence has generated (each one the mask allowed)."""
        for token in tokens:  # one at a time: consume_tokens refuses the end token
            if not self.matcher.consume_token(token):
                raise AssertionError(f"the grammar refused committed token {token}")

    def allowed(
        self, paths: torch.Tensor, stop_ids: frozenset[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([M, V] bool: the tokens each of M nodes may take, [M] bool: whether the node
        can be reached), the node's branch beyond the output being paths [M, D] (-1 past
        its end). A branch the grammar refuses or that passed a stop token is never
        accepted, and one whose grammar is done allows nothing: those are not live."""
        masks = torch.zeros(paths.shape[0], (self.vocab_size + 31) // 32, dtype=torch.int32)
        matcher = self.matcher
        for node, branch in enumerate(paths.tolist()):
            tokens = [t for t in branch if t >= 0]
            if any(t in stop_ids for t in tokens):
                continue
            taken = matcher.try_consume_tokens(tokens)
            if taken == len(tokens):
                llguidance.torch.fill_next_token_bitmask(matcher, masks, node)
            if taken:
                matcher.rollback(taken)
        bits = (masks[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.bool().flatten(1)[:, : self.vocab_size].to(paths.device)
        return allowed, allowed.any(dim=1)
