"""Batched decoding must give every sequence exactly what decoding it alone gives."""

from __future__ import annotations

import pytest
import torch

from eagle2_core.config import DecodeConfig
from eagle2_core.dynamic import DynamicDrafter
from eagle2_core.engine import BatchDecoder, Engine
from eagle2_core.kv import RaggedKV
from tests.eagle2_core.tiny import OracleDrafter, hf_greedy, prompts, tiny_head, tiny_target

LENGTHS = (1, 70, 5, 140, 23, 3, 9, 40, 2, 60)
MAX_NEW = (48, 5, 30, 1, 40, 17, 0, 25, 33, 12)


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target(eos=None)
    return target, Engine(target, tiny_head(target))


@pytest.fixture(scope="module")
def expected(tiny):
    target, _ = tiny
    return [
        hf_greedy(target, p, n) if n else []
        for p, n in zip(prompts(96, LENGTHS), MAX_NEW, strict=True)
    ]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("mode", ["vanilla", "eagle1", "eagle2"])
def test_batch_equals_generate_alone(tiny, expected, mode, batch_size):
    """Different prompt lengths and lengths to generate; more items than the batch holds,
    so finished sequences are replaced mid-flight (continuous batching)."""
    _, engine = tiny
    items = [
        (i, p, DecodeConfig(mode=mode, max_new_tokens=n, total_tokens=12))
        for i, (p, n) in enumerate(zip(prompts(96, LENGTHS), MAX_NEW, strict=True))
    ]
    got = dict(engine.generate_batch(items, batch_size))
    assert sorted(got) == list(range(len(items)))
    for i, want in enumerate(expected):
        assert got[i].token_ids == want, f"sequence {i} (prompt of {LENGTHS[i]} tokens)"
        assert got[i].finish_reason == "length"


def test_uneven_acceptance_commits_each_rows_own_path(tiny, expected):
    """Oracle drafters accept 0-6 drafts per round, different per row, at tree nodes that
    are not a prefix of the tree: every row's cache grows by its own accepted path."""
    target, engine = tiny
    decoder = BatchDecoder(engine)
    for i, (prompt, want) in enumerate(zip(prompts(96, LENGTHS), expected, strict=True)):
        if not want:
            continue
        budget = 3 + 4 * (i % 3)  # trees of 3, 7 and 11 nodes: accepted lengths differ
        config = DecodeConfig(max_new_tokens=len(want), total_tokens=budget)
        decoder.add(i, prompt, config, drafter=OracleDrafter(prompt, want, 96))
    results, uneven = {}, False
    while not decoder.idle:
        before = list(decoder.kv.lens)
        results.update(decoder.step())
        if len(decoder.kv.lens) == len(before):  # no row left: rows kept their places
            grew = {n - b for n, b in zip(decoder.kv.lens, before, strict=True)}
            uneven |= len(grew) > 1  # rows accepted different numbers of drafts in a round
    assert uneven
    for i, want in enumerate(expected):
        if want:
            assert results[i].token_ids == want
            if len(want) > 10:
                assert results[i].stats.tau > 1.5


def test_sequences_stop_independently():
    """One sequence hits EOS at once, others run long; each stops where generate does."""
    target = tiny_target(vocab_size=12, eos=1, seed=3)
    engine = Engine(target, tiny_head(target))
    candidates = prompts(12, lengths=tuple(range(2, 40)), seed=5)
    immediate = next(p for p in candidates if hf_greedy(target, p, 1) == [1])
    batch = [immediate] + prompts(12, lengths=(2, 4, 6, 8, 10, 12), seed=5)
    items = [(i, p, DecodeConfig(max_new_tokens=60, tree_width=4)) for i, p in enumerate(batch)]
    got = dict(engine.generate_batch(items, batch_size=8))
    assert got[0].token_ids == [1] and got[0].finish_reason == "stop"
    lengths = set()
    for i, prompt in enumerate(batch):
        want = hf_greedy(target, prompt, 60)
        assert got[i].token_ids == want
        assert got[i].finish_reason == ("stop" if want[-1] == 1 else "length")
        lengths.add(len(want))
    assert len(lengths) > 2, "the sequences should stop at different lengths"


def test_context_limit_per_sequence():
    target = tiny_target(max_positions=40, eos=None)
    engine = Engine(target, tiny_head(target))
    short, long = prompts(96, lengths=(5, 30))
    items = [("short", short, DecodeConfig(max_new_tokens=20)), ("long", long, DecodeConfig())]
    got = dict(engine.generate_batch(items, batch_size=2))
    assert got["long"].finish_reason == "context"
    assert len(long) + got["long"].completion_tokens == 41
    assert got["short"].token_ids == hf_greedy(target, short, 20)


