"""Stored logprobs as OpenAI's chat completions show them: `choices[i].logprobs` with a
`content` item per token (`token`, `logprob`, `bytes`, `top_logprobs`). Rows store token
ids (eagle2_core/logprobs.py); their text and UTF-8 bytes come from the job's tokenizer,
loaded only when a row to export has logprobs."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from producer.tokenizer import model_tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (each byte drawn as a printable character), reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    shown = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in shown)
    shown.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return {char: b for b, char in shown.items()}


class TokenText:
    """Each token id's text and bytes under the tokenizer of `model`."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._tokenizer: Any = None
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._seen:
            if self._tokenizer is None:
                self._tokenizer = model_tokenizer(self.model)
            raw = token_bytes(self._tokenizer, token_id)
            self._seen[token_id] = raw.decode("utf-8", errors="replace"), list(raw)
        return self._seen[token_id]


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's own bytes: exact for byte-level BPE (a piece of a character included) and
    SentencePiece byte pieces, else the UTF-8 of its decoded text."""
    piece = tokenizer.convert_ids_to_tokens(token_id) or ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    alphabet = _byte_level_alphabet()
    if type(getattr(backend, "decoder", None)).__name__ == "ByteLevel" and all(
        char in alphabet for char in piece
    ):
        return bytes(alphabet[char] for char in piece)
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match[1], 16)])
    return tokenizer.decode([token_id]).encode("utf-8")


def openai_logprobs(
    entries: Sequence[Mapping[str, Any]] | None, text: TokenText
) -> dict[str, Any] | None:
    """A choice's `logprobs` from a row's stored ones (None when it asked for none)."""
    if entries is None:
        return None

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        token, raw = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": raw}

    content = [
        {
            **item(entry["token_id"], entry["logprob"]),
            "top_logprobs": [
                item(t, lp) for t, lp in zip(entry["top_ids"], entry["top_logprobs"], strict=True)
            ],
        }
        for entry in entries
    ]
    return {"content": content, "refusal": None}
