"""The real default model and head under a JSON schema: the answer parses as JSON that fits
the schema, and is the same token for token in EAGLE-2 and vanilla mode and in plain
constrained decoding (transformers' forward, llguidance's mask, argmax)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from eagle2_core.config import DecodeConfig
from eagle2_core.registry import encode_chat
from tests.eagle2_core.test_grammar import plain_constrained
from tests.eagle2_core.test_smollm2 import FIXED_TREE, engine  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2030},
        "genres": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
    },
    "required": ["title", "year", "genres", "rating"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "film", "schema": SCHEMA}}
QUESTIONS = [
    "Describe a famous film as JSON with its title, year, genres and rating.",
    "Give me a JSON record of a classic novel: title, year, genres, rating.",
]
TOKENS = 120


@pytest.mark.parametrize("question", QUESTIONS)
def test_a_json_schema_answer_fits_it_and_is_the_same_in_every_mode(engine, question):  # noqa: F811
    target = engine.target
    ids = encode_chat(target.tokenizer, [{"role": "user", "content": question}])
    settings = {"max_new_tokens": TOKENS, "response_format": FORMAT, "total_tokens": FIXED_TREE}
    answers = {
        mode: engine.generate(ids, DecodeConfig.from_settings(mode, settings))
        for mode in ("eagle2", "vanilla")
    }
    assert answers["eagle2"].token_ids == answers["vanilla"].token_ids
    assert answers["eagle2"].token_ids == plain_constrained(target, ids, TOKENS, FORMAT)
    assert answers["eagle2"].finish_reason == "stop"
    jsonschema.validate(json.loads(answers["eagle2"].text), SCHEMA)