def test_time_is_attributed_per_sequence(tiny):
    _, engine = tiny
    items = [(n, [5] * n, DecodeConfig(max_new_tokens=n)) for n in (4, 40)]
    got = dict(engine.generate_batch(items, batch_size=2))
    for n in (4, 40):
        stats = got[n].stats
        assert stats.n_cycles == n - 1
        assert stats.total_ms >= stats.draft_ms + stats.verify_ms > 0
    assert got[40].stats.verify_ms > got[4].stats.verify_ms


def test_sampled_rows_keep_their_own_generators(tiny):
    """A seeded sampled sequence draws the same tokens alone and inside a batch."""
    _, engine = tiny
    config = DecodeConfig(temperature=1.0, max_new_tokens=20, seed=7)
    alone = engine.generate([4, 5, 6], config)
    others = [
        (i, [9, i + 2], DecodeConfig(temperature=1.0, max_new_tokens=30, seed=i)) for i in range(4)
    ]
    got = dict(engine.generate_batch([("x", [4, 5, 6], config), *others], batch_size=5))
    assert got["x"].token_ids == alone.token_ids
    assert torch.tensor(alone.token_ids).unique().numel() > 3  # really sampled


@pytest.mark.parametrize("mode", ["vanilla", "eagle2"])
def test_completions_of_one_prompt_share_its_prefill(tiny, mode, monkeypatch):
    """n sequences of one prompt (a request's completions), queued with another prompt
    between them: one padded forward prefills each distinct prompt once, the rest copy
    its cache row; one added after a step copies the row still decoding. Each sequence
    decodes exactly what it does alone, greedy or sampled with its own seed."""
    _, engine = tiny
    prompt = prompts(96, (50,))[0]
    configs = [DecodeConfig(mode=mode, max_new_tokens=20, total_tokens=8)] + [
        DecodeConfig(mode=mode, max_new_tokens=20, total_tokens=8, temperature=1.0, seed=s)
        for s in (1, 2, 3)
    ]
    alone = [engine.generate(prompt, c).token_ids for c in configs]
    forwards = []
    original = BatchDecoder._forward

    def counting(self, ids, *args):
        forwards.append(tuple(ids.shape))
        return original(self, ids, *args)

    monkeypatch.setattr(BatchDecoder, "_forward", counting)
    other = prompts(96, (30,), seed=9)[0]
    decoder = BatchDecoder(engine, batch_size=8)
    keys = [0, 1, "other", 2, 3]
    for key in keys:
        decoder.add(key, other if key == "other" else prompt, configs[0 if key == "other" else key])
    got = dict(decoder.step())
    assert forwards[0] == (2, len(prompt))  # both prompts, the shorter one padded
    assert all(width < len(other) for _, width in forwards[1:])  # the rest are rounds
    forwards.clear()
    decoder.add("again", prompt, configs[0])
    while not decoder.idle:
        got.update(decoder.step())
    assert all(width < len(other) for _, width in forwards)  # "again" copied row 0
    assert [got[k].token_ids for k in range(4)] == alone
    assert got["again"].token_ids == alone[0]
    assert len({tuple(t) for t in alone}) == 4  # the sampled ones really differ


@pytest.mark.parametrize("mode", ["vanilla", "eagle2"])
def test_a_wide_batch_in_chunks_and_resorted_equals_generate_alone(tiny, mode, monkeypatch):
    """More rows than an attention chunk, of very different lengths, joining in two waves
    and finishing at different times: rows are read in chunks of their own lengths and
    re-sorted as they come and leave."""
    target, engine = tiny
    lengths = [
        int(x) for x in torch.randint(1, 160, (40,), generator=torch.Generator().manual_seed(7))
    ]
    news = [5 + (7 * i) % 40 for i in range(40)]
    items = [
        (i, p, DecodeConfig(mode=mode, max_new_tokens=n, total_tokens=6))
        for i, (p, n) in enumerate(zip(prompts(96, tuple(lengths), seed=2), news, strict=True))
    ]
    sorts = []
    real = RaggedKV.reorder
    monkeypatch.setattr(
        RaggedKV, "reorder", lambda kv, order: sorts.append(order) or real(kv, order)
    )
    decoder = BatchDecoder(engine, batch_size=40)
    got = {}
    for half in (items[::2], items[1::2]):  # each half joins longest first, after the other
        for item in half:
            decoder.add(*item)
        got.update(decoder.step())
    while not decoder.idle:
        got.update(decoder.step())
    assert sorts  # rows were re-sorted on the way
    for i, prompt, config in items:
        assert got[i].token_ids == hf_greedy(target, prompt, config.max_new_tokens), i


