"""`eagle2-batch stats`: numbers recomputed independently from the raw stored rows."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from producer.cli import main
from producer.stats import compute_stats, format_stats, percentile, plot_title
from workers import db


def _fill(engine, make_job, fake_sample, failed_sample, n=40, seed=0):
    job_id, requests = make_job(engine, n=n, shard_size=8)
    rng = random.Random(seed)
    rows = [
        failed_sample(r) if i % 9 == 4 else fake_sample(r, rng, depth=6)
        for i, r in enumerate(requests)
    ]
    db.insert_samples(engine, rows)
    return job_id, rows


def _expected(rows):
    """The statistics of `rows`, computed directly with numpy."""
    ok = [r for r in rows if r["status"] == "ok"]
    tau = np.array([r["mean_accept_length"] for r in ok])
    tokens = np.array([r["completion_tokens"] for r in ok])
    total_ms = np.array([r["total_ms"] for r in ok])
    hist = np.sum([r["accept_hist"] for r in ok], axis=0)
    attempts = np.sum([r["depth_attempts"] for r in ok], axis=0)
    accepts = np.sum([r["depth_accepts"] for r in ok], axis=0)
    return {
        "samples": len(rows),
        "requests": len({r["request_id"] for r in rows}),
        "ok": len(ok),
        "failed": len(rows) - len(ok),
        "completion_tokens": int(tokens.sum()),
        "tau_mean": float(tau.mean()),
        "tau_p50": float(np.percentile(tau, 50)),
        "tau_p90": float(np.percentile(tau, 90)),
        "tree_size_mean": float(np.mean([r["mean_tree_size"] for r in ok])),
        "tokens_per_s": float(tokens.sum() / total_ms.sum() * 1000),
        "tokens_per_s_mean": float(np.mean([r["tokens_per_s"] for r in ok])),
        "accept_hist": hist.tolist(),
        "depth_attempts": attempts.tolist(),
        "depth_accepts": accepts.tolist(),
        "depth_accept_rate": (accepts / attempts).tolist(),
    }


def _assert_close(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key


def test_stats_match_an_independent_computation(engine, make_job, fake_sample, failed_sample):
    job_id, rows = _fill(engine, make_job, fake_sample, failed_sample)
    stats = compute_stats(db.iter_samples(engine, job_id), by="category")
    _assert_close(stats["overall"], _expected(rows))
    assert list(stats["groups"]) == ["math", "writing", "(none)"]
    for name, key in (("math", "math"), ("writing", "writing"), ("(none)", None)):
        _assert_close(stats["groups"][name], _expected([r for r in rows if r["category"] == key]))
    # Consistency of the fixture's statistics: every cycle adds accepted + 1 tokens.
    hist = stats["overall"]["accept_hist"]
    cycles = sum(hist)
    assert sum(k * c for k, c in enumerate(hist)) + cycles == stats["overall"]["completion_tokens"]
    assert stats["overall"]["depth_attempts"][0] == cycles


def test_stats_count_completions_and_requests_apart(engine, make_job, fake_sample, failed_sample):
    job_id, requests = make_job(engine, n=7, shard_size=3, completions=3)
    rng = random.Random(3)
    rows = [failed_sample(r) if i % 5 == 1 else fake_sample(r, rng) for i, r in enumerate(requests)]
    db.insert_samples(engine, rows[::-1])
    stats = compute_stats(db.iter_samples(engine, job_id), by="finish_reason")
    _assert_close(stats["overall"], _expected(rows))
    assert (stats["overall"]["samples"], stats["overall"]["requests"]) == (21, 7)
    for name, group in stats["groups"].items():  # a request's completions may differ here
        mine = [r for r in rows if r.get("finish_reason") == (None if name == "(none)" else name)]
        assert group["samples"] == len(mine)
        assert group["requests"] == len({r["request_id"] for r in mine})
    job = db.get_job(engine, job_id)
    assert "expected 21  stored 21 (completions of 7 requests)" in format_stats(job, stats, None)


@pytest.mark.parametrize(
    ("draft", "mode", "shown"),
    [(None, "eagle2", "draft=shipped:smollm2-135m"), (None, "vanilla", "draft=-"),
     ("/heads/mine", "eagle1", "draft=/heads/mine")],
)  # fmt: skip
def test_stats_header_names_the_head_the_rows_name(draft, mode, shown):
    job = {"id": "j", "state": "done", "model": "smollm2-135m", "draft": draft, "mode": mode,
           "n_expected": 0, "n_rejected": 0}  # fmt: skip
    assert shown in format_stats(job, compute_stats([]), by=None).splitlines()[0]
    # The plot's title says the same (it said "no draft" for the shipped head).
    named = shown.removeprefix("draft=")
    assert f"+ {'no draft' if named == '-' else named} ({mode})" in plot_title(job)


def test_stats_of_only_failed_samples_has_no_rates():
    row = {
        "status": "failed",
        "request_id": "a",
        "category": None,
        "completion_tokens": None,
        "mean_accept_length": None,
        "accept_hist": None,
        "depth_attempts": None,
        "depth_accepts": None,
        "total_ms": None,
        "tokens_per_s": None,
    }
    overall = compute_stats([row, row])["overall"]
    assert (overall["samples"], overall["ok"], overall["failed"]) == (2, 0, 2)
    assert overall["requests"] == 1  # two completions of one request
    assert overall["tau_mean"] is None and overall["tokens_per_s"] is None
    assert overall["tree_size_mean"] is None
    assert overall["accept_hist"] == [] and overall["depth_accept_rate"] == []


@given(
    st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=50),
    st.floats(0, 1),
)
def test_percentile_is_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q * 100), abs=1e-9)


def test_stats_cli_json(engine, db_url, make_job, fake_sample, failed_sample):
    job_id, rows = _fill(engine, make_job, fake_sample, failed_sample, seed=1)
    result = CliRunner().invoke(
        main, ["stats", job_id, "--json", "--by", "category", "--url", db_url]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["job"]["id"] == job_id and data["by"] == "category"
    _assert_close(data["overall"], _expected(rows))
    _assert_close(data["groups"]["math"], _expected([r for r in rows if r["category"] == "math"]))


def test_stats_cli_table_latest_job_and_plot(
    sqlite_url, make_job, fake_sample, failed_sample, tmp_path
):
    engine = db.make_engine(sqlite_url)
    _fill(engine, make_job, fake_sample, failed_sample, seed=2)
    job_id, rows = _fill(engine, make_job, fake_sample, failed_sample, seed=3)
    engine.dispose()
    png = tmp_path / "stats.png"
    result = CliRunner().invoke(main, ["stats", "--url", sqlite_url, "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert f"job {job_id}" in result.output  # the latest job by default
    want = _expected(rows)
    assert f"{want['tau_mean']:.2f}" in result.output
    assert f"{want['tokens_per_s']:.1f}" in result.output
    assert "acceptance rate by tree depth" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_stats_cli_unknown_job_fails_with_a_reason(sqlite_url):
    runner = CliRunner()
    result = runner.invoke(main, ["stats", "--url", sqlite_url])
    assert result.exit_code == 1 and "no jobs yet" in result.output
    result = runner.invoke(main, ["stats", "nope", "--url", sqlite_url])
    assert result.exit_code == 1 and "no job nope" in result.output
