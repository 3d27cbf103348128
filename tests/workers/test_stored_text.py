"""Outputs come back exactly as the model wrote them, from Postgres, SQLite, Parquet and the
exports, even with characters no sink holds: NUL and lone surrogates, as a byte-level
vocabulary decoded with surrogateescape writes them."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Engine
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizer

from eagle2_core.engine import Engine as DecodeEngine
from eagle2_core.models import target_from_model
from producer.export import export_job
from tests.workers.manifests import store_job
from workers import db
from workers.decoding import RowOrigin, SampleDecoder
from workers.parquet_sink import shard_path, write_shard_parquet
from workers.request import Request
from workers.shards import process_shard
from workers.stored_text import MARK, stored, stored_row, unstored, unstored_row

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Characters that need care, beside ordinary ones.
HARD = ["\x00", "\ud800", "\udc80", "\udfff", "\\", "\\u0000", MARK, "u", "0", "a", "é", "\n"]
TEXTS = st.lists(st.sampled_from(HARD) | st.text(max_size=4), max_size=12).map("".join)


@given(text=TEXTS)
def test_stored_is_storable_and_unstored_is_its_inverse(text: str) -> None:
    kept = stored(text)
    assert unstored(kept) == text
    assert "\x00" not in kept
    kept.encode("utf-8")  # strict: no lone surrogate left
    if not text.startswith(MARK) and "\x00" not in text and text.isascii():
        assert kept == text  # what SQL and DuckDB read is the text itself


def test_plain_outputs_are_stored_as_written() -> None:
    for text in ("", "code: a\\nb \\u0000 literally", "ü ✓ \t", "x\uffff"):
        assert stored(text) == text
    assert stored("a\x00b\\") == MARK + "a\\u0000b\\\\"
    assert stored("\uffffz") == MARK + "\uffffz"


ODD = ["a\x00b", "\udc80\udcff", "\ud83d\ude00 pair of surrogates", "\\u0000 is not NUL", MARK]


def odd_rows(request_rows: list[dict[str, Any]], fake_sample: Any) -> list[dict[str, Any]]:
    rng = random.Random(3)
    rows = []
    for i, request_row in enumerate(request_rows):
        text = ODD[i % len(ODD)]
        turns = [ODD[(i + 1) % len(ODD)], text]
        rows.append(fake_sample(request_row, rng, output_text=text, turn_outputs=turns))
    return rows


def test_database_and_parquet_give_back_every_character(
    engine: Engine, make_job: Any, fake_sample: Any, tmp_path: Path
) -> None:
    job_id, request_rows = make_job(engine, n=len(ODD), shard_size=len(ODD))
    rows = odd_rows(request_rows, fake_sample)
    assert db.insert_samples(engine, rows) == len(rows)
    back = {r["sample_id"]: r for r in db.iter_samples(engine, job_id)}
    for row in rows:
        assert back[row["sample_id"]]["output_text"] == row["output_text"]
        assert back[row["sample_id"]]["turn_outputs"] == row["turn_outputs"]
    path = write_shard_parquet(tmp_path, job_id, 0, db.iter_samples(engine, job_id), {})
    from_file = [unstored_row(r) for r in pq.read_table(path).to_pylist()]
    assert [(r["output_text"], r["turn_outputs"]) for r in from_file] == [
        (r["output_text"], r["turn_outputs"]) for r in rows
    ]
    assert stored_row(rows[0])["output_text"].startswith(MARK)  # what the file holds


# Token i decodes to byte BYTES[i]: NUL, invalid UTF-8 (surrogateescape: \udc80, \udcff),
# a two-byte character and plain letters. The tokenizer's end of sequence (id 8) is outside
# the model's vocabulary: every answer runs its full length.
BYTES = [0x00, ord("a"), ord(" "), 0x80, 0xC3, 0xA9, 0xFF, ord("b")]


class ByteTokenizer(PreTrainedTokenizer):
    """A byte vocabulary decoded as Python decodes bytes it cannot read: surrogateescape."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(eos_token="</s>", **kwargs)
        self.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}b"

    @property
    def vocab_size(self) -> int:
        return len(BYTES)

    def get_vocab(self) -> dict[str, int]:
        return {chr(b): i for i, b in enumerate(BYTES)} | dict(self.added_tokens_encoder)

    def _tokenize(self, text: str, **_: Any) -> list[str]:
        return [chr(b) for b in text.encode("utf-8", "surrogateescape") if b in BYTES]

    def _convert_token_to_id(self, token: str) -> int:
        return BYTES.index(ord(token)) if len(token) == 1 and ord(token) in BYTES else 1

    def _convert_id_to_token(self, index: int) -> str:
        return chr(BYTES[index])

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(ord(t) for t in tokens).decode("utf-8", "surrogateescape")


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def byte_decoder() -> SampleDecoder:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(BYTES),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    target = target_from_model(LlamaForCausalLM(config), ByteTokenizer(), "byte-llama")
    return SampleDecoder(DecodeEngine(target, None), model="byte-llama", draft=None, mode="vanilla")


def test_outputs_from_the_decoder_are_stored_exactly(
    engine: Engine, byte_decoder: SampleDecoder, tmp_path: Path
) -> None:
    requests = [
        Request(f"s{i}", i + 1, messages=[user("ab" * (i + 1))], overrides={"seed": i})
        for i in range(6)
    ]
    params = {"max_new_tokens": 24, "temperature": 1.5}
    job_id = store_job(engine, requests, 6, params, model="byte-llama", draft=None)
    process_shard(engine, byte_decoder, job_id, 0, tmp_path, "cpu0@test")
    rows = {r["sample_id"]: r for r in db.iter_samples(engine, job_id)}
    written = [rows[f"s{i}"]["output_text"] for i in range(6)]
    # The premise: the model wrote what no sink holds as it is.
    assert any("\x00" in text for text in written)
    assert any(any(0xD800 <= ord(c) <= 0xDFFF for c in text) for text in written)
    again = list(byte_decoder.decode_many(requests, params, RowOrigin(job_id, 0, "w")))
    again_by_id = {r["sample_id"]: r["output_text"] for r in again}
    assert [again_by_id[f"s{i}"] for i in range(6)] == written  # seeded: what it wrote
    table = pq.read_table(shard_path(tmp_path, job_id, 0)).to_pylist()
    assert [unstored_row(r)["output_text"] for r in table] == written
    out = tmp_path / "export.jsonl"
    export_job(engine, job_id, "jsonl", out)
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [line["output_text"] for line in lines] == written
