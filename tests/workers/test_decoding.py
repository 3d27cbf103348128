"""SampleDecoder: settings precedence, multi-turn aggregation, failure rows, draft policy."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from eagle2_core.config import JOB_DECODE_KEYS, DecodeConfig
from eagle2_core.draft import save_draft
from eagle2_core.engine import Engine
from eagle2_core.registry import DraftUnavailableError, encode_chat
from tests.eagle2_core.tiny import tiny_head, tiny_target
from workers.decoding import RowOrigin, SampleDecoder
from workers.request import Request
from workers.schema import SAMPLE_FIELDS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}t2"
JOB = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "tree_width": 4, "tree_depth": 3}


def chat_target(**kwargs):
    """A tiny random Llama whose tokenizer has a chat template (tiny ones have none)."""
    target = tiny_target(**kwargs)
    target.tokenizer.chat_template = CHAT_TEMPLATE
    return target


def save_tiny_model(root: Path) -> tuple[Path, Path]:
    """A tiny model + draft head on disk, loadable by name as real workers load them."""
    target = chat_target()
    model_dir, draft_dir = root / "tiny-llama", root / "tiny-eagle"
    target.model.save_pretrained(model_dir)
    target.tokenizer.save_pretrained(model_dir)
    save_draft(tiny_head(target), draft_dir)
    return model_dir, draft_dir


def request(sample_id: str = "s1", followups=(), overrides=None, content="t5 t6 t7") -> Request:
    return Request(
        sample_id=sample_id,
        line_no=3,
        messages=[{"role": "user", "content": content}],
        followups=list(followups),
        overrides=dict(overrides or {}),
        custom_id="c-1",
        category="math",
    )


@pytest.fixture(scope="module")
def decoder() -> SampleDecoder:
    target = chat_target(eos=None)  # no EOS: every answer runs to max_new_tokens
    return SampleDecoder(
        Engine(target, tiny_head(target)), model="tiny-llama", draft="tiny-eagle", mode="eagle2"
    )


ORIGIN = RowOrigin("job1", 2, "cpu0@test", "cpu")


def decode(decoder: SampleDecoder, req: Request, params=JOB, origin=ORIGIN) -> dict:
    """The row of one request."""
    return next(decoder.decode_many([req], params, origin))


def test_row_has_every_samples_field_and_identity(decoder):
    row = decode(decoder, request())
    assert set(row) == set(SAMPLE_FIELDS)
    assert row["status"] == "ok" and row["error"] is None
    assert (row["job_id"], row["sample_id"], row["line_no"], row["shard"]) == ("job1", "s1", 3, 2)
    assert (row["custom_id"], row["category"]) == ("c-1", "math")
    assert (row["model"], row["draft"], row["mode"]) == ("tiny-llama", "tiny-eagle", "eagle2")
    assert (row["worker"], row["device"]) == ("cpu0@test", "cpu")
    assert row["completion_tokens"] == 8 and row["finish_reason"] == "length"
    assert row["turn_outputs"] == [row["output_text"]]


def test_per_line_overrides_win_over_job_params(decoder):
    req = request(overrides={"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "seed": 11})
    settings = decoder.config_for(req, {**JOB, "seed": 5, "shard_size": 4})
    assert settings == {
        **{key: getattr(DecodeConfig(), key) for key in JOB_DECODE_KEYS},
        "max_new_tokens": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 11,
        "tree_width": 4,
        "tree_depth": 3,
    }
    row = decode(decoder, req)
    assert row["completion_tokens"] == 3
    assert (row["temperature"], row["top_p"], row["seed"]) == (0.7, 0.9, 11)
    # A seeded sampled answer is reproducible.
    assert decode(decoder, req)["output_text"] == row["output_text"]
    # Without overrides the job's parameters apply.
    plain = decode(decoder, request(), {**JOB, "max_new_tokens": 5, "seed": 5})
    assert plain["completion_tokens"] == 5 and plain["seed"] == 5


def test_multi_turn_sums_statistics_over_turns(decoder):
    req = request(followups=["t8 t9", "t10"])
    row = decode(decoder, req)
    config = DecodeConfig.from_settings("eagle2", decoder.config_for(req, JOB))
    turns = decoder.engine.chat(req.messages, req.followups, config)
    assert row["turn_outputs"] == [t.text for t in turns]
    assert row["output_text"] == turns[-1].text
    assert row["completion_tokens"] == 3 * 8 == sum(t.completion_tokens for t in turns)
    assert row["prompt_tokens"] == sum(t.prompt_tokens for t in turns)
    assert row["n_cycles"] == sum(t.stats.n_cycles for t in turns)
    width = max(len(t.stats.accept_hist) for t in turns)
    hist = [sum(t.stats.accept_hist[k] for t in turns if k < len(t.stats.accept_hist))
            for k in range(width)]  # fmt: skip
    assert row["accept_hist"] == hist and sum(hist) == row["n_cycles"]
    assert len(row["depth_attempts"]) == len(row["depth_accepts"])
    assert all(a <= t for a, t in zip(row["depth_accepts"], row["depth_attempts"], strict=True))
    rounds = sum(t.stats.round_tokens for t in turns)
    assert row["mean_accept_length"] == pytest.approx(rounds / row["n_cycles"])
    assert row["total_ms"] >= row["draft_ms"] + row["verify_ms"] > 0
    assert row["tokens_per_s"] == pytest.approx(24 / (row["total_ms"] / 1000))


def assert_failed(row: dict, error: str) -> None:
    assert set(row) == set(SAMPLE_FIELDS)
    assert row["status"] == "failed" and error in row["error"]
    measured = ("output_text", "completion_tokens", "n_cycles", "total_ms", "accept_hist")
    assert all(row[k] is None for k in measured)
    assert row["sample_id"] == "s1" and row["model"] == "tiny-llama"


def test_too_long_prompt_is_a_failed_row(decoder):
    long_prompt = " ".join(["t5"] * 600)  # the tiny model's context holds 512
    assert_failed(decode(decoder, request(content=long_prompt)), "PromptError")


def test_invalid_settings_are_a_failed_row(decoder):
    row = decode(decoder, request(overrides={"temperature": -1.0}))
    assert_failed(row, "ValueError")
    assert row["temperature"] == -1.0


def test_controls_from_the_job_and_the_line_reach_the_decoder(decoder):
    """A job's logit_bias ({"id": bias} in JSON) and a line's repetition_penalty and
    logprobs decode as DecodeConfig says; the logprobs are stored per token."""
    job = {**JOB, "logit_bias": {"7": 5.0}, "max_new_tokens": 12}
    overrides = {"repetition_penalty": 1.4, "logprobs": True, "top_logprobs": 2}
    req = request(overrides=overrides)
    row = decode(decoder, req, job)
    config = DecodeConfig(
        mode="eagle2", max_new_tokens=12, tree_width=4, tree_depth=3, logit_bias=((7, 5.0),),
        **overrides,
    )  # fmt: skip
    ids = encode_chat(decoder.engine.target.tokenizer, req.messages)
    want = decoder.engine.generate(ids, config)
    plain = decode(decoder, request(), {**JOB, "max_new_tokens": 12})
    assert row["output_text"] == want.text != plain["output_text"]
    assert len(row["logprobs"]) == row["completion_tokens"]
    for stored, entry in zip(row["logprobs"], want.logprobs, strict=True):  # a batch rounds apart
        assert stored["token_id"] == entry.token_id and stored["top_ids"] == list(entry.top_ids)
        assert stored["logprob"] == pytest.approx(entry.logprob, abs=1e-4)
        assert stored["top_logprobs"] == pytest.approx(list(entry.top_logprobs), abs=1e-4)
    assert decode(decoder, request())["logprobs"] is None


def test_a_token_id_outside_the_vocabulary_is_a_failed_row_naming_the_field(decoder):
    row = decode(decoder, request(overrides={"logit_bias": {"5000": 1.0}}))
    assert_failed(row, "logit_bias: token id 5000 is outside the model's vocabulary")
    row = decode(decoder, request(overrides={"stop_token_ids": [3, 96]}))
    assert_failed(row, "stop_token_ids: token id 96")


def test_engine_crash_raises_instead_of_failing_every_row(decoder, monkeypatch):
    """A lost device or a bug would fail every sample alike: the shard must fail visibly
    (and be retried) rather than store a shard of failed rows."""

    def boom(*_args, **_kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr("workers.decoding.BatchDecoder.step", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        decode(decoder, request())


def test_batched_rows_equal_one_at_a_time(decoder):
    """Batch size changes throughput, never a row: same outputs, tokens, cycles; rows come
    out as they finish, failed ones at once (the batch goes on), and multi-turn requests
    keep their turns."""
    reqs = [
        request("short", overrides={"max_new_tokens": 2}),
        request("long", followups=["t8 t9"], content="t5 " * 40),
        request("bad", overrides={"temperature": -1.0}),
        request("too-long", content=" ".join(["t5"] * 600)),
        request("no-such-token", overrides={"logit_bias": {"5000": 1.0}}),
        request("sampled", overrides={"temperature": 1.0, "seed": 3}),
    ]
    alone = {r.sample_id: decode(decoder, r) for r in reqs}
    batched = SampleDecoder(
        decoder.engine, model="tiny-llama", draft="tiny-eagle", mode="eagle2", batch_size=3
    )
    rows = list(batched.decode_many(reqs, JOB, ORIGIN))
    assert sorted(r["sample_id"] for r in rows) == sorted(alone)
    failed = {"bad", "too-long", "no-such-token"}  # failed at once: no decoding
    assert {r["sample_id"] for r in rows[:3]} == failed
    keys = ("status", "error", "output_text", "turn_outputs", "completion_tokens", "n_cycles")
    for row in rows:
        assert {k: row[k] for k in keys} == {k: alone[row["sample_id"]][k] for k in keys}


def test_speculative_modes_refuse_to_run_without_a_draft(tmp_path):
    target = chat_target()
    for mode in ("eagle2", "eagle1"):
        with pytest.raises(DraftUnavailableError):
            SampleDecoder(Engine(target), model="tiny", draft=None, mode=mode)
        with pytest.raises(DraftUnavailableError, match="--draft"):
            SampleDecoder.load(str(tmp_path / "not-loaded"), None, mode)  # refused before load
    vanilla = SampleDecoder(Engine(target), model="tiny", draft="ignored", mode="vanilla")
    row = decode(vanilla, request(), origin=RowOrigin("job1", 0, "w"))
    assert row["status"] == "ok" and row["draft"] is None and row["device"] == "cpu fp32"


def test_load_by_name_from_disk_and_random_head_warns(tmp_path, caplog):
    model_dir, draft_dir = save_tiny_model(tmp_path)
    loaded = SampleDecoder.load(str(model_dir), str(draft_dir), "eagle2")
    assert loaded.draft == str(draft_dir) and loaded.engine.draft_head is not None
    assert decode(loaded, request())["status"] == "ok"
    with caplog.at_level(logging.WARNING, logger="workers.decoding"):
        rand = SampleDecoder.load(str(model_dir), "random", "eagle1", target=loaded.engine.target)
    assert "RANDOM, UNTRAINED DRAFT HEAD" in caplog.text
    assert rand.engine.target is loaded.engine.target and rand.draft == "random"


def test_an_auto_batch_size_is_read_from_the_cost_table(decoder, monkeypatch):
    auto = SampleDecoder(decoder.engine, model="tiny-llama", draft="tiny-eagle")
    monkeypatch.setattr(decoder.engine, "auto_batch_size", lambda on_measure=None: 48)
    assert auto.batch_size == 48 and auto.batch_size == 48
    asked = []
    monkeypatch.setattr(
        decoder.engine, "auto_rows_for", lambda n, on_measure=None: asked.append(n) or n // 2
    )
    assert [auto.rows_for(n) for n in (30, 80)] == [15, 40] and asked == [30, 80]
    fixed = SampleDecoder(decoder.engine, model="m", draft=None, mode="vanilla", batch_size=48)
    assert fixed.rows_for(80) == 48  # a number given is a number kept
    with pytest.raises(ValueError, match="'auto' or >= 1"):
        SampleDecoder(decoder.engine, model="m", draft=None, mode="vanilla", batch_size=0)


def test_a_lines_response_format_wins_over_the_jobs_and_text_frees_it():
    """Formats as the producer stores them (their JSON text): the job's constrains every
    line that says nothing, a line's own replaces it, {"type": "text"} lifts it."""
    target = chat_target(byte_level=True, seed=5)
    decoder = SampleDecoder(
        Engine(target, tiny_head(target, seed=6)), model="tiny", draft="tiny", mode="eagle2"
    )
    digits = json.dumps({"type": "regex", "regex": "[0-9]{4}"})
    letters = json.dumps({"type": "regex", "regex": "[a-z]{3}"})
    job = {**JOB, "max_new_tokens": 12, "response_format": digits}
    rows = {
        r["sample_id"]: r
        for r in decoder.decode_many(
            [
                request("job's", content="Go"),
                request("own", content="Go", overrides={"response_format": letters}),
                request("free", content="Go", overrides={"response_format": '{"type": "text"}'}),
            ],
            job,
            ORIGIN,
        )
    }
    assert re.fullmatch("[0-9]{4}", rows["job's"]["output_text"])
    assert re.fullmatch("[a-z]{3}", rows["own"]["output_text"])
    assert rows["free"]["finish_reason"] == "length"  # 12 tokens of a random model
    assert rows["job's"]["finish_reason"] == rows["own"]["finish_reason"] == "stop"
