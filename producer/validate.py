"""The rules for one input record: turn a parsed JSON object (or Parquet row) into a
`Request`, or say precisely which field is wrong and what was expected.

Kept apart from reading (producer/inputs.py) so that every input format shares one
set of rules and one wording of errors, and so the rules can be tested on plain
Python objects without writing files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from eagle2_core.config import format_text
from producer.control_fields import CONTROL_KEYS, BadControl, control_value
from producer.storable import json_problem, text_problem
from workers.request import MAX_COMPLETIONS, Request, completion_id

ROLES = ("system", "user", "assistant")
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
# Sample ids, custom ids and categories are String(255) columns (workers/db.py); ids
# are also kept in memory for the whole file (duplicate check).
MAX_ID_CHARS = 255
# Fits a 32-bit INTEGER column and any tensor index.
MAX_NEW_TOKENS_LIMIT = 2**31 - 1
# Fits a signed 64-bit BIGINT column and torch.manual_seed.
MAX_SEED = 2**63 - 1
# OpenAI's limit on `stop`.
MAX_STOP_STRINGS = 4

_CONTENT_FIELDS = ("prompt", "messages", "turns", "body")
_ID_FIELDS = ("id", "question_id", "custom_id")
_TOP_OVERRIDES = (
    ("max_new_tokens", "max_new_tokens"),
    ("max_tokens", "max_new_tokens"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("seed", "seed"),
    ("stop", "stop"),
    *((key, key) for key in CONTROL_KEYS),  # the generation controls (control_fields.py)
)
# An OpenAI body spells max_new_tokens max_completion_tokens (or max_tokens), not as ours.
_BODY_OVERRIDES = (("max_completion_tokens", "max_new_tokens"), *_TOP_OVERRIDES[1:])
_OVERRIDE_KEYS = frozenset(key for key, _ in _TOP_OVERRIDES)
_MISSING: Any = object()
_new_object = object.__new__


@dataclass(frozen=True, slots=True)
class Rejected:
    """A bad line: where it is, its sample id when that much was readable, and why."""

    line_no: int
    sample_id: str | None
    reason: str

    def __str__(self) -> str:
        return f"line {self.line_no}: {self.reason}"


class InvalidLine(ValueError):
    """Raised inside validation; carries the sample id once it has been read."""

    def __init__(self, reason: str, sample_id: str | None = None) -> None:
        super().__init__(reason)
        self.sample_id = sample_id


def quote(text: str, limit: int = 40) -> str:
    """A short JSON-quoted excerpt that is always valid UTF-8 (it may go to a database)."""
    excerpt = json.dumps(text[:limit], ensure_ascii=False)
    if len(text) > limit:
        excerpt += "..."
    return excerpt.encode("utf-8", "backslashreplace").decode("utf-8")


def _describe(value: object) -> str:
    """How a bad value is shown after "got" in an error message, in JSON terms."""
    if value is _MISSING:
        return "nothing"
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if type(value) is int or type(value) is float:
        if type(value) is float and not math.isfinite(value):
            return json.dumps(value)  # NaN, Infinity, -Infinity as JSON spells them
        text = repr(value)
        return text if len(text) <= 40 else text[:40] + "..."
    if type(value) is str:
        return "an empty string" if not value else quote(value)
    if type(value) is list:
        return f"an array of {len(value)} items"
    if type(value) is dict:
        return "an object"
    return type(value).__name__


def _text(value: object, path: str, *, allow_empty: bool = False) -> str:
    """A string field that can be stored (`text_problem`)."""
    if type(value) is not str or (not allow_empty and (not value or value.isspace())):
        expected = "a string" if allow_empty else "a non-empty string"
        raise InvalidLine(f'field "{path}": expected {expected}, got {_describe(value)}')
    problem = text_problem(value)
    if problem is not None:
        raise InvalidLine(f'field "{path}": {problem}')
    return value


def _sample_id(obj: dict[str, Any], line_no: int) -> tuple[str, str | None]:
    """(sample id, custom_id): the line's id field as a string, else "line-N"."""
    key = None
    for name in _ID_FIELDS:
        if obj.get(name) is not None:
            if key is not None:
                raise InvalidLine(
                    f'fields "{key}" and "{name}": expected at most one sample id field'
                )
            key = name
    if key != "custom_id" and obj.get("body") is not None:
        raise InvalidLine(
            'field "custom_id": expected a non-empty string or an integer '
            f"(an OpenAI batch line needs one), got {_describe(obj.get('custom_id', _MISSING))}"
        )
    if key is None:
        return f"line-{line_no}", None
    value = obj[key]
    if type(value) is int:
        sample_id = str(value)
    else:
        if type(value) is not str or not value or value.isspace():
            raise InvalidLine(
                f'field "{key}": expected a non-empty string or an integer, got {_describe(value)}'
            )
        sample_id = _text(value, key)
    if len(sample_id) > MAX_ID_CHARS:
        raise InvalidLine(
            f'field "{key}": expected at most {MAX_ID_CHARS} characters, got {len(sample_id)}'
        )
    return sample_id, sample_id if key == "custom_id" else None


