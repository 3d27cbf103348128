"""Reading and validating prompt files: every format, every kind of bad line, files
that are damaged in the ways real files are (truncated, binary, huge lines), a
generated file whose good and bad lines are known, and a property test that every
non-blank line is accounted for exactly once."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer import inputs
from producer.inputs import (
    MAX_LINE_BYTES,
    InputFileError,
    Rejected,
    Request,
    plan_shards,
    read_requests,
    shard_of,
)
from producer.prompt_length import TokensAtLeast
from producer.validate import MAX_ID_CHARS, InvalidLine, request_from_object
from workers.request import MAX_COMPLETIONS

REPO_ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, lines: list[Any] | bytes, name: str = "in.jsonl") -> Path:
    """A file of `lines` (objects are dumped as JSON, str/bytes written as they are)."""
    if isinstance(lines, bytes):
        data = lines
    else:
        parts = []
        for line in lines:
            if isinstance(line, bytes):
                parts.append(line)
            elif isinstance(line, str):
                parts.append(line.encode())
            else:
                parts.append(json.dumps(line).encode())
        data = b"".join(part + b"\n" for part in parts)
    path = tmp_path / name
    path.write_bytes(data)
    return path


def read(path: Path, **kwargs: Any) -> list[Request | Rejected]:
    return list(read_requests(path, **kwargs))


def only_rejected(tmp_path: Path, line: Any) -> Rejected:
    [item] = read(write(tmp_path, [line]))
    assert isinstance(item, Rejected), item
    return item


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


# ---------------------------------------------------------------- formats


def test_prompt_lines_with_str_int_and_missing_ids(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        [
            {"id": "a", "prompt": "Hello"},
            "",
            {"id": 17, "prompt": "Int id"},
            {"prompt": "No id"},
        ],
    )
    items = read(path)
    assert items == [
        Request("a", 1, [user("Hello")]),
        Request("17", 3, [user("Int id")]),
        Request("line-4", 4, [user("No id")]),
    ]


def test_messages_line_keeps_the_conversation(tmp_path: Path) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Again", "name": "ignored"},
    ]
    [item] = read(write(tmp_path, [{"id": "m", "messages": messages}]))
    assert isinstance(item, Request)
    assert item.messages == [
        {"role": "system", "content": "Be brief."},
        user("Hi"),
        {"role": "assistant", "content": ""},
        user("Again"),
    ]
    assert item.followups == []


def test_turns_line_is_multi_turn(tmp_path: Path) -> None:
    line = {
        "question_id": 81,
        "category": "writing",
        "turns": ["First", "Second", "Third"],
        "reference": ["ignored"],
    }
    [item] = read(write(tmp_path, [line]))
    assert item == Request(
        "81", 1, [user("First")], followups=["Second", "Third"], category="writing"
    )


def test_openai_batch_line(tmp_path: Path) -> None:
    line = {
        "custom_id": "req-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "whatever",
            "messages": [{"role": "system", "content": "S"}, user("Q")],
            "max_completion_tokens": 64,
            "temperature": 0,
            "top_p": 0.9,
            "seed": 3,
            "n": 1,
            "stop": ["\n"],
        },
    }
    [item] = read(write(tmp_path, [line]))
    assert item == Request(
        "req-1",
        1,
        [{"role": "system", "content": "S"}, user("Q")],
        overrides={
            "max_new_tokens": 64,
            "temperature": 0.0,
            "top_p": 0.9,
            "seed": 3,
            "stop": ["\n"],  # honoured now (it was ignored)
        },
        custom_id="req-1",
    )
    assert isinstance(item, Request) and type(item.overrides["temperature"]) is float


def test_openai_max_tokens_spelling(tmp_path: Path) -> None:
    line = {
        "custom_id": 5,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [user("Q")], "max_tokens": 10},
    }
    [item] = read(write(tmp_path, [line]))
    assert isinstance(item, Request)
    assert (item.sample_id, item.custom_id, item.overrides) == ("5", "5", {"max_new_tokens": 10})


@pytest.mark.parametrize(
    ("fields", "overrides"),
    [
        ({"max_tokens": 5}, {"max_new_tokens": 5}),
        ({"max_new_tokens": 7, "seed": 0}, {"max_new_tokens": 7, "seed": 0}),
        ({"temperature": 1, "top_p": 1}, {"temperature": 1.0, "top_p": 1.0}),
        ({"temperature": 0.0, "top_p": 1e-9}, {"temperature": 0.0, "top_p": 1e-9}),
        ({"seed": 2**63 - 1, "max_tokens": None}, {"seed": 2**63 - 1}),
    ],
)
def test_top_level_overrides(tmp_path: Path, fields: dict, overrides: dict) -> None:
    [item] = read(write(tmp_path, [{"id": "x", "prompt": "p", **fields}]))
    assert isinstance(item, Request)
    assert item.overrides == overrides


def test_null_optional_fields_are_absent_and_unknown_fields_ignored(tmp_path: Path) -> None:
    line = {"id": None, "prompt": "p", "category": None, "temperature": None, "extra": [1, {}]}
    [item] = read(write(tmp_path, [line]))
    assert item == Request("line-1", 1, [user("p")])


def test_payload_round_trip_through_json() -> None:
    request = Request(
        "s1",
        12,
        [{"role": "system", "content": "S"}, user("Q é 😀")],
        followups=["next"],
        overrides={"max_new_tokens": 9, "temperature": 0.5},
        custom_id="s1",
        category="c",
    )
    payload = json.loads(json.dumps(request.to_payload()))
    assert Request.from_payload(payload) == request
    copy = Request.from_payload(request.to_payload())
    copy.messages[0]["content"] = "changed"
    assert request.messages[0]["content"] == "S", "payloads must not alias the request"


def test_requests_read_from_a_file_are_frozen(tmp_path: Path) -> None:
    [item] = read(write(tmp_path, [{"id": "a", "prompt": "x"}]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.sample_id = "b"  # type: ignore[misc]


def test_example_prompts_file_parses() -> None:
    items = read(REPO_ROOT / "examples" / "prompts.jsonl")
    assert all(isinstance(item, Request) for item in items)
    assert [item.sample_id for item in items] == ["capital", "haiku", "python", "math", "81"]


# ---------------------------------------------------------------- bad lines

BAD_LINES = [
    (
        '{"prompt": "x",}',
        "invalid JSON: Expecting property name enclosed in double quotes: column 16",
    ),
    ("[1, 2]", "expected a JSON object, got an array of 2 items"),
    ('"text"', 'expected a JSON object, got "text"'),
    ("null", "expected a JSON object, got null"),
    (
        {"id": "a"},
        'no prompt: expected one of the fields "prompt", "messages", "turns" or "body" '
        "(an OpenAI batch line)",
    ),
    ({"prompt": "x", "turns": ["y"]}, 'fields "prompt" and "turns": expected exactly one of them'),
    ({"prompt": None}, 'field "prompt": expected a non-empty string, got null'),
    ({"prompt": ""}, 'field "prompt": expected a non-empty string, got an empty string'),
    ({"prompt": " \n"}, 'field "prompt": expected a non-empty string, got " \\n"'),
    ({"prompt": 3}, 'field "prompt": expected a non-empty string, got 3'),
    ({"prompt": ["x"]}, 'field "prompt": expected a non-empty string, got an array of 1 items'),
    (
        {"prompt": "bad \udc80 text"},
        'field "prompt": expected valid Unicode text, got a lone surrogate \\udc80 at character 5',
    ),
    (
        {"messages": []},
        'field "messages": expected a non-empty array of messages, got an array of 0 items',
    ),
    (
        {"messages": {"role": "user"}},
        'field "messages": expected a non-empty array of messages, got an object',
    ),
    (
        {"messages": ["hi"]},
        'field "messages[0]": expected an object with "role" and "content", got "hi"',
    ),
    (
        {"messages": [{"content": "x"}]},
        'field "messages[0].role": expected one of "system", "user", "assistant", got nothing',
    ),
    (
        {"messages": [{"role": "bot", "content": "x"}]},
        'field "messages[0].role": expected one of "system", "user", "assistant", got "bot"',
    ),
    (
        {"messages": [{"role": "user"}]},
        'field "messages[0].content": expected a non-empty string, got nothing',
    ),
    (
        {"messages": [{"role": "system", "content": 1}, user("x")]},
        'field "messages[0].content": expected a string, got 1',
    ),
    (
        {"messages": [user("q"), {"role": "assistant", "content": "a"}]},
        'field "messages[1].role": expected the last message to be from "user" '
        '(the turn to answer), got "assistant"',
    ),
    (
        {"turns": []},
        'field "turns": expected a non-empty array of strings, got an array of 0 items',
    ),
    ({"turns": ["a", 3]}, 'field "turns[1]": expected a non-empty string, got 3'),
    ({"prompt": "x", "temperature": -0.1}, 'field "temperature": expected a number >= 0, got -0.1'),
    (
        {"prompt": "x", "temperature": "hot"},
        'field "temperature": expected a number >= 0, got "hot"',
    ),
    ({"prompt": "x", "temperature": True}, 'field "temperature": expected a number >= 0, got true'),
    ('{"prompt": "x", "temperature": NaN}', 'field "temperature": expected a number >= 0, got NaN'),
    (
        {"prompt": "x", "temperature": 10**400},
        'field "temperature": expected a number >= 0, got ' + "1" + "0" * 39 + "...",
    ),
    (
        '{"prompt": "x", "top_p": -Infinity}',
        'field "top_p": expected a number in (0, 1] (greater than 0, at most 1), got -Infinity',
    ),
    (
        {"prompt": "x", "top_p": 0},
        'field "top_p": expected a number in (0, 1] (greater than 0, at most 1), got 0',
    ),
    (
        {"prompt": "x", "top_p": 1.5},
        'field "top_p": expected a number in (0, 1] (greater than 0, at most 1), got 1.5',
    ),
    (
        {"prompt": "x", "max_tokens": 0},
        'field "max_tokens": expected an integer from 1 to 2147483647, got 0',
    ),
    (
        {"prompt": "x", "max_new_tokens": 2.0},
        'field "max_new_tokens": expected an integer from 1 to 2147483647, got 2.0',
    ),
    (
        {"prompt": "x", "max_tokens": 2**31},
        'field "max_tokens": expected an integer from 1 to 2147483647, got 2147483648',
    ),
    (
        {"prompt": "x", "max_tokens": 3, "max_new_tokens": 3},
        'fields "max_new_tokens" and "max_tokens": expected at most one of them',
    ),
    (
        {"prompt": "x", "seed": "1"},
        'field "seed": expected an integer from 0 to 9223372036854775807, got "1"',
    ),
    (
        {"prompt": "x", "seed": -1},
        'field "seed": expected an integer from 0 to 9223372036854775807, got -1',
    ),
    (
        {"prompt": "x", "seed": 1.0},
        'field "seed": expected an integer from 0 to 9223372036854775807, got 1.0',
    ),
    ({"prompt": "x", "category": 3}, 'field "category": expected a string, got 3'),
    ({"id": 1.5, "prompt": "x"}, 'field "id": expected a non-empty string or an integer, got 1.5'),
    (
        {"id": "", "prompt": "x"},
        'field "id": expected a non-empty string or an integer, got an empty string',
    ),
    (
        {"id": True, "prompt": "x"},
        'field "id": expected a non-empty string or an integer, got true',
    ),
    (
        {"id": "a\u0000b", "prompt": "x"},
        'field "id": expected text without NUL (\\u0000), got one at character 2',
    ),
    (
        {"prompt": "\u0000"},
        'field "prompt": expected text without NUL (\\u0000), got one at character 1',
    ),
    (
        {"messages": [{"role": "system", "content": "ab\u0000"}, user("x")]},
        'field "messages[0].content": expected text without NUL (\\u0000), got one at character 3',
    ),
    (
        {"turns": ["ok", "é\u0000"]},
        'field "turns[1]": expected text without NUL (\\u0000), got one at character 2',
    ),
    (
        {"prompt": "x", "category": "c" * (MAX_ID_CHARS + 1)},
        f'field "category": expected at most {MAX_ID_CHARS} characters, got {MAX_ID_CHARS + 1}',
    ),
    (
        {"id": "x" * (MAX_ID_CHARS + 1), "prompt": "x"},
        f'field "id": expected at most {MAX_ID_CHARS} characters, got {MAX_ID_CHARS + 1}',
    ),
    (
        {"id": "a", "question_id": 1, "turns": ["x"]},
        'fields "id" and "question_id": expected at most one sample id field',
    ),
    ({"prompt": "x", "n": 0}, f'field "n": expected an integer from 1 to {MAX_COMPLETIONS}, got 0'),
    (
        {"prompt": "x", "n": -1},
        f'field "n": expected an integer from 1 to {MAX_COMPLETIONS}, got -1',
    ),
    (
        {"prompt": "x", "n": 1000},
        f'field "n": expected an integer from 1 to {MAX_COMPLETIONS}, got 1000',
    ),
    (
        {"prompt": "x", "n": 2.0},
        f'field "n": expected an integer from 1 to {MAX_COMPLETIONS}, got 2.0',
    ),
    (
        {"prompt": "x", "n": "3"},
        f'field "n": expected an integer from 1 to {MAX_COMPLETIONS}, got "3"',
    ),
    (
        {"prompt": "x", "n": True},
        f'field "n": expected an integer from 1 to {MAX_COMPLETIONS}, got true',
    ),
]

NO_CUSTOM_ID = (
    'field "custom_id": expected a non-empty string or an integer '
    "(an OpenAI batch line needs one), got nothing"
)
OPENAI = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions"}
BAD_OPENAI_LINES = [
    (
        {**OPENAI, "url": "/v1/completions", "body": {"prompt": "x"}},
        'field "url": expected "/v1/chat/completions" (the only endpoint served), '
        'got "/v1/completions"',
    ),
    (
        {**OPENAI, "method": "GET", "body": {"messages": [user("x")]}},
        'field "method": expected "POST", got "GET"',
    ),
    ({**OPENAI, "body": "x"}, 'field "body": expected an object, got "x"'),
    (
        {**OPENAI, "body": {}},
        'field "body.messages": expected a non-empty array of messages, got nothing',
    ),
    (
        {**OPENAI, "body": {"messages": [user("x")], "n": 0}},
        f'field "body.n": expected an integer from 1 to {MAX_COMPLETIONS}, got 0',
    ),
    (
        {**OPENAI, "body": {"messages": [user("x")], "n": 1000}},
        f'field "body.n": expected an integer from 1 to {MAX_COMPLETIONS}, got 1000',
    ),
    (
        {**OPENAI, "n": 2, "body": {"messages": [user("x")], "n": 2}},
        'fields "n" and "body.n": expected at most one of them',
    ),
    (
        {**OPENAI, "body": {"messages": [user("x")], "top_p": 2}},
        'field "body.top_p": expected a number in (0, 1] (greater than 0, at most 1), got 2',
    ),
    (
        {**OPENAI, "body": {"messages": [user("x")], "max_tokens": 1, "max_completion_tokens": 2}},
        'fields "body.max_completion_tokens" and "body.max_tokens": expected at most one of them',
    ),
    (
        {**OPENAI, "temperature": 1, "body": {"messages": [user("x")], "temperature": 1}},
        'fields "temperature" and "body.temperature": expected at most one of them',
    ),
    (
        {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [user("x")]}},
        NO_CUSTOM_ID,
    ),
    (
        {
            "id": "c",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [user("x")]},
        },
        NO_CUSTOM_ID,
    ),
]


@pytest.mark.parametrize(("line", "reason"), BAD_LINES + BAD_OPENAI_LINES)
def test_each_kind_of_bad_line_has_one_precise_message(
    tmp_path: Path, line: Any, reason: str
) -> None:
    # Line 1 is good, so the bad line is line 2 and the good one is unaffected.
    items = read(write(tmp_path, [{"id": "good", "prompt": "ok"}, line]))
    assert items[0] == Request("good", 1, [user("ok")])
    assert items[1] == Rejected(2, items[1].sample_id, reason)
    assert str(items[1]) == f"line 2: {reason}"
    assert len(items) == 2


def test_rejected_carries_the_sample_id_once_read(tmp_path: Path) -> None:
    assert only_rejected(tmp_path, {"id": "a", "prompt": "x", "top_p": 0}).sample_id == "a"
    assert only_rejected(tmp_path, {"question_id": 4, "turns": []}).sample_id == "4"
    assert only_rejected(tmp_path, {"prompt": ""}).sample_id == "line-1"
    assert only_rejected(tmp_path, {"id": 1.5, "prompt": "x"}).sample_id is None
    assert only_rejected(tmp_path, "{").sample_id is None


def test_duplicate_ids_name_the_first_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        [
            {"id": "a", "prompt": "1"},
            {"id": "b", "prompt": "bad", "temperature": -1},  # refused: "b" stays free
            {"id": "a", "prompt": "3"},
            {"id": "b", "prompt": "4"},
            {"id": 7, "prompt": "5"},
            {"question_id": "7", "turns": ["6"]},  # int 7 and "7" are the same id
            {"id": "line-8", "prompt": "7"},
            {"prompt": "8"},  # its own id "line-8" is taken by line 7
            {"id": "a", "prompt": "9"},
        ],
    )
    items = read(path)
    accepted = [(i.line_no, i.sample_id) for i in items if isinstance(i, Request)]
    assert accepted == [(1, "a"), (4, "b"), (5, "7"), (7, "line-8")]
    rejected = [str(i) for i in items if isinstance(i, Rejected)]
    assert rejected == [
        'line 2: field "temperature": expected a number >= 0, got -1',
        'line 3: duplicate sample id "a": first used on line 1',
        'line 6: duplicate sample id "7": first used on line 5',
        'line 8: duplicate sample id "line-8": first used on line 7',
        'line 9: duplicate sample id "a": first used on line 1',
    ]


def test_prompts_too_long_for_the_context(tmp_path: Path) -> None:
    counted: list[str] = []

    def count_prompt_tokens(requests: list[Request]) -> list[int]:
        counted.extend(r.sample_id for r in requests)
        return [sum(len(m["content"]) for m in r.messages) for r in requests]

    path = write(
        tmp_path,
        [
            {"id": "fits", "prompt": "x" * 9},
            {"id": "full", "prompt": "x" * 10},
            {"id": "bad", "prompt": ""},
            {"id": "fits", "prompt": "y"},
        ],
    )
    items = read(path, count_prompt_tokens=count_prompt_tokens, max_context=10)
    assert isinstance(items[0], Request)
    assert str(items[1]) == (
        "line 2: prompt is 10 tokens; the model's context is 10 tokens, "
        "which leaves no room to generate"
    )
    assert items[1].sample_id == "full"
    assert isinstance(items[2], Rejected) and isinstance(items[3], Rejected)
    assert "duplicate" in items[3].reason
    assert counted == ["fits", "full"], "only valid, non-duplicate lines are tokenized"


def test_prompts_are_counted_a_window_at_a_time(tmp_path: Path) -> None:
    """One counter call per window of lines; the decisions stay those of one line after
    another: a line refused for its length does not take its id, so a later line may."""
    calls: list[list[int]] = []

    def count_prompt_tokens(requests: list[Request]) -> list[int]:
        calls.append([r.line_no for r in requests])
        return [sum(len(m["content"]) for m in r.messages) for r in requests]

    lines = [{"id": "a", "prompt": "x" * 20}, {"id": "a", "prompt": "y"}]
    lines += [{"id": f"q{i}", "prompt": "z"} for i in range(300)]
    items = read(write(tmp_path, lines), count_prompt_tokens=count_prompt_tokens, max_context=10)
    assert str(items[0]).startswith("line 1: prompt is 20 tokens")
    assert isinstance(items[1], Request) and items[1].sample_id == "a"
    assert all(isinstance(x, Request) for x in items[2:]) and len(items) == 302
    # Line 2 names line 1's id: counted once line 1 is decided. Then the rest of the
    # first window of 256 lines in the same call as line 1, and the last 46 together.
    assert calls == [[1, *range(3, 257)], [2], list(range(257, 303))]


def test_windows_are_bounded_in_bytes_as_well(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long prompts wait for their length check a few at a time, not 256 of them."""
    monkeypatch.setattr(inputs, "_CHECK_WINDOW_BYTES", 10_000)
    calls: list[list[int]] = []

    def count_prompt_tokens(requests: list[Request]) -> list[int]:
        calls.append([r.line_no for r in requests])
        return [1] * len(requests)

    lines = [{"id": f"q{i}", "prompt": "z" * (3000 if i < 10 else 10)} for i in range(40)]
    items = read(write(tmp_path, lines), count_prompt_tokens=count_prompt_tokens, max_context=10)
    assert all(isinstance(x, Request) for x in items) and len(items) == 40
    # ~3 KB lines: a window closes once it reaches 10,000 bytes, at the fourth of them.
    assert calls == [[1, 2, 3, 4], [5, 6, 7, 8], list(range(9, 41))]


