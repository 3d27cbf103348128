"""A line's n completions: ids, seeds, and the payload that carries them."""

from __future__ import annotations

from workers.request import Request, completion_seed


def request(**fields) -> Request:
    return Request("q", 7, [{"role": "user", "content": "hi"}], **fields)


def test_one_completion_is_the_request_itself():
    r = request(overrides={"seed": 5})
    assert r.completions(job_seed=9) == [r]
    assert r.line_id == "q"


def test_completions_have_their_own_ids_and_seeds_from_the_line_seed():
    r = request(n=3, overrides={"seed": 5, "temperature": 0.8}, custom_id="c")
    out = r.completions(job_seed=9)  # the line's seed wins over the job's
    assert [c.sample_id for c in out] == ["q#0", "q#1", "q#2"]
    assert [c.choice_index for c in out] == [0, 1, 2]
    assert {c.line_id for c in out} == {"q"}
    assert {(c.line_no, c.custom_id, c.n) for c in out} == {(7, "c", 3)}
    seeds = [c.overrides["seed"] for c in out]
    assert seeds[0] == 5 and len(set(seeds)) == 3  # the first keeps the line's seed
    assert all(c.overrides["temperature"] == 0.8 for c in out)
    assert r.completions(job_seed=1) == out  # a rerun derives the same seeds


def test_completions_take_the_job_seed_or_none():
    by_job = [c.overrides["seed"] for c in request(n=2).completions(job_seed=9)]
    assert by_job == [9, completion_seed(9, 1)]
    assert [c.overrides for c in request(n=2).completions(None)] == [{}, {}]


def test_derived_seeds_are_distinct_and_in_range():
    seeds = {completion_seed(s, k) for s in (0, 1, 2**63 - 1) for k in range(1, 200)}
    assert len(seeds) == 3 * 199
    assert all(0 <= s < 2**63 for s in seeds)


def test_payload_round_trips_a_completion_and_reads_old_payloads():
    c = request(n=2, overrides={"seed": 1}).completions()[1]
    assert Request.from_payload(c.to_payload()) == c
    old = {"sample_id": "q", "line_no": 7, "messages": [{"role": "user", "content": "hi"}]}
    assert Request.from_payload(old) == request()
