"""--adapt-draft end to end on a tiny random model: the job fine-tunes its head between
shards, switches to it where it wins, and not one output changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from eagle2_core.train.data import is_validation
from producer.cli import main
from tests.producer.test_jobs import save_tiny_model
from workers.db import get_job, iter_samples, make_engine
from workers.head_versions import versions

# ids of the validation split (is_validation): the held-out prompts a round measures on
VALIDATION_IDS = ["alpaca-00056", "alpaca-00085", "alpaca-00087"]


def _job_file(path: Path) -> Path:
    ids = [f"alpaca-{i:05d}" for i in range(36)] + VALIDATION_IDS
    assert [i for i in ids if is_validation(i)] == VALIDATION_IDS
    lines = [
        {"id": i, "prompt": f"t{7 + n % 40} t{20 + n % 50} t{5 + n % 7}"} for n, i in enumerate(ids)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _run(args: list[str]) -> str:
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output.strip().splitlines()[-1]


def _outputs(url: str, job_id: str) -> tuple[dict, list[dict], list[dict]]:
    engine = make_engine(url)
    try:
        rows = list(iter_samples(engine, job_id))
        return get_job(engine, job_id), rows, versions(engine, job_id)
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)]
)
def test_an_adapting_job_switches_heads_between_shards_and_changes_no_output(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    model, head = save_tiny_model(tmp_path)
    prompts = _job_file(tmp_path / "job.jsonl")
    common = [str(prompts), "--model", str(model), "--draft", str(head)]
    common += "--max-new-tokens 12 --batch-size 4 --shard-size 13".split()
    url = request.getfixturevalue(f"{backend}_url")
    adapted = _run([*common, "--out", str(tmp_path / "a"), "--db-url", url, "--adapt-draft",
                    "--adapt-after", "10"])  # fmt: skip
    plain_url = f"sqlite:///{tmp_path / 'plain.db'}"
    plain = _run([*common, "--out", str(tmp_path / "p"), "--db-url", plain_url])

    job, rows, attempts = _outputs(url, adapted)
    assert job["params"]["adapt_draft"] is True and job["params"]["adapt_after"] == 10
    _, plain_rows, no_attempts = _outputs(plain_url, plain)
    assert no_attempts == [] and {r["head_version"] for r in plain_rows} == {0}
    assert {r["sample_id"]: r["output_text"] for r in rows} == {
        r["sample_id"]: r["output_text"] for r in plain_rows
    }
    # 39 lines in shards of 13: a round after shard 0 (13 >= 10 completions); the next is
    # due at 4x 13 = 52 > 39, or never if the first lost.
    assert len(attempts) == 1
    first = attempts[0]
    assert first["based_on"] == 0 and first["train_completions"] == 13
    assert first["eval_prompts"] == len(VALIDATION_IDS)
    assert first["tau_before"] is not None and first["tau_after"] is not None
    assert first["published"] == (first["tau_after"] > first["tau_before"])
    assert (first["sha256"] is not None) == first["published"]
    by_shard = {(r["shard"], r["head_version"]) for r in rows}
    later = 1 if first["published"] else 0
    assert by_shard == {(0, 0), (1, later), (2, later)}
    assert first["published"], f"the fine-tuned head should beat a random one: {first}"
    _assert_reported(url, adapted, rows, tmp_path / "stats.png")


def test_a_job_without_held_out_prompts_skips_the_round_and_says_why(tmp_path: Path) -> None:
    """No prompt in the validation split: no head could be judged, so the round records a
    loss at once (no minutes of training for nothing) and the user reads why."""
    model, head = save_tiny_model(tmp_path)
    ids = [f"alpaca-{i:05d}" for i in range(26)]
    assert not any(is_validation(i) for i in ids)
    prompts = tmp_path / "job.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"t{7 + n}"}) + "\n"
                               for n, i in enumerate(ids)))  # fmt: skip
    url = f"sqlite:///{tmp_path / 'eagle2.db'}"
    args = [str(prompts), "--model", str(model), "--draft", str(head), "--out",
            str(tmp_path / "out"), "--db-url", url, "--max-new-tokens", "6",
            "--shard-size", "13", "--adapt-draft", "--adapt-after", "10"]  # fmt: skip
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "draft head v1 not trained: none of the job's prompts is in the validation" in (
        result.output
    )
    _, rows, attempts = _outputs(url, result.output.strip().splitlines()[-1])
    assert len(rows) == 26 and {r["head_version"] for r in rows} == {0}
    assert len(attempts) == 1
    assert attempts[0]["eval_prompts"] == 0 and not attempts[0]["published"]
    assert attempts[0]["train_s"] == 0.0 and not (tmp_path / "out" / "_adapt").exists()


def _assert_reported(url: str, job_id: str, rows: list[dict], png: Path) -> None:
    """stats gives tau per head version and the rounds, --plot the switch; status the
    version shards start with now."""
    runner = CliRunner()
    shown = runner.invoke(main, ["stats", job_id, "--json", "--url", url])
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    assert data["by"] == "head_version" and set(data["groups"]) == {"0", "1"}
    for version in (0, 1):
        mine = [r for r in rows if r["head_version"] == version and r["status"] == "ok"]
        group = data["groups"][str(version)]
        assert group["ok"] == len(mine) > 0
        taus = [r["mean_accept_length"] for r in mine if r["mean_accept_length"] is not None]
        assert group["tau_mean"] == pytest.approx(sum(taus) / len(taus))
    assert [v["version"] for v in data["head_versions"]] == [1]
    table = runner.invoke(main, ["stats", job_id, "--url", url, "--plot", str(png)])
    assert table.exit_code == 0, table.output
    assert "draft head versions" in table.output and "published" in table.output
    over_time = png.with_name("stats-adaptation.png")
    assert over_time.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    status = runner.invoke(main, ["status", job_id, "--db-url", url])
    assert status.exit_code == 0, status.output
    assert "draft head: version 1 for shards that start now" in status.output
    assert "no more fine-tuning" in status.output  # 4x 13 = 52 > the job's 39


def test_adapt_beside_workers_publishes_a_head_the_next_shard_drafts_with(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The submit path: shards go through process_shard (what every Celery worker runs)
    and `eagle2-batch adapt JOB` trains between them, in its own process's place."""
    from producer.creation import create_job
    from producer.database import open_database
    from producer.jobs import make_spec
    from workers.decoding import SampleDecoder
    from workers.shards import process_shard

    monkeypatch.setenv("EAGLE2_CACHE_DIR", str(tmp_path / "cache"))
    model, head = save_tiny_model(tmp_path)
    url = sqlite_url
    spec = make_spec(model=str(model), draft=str(head), mode="eagle2", shard_size=13,
                     max_new_tokens=12, adapt_draft=True, adapt_after=10)  # fmt: skip
    plain_spec = make_spec(
        model=str(model), draft=str(head), mode="eagle2", shard_size=13, max_new_tokens=12
    )
    decoder = SampleDecoder.load(str(model), str(head), batch_size=4)
    with open_database(url) as engine:
        job_id, _ = create_job(engine, _job_file(tmp_path / "job.jsonl"), spec)
        plain_id, _ = create_job(engine, tmp_path / "job.jsonl", plain_spec)
        process_shard(engine, decoder, job_id, 0, tmp_path / "out", "w0")

        refused = CliRunner().invoke(main, ["adapt", plain_id, "--db-url", url])
        assert refused.exit_code != 0 and "not submitted with --adapt-draft" in refused.output
        args = ["adapt", job_id, "--db-url", url, "--work", str(tmp_path / "work")]
        result = CliRunner().invoke(main, [*args, "--interval", "1"])
        assert result.exit_code == 0, result.output + repr(result.exception)
        assert "draft head v1 from v0 on 13 completions" in result.output

        process_shard(engine, decoder, job_id, 1, tmp_path / "out", "w0")
        for shard in (0, 1):
            process_shard(engine, decoder, plain_id, shard, tmp_path / "out", "w0")
        attempts = versions(engine, job_id)
        rows = {r["sample_id"]: r for r in iter_samples(engine, job_id)}
        plain = {r["sample_id"]: r for r in iter_samples(engine, plain_id)}
    assert len(attempts) == 1 and attempts[0]["published"]
    assert {(r["shard"], r["head_version"]) for r in rows.values()} == {(0, 0), (1, 1)}
    assert decoder.head_of is None and decoder.head_version == 0  # back for the plain job
    assert {r["head_version"] for r in plain.values()} == {0}
    assert {k: r["output_text"] for k, r in plain.items()} == {
        k: r["output_text"] for k, r in rows.items()
    }
