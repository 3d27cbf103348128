"""The prompt-length check of job creation: exact in its decisions, paid only where it
matters.

Every request must leave room to generate: len(encode_chat(tokenizer, messages)) below
the model's context. Tokenizing costs ~300 us a request and rendering the chat template
~70 us; millions of lines cannot pay either. Two bounds decide almost every request
without them, and each replaces the count only when it is below the context, so a
request passes exactly when the count would let it pass:

1. Tokens <= bytes. A byte-level tokenizer without a normalizer (nothing expands the
   text) spends at least one UTF-8 byte of the rendered prompt per token, plus the
   specials its post-processor adds.
2. Rendered bytes = the template's bytes for that sequence of roles + the contents'
   bytes, for a template that copies each content once, verbatim. That is checked per
   role sequence on probe contents (quotes, backslashes, newlines, non-ASCII, markup:
   what an escaping filter would expand); a role sequence whose probes disagree is
   rendered every time.

Anything near the limit is tokenized exactly, many requests in one batch encode (the
fast tokenizer encodes a batch on all cores) of at most EXACT_BATCH_BYTES of prompt text,
so the memory the tokenizer takes is bounded by that (or by one line, max_line_bytes),
not by the input. And what cannot fit is refused before any tokenizing:

3. Tokens >= rendered bytes / the longest token's bytes, for a BPE without an unknown
   token and without a normalizer (every token stands for bytes of the text it came
   from). A bound at or above the context is returned as `TokensAtLeast`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import cache
from typing import Any

from tokenizers.models import BPE

from eagle2_core.registry import encode_chats
from workers.request import Request

# Probe contents: plain, and with every character an escaping template filter changes.
_PROBES = ("probe", 'q"u\\o\nte <b>&amp; ü ✓ \t {x}')
# Role sequences remembered at most (a file has a handful; a hostile one cannot grow it).
_MAX_SIGNATURES = 4096
# Prompt text tokenized in one batch encode at most (a longer prompt goes alone): about
# 100 bytes of tokenizer state a token, so some 50 MB.
EXACT_BATCH_BYTES = 2 * 1024 * 1024

Messages = list[dict[str, str]]
# Prompt tokens of each request, or a bound on it: below the context, or at or above it
# as TokensAtLeast (see the module doc).
TokenCounter = Callable[[Sequence[Request]], list[int]]


class TokensAtLeast(int):
    """A lower bound on a prompt's tokens, at or above the context: refused uncounted."""


def _text_bytes(request: Request) -> int:
    return sum(len(m["content"].encode("utf-8")) for m in request.messages)


def _batches(requests: Sequence[Request]) -> Iterator[list[int]]:
    """Positions of `requests` in runs of at most EXACT_BATCH_BYTES of text (one at least)."""
    batch: list[int] = []
    size = 0
    for i, request in enumerate(requests):
        n = _text_bytes(request)
        if batch and size + n > EXACT_BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += n
    if batch:
        yield batch


def longest_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes of text one token can stand for, where that is bounded: a BPE with
    no unknown token (a byte-level vocabulary) and no normalizer. A token's UTF-8 length
    is at least the bytes it covers (a byte-level character is one byte, two in UTF-8)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    if not isinstance(backend.model, BPE) or backend.model.unk_token is not None:
        return None
    tokens = [*backend.get_vocab(with_added_tokens=False), *tokenizer.get_added_vocab()]
    return max(len(token.encode("utf-8")) for token in tokens)


def prompt_token_counter(tokenizer: Any, max_context: int) -> TokenCounter:
    """counts(requests): for each, len(encode_chat(tokenizer, messages)), or a bound on it
    that is below `max_context`, or a TokensAtLeast bound at or above it (so the length
    check decides as the count would). The requests no bound decides are tokenized in
    batch encodes of at most EXACT_BATCH_BYTES of text."""

    def exact(requests: Sequence[Request]) -> list[int]:
        out = [0] * len(requests)
        for batch in _batches(requests):
            encoded = encode_chats(tokenizer, [requests[i].messages for i in batch])
            for i, ids in zip(batch, encoded, strict=True):
                out[i] = len(ids)
        return out

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or not tokenizer.chat_template:
        return exact
    # Post-processor specials (BOS/EOS) and a prefix space some pre-tokenizers insert.
    slack = len(backend.encode("").ids) + 1
    template = TemplateBytes(tokenizer)
    # Read off the whole vocabulary (~40 ms of every job's creation) only once a request's
    # bytes reach the context: most jobs have none.
    longest = cache(lambda: longest_token_bytes(tokenizer))

    def counts(requests: Sequence[Request]) -> list[int]:
        rendered = [template.rendered_bytes(r.messages) for r in requests]
        out = [n + slack for n in rendered]
        unsure = []
        for i, bound in enumerate(out):
            if bound < max_context:
                continue
            most = longest()
            if most is not None and -(-rendered[i] // most) >= max_context:
                out[i] = TokensAtLeast(-(-rendered[i] // most))
            else:
                unsure.append(i)
        for i, n in zip(unsure, exact([requests[i] for i in unsure]), strict=True):
            out[i] = n
        return out

    return counts


class TemplateBytes:
    """The UTF-8 length of a conversation rendered by the chat template, from the lengths
    of its contents and the template's fixed bytes for its role sequence."""

    def __init__(self, tokenizer: Any) -> None:
        self._render = tokenizer.apply_chat_template
        self._fixed: dict[tuple[str, ...], int | None] = {}

    def _bytes(self, messages: Messages) -> int:
        text = self._render(messages, add_generation_prompt=True, tokenize=False)
        return len(text.encode("utf-8"))

    def fixed_bytes(self, roles: tuple[str, ...]) -> int | None:
        """The template's own bytes around contents of these roles; None when the probes
        show it does not copy contents verbatim (or it fails on them)."""
        if roles in self._fixed:
            return self._fixed[roles]
        overheads = set()
        for probe in _PROBES:
            messages = [{"role": role, "content": probe} for role in roles]
            try:
                rendered = self._bytes(messages)
            except Exception:  # noqa: BLE001 - a template may refuse a role order
                overheads.add(None)
                break
            overheads.add(rendered - len(roles) * len(probe.encode("utf-8")))
        fixed = overheads.pop() if len(overheads) == 1 else None
        if len(self._fixed) < _MAX_SIGNATURES:
            self._fixed[roles] = fixed
        return fixed

    def rendered_bytes(self, messages: Messages) -> int:
        """Bytes of the rendered conversation: from the lengths where the template's
        probes allow it, else by rendering."""
        fixed = self.fixed_bytes(tuple(m["role"] for m in messages))
        if fixed is None:
            return self._bytes(messages)
        total = fixed
        for message in messages:
            content = message["content"]
            total += len(content) if content.isascii() else len(content.encode("utf-8"))
        return total
