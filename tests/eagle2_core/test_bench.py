"""The throughput benchmark compares like with like: same prompts, same token counts."""

from __future__ import annotations

from eagle2_core.bench import hf_generate_batch, run_batch_bench
from eagle2_core.config import DecodeConfig
from eagle2_core.engine import Engine
from tests.eagle2_core.tiny import hf_greedy, prompts, tiny_head, tiny_target


def test_hf_batch_baseline_matches_generate_alone_and_stops_at_eos():
    target = tiny_target(vocab_size=12, eos=1, seed=3)
    batch = prompts(12, lengths=(2, 7, 12), seed=5)
    got = hf_generate_batch(target, batch, 30)
    assert got == [hf_greedy(target, p, 30) for p in batch]
    assert any(answer[-1] == 1 and len(answer) < 30 for answer in got)


def test_batch_bench_runs_every_way_on_the_same_prompts():
    target = tiny_target(eos=None)
    engine = Engine(target, tiny_head(target))
    batch = prompts(96, lengths=(3, 20, 9, 40, 5))
    seen = []
    results = run_batch_bench(
        engine, batch, DecodeConfig(max_new_tokens=12), [2, 4], on_result=seen.append
    )
    assert seen == results
    names = [(r.name, r.batch_size) for r in results]
    assert names == [
        ("eagle2 B=1", 1),
        ("hf generate", 2),
        ("engine-vanilla batched", 2),
        ("eagle2 batched", 2),
        ("hf generate", 4),
        ("engine-vanilla batched", 4),
        ("eagle2 batched", 4),
    ]
    assert all(r.tokens == 5 * 12 and r.seconds > 0 for r in results)
    for plain, eagle in (results[2:4], results[5:7]):
        assert plain.outputs == eagle.outputs == results[0].outputs
        assert plain.as_dict()["tau"] == 1.0 and plain.as_dict()["tree_size"] == 1.0
        assert eagle.as_dict()["tau"] >= 1.0 and 0 < eagle.as_dict()["draft_share"] < 1