def test_a_lower_bound_refuses_and_says_so(tmp_path: Path) -> None:
    def count_prompt_tokens(requests: list[Request]) -> list[int]:
        return [TokensAtLeast(50) if r.sample_id == "huge" else 3 for r in requests]

    lines = [{"id": "huge", "prompt": "x"}, {"id": "small", "prompt": "y"}]
    items = read(write(tmp_path, lines), count_prompt_tokens=count_prompt_tokens, max_context=10)
    assert str(items[0]) == (
        "line 1: prompt is at least 50 tokens; the model's context is 10 tokens, "
        "which leaves no room to generate"
    )
    assert isinstance(items[1], Request)


def test_context_arguments_go_together(tmp_path: Path) -> None:
    path = write(tmp_path, [{"prompt": "x"}])
    with pytest.raises(ValueError, match="go together"):
        read_requests(path, max_context=10)
    with pytest.raises(ValueError, match="go together"):
        read_requests(path, count_prompt_tokens=lambda requests: [1] * len(requests))
    with pytest.raises(ValueError, match="max_line_bytes"):
        read_requests(path, max_line_bytes=0)


# ---------------------------------------------------------------- damaged files


def test_blank_lines_crlf_and_bom(tmp_path: Path) -> None:
    data = b'\xef\xbb\xbf{"id": "a", "prompt": "x"}\r\n\r\n   \t \n\n{"id": "b", "prompt": "y"}\r\n'
    items = read(write(tmp_path, data))
    assert [(i.line_no, i.sample_id) for i in items] == [(1, "a"), (5, "b")]
    assert all(isinstance(i, Request) for i in items)


