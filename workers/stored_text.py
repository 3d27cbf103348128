"""Outputs stored exactly, whatever characters the model wrote.

A decoder can write text that no sink holds: NUL (a byte-level vocabulary has a token for
the byte 0x00; Postgres text and JSONB refuse it) and lone surrogates (a tokenizer that
decodes stray bytes with Python's surrogateescape; UTF-8, so Postgres, SQLite's driver and
Arrow, refuse them). Such an output is stored as `MARK` (U+FFFF, a noncharacter: no text
is meant to hold one) followed by the text with each backslash, NUL and surrogate written
as JSON writes them (\\\\, \\u0000, \\udXXX). So is an output that itself starts with
U+FFFF; every other output, all but never-seen ones, is stored as it is, so SQL and
DuckDB read it as written. `stored` and `unstored` are exact inverses, applied where rows
enter and leave storage (workers/db.py, workers/parquet_sink.py); a Parquet reader
outside this package decodes a row with `unstored_row`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MARK = "\uffff"
# The output columns a model writes: one text, and the text of every turn.
OUTPUT_FIELDS = ("output_text", "turn_outputs")

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_TO_ESCAPE = re.compile("[\\\\\x00\ud800-\udfff]")
_ESCAPED = re.compile(r"\\(\\|u[0-9a-f]{4})")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return "\\\\" if char == "\\" else f"\\u{ord(char):04x}"


def _unescape(match: re.Match[str]) -> str:
    code = match.group(1)
    return "\\" if code == "\\" else chr(int(code[1:], 16))


def stored(text: str) -> str:
    """The form of one output that every database and Parquet holds."""
    if not text.startswith(MARK) and _UNSTORABLE.search(text) is None:
        return text
    return MARK + _TO_ESCAPE.sub(_escape, text)


def unstored(text: str) -> str:
    """The output as the model wrote it, from its stored form."""
    if not text.startswith(MARK):
        return text
    return _ESCAPED.sub(_unescape, text[1:])


def _convert(row: Mapping[str, Any], convert: Any) -> dict[str, Any]:
    out = dict(row)
    if out.get("output_text") is not None:
        out["output_text"] = convert(out["output_text"])
    if out.get("turn_outputs") is not None:
        out["turn_outputs"] = [convert(text) for text in out["turn_outputs"]]
    return out


def stored_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """An output row with its outputs in stored form (a copy)."""
    return _convert(row, stored)


def unstored_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A stored output row with its outputs as the model wrote them (a copy)."""
    return _convert(row, unstored)
