"""A line's response_format (producer/control_fields.py): every form is stored as the JSON
text of what decides its grammar, keys in the order given (Postgres's JSONB would sort
them, and a schema's properties come in the answer in that order); one that does not
compile, or holds a text that cannot be stored, is a bad line naming its line and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle2_core.config import DecodeConfig
from producer.inputs import Rejected, Request
from producer.storable import text_problem
from tests.producer.test_validate import OPENAI, read_lines, user

SCHEMA = {
    "type": "object",
    "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}},
    "required": ["zeta", "alpha"],
}
GOOD_FORMS = [
    ({"type": "json_object"}, {"type": "json_object"}),
    (
        {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": SCHEMA}},
        {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
    ),
    ({"type": "regex", "regex": "[0-9]{3}-[a-z]+"}, {"type": "regex", "regex": "[0-9]{3}-[a-z]+"}),
    (
        {"type": "grammar", "grammar": 'root ::= "yes" | "no"'},
        {"type": "grammar", "grammar": 'root ::= "yes" | "no"'},
    ),
    ({"type": "text"}, {"type": "text"}),
]


@pytest.mark.parametrize(("given", "stored"), GOOD_FORMS)
def test_every_form_is_stored_as_the_text_of_its_grammar_top_level_and_in_a_body(
    tmp_path: Path, given: dict[str, Any], stored: dict[str, Any]
) -> None:
    _, top, body = read_lines(
        tmp_path,
        {"prompt": "x", "response_format": given},
        {**OPENAI, "body": {"messages": [user("x")], "response_format": given}},
    )
    assert isinstance(top, Request) and isinstance(body, Request)
    assert top.overrides == body.overrides == {"response_format": json.dumps(stored)}
    config = DecodeConfig.from_settings("eagle2", top.overrides)
    expected = None if given["type"] == "text" else json.dumps(stored)
    assert config.response_format == expected  # for json_schema: zeta before alpha


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("json", 'field "body.response_format": expected an object with "type": one of text,'),
        ({"type": "xml"}, 'field "body.response_format.type": expected one of text, json_object'),
        (
            {"type": "json_schema", "json_schema": {"name": "x"}},
            'field "body.response_format.json_schema.schema": expected an object (a JSON schema)',
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": BAD_SCHEMA}},
            'field "body.response_format.json_schema.schema": expected a JSON schema that '
            "compiles (",
        ),
        (
            {"type": "regex", "regex": "(ab"},
            'field "body.response_format.regex": expected a regular expression that compiles (',
        ),
        ({"type": "regex", "regex": ""}, 'field "body.response_format.regex": expected a non-'),
        (
            {"type": "grammar", "grammar": "root ::= missing"},
            'field "body.response_format.grammar": expected a grammar that compiles (',
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {"enum": ["a\x00"]}}},
            'field "body.response_format.json_schema.schema.enum[0]": expected text without NUL',
        ),
    ],
)
def test_a_format_that_does_not_compile_is_a_bad_line_naming_the_field(
    tmp_path: Path, value: Any, reason: str
) -> None:
    body = {"messages": [user("x")], "response_format": value}
    [_, item] = read_lines(tmp_path, {**OPENAI, "body": body})
    assert isinstance(item, Rejected) and item.line_no == 2
    assert item.reason.startswith(reason), item.reason
    assert text_problem(item.reason) is None


def test_a_grammar_and_min_tokens_exclude_each_other(tmp_path: Path) -> None:
    """The grammar decides where the answer may end; min_tokens would hold the end back."""
    json_object = {"type": "json_object"}
    _, both, text = read_lines(
        tmp_path,
        {"prompt": "x", "min_tokens": 3, "response_format": json_object},
        {"prompt": "x", "min_tokens": 3, "response_format": {"type": "text"}},
    )
    assert isinstance(both, Rejected)
    assert both.reason.startswith(
        'fields "min_tokens" and "response_format": expected at most one of them'
    )
    assert isinstance(text, Request)  # {"type": "text"} constrains nothing