def test_invalid_utf8_is_a_per_line_error(tmp_path: Path) -> None:
    data = b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n{"prompt": "\xf0\x9f\x98\x80"}\n'
    items = read(write(tmp_path, data))
    assert str(items[1]) == "line 2: invalid UTF-8 at byte 16 (0xe9)"
    assert isinstance(items[0], Request) and isinstance(items[2], Request)
    assert items[2].messages[0]["content"] == "\U0001f600"


def test_truncated_last_line(tmp_path: Path) -> None:
    complete = read(write(tmp_path, b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}'))
    assert [i.sample_id for i in complete if isinstance(i, Request)] == ["a", "b"]
    cut = read(write(tmp_path, b'{"id": "a", "prompt": "x"}\n{"id": "b", "prom'))
    assert isinstance(cut[0], Request)
    assert str(cut[1]) == (
        "line 2: invalid JSON: Unterminated string starting at: column 13 "
        "(the last line has no newline: is the file truncated?)"
    )


def test_random_binary_garbage(tmp_path: Path) -> None:
    garbage = random.Random(0).randbytes(200_000)
    data = b'{"id": "first", "prompt": "x"}\n' + garbage + b'\n{"id": "last", "prompt": "y"}\n'
    items = read(write(tmp_path, data))
    lines = data.split(b"\n")[:-1]
    non_blank = [n for n, line in enumerate(lines, 1) if line and not line.isspace()]
    assert [i.line_no for i in items] == non_blank
    assert [i.sample_id for i in items if isinstance(i, Request)] == ["first", "last"]
    assert items[0].line_no == 1 and items[-1].line_no == len(lines)
    assert all(isinstance(i, Rejected) for i in items[1:-1])
    assert all(i.reason.startswith(("invalid UTF-8", "invalid JSON")) for i in items[1:-1])


def test_ten_megabyte_line(tmp_path: Path) -> None:
    prompt = "word " * (2 * 1024 * 1024)  # 10 MiB
    path = write(tmp_path, [{"id": "big", "prompt": prompt}, {"id": "after", "prompt": "x"}])
    items = read(path)
    assert isinstance(items[0], Request) and items[0].messages[0]["content"] == prompt
    assert items[1] == Request("after", 2, [user("x")])

    small = read(path, max_line_bytes=1024 * 1024)
    length = len(path.read_bytes().split(b"\n")[0])
    assert small[0] == Rejected(
        1, None, f"line too long: {length} bytes, the limit is 1048576 (max_line_bytes)"
    )
    assert small[1] == Request("after", 2, [user("x")]), "reading resumes after the long line"


@pytest.mark.parametrize("newline", [True, False])
def test_line_length_limit_boundary(tmp_path: Path, newline: bool) -> None:
    def line(n_bytes: int) -> bytes:
        text = json.dumps({"prompt": "x"}).encode()
        return text[:-1] + b" " * (n_bytes - len(text)) + b"}"

    limit = 100
    exact = write(tmp_path, line(limit) + (b"\n" if newline else b""))
    assert isinstance(read(exact, max_line_bytes=limit)[0], Request)
    over = write(tmp_path, line(limit + 1) + (b"\n" if newline else b""))
    assert read(over, max_line_bytes=limit) == [
        Rejected(1, None, "line too long: 101 bytes, the limit is 100 (max_line_bytes)")
    ]


def test_default_line_limit_is_sixteen_mebibytes() -> None:
    assert MAX_LINE_BYTES == 16 * 1024 * 1024


def test_json_that_python_refuses_late(tmp_path: Path) -> None:
    items = read(write(tmp_path, ["[" * 100_000, '{"prompt": "x", "id": ' + "9" * 5000 + "}"]))
    assert str(items[0]) == "line 1: invalid JSON: nested too deeply"
    assert isinstance(items[1], Rejected) and items[1].reason.startswith("invalid JSON: ")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read(tmp_path / "nope.jsonl")


# ---------------------------------------------------------------- parquet


def test_parquet_prompt_column(tmp_path: Path) -> None:
    table = pa.table(
        {
            "id": pa.array([10, 11, None, 13], pa.int64()),
            "prompt": ["a", "b", "c", None],
            "temperature": [None, 0.5, None, None],
            "other": ["x", "y", "z", "w"],
        }
    )
    path = tmp_path / "in.parquet"
    pq.write_table(table, path)
    items = read(path)
    assert items[:3] == [
        Request("10", 1, [user("a")]),
        Request("11", 2, [user("b")], overrides={"temperature": 0.5}),
        Request("line-3", 3, [user("c")]),
    ]
    assert items[3] == Rejected(4, "13", 'field "prompt": expected a non-empty string, got null')


def test_parquet_messages_column_across_batches(tmp_path: Path) -> None:
    n_rows = 2500  # more than one record batch and one row group
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    rows = [[{"role": "user", "content": f"q{i}"}] for i in range(n_rows)]
    rows[1200] = [{"role": "assistant", "content": "a"}]
    table = pa.table(
        {"id": [f"s{i}" for i in range(n_rows)], "messages": pa.array(rows, pa.list_(message))}
    )
    path = tmp_path / "in.PARQUET"
    pq.write_table(table, path, row_group_size=700)
    items = read(path)
    assert len(items) == n_rows
    assert [i.line_no for i in items] == list(range(1, n_rows + 1))
    assert items[2499] == Request("s2499", 2500, [user("q2499")])
    assert items[1200] == Rejected(
        1201,
        "s1200",
        'field "messages[0].role": expected the last message to be from "user" '
        '(the turn to answer), got "assistant"',
    )
    assert sum(isinstance(i, Rejected) for i in items) == 1


def test_parquet_file_level_errors(tmp_path: Path) -> None:
    no_prompt = tmp_path / "no_prompt.parquet"
    pq.write_table(pa.table({"id": [1], "text": ["x"]}), no_prompt)
    with pytest.raises(InputFileError, match='expected a "prompt"'):
        read(no_prompt)
    not_parquet = write(tmp_path, [{"prompt": "x"}], name="fake.parquet")
    with pytest.raises(InputFileError, match="not a readable Parquet file"):
        read(not_parquet)


# ---------------------------------------------------------------- shards


def test_shard_of() -> None:
    assert [shard_of(n, 3) for n in range(1, 8)] == [0, 0, 0, 1, 1, 1, 2]
    assert shard_of(1_000_000, 1000) == 999
    for bad in [(0, 3), (1, 0)]:
        with pytest.raises(ValueError):
            shard_of(*bad)


def test_plan_shards(tmp_path: Path) -> None:
    lines: list[Any] = [{"id": f"s{n}", "prompt": "x"} for n in range(1, 12)]
    lines[4] = ""  # a blank line: nothing to place
    lines[5] = {"prompt": ""}
    lines[6:9] = ["", "", ""]  # shard 2 (lines 7-9) is empty
    shards = list(plan_shards(read_requests(write(tmp_path, lines)), 3))
    assert [(s.index, s.first_line, s.last_line) for s in shards] == [
        (0, 1, 3),
        (1, 4, 6),
        (3, 10, 12),
    ]
    assert [r.sample_id for r in shards[0].requests] == ["s1", "s2", "s3"]
    assert [r.sample_id for r in shards[1].requests] == ["s4"]
    assert [r.line_no for r in shards[1].rejected] == [6]
    assert [r.sample_id for r in shards[2].requests] == ["s10", "s11"]
    out_of_order = [Request("b", 5, [user("x")]), Request("a", 2, [user("x")])]
    with pytest.raises(ValueError, match="not in file order"):
        list(plan_shards(out_of_order, 3))


# ---------------------------------------------------------------- benchmark sets


def shared_benchmarks() -> Path | None:
    for shared in (REPO_ROOT / "shared", REPO_ROOT.parent / "shared"):
        if (shared / "benchmarks").is_dir():
            return shared / "benchmarks"
    return None


@pytest.mark.parametrize("task", ["mt_bench", "humaneval", "gsm8k", "alpaca"])
def test_benchmark_question_files_parse_fully(task: str) -> None:
    benchmarks = shared_benchmarks()
    if benchmarks is None:
        pytest.skip(f"no shared/benchmarks next to or inside the repository ({REPO_ROOT})")
    path = benchmarks / task / "question.jsonl"
    expected = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    items = read(path)
    assert len(items) == len(expected) == 80
    for item, question in zip(items, expected, strict=True):
        assert isinstance(item, Request), str(item)
        assert item.sample_id == str(question["question_id"])
        assert [item.messages[0]["content"], *item.followups] == question["turns"]
        assert item.category == question["category"]
    if task == "mt_bench":
        assert all(len(item.followups) == 1 for item in items)


# ---------------------------------------------------------------- generated files


def good_line(rng: random.Random, k: int, line_no: int) -> tuple[Any, str]:
    """A valid line of a random format, and the sample id it must get."""
    text = "".join(rng.choice('abc xyz é😀\n"\\') for _ in range(rng.randint(1, 30))) + "?"
    kind = rng.randrange(6)
    if kind == 0:
        return {"id": f"s{k}", "prompt": text}, f"s{k}"
    if kind == 1:
        return {"prompt": text, "max_tokens": rng.randint(1, 512)}, f"line-{line_no}"
    if kind == 2:
        messages = [{"role": "system", "content": "sys"}, user(text)]
        return {"id": f"m{k}", "messages": messages, "temperature": rng.random()}, f"m{k}"
    if kind == 3:
        return {"question_id": 10**6 + k, "turns": [text, text + "!"]}, str(10**6 + k)
    if kind == 4:
        body = {"messages": [user(text)], "seed": k, "max_completion_tokens": 8}
        line = {**OPENAI, "custom_id": f"c{k}", "body": body}
        return line, f"c{k}"
    return {"id": f"t{k}", "prompt": text, "top_p": rng.uniform(0.01, 1.0)}, f"t{k}"


def bad_line(rng: random.Random, accepted: list[tuple[int, str]]) -> tuple[bytes, str]:
    """An invalid line of a random kind, and a part of the reason it must get."""
    kinds: list[tuple[Any, str]] = [
        ('{"id": "x", "prompt": "a"', "invalid JSON: "),
        ("[1, 2, 3]", "expected a JSON object, got an array"),
        ({"prompt": "x", "temperature": -1}, 'field "temperature"'),
        ({"messages": [{"role": "robot", "content": "x"}]}, 'field "messages[0].role"'),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "last message to be from"),
        ({"prompt": ""}, 'field "prompt": expected a non-empty string'),
        ({"prompt": "x", "top_p": 0}, 'field "top_p"'),
        ({**OPENAI, "url": "/v1/embeddings", "body": {}}, 'field "url"'),
        (b"\xff" + rng.randbytes(20).replace(b"\n", b"#"), "invalid UTF-8 at byte 1 (0xff)"),
    ]
    if accepted:
        first_line, sample_id = rng.choice(accepted)
        line = {"id": sample_id, "prompt": "again"}
        kinds.append(
            (line, f"duplicate sample id {json.dumps(sample_id)}: first used on line {first_line}")
        )
    line, reason = rng.choice(kinds)
    if isinstance(line, bytes):
        return line, reason
    return (line if isinstance(line, str) else json.dumps(line)).encode(), reason


