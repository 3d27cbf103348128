"""The checks of a line's generation controls (README, "Generation controls"): each value
as JSON gives it -> the value a job's params and a line's overrides store, or `BadControl`
saying where in the value and what was expected. producer/validate.py words the error for
its field; the job options (--logit-bias) use the same checks."""

from __future__ import annotations

import json
from typing import Any

from eagle2_core.config import CONTROL_BOUNDS, CONTROL_KEYS, LOGIT_BIAS_BOUND, TOKEN_ID_BOUND

# Bounds on what one line may list, so that a manifest row stays small.
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64

__all__ = ["CONTROL_KEYS", "BadControl", "control_value", "logit_bias_entry", "response_format"]


class BadControl(ValueError):
    """A control's value is wrong at `where` (appended to its field's path: "", ".123",
    "[2]"): `expected` says what would do, `value` is what was there."""

    def __init__(self, where: str, expected: str, value: object) -> None:
        super().__init__(f"{where}: expected {expected}")
        self.where, self.expected, self.value = where, expected, value


def _token_id(value: object, where: str) -> int:
    if not TOKEN_ID_BOUND.admits(value):
        raise BadControl(where, f"a token id ({TOKEN_ID_BOUND.expected()})", value)
    return int(value)  # type: ignore[arg-type]


def logit_bias_entry(key: object, bias: object) -> tuple[str, float]:
    """One logit_bias entry (a token id as JSON object keys spell it: decimal digits, or an
    integer) -> (the id as a key, the bias). A bad key is quoted in the error, never put in
    its path, which is stored as it is."""
    if type(key) is str and key.isascii() and key.isdecimal() and len(key) <= 10:
        token = int(key)
    elif type(key) is int:
        token = key
    else:
        raise BadControl("", "token ids as keys (decimal digits)", key)
    where = f".{token}"
    _token_id(token, where)
    if not LOGIT_BIAS_BOUND.admits(bias):
        raise BadControl(where, LOGIT_BIAS_BOUND.expected(), bias)
    return str(token), float(bias)  # type: ignore[arg-type]


def control_value(name: str, value: object) -> Any:
    """The stored form of control `name` (one of CONTROL_KEYS); raises BadControl."""
    bound = CONTROL_BOUNDS.get(name)
    if bound is not None:
        if not bound.admits(value):
            raise BadControl("", bound.expected(), value)
        return value if bound.integer else float(value)  # type: ignore[arg-type]
    if name == "logprobs":
        if type(value) is not bool:
            raise BadControl("", "true or false", value)
        return value
    if name == "logit_bias":
        if type(value) is not dict or len(value) > MAX_LOGIT_BIAS:
            expected = f"an object of at most {MAX_LOGIT_BIAS} token ids and their biases"
            raise BadControl("", expected, value)
        return dict(logit_bias_entry(key, bias) for key, bias in value.items())
    if name == "stop_token_ids":
        if type(value) is not list or len(value) > MAX_STOP_TOKEN_IDS:
            raise BadControl("", f"an array of at most {MAX_STOP_TOKEN_IDS} token ids", value)
        return [_token_id(token, f"[{i}]") for i, token in enumerate(value)]
    if name == "response_format":
        return response_format(value)
    raise KeyError(name)


# Each form of response_format that holds a grammar: (where, what it must be, its name).
_GRAMMAR_FIELDS = {
    "json_schema": ("json_schema.schema", "an object (a JSON schema)", "JSON schema"),
    "regex": ("regex", "a non-empty regular expression", "regular expression"),
    "grammar": ("grammar", "a non-empty Lark or GBNF grammar", "grammar"),
}


def response_format(value: object) -> str:
    """OpenAI's response_format (or its regex and grammar forms), checked by compiling it
    (without a tokenizer: a millisecond for a schema) -> the stored form, the JSON text of
    only what decides the grammar (so equal formats share one compile; a schema keeps its
    key order: eagle2_core.config.format_text)."""
    from eagle2_core.response_format import RESPONSE_TYPES, grammar_problem

    if type(value) is not dict:
        raise BadControl("", f'an object with "type": one of {", ".join(RESPONSE_TYPES)}', value)
    kind = value.get("type")
    if kind not in RESPONSE_TYPES:
        raise BadControl(".type", f"one of {', '.join(RESPONSE_TYPES)}", kind)
    canonical: dict[str, Any] = {"type": kind}
    if kind in _GRAMMAR_FIELDS:
        where, expected, what = _GRAMMAR_FIELDS[kind]
        if kind == "json_schema":
            holder = value.get("json_schema")
            part = holder.get("schema") if type(holder) is dict else None
            canonical["json_schema"] = {"schema": part}
        else:
            part = canonical[kind] = value.get(kind)
        if type(part) is not (dict if kind == "json_schema" else str) or part == "":
            raise BadControl(f".{where}", expected, part)
        problem = grammar_problem(canonical)
        if problem is not None:
            words = " ".join(line.strip() for line in problem.splitlines() if line.strip())
            reason = json.dumps(words[:200])[1:-1]  # escaped: storable whatever it quotes
            raise BadControl(f".{where}", f"a {what} that compiles ({reason})", part)
    return json.dumps(canonical)