def _check_completion_ids(obj: dict[str, Any], sample_id: str, n: int) -> None:
    """A line of n > 1 completions stores each as "<id>#<k>": the longest of those ids
    must fit the id columns, as the line's own id does."""
    suffix = len(completion_id(sample_id, n - 1)) - len(sample_id)
    if len(sample_id) + suffix > MAX_ID_CHARS:
        key = next(name for name in _ID_FIELDS if obj.get(name) is not None)
        raise InvalidLine(
            f'field "{key}": expected at most {MAX_ID_CHARS - suffix} characters with n = {n} '
            f'(its completion ids "<id>#0" to "<id>#{n - 1}" are stored, at most '
            f"{MAX_ID_CHARS} characters each), got {len(sample_id)}"
        )


def _messages(value: object, path: str) -> list[dict[str, str]]:
    # Error paths are built only on failure: this loop runs for every message of every line.
    if type(value) is not list or not value:
        raise InvalidLine(
            f'field "{path}": expected a non-empty array of messages, got {_describe(value)}'
        )
    out = []
    role = ""
    for i, message in enumerate(value):
        if type(message) is not dict:
            raise InvalidLine(
                f'field "{path}[{i}]": expected an object with "role" and "content", '
                f"got {_describe(message)}"
            )
        role = message.get("role", _MISSING)
        if type(role) is not str or role not in ROLES:
            raise InvalidLine(
                f'field "{path}[{i}].role": expected one of "system", "user", "assistant", '
                f"got {_describe(role)}"
            )
        content = message.get("content", _MISSING)
        if not (
            type(content) is str
            and content.isascii()
            and "\x00" not in content
            and (role != "user" or (content and not content.isspace()))
        ):
            content = _text(content, f"{path}[{i}].content", allow_empty=role != "user")
        out.append({"role": role, "content": content})
    if role != "user":
        raise InvalidLine(
            f'field "{path}[{len(out) - 1}].role": expected the last message to be from '
            f'"user" (the turn to answer), got {quote(role)}'
        )
    return out


def _turns(value: object) -> list[str]:
    if type(value) is not list or not value:
        raise InvalidLine(
            f'field "turns": expected a non-empty array of strings, got {_describe(value)}'
        )
    return [_text(turn, f"turns[{i}]") for i, turn in enumerate(value)]


def _openai_messages(obj: dict[str, Any]) -> list[dict[str, str]]:
    """Messages of an OpenAI Batch API line, after checking it asks for what we serve."""
    url = obj.get("url", _MISSING)
    if url != CHAT_COMPLETIONS_URL:
        raise InvalidLine(
            f'field "url": expected "{CHAT_COMPLETIONS_URL}" (the only endpoint served), '
            f"got {_describe(url)}"
        )
    method = obj.get("method", _MISSING)
    if method != "POST":
        raise InvalidLine(f'field "method": expected "POST", got {_describe(method)}')
    body = obj["body"]
    if type(body) is not dict:
        raise InvalidLine(f'field "body": expected an object, got {_describe(body)}')
    return _messages(body.get("messages", _MISSING), "body.messages")


def _label(name: str) -> str:
    """How an error names a line's field ('field "stop"') or a job's option ('--stop')."""
    return name if name.startswith("--") else f'field "{name}"'