def test_generated_file_of_good_and_bad_lines(tmp_path: Path) -> None:
    rng = random.Random(1234)
    chunks: list[bytes] = []
    expected: dict[int, tuple[str, str]] = {}
    accepted: list[tuple[int, str]] = []
    for line_no in range(1, 5001):
        roll = rng.random()
        if roll < 0.05:
            chunks.append(rng.choice([b"", b"  ", b"\t", b"\r"]))
        elif roll < 0.7:
            line, sample_id = good_line(rng, line_no, line_no)
            chunks.append(json.dumps(line, ensure_ascii=rng.random() < 0.5).encode())
            expected[line_no] = ("ok", sample_id)
            accepted.append((line_no, sample_id))
        else:
            data, reason = bad_line(rng, accepted)
            chunks.append(data)
            expected[line_no] = ("bad", reason)
    # The last line has no newline; make sure it is not blank so it counts.
    line, sample_id = good_line(rng, 5001, 5001)
    chunks.append(json.dumps(line).encode())
    expected[5001] = ("ok", sample_id)
    path = write(tmp_path, b"\n".join(chunks))

    items = read(path)
    got: dict[int, tuple[str, str]] = {}
    for item in items:
        assert item.line_no not in got, f"line {item.line_no} reported twice"
        if isinstance(item, Request):
            got[item.line_no] = ("ok", item.sample_id)
        else:
            got[item.line_no] = ("bad", item.reason)
    assert got.keys() == expected.keys()
    for line_no, (status, value) in expected.items():
        assert got[line_no][0] == status, (line_no, got[line_no], value)
        if status == "ok":
            assert got[line_no][1] == value
        else:
            assert value in got[line_no][1], (line_no, got[line_no][1], value)
    assert 3000 < sum(status == "ok" for status, _ in got.values()) < 3600


JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.just(10**400)
    | st.floats()
    | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "id",
                    "prompt",
                    "messages",
                    "turns",
                    "role",
                    "content",
                    "body",
                    "url",
                    "method",
                    "custom_id",
                    "question_id",
                    "temperature",
                    "top_p",
                    "seed",
                    "max_tokens",
                    "x",
                ]
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=12,
)
LINE = st.one_of(
    st.binary(max_size=40),
    JSONISH.map(lambda v: json.dumps(v).encode()),
    JSONISH.map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    st.sampled_from(
        [b"", b" ", b"\r", b"\xef\xbb\xbf", b'{"prompt": "x"}', b'{"prompt": "x", "id": 1}']
    ),
)


def strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings_in(item)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(LINE, max_size=12), final_newline=st.booleans(), limit=st.integers(1, 120))
def test_every_non_blank_line_is_accounted_for_once(
    tmp_path_factory: pytest.TempPathFactory, lines: list[bytes], final_newline: bool, limit: int
) -> None:
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    path = tmp_path_factory.getbasetemp() / "property.jsonl"
    path.write_bytes(data)

    physical = data.split(b"\n")
    if physical[-1] == b"":
        physical.pop()
    expected = []
    for line_no, line in enumerate(physical, 1):
        if len(line) > limit:
            expected.append(line_no)
            continue
        if line_no == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        if line and not line.isspace():
            expected.append(line_no)

    items = read(path, max_line_bytes=limit)
    assert [item.line_no for item in items] == expected
    ids = [item.sample_id for item in items if isinstance(item, Request)]
    assert len(ids) == len(set(ids))
    for item in items:
        if isinstance(item, Request):
            assert item.messages[-1]["role"] == "user"
            # Storable as Postgres JSONB: strict JSON, valid UTF-8, no NUL in any string.
            payload = item.to_payload()
            json.dumps(payload, ensure_ascii=False, allow_nan=False).encode("utf-8")
            assert not any("\x00" in text for text in strings_in(payload))
            assert Request.from_payload(item.to_payload()) == item
        else:
            assert isinstance(item, Rejected) and item.reason
            str(item).encode("utf-8")  # storable and printable