class OwnPrefill(BatchDecoder):
    """Every prompt runs through the target whole: the baseline of prefix sharing."""

    shares_prefill = False


@pytest.mark.parametrize("mode", ["vanilla", "eagle2"])
def test_prompts_sharing_a_prefix_run_it_once(tiny, mode, monkeypatch):
    """Prompts that start alike (a chat template's system prompt): the shared tokens go
    through the target once and every row copies them, while a prompt that opens
    otherwise is prefilled whole; prompts joining later that extend them copy them again.
    Every sequence decodes what it does alone, and the draft head reads the same features
    as without sharing."""
    target, engine = tiny
    prefix = prompts(96, (40,), seed=3)[0]
    tails = prompts(96, (1, 12, 30, 5, 2), seed=4)
    loner, stranger = prompts(96, (20, 25), seed=5)
    first = [prefix + t for t in tails[:3]] + [loner]
    later = [prefix + t for t in tails[3:]]
    config = DecodeConfig(mode=mode, max_new_tokens=12, total_tokens=6)
    forwards, features = [], {}
    original_forward = BatchDecoder._forward
    monkeypatch.setattr(
        BatchDecoder,
        "_forward",
        lambda self, ids, *args: (
            forwards.append(tuple(ids.shape)) or original_forward(self, ids, *args)
        ),
    )
    original_add = DynamicDrafter.add_rows

    def capture(drafter, rows, budget):
        for f, t in rows:
            features.setdefault(drafter, []).append((len(t), f))
        return original_add(drafter, rows, budget)

    monkeypatch.setattr(DynamicDrafter, "add_rows", capture)
    got, baseline = {}, {}
    for decoder_type, out in ((BatchDecoder, got), (OwnPrefill, baseline)):
        forwards.clear()
        decoder = decoder_type(engine, batch_size=8)
        for k, prompt in enumerate(first):
            decoder.add(k, prompt, config)
        out.update(decoder.step())
        if decoder_type is BatchDecoder:
            # the prefix, the tails (30 | 12 and 1: the cheapest cut), the prompt that opens
            # otherwise
            assert forwards[:4] == [(1, len(prefix)), (1, 30), (2, 12), (1, len(loner))]
        forwards.clear()
        for k, prompt in enumerate([*later, stranger], start=len(first)):
            decoder.add(k, prompt, config)
        out.update(decoder.step())
        if decoder_type is BatchDecoder:
            assert forwards[:2] == [(2, 5), (1, len(stranger))]  # held prefix; stranger whole
        while not decoder.idle:
            out.update(decoder.step())
    for k, prompt in enumerate([*first, *later, stranger]):
        assert got[k].token_ids == hf_greedy(target, prompt, 12), k
        assert baseline[k].token_ids == got[k].token_ids
    if mode == "eagle2":
        shared, own = features.values()
        assert [n for n, _ in shared] == [n for n, _ in own]
        for (_, a), (_, b) in zip(shared, own, strict=True):
            torch.testing.assert_close(a, b)


def test_rows_read_the_shared_prefix_in_one_place_and_decode_the_same(monkeypatch):
    """bf16 with 64-wide heads (the AVX-512 kernel's case): rows that copied a shared prefix
    have every round's attention read it from the prefix's own cache, and decode exactly
    the tokens they decode reading their own copies."""
    target = tiny_target(hidden=256, dtype=torch.bfloat16)
    engine = Engine(target, None)
    prefix = prompts(96, (40,), seed=3)[0]
    rows = [prefix + tail for tail in prompts(96, (3, 9, 1, 20, 6), seed=4)]
    rows.append(prompts(96, (25,), seed=5)[0])  # a prompt of its own
    config = DecodeConfig(mode="vanilla", max_new_tokens=16)
    reads = []
    original = RaggedKV.prefix_reads

    def recorded(kv):
        shared = original(kv)
        reads.append(None if shared is None else shared.lens.tolist())
        return shared

    def decode() -> dict:
        decoder = BatchDecoder(engine, batch_size=8)
        for k, prompt in enumerate(rows):
            decoder.add(k, prompt, config)
        out = {}
        while not decoder.idle:
            out.update(decoder.step())
        return {k: g.token_ids for k, g in out.items()}

    monkeypatch.setattr(RaggedKV, "prefix_reads", recorded)
    shared = decode()
    assert reads and all(sorted(lens) == [0] + [len(prefix)] * (len(lens) - 1) for lens in reads)
    monkeypatch.setattr(RaggedKV, "prefix_reads", lambda kv: None)
    assert decode() == shared
