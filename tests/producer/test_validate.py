"""Every text a job stores from its user passes one check (producer/validate.py): stop
strings, ids as their completions will store them, every stored string of an OpenAI body,
and the job's own --stop, --system, --model and --draft. A bad one is a named bad line (or
a one-line option error), never a crash at insert time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from producer.inputs import Rejected, Request, read_requests
from producer.jobs import JobError, make_spec
from producer.storable import text_problem
from producer.validate import MAX_ID_CHARS
from workers.request import MAX_COMPLETIONS

GOOD = {"id": "good", "prompt": "ok"}
OPENAI = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions"}
NUL = "expected text without NUL (\\u0000), got one at character"
SURROGATE = "expected valid Unicode text, got a lone surrogate"


def read_lines(tmp_path: Path, *lines: Any, **kwargs: Any) -> list[Request | Rejected]:
    """read_requests of a JSONL file of GOOD then `lines` (json.dumps escapes a lone
    surrogate or a NUL as \\udXXX or \\u0000, as a user's file would hold them)."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in (GOOD, *lines)))
    return list(read_requests(path, **kwargs))


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_text_problem_names_the_first_bad_character() -> None:
    assert text_problem("plain ü ✓ \t\n") is None
    assert text_problem("ab\x00c") == f"{NUL} 3"
    assert text_problem("é\udc80") == f"{SURROGATE} \\udc80 at character 2"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ({"prompt": "x", "stop": "\ud800"}, f'field "stop": {SURROGATE} \\ud800 at character 1'),
        ({"prompt": "x", "stop": "a\x00"}, f'field "stop": {NUL} 2'),
        ({"prompt": "x", "stop": ["ok", "\x00"]}, f'field "stop[1]": {NUL} 1'),
        (
            {**OPENAI, "body": {"messages": [user("x")], "stop": ["\udfff"]}},
            f'field "body.stop[0]": {SURROGATE} \\udfff at character 1',
        ),
        (
            {**OPENAI, "body": {"messages": [user("x")], "stop": "z\x00"}},
            f'field "body.stop": {NUL} 2',
        ),
    ],
)
def test_stop_strings_get_the_text_checks(tmp_path: Path, line: Any, reason: str) -> None:
    items = read_lines(tmp_path, line)
    assert items[0] == Request("good", 1, [user("ok")])
    assert isinstance(items[1], Rejected) and str(items[1]) == f"line 2: {reason}"