@given(obj=JSONISH)
@settings(max_examples=300, deadline=None)
def test_validation_only_raises_its_own_error(obj: Any) -> None:
    try:
        request = request_from_object(obj, 1)
    except InvalidLine as exc:
        assert str(exc)
    else:
        assert request.messages and request.messages[-1]["role"] == "user"


@pytest.mark.parametrize(
    ("fields", "stop"),
    [
        ({"stop": "###"}, ["###"]),
        ({"stop": ["a", "b c", "\n\n", "END"]}, ["a", "b c", "\n\n", "END"]),
        ({"stop": None}, None),
    ],
)
def test_stop_is_a_string_or_up_to_four(tmp_path: Path, fields: dict, stop: Any) -> None:
    [item] = read(write(tmp_path, [{"id": "x", "prompt": "p", **fields}]))
    assert item.overrides.get("stop") == stop
    body = {"messages": [user("p")], **fields}
    [line] = read(write(tmp_path, [{**OPENAI, "body": body}]))
    assert line.overrides.get("stop") == stop


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (["a", "b", "c", "d", "e"], "an array of 5 items"),
        (3, "3"),
        ([], "an array of 0 items"),
        (["ok", ""], "an array of 2 items"),
        (["ok", 7], "an array of 2 items"),
    ],
)
def test_bad_stop_values_name_the_line_and_field(tmp_path: Path, value: Any, shown: str) -> None:
    items = read(write(tmp_path, [{"id": "good", "prompt": "ok"}, {"prompt": "x", "stop": value}]))
    assert items[0] == Request("good", 1, [user("ok")])
    assert str(items[1]) == (
        'line 2: field "stop": expected a non-empty string or a list of 1 to 4 non-empty '
        f"strings, got {shown}"
    )