def stop_strings(value: object, name: str) -> list[str]:
    """`stop` as OpenAI takes it (a string, or a list of up to 4 storable texts) -> the
    list; raises ValueError naming `name` (a field's path, or an option such as --stop)
    and saying what was expected."""
    strings = [value] if isinstance(value, str) else value
    if (
        type(strings) is not list
        or not 1 <= len(strings) <= MAX_STOP_STRINGS
        or not all(isinstance(x, str) and x for x in strings)
    ):
        raise ValueError(
            f"{_label(name)}: expected a non-empty string or a list of 1 to {MAX_STOP_STRINGS} "
            f"non-empty strings, got {_describe(value)}"
        )
    for i, text in enumerate(strings):
        problem = text_problem(text)
        if problem is not None:
            if name.startswith("--"):  # the option given several times: which one
                where = name if len(strings) == 1 else f"{name} #{i + 1}"
            else:
                where = name if isinstance(value, str) else f"{name}[{i}]"
            raise ValueError(f"{_label(where)}: {problem}")
    return list(strings)


Override = int | float | bool | str | list[str] | list[int] | dict[str, float]


def _override(name: str, path: str, value: object) -> Override:
    if name in CONTROL_KEYS:
        if name == "response_format" and (problem := json_problem(value, path)) is not None:
            raise InvalidLine(problem)
        try:
            return control_value(name, value)
        except BadControl as exc:
            raise InvalidLine(
                f'field "{path}{exc.where}": expected {exc.expected}, got {_describe(exc.value)}'
            ) from None
    if name == "stop":
        try:
            return stop_strings(value, path)
        except ValueError as exc:
            raise InvalidLine(str(exc)) from None
    if name == "max_new_tokens":
        if type(value) is not int or not 1 <= value <= MAX_NEW_TOKENS_LIMIT:
            raise InvalidLine(
                f'field "{path}": expected an integer from 1 to {MAX_NEW_TOKENS_LIMIT}, '
                f"got {_describe(value)}"
            )
        return value
    if name == "seed":
        if type(value) is not int or not 0 <= value <= MAX_SEED:
            raise InvalidLine(
                f'field "{path}": expected an integer from 0 to {MAX_SEED}, got {_describe(value)}'
            )
        return value
    if type(value) is not int and type(value) is not float:
        number = math.nan
    else:
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            number = math.inf
    if name == "temperature":
        if not (math.isfinite(number) and number >= 0):
            raise InvalidLine(f'field "{path}": expected a number >= 0, got {_describe(value)}')
    elif not 0 < number <= 1:
        raise InvalidLine(
            f'field "{path}": expected a number in (0, 1] (greater than 0, at most 1), '
            f"got {_describe(value)}"
        )
    return number


def _overrides(obj: dict[str, Any], body: object) -> dict[str, Override]:
    """Per-line generation parameters; null means not set. Two spellings of one
    parameter on one line (say max_tokens and body.max_completion_tokens) are refused
    rather than silently picking one."""
    out: dict[str, Override] = {}
    where: dict[str, str] = {}
    for key, name in _TOP_OVERRIDES:
        value = obj.get(key)
        if value is not None:
            _set_override(out, where, name, key, value)
    if type(body) is dict:
        for key, name in _BODY_OVERRIDES:
            value = body.get(key)
            if value is not None:
                _set_override(out, where, name, "body." + key, value)
    if format_text(out.get("response_format")) is not None and out.get("min_tokens"):
        raise InvalidLine(
            f'fields "{where["min_tokens"]}" and "{where["response_format"]}": expected at most '
            "one of them (the grammar decides where the answer may end)"
        )
    if "top_logprobs" in out and out.get("logprobs") is not True:
        raise InvalidLine(
            f'field "{where["top_logprobs"]}": expected "logprobs": true beside it (as '
            f"OpenAI requires), got {_describe(out.get('logprobs', _MISSING))}"
        )
    return out


def _set_override(
    out: dict[str, Override], where: dict[str, str], name: str, path: str, value: object
) -> None:
    if name in where:
        raise InvalidLine(f'fields "{where[name]}" and "{path}": expected at most one of them')
    out[name] = _override(name, path, value)
    where[name] = path