@pytest.mark.parametrize("field", ["id", "custom_id", "question_id"])
def test_ids_are_checked_at_the_length_of_their_completion_ids(tmp_path: Path, field: str) -> None:
    def line(length: int, n: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {field: "i" * length, "prompt": "p"}
        if field == "custom_id":
            out = {**OPENAI, "custom_id": out[field], "body": {"messages": [user("p")]}}
        if n is not None:
            out["n"] = n
        return out

    items = read_lines(
        tmp_path,
        line(MAX_ID_CHARS - 2, 2),  # "<id>#1" is 255 characters: fits
        line(MAX_ID_CHARS - 1, 2),  # "<id>#1" would be 256
        line(MAX_ID_CHARS - 4, MAX_COMPLETIONS),  # "<id>#127" is 255
        line(MAX_ID_CHARS - 3, MAX_COMPLETIONS),
        line(MAX_ID_CHARS, None),  # one completion: the id itself is stored
    )
    assert [type(item).__name__ for item in items] == [
        "Request",
        "Request",
        "Rejected",
        "Request",
        "Rejected",
        "Request",
    ]
    for item in items:
        if isinstance(item, Request):
            ids = [c.sample_id for c in item.completions()]
            assert max(len(i) for i in ids) <= MAX_ID_CHARS
    assert str(items[2]) == (
        f'line 3: field "{field}": expected at most {MAX_ID_CHARS - 2} characters with n = 2 '
        '(its completion ids "<id>#0" to "<id>#1" are stored, at most 255 characters each), '
        f"got {MAX_ID_CHARS - 1}"
    )
    assert items[2].sample_id == "i" * (MAX_ID_CHARS - 1)  # named, and storable
    assert f"at most {MAX_ID_CHARS - 4} characters with n = 128" in items[4].reason


def test_the_jobs_n_counts_for_lines_that_do_not_say(tmp_path: Path) -> None:
    long_id = {"id": "x" * (MAX_ID_CHARS - 1), "prompt": "p"}
    [_, alone] = read_lines(tmp_path, long_id)
    assert isinstance(alone, Request)
    [_, with_n] = read_lines(tmp_path, long_id, n=2)
    assert isinstance(with_n, Rejected) and "with n = 2" in with_n.reason


BODY_TEXTS = [
    ({"messages": [user("\x00")]}, f'field "body.messages[0].content": {NUL} 1'),
    (
        {"messages": [{"role": "system", "content": "s\udc00"}, user("x")]},
        f'field "body.messages[0].content": {SURROGATE} \\udc00 at character 2',
    ),
    (
        {"messages": [user("a"), {"role": "assistant", "content": "\x00"}, user("b")]},
        f'field "body.messages[1].content": {NUL} 1',
    ),
    (
        {"messages": [{"role": "us\x00er", "content": "x"}]},
        'field "body.messages[0].role": expected one of "system", "user", "assistant", '
        'got "us\\u0000er"',
    ),
]


@pytest.mark.parametrize(("body", "reason"), BODY_TEXTS)
def test_every_stored_string_of_an_openai_body_is_checked(
    tmp_path: Path, body: dict[str, Any], reason: str
) -> None:
    [_, item] = read_lines(tmp_path, {**OPENAI, "body": body})
    assert isinstance(item, Rejected) and item.reason == reason


def test_body_fields_that_are_not_stored_cannot_spoil_the_line(tmp_path: Path) -> None:
    body = {
        "messages": [user("x")],
        "model": "\x00",
        "user": "\ud800",
        "metadata": {"k": ["\x00"]},
    }
    [_, item] = read_lines(tmp_path, {**OPENAI, "body": body, "extra": "\x00"})
    assert isinstance(item, Request)
    stored = json.dumps(item.to_payload(), ensure_ascii=False)
    assert text_problem(stored) is None


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("top_k", -1, 'field "body.top_k": expected an integer from 0 to 2147483647, got -1'),
        ("top_k", 2.0, 'field "body.top_k": expected an integer from 0 to 2147483647, got 2.0'),
        ("min_p", 1.5, 'field "body.min_p": expected a number from 0 to 1, got 1.5'),
        ("repetition_penalty", 0, 'field "body.repetition_penalty": expected a number > 0, got 0'),
        ("presence_penalty", -3, 'field "body.presence_penalty": expected a number from -2 to 2'),
        ("frequency_penalty", "1", 'field "body.frequency_penalty": expected a number from -2'),
        ("min_tokens", True, 'field "body.min_tokens": expected an integer from 0 to'),
        ("logprobs", 1, 'field "body.logprobs": expected true or false, got 1'),
        ("top_logprobs", 2, 'field "body.top_logprobs": expected "logprobs": true beside it'),
        ("stop_token_ids", [2, -1], 'field "body.stop_token_ids[1]": expected a token id'),
        ("stop_token_ids", 2, 'field "body.stop_token_ids": expected an array of at most 64'),
        ("logit_bias", {"12": 101}, 'field "body.logit_bias.12": expected a number from -100'),
        ("logit_bias", {"12": "\x00"}, 'field "body.logit_bias.12": expected a number from -100'),
        ("logit_bias", [3], 'field "body.logit_bias": expected an object of at most 1024'),
        # a key that cannot be stored is quoted (escaped) in the reason, never in its path
        ("logit_bias", {"\udc80": 5}, 'field "body.logit_bias": expected token ids as keys'),
        ("logit_bias", {"-3": 5}, 'field "body.logit_bias": expected token ids as keys'),
    ],
)
def test_a_bad_control_is_a_bad_line_naming_the_field(
    tmp_path: Path, field: str, value: Any, reason: str
) -> None:
    body = {"messages": [user("x")], field: value}
    [_, item] = read_lines(tmp_path, {**OPENAI, "body": body})
    assert isinstance(item, Rejected) and item.reason.startswith(reason), item
    assert text_problem(item.reason) is None


def test_controls_are_read_top_level_and_in_a_body(tmp_path: Path) -> None:
    controls = {
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "presence_penalty": -0.5,
        "frequency_penalty": 1,
        "logit_bias": {"12": -100, "7": 2.5},
        "stop_token_ids": [2, 3],
        "min_tokens": 4,
        "logprobs": True,
        "top_logprobs": 3,
    }
    stored = {**controls, "frequency_penalty": 1.0, "logit_bias": {"12": -100.0, "7": 2.5}}
    _, top, body = read_lines(
        tmp_path,
        {"prompt": "x", **controls},
        {**OPENAI, "body": {"messages": [user("x")], **controls}},
    )
    assert top.overrides == stored and body.overrides == stored


def spec(**options: Any) -> None:
    make_spec(**{"model": "m", "draft": "random", "mode": "eagle2", "shard_size": 1, **options})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stop": ["a\x00"]}, f"--stop: {NUL} 2"),
        ({"stop": ["ok", "\udcff"]}, f"--stop #2: {SURROGATE} \\udcff at character 1"),
        ({"system": "be \x00 brief"}, f"--system: {NUL} 4"),
        ({"system": "\udce9t\udce9"}, f"--system: {SURROGATE} \\udce9 at character 1"),
        ({"model": "m" * 256}, "--model: expected at most 255 characters, got 256"),
        ({"model": "/models/\udcff.gguf"}, f"--model: {SURROGATE} \\udcff at character 9"),
        ({"draft": "/heads/" + "d" * 250}, "--draft: expected at most 255 characters, got 257"),
    ],
)
def test_job_options_get_the_same_checks(options: dict[str, Any], message: str) -> None:
    with pytest.raises(JobError) as raised:
        spec(**options)
    assert str(raised.value) == message
