"""The checks of a line's generation controls (README, "Generation controls"): each value
as JSON gives it -> the value a job's params and a line's overrides store, or `BadControl`
saying where in the value and what was expected. producer/validate.py words the error for
its field; the job options (--logit-bias) use the same checks."""

from __future__ import annotations

from typing import Any

from eagle2_core.config import CONTROL_BOUNDS, CONTROL_KEYS, LOGIT_BIAS_BOUND, TOKEN_ID_BOUND

# Bounds on what one line may list, so that a manifest row stays small.
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64

__all__ = ["CONTROL_KEYS", "BadControl", "control_value", "logit_bias_entry"]


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
    raise KeyError(name)