def test_n_per_line_in_the_body_or_from_the_job(tmp_path: Path) -> None:
    lines = [
        {"id": "a", "prompt": "p", "n": 3},
        {**OPENAI, "body": {"messages": [user("p")], "n": 2}},
        {"id": "b", "prompt": "p"},
        {"id": "d", "prompt": "p", "n": None},  # null: not set
    ]
    assert [r.n for r in read(write(tmp_path, lines))] == [3, 2, 1, 1]
    assert [r.n for r in read(write(tmp_path, lines), n=4)] == [3, 2, 4, 4]
    parquet = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["x", "y"], "prompt": ["p", "q"], "n": [2, None]}), parquet)
    assert [r.n for r in read(parquet, n=5)] == [2, 5]


def test_a_completion_id_taken_by_another_line_is_a_duplicate(tmp_path: Path) -> None:
    lines = [
        {"id": "a", "prompt": "p", "n": 2},
        {"id": "a#1", "prompt": "p"},  # the second completion of line 1
        {"id": "a", "prompt": "p", "n": 2},  # the same line id again, even with n > 1
        {"id": "b#0", "prompt": "p"},
        {"id": "b", "prompt": "p", "n": 2},  # its first completion's id is line 4's
    ]
    items = read(write(tmp_path, lines))
    assert [str(r) for r in items[1:3]] == [
        'line 2: duplicate sample id "a#1": first used on line 1',
        'line 3: duplicate sample id "a": first used on line 1',
    ]
    assert isinstance(items[3], Request)
    assert str(items[4]) == 'line 5: duplicate sample id "b#0": first used on line 4'
