"""A line's `response_format` as a grammar (llguidance), without a tokenizer or torch: what
the producer checks each line with, and what decoding compiles (grammar.py).

Forms: OpenAI's `{"type": "json_object"}` and `{"type": "json_schema", "json_schema":
{"schema": ...}}`, plus `{"type": "regex", "regex": ...}` and `{"type": "grammar",
"grammar": ...}` (Lark, or GBNF as llama.cpp writes it), as vLLM's and SGLang's guided
decoding take them; `{"type": "text"}` constrains nothing.
"""

from __future__ import annotations

from typing import Any

import llguidance

RESPONSE_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
# JSON as json.dumps writes it (one space after ':' and ','; no other whitespace), so the
# grammar leaves no freedom where an answer's content has none.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A response_format that does not compile; the message says why."""


def grammar_text(response_format: dict[str, Any]) -> str:
    """The llguidance grammar of a response_format; raises GrammarError for one that does
    not translate (a schema llguidance cannot take, a form without its field)."""
    try:
        return _translated(response_format)
    except (ValueError, KeyError, TypeError) as exc:  # GrammarError is a ValueError
        raise GrammarError(str(exc)) from None


def _translated(response_format: dict[str, Any]) -> str:
    kind = response_format.get("type")
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_OPTIONS
        )
    if kind == "json_schema":
        schema = response_format["json_schema"]["schema"]
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(response_format["regex"])
    if kind == "grammar":
        return llguidance.grammar_from("grammar", response_format["grammar"])
    raise GrammarError(f"type must be one of {', '.join(RESPONSE_TYPES[1:])}, got {kind!r}")


def grammar_problem(response_format: dict[str, Any]) -> str | None:
    """Why the response_format does not compile, None when it does (no tokenizer needed:
    what the producer checks every line with)."""
    try:
        problem = llguidance.LLMatcher.validate_grammar(grammar_text(response_format))
    except GrammarError as exc:
        problem = str(exc)
    return problem or None