def completions_count(value: object, what: str) -> int:
    """`n`, the completions a request asks for: an integer from 1 to MAX_COMPLETIONS;
    raises ValueError saying what was expected."""
    if type(value) is not int or not 1 <= value <= MAX_COMPLETIONS:
        raise ValueError(
            f"{what}: expected an integer from 1 to {MAX_COMPLETIONS}, got {_describe(value)}"
        )
    return value


def _completions(obj: dict[str, Any], body: object) -> int | None:
    """The line's `n` (or its OpenAI body's), None when it sets neither."""
    top = obj.get("n")
    inner = body.get("n") if type(body) is dict else None
    if top is not None and inner is not None:
        raise InvalidLine('fields "n" and "body.n": expected at most one of them')
    if top is None and inner is None:
        return None
    try:
        return completions_count(
            top if inner is None else inner, 'field "n"' if inner is None else 'field "body.n"'
        )
    except ValueError as exc:
        raise InvalidLine(str(exc)) from None


def _content_kind(obj: dict[str, Any]) -> str:
    """Which content field a line with several of them uses: the one that is not null.
    (A single content field that is null is refused by its own check: "got null".)"""
    kinds = [k for k in _CONTENT_FIELDS if obj.get(k) is not None]
    if len(kinds) > 1:
        names = " and ".join(f'"{k}"' for k in kinds)
        raise InvalidLine(f"fields {names}: expected exactly one of them")
    return kinds[0] if kinds else next(k for k in _CONTENT_FIELDS if k in obj)


def request_from_object(obj: object, line_no: int, default_n: int = 1) -> Request:
    """Normalise one parsed record into a Request, or raise InvalidLine.

    Null in an optional field means the field is absent (Parquet columns cannot be
    omitted per row). Unknown fields (e.g. "reference", "model") are ignored. A line
    without `n` asks for `default_n` completions (the job's --n).
    """
    if type(obj) is not dict:
        raise InvalidLine(f"expected a JSON object, got {_describe(obj)}")
    sample_id, custom_id = _sample_id(obj, line_no)
    try:
        kind = ""
        for name in _CONTENT_FIELDS:
            if name in obj:
                if kind:  # several: rare, so resolved off the fast path
                    kind = _content_kind(obj)
                    break
                kind = name
        if not kind:
            raise InvalidLine(
                'no prompt: expected one of the fields "prompt", "messages", "turns" '
                'or "body" (an OpenAI batch line)'
            )
        followups: list[str] = []
        if kind == "prompt":
            messages = [{"role": "user", "content": _text(obj["prompt"], "prompt")}]
        elif kind == "messages":
            messages = _messages(obj["messages"], "messages")
        elif kind == "turns":
            turns = _turns(obj["turns"])
            messages = [{"role": "user", "content": turns[0]}]
            followups = turns[1:]
        else:
            messages = _openai_messages(obj)
        body = obj.get("body")
        overrides = (
            {}
            if type(body) is not dict and obj.keys().isdisjoint(_OVERRIDE_KEYS)
            else _overrides(obj, body)
        )
        n = _completions(obj, body) if "n" in obj or type(body) is dict else None
        if n is None:
            n = default_n
        if n > 1:
            _check_completion_ids(obj, sample_id, n)
        category = obj.get("category")
        if category is not None:
            category = _text(category, "category", allow_empty=True)
            if len(category) > MAX_ID_CHARS:
                raise InvalidLine(
                    f'field "category": expected at most {MAX_ID_CHARS} characters, '
                    f"got {len(category)}"
                )
    except InvalidLine as exc:
        exc.sample_id = sample_id
        raise
    # The dataclass's frozen __init__ (one object.__setattr__ per field) costs about a
    # tenth of the time per line; fill the new instance's __dict__ in one call instead.
    request = _new_object(Request)
    request.__dict__.update(
        sample_id=sample_id,
        line_no=line_no,
        messages=messages,
        followups=followups,
        overrides=overrides,
        custom_id=custom_id,
        category=category,
        n=n,
        choice_index=0,
        request_id=None,
    )
    return request
