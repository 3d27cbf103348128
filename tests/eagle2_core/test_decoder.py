"""The decoding loop's own decisions: pausing drafting, batch kinds, fresh tokens."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from eagle2_core import cost
from eagle2_core.config import DecodeConfig
from eagle2_core.cost import CostModel
from eagle2_core.decoder import GROUP_COST_TOKENS, MAX_REST, PREFILL_TOKENS, BatchDecoder, _groups
from eagle2_core.dynamic import DynamicDrafter, Fresh, extend_fresh
from eagle2_core.engine import Engine
from tests.eagle2_core.tiny import (
    OracleDrafter,
    device_costs,
    hf_greedy,
    kept,
    prompts,
    tiny_head,
    tiny_target,
)


def count_calls(monkeypatch, method: str) -> list[int]:
    """A list that gains an entry at each call of DynamicDrafter.<method>."""
    calls = []
    real = getattr(DynamicDrafter, method)

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DynamicDrafter, method, counted)
    return calls


def test_drafting_pauses_where_it_cannot_pay_and_outputs_stay_exact(monkeypatch):
    """A node costs half a plain step and a draft step four: the planner verifies the root
    alone and the decoder stops drafting for 1, 2, 4 .. rounds; tokens are generate's."""
    target = tiny_target(eos=None)
    engine = Engine(target, tiny_head(target))
    engine._costs = device_costs(verify_per_node_ms=5.0, draft_ms=40.0)
    calls = count_calls(monkeypatch, "draft")
    prompt = prompts(96, lengths=(7,))[0]
    got = engine.generate(prompt, DecodeConfig(max_new_tokens=60))
    assert got.token_ids == hf_greedy(target, prompt, 60)
    assert got.stats.mean_tree_size < 1.2  # the root alone, bar a lucky draft or two
    rounds = got.stats.n_cycles  # 59 for 60 tokens; each lucky draft accepted saves one
    # (the planner calibrates on measured round times, so which rounds probe moves with load)
    assert 57 <= rounds <= 59 and len(calls) <= 1 + rounds // MAX_REST + 5  # 1 + 1 + 2 + 4 + 8..


def dear_nodes(monkeypatch, verify_per_node_ms: float = 5.0):
    """A tiny engine whose extra nodes cost the verify forward half a plain step each (a
    good head's drafts could pay, the tiny head's cannot), its draft calls counted, and
    two prompts."""
    target = tiny_target(eos=None)
    engine = Engine(target, tiny_head(target))
    engine._costs = device_costs(verify_per_node_ms=verify_per_node_ms, draft_ms=40.0)
    calls = count_calls(monkeypatch, "draft")
    first, second = prompts(96, lengths=(7, 9))
    return target, engine, calls, first, second


def test_a_batch_stops_drafting_where_verifying_more_nodes_cannot_pay(monkeypatch):
    """The tiny head's drafts do not pay for their nodes: after the longest pause
    the batch stops drafting for good (1 + 1 + 2 + 4 + 8 + 16 rounds, six drafts), its
    rows go on plain and exact, and a batch that starts after it empties drafts again."""
    target, engine, calls, first, second = dear_nodes(monkeypatch)
    decoder = BatchDecoder(engine, batch_size=1)
    decoder.add("first", first, DecodeConfig(max_new_tokens=100))
    done = []
    while not done:
        done = decoder.step()
        if len(calls) < 6:
            assert not decoder.retired
    assert decoder.retired and decoder.dynamic is None and len(calls) == 6
    assert done[0][1].token_ids == hf_greedy(target, first, 100)
    decoder.add("second", second, DecodeConfig(max_new_tokens=3))
    assert not decoder.retired and decoder.dynamic is not None
    while not decoder.step():
        pass
    assert len(calls) == 7  # the new batch's first round drafted


def test_rows_joining_a_batch_that_stopped_drafting_skip_the_head(monkeypatch):
    target, engine, calls, first, second = dear_nodes(monkeypatch)
    decoder = BatchDecoder(engine, batch_size=2)
    decoder.add("first", first, DecodeConfig(max_new_tokens=60))
    while not decoder.retired:
        decoder.step()
    added = count_calls(monkeypatch, "add_rows")
    decoder.add("second", second, DecodeConfig(max_new_tokens=20))
    outputs = {}
    while decoder.active:
        outputs.update(decoder.step())
    assert added == [] and len(calls) == 6
    assert outputs["second"].token_ids == hf_greedy(target, second, 20)
    assert outputs["first"].token_ids == hf_greedy(target, first, 60)


def test_a_batch_where_no_head_could_pay_never_drafts(monkeypatch):
    """Each extra node costs the verify forward five plain steps, more than the best head
    could bring: the batch stops drafting before the head reads a prompt, its rows decode
    plain and exact, and so does the next batch."""
    target, engine, calls, first, second = dear_nodes(monkeypatch, verify_per_node_ms=50.0)
    added = count_calls(monkeypatch, "add_rows")
    decoder = BatchDecoder(engine, batch_size=2)
    for key, prompt in (("first", first), ("second", second)):
        decoder.add(key, prompt, DecodeConfig(max_new_tokens=30))
    outputs = dict(decoder.step())
    assert decoder.retired and decoder.dynamic is None
    while decoder.active:
        outputs.update(decoder.step())
    assert outputs["first"].token_ids == hf_greedy(target, first, 30)
    assert outputs["second"].token_ids == hf_greedy(target, second, 30)
    assert outputs["first"].stats.mean_tree_size == 1.0
    decoder.add("again", first, DecodeConfig(max_new_tokens=5))
    while not decoder.step():
        pass
    assert added == [] and calls == []


def test_a_batch_is_judged_by_the_heads_own_ceiling(monkeypatch):
    """Extra nodes cost 0.3 plain steps: at two rows a head right 0.8 of the time could
    pay for a second node each (1.8 tokens a row for 19 ms against 1 for 13), a head
    recorded at 0.1 held-out top-1 (a ceiling of one half) could not: its batch never
    drafts, and its rows are exact. The same head recording nothing probes."""
    target, _, calls, first, second = dear_nodes(monkeypatch)
    added = count_calls(monkeypatch, "add_rows")
    for recorded, drafts in ((0.1, False), (None, True)):
        head = tiny_head(target)
        head.held_out_top1 = recorded
        engine = Engine(target, head)
        engine._costs = device_costs(verify_per_node_ms=3.0, draft_ms=40.0)
        decoder = BatchDecoder(engine, batch_size=2)
        for key, prompt in (("first", first), ("second", second)):
            decoder.add(key, prompt, DecodeConfig(max_new_tokens=12))
        outputs = {}
        while not outputs or decoder.active:
            outputs.update(decoder.step())
        assert outputs["first"].token_ids == hf_greedy(target, first, 12)
        assert outputs["second"].token_ids == hf_greedy(target, second, 12)
        assert bool(added) == bool(calls) == drafts


def test_fixed_trees_draft_where_no_head_could_pay(monkeypatch):
    """total_tokens set: the trees the user asked for, whatever the device charges."""
    target, engine, calls, first, _ = dear_nodes(monkeypatch, verify_per_node_ms=50.0)
    got = engine.generate(first, DecodeConfig(max_new_tokens=10, total_tokens=4))
    assert got.token_ids == hf_greedy(target, first, 10)
    assert len(calls) == got.stats.n_cycles and got.stats.mean_tree_size > 1


def test_a_batch_keeps_probing_where_only_drafting_is_dear(monkeypatch):
    """Verifying more nodes costs nothing extra (one row on a memory-bound device) but a
    draft step costs four forwards: drafting pauses for up to MAX_REST rounds at a time,
    and never stops for good."""
    target = tiny_target(eos=None)
    engine = Engine(target, tiny_head(target))
    engine._costs = device_costs(verify_per_node_ms=0.0, draft_ms=40.0)
    calls = count_calls(monkeypatch, "draft")
    prompt = prompts(96, lengths=(7,))[0]
    decoder = BatchDecoder(engine, batch_size=1)
    decoder.add("only", prompt, DecodeConfig(max_new_tokens=100))
    done = []
    while not done:
        done = decoder.step()
    assert not decoder.retired
    assert len(calls) > 6  # probes at rounds 1, 3, 6, 11, 20, 37, 54, 71, 88
    assert done[0][1].token_ids == hf_greedy(target, prompt, 100)


def test_drafting_goes_on_where_it_pays(monkeypatch):
    target = tiny_target(eos=None)
    engine = Engine(target, tiny_head(target))
    engine._costs = device_costs(verify_per_node_ms=0.0, draft_ms=0.01)
    calls = count_calls(monkeypatch, "draft")
    prompt = prompts(96, lengths=(7,))[0]
    got = engine.generate(prompt, DecodeConfig(max_new_tokens=30))
    assert got.token_ids == hf_greedy(target, prompt, 30)
    assert len(calls) == got.stats.n_cycles and got.stats.mean_tree_size > 1


def kept_costs(tmp_path) -> CostModel:
    """device_costs as the cache keeps a measured table (read from its file): 10 ms a
    round, far above what the tiny model's rounds take."""
    return kept(device_costs(verify_per_node_ms=0.0, draft_ms=0.01), tmp_path)


def test_rounds_faster_than_the_table_lower_it_and_the_emptied_batch_keeps_it(tmp_path):
    """Rounds with every logit (logprobs: the full lm_head, as the table times it) beat
    the table's 10 ms: the entries at their sizes are lowered in the engine's table and,
    once the batch empties, in its file; the tokens stay generate's."""
    target = tiny_target(eos=None)
    engine = Engine(target, tiny_head(target))
    engine._costs = kept_costs(tmp_path)
    prompt = prompts(96, lengths=(7,))[0]
    got = engine.generate(prompt, DecodeConfig(max_new_tokens=30, logprobs=True))
    assert got.token_ids == hf_greedy(target, prompt, 30)
    lowered = engine._costs.verify_ms[0]
    assert lowered[0] < 10.0 and lowered == sorted(lowered)
    assert cost._read(tmp_path / "test.json").verify_ms[0] == lowered


def test_plain_greedy_rounds_through_the_screened_lm_head_teach_the_table_nothing(tmp_path):
    """On CPUs with native bf16 a plain greedy fp32 round scores its tokens through the
    screened lm_head, cheaper than the table's full one: its time proves nothing about
    the table's entries. Elsewhere it runs the full lm_head and teaches."""
    target = tiny_target(eos=None)
    engine = Engine(target, tiny_head(target))
    engine._costs = kept_costs(tmp_path)
    engine.generate(prompts(96, lengths=(7,))[0], DecodeConfig(max_new_tokens=20))
    assert (engine._costs.verify_ms[0][0] < 10.0) == (target.screened is None)


def test_rows_reading_a_shared_prefix_count_their_own_slots(tmp_path, monkeypatch):
    """Rows that read a shared 20-token prefix from one copy are compared with the table
    at their own slots (prompts of 21 and 22 tokens: 1 and 2), and teach it."""
    target = tiny_target(eos=None)
    engine = Engine(target, tiny_head(target))
    engine._costs = kept_costs(tmp_path)
    compared = []
    real = CostModel.lower

    def recorded(self, n, contexts, ms):
        compared.append(sorted(contexts))
        return real(self, n, contexts, ms)

    monkeypatch.setattr(CostModel, "lower", recorded)
    shared = prompts(96, lengths=(20,))[0]
    config = DecodeConfig(max_new_tokens=20, logprobs=True)
    batch = [("a", [*shared, 5], config), ("b", [*shared, 6, 7], config)]
    list(engine.generate_batch(batch, 2))
    assert compared[0] == [1, 2]
    assert engine._costs.verify_ms[0][0] < 10.0  # the grid point at or below 2 rows: 1


def test_a_batch_drafts_one_way():
    target = tiny_target(eos=None)
    engine = Engine(target, tiny_head(target))
    decoder = BatchDecoder(engine)
    decoder.add("a", [5, 6, 7], DecodeConfig(tree_width=4, tree_depth=3))
    with pytest.raises(ValueError, match="share tree_width and tree_depth"):
        decoder.add("b", [5, 6], DecodeConfig(tree_width=5, tree_depth=3))
    with pytest.raises(ValueError, match="not both"):
        decoder.add("c", [5, 6], DecodeConfig(), drafter=OracleDrafter([5, 6], [7], 96))
    assert decoder.active == 1


def test_fresh_tokens_wait_in_order_while_drafting_pauses():
    h = 2
    old = Fresh(
        torch.arange(12.0).view(2, 3, h), torch.tensor([[1, 2, 0], [5, 0, 0]]), torch.tensor([2, 1])
    )
    new = Fresh(torch.full((2, 2, h), -1.0), torch.tensor([[3, 0], [6, 7]]), torch.tensor([1, 2]))
    both = extend_fresh(old, new)
    assert both.lengths.tolist() == [3, 3]
    assert both.tokens.tolist() == [[1, 2, 3], [5, 6, 7]]
    assert both.features[0, :2].tolist() == old.features[0, :2].tolist()
    assert both.features[1, 1:].tolist() == [[-1.0, -1.0], [-1.0, -1.0]]
    assert both.roots().tolist() == [3, 7]


def cut_cost(groups: list[list[int]], skip: int) -> int:
    """Padded slots plus GROUP_COST_TOKENS a forward: what _groups minimises."""
    return sum((group[0] - skip) * len(group) + GROUP_COST_TOKENS for group in groups)


def every_cut(lengths: list[int], skip: int) -> list[list[list[int]]]:
    """Every split of `lengths` into consecutive groups within PREFILL_TOKENS padded slots
    (a single prompt always allowed)."""
    if not lengths:
        return [[]]
    cuts = []
    for size in range(1, len(lengths) + 1):
        head = lengths[:size]
        if size > 1 and (head[0] - skip) * size > PREFILL_TOKENS:
            break
        cuts += [[head, *rest] for rest in every_cut(lengths[size:], skip)]
    return cuts


@pytest.mark.parametrize("seed", range(30))
def test_prefill_groups_are_the_cheapest_cut_in_order_within_the_cap(seed):
    rng = random.Random(seed)
    skip = rng.choice([0, 24])
    lengths = sorted((skip + rng.randint(1, 300) for _ in range(rng.randint(1, 9))), reverse=True)
    if seed == 0:
        lengths[0] = skip + PREFILL_TOKENS + 100  # a prompt longer than any group goes alone
    joining = [SimpleNamespace(prompt_ids=[0] * n) for n in lengths]
    groups = _groups(joining, skip)
    assert [join for group in groups for join in group] == joining  # all of them, in order
    sizes = [[len(join.prompt_ids) for join in group] for group in groups]
    for group in sizes:
        assert len(group) == 1 or (group[0] - skip) * len(group) <= PREFILL_TOKENS
    if seed == 0:
        assert sizes[0] == [lengths[0]]
    assert cut_cost(sizes, skip) == min(cut_cost(cut, skip) for cut in every_cut(lengths, skip))


def test_prefill_groups_pad_less_than_filling_each_group_in_turn():
    # Filling each group in turn: [250, 120] (500 slots), [118, 116, 114] (354): 854 slots.
    # The cut keeps the short ones together: [250], [120, 118, 116, 114]: 730.
    lengths = [250, 120, 118, 116, 114]
    joining = [SimpleNamespace(prompt_ids=[0] * n) for n in lengths]
    sizes = [[len(join.prompt_ids) for join in group] for group in _groups(joining)]
    assert sizes == [[250], [120, 118, 116, 114]]


def test_only_rounds_of_plain_greedy_rows_skip_the_logits(monkeypatch):
    """Rounds where every row takes its raw argmax read the tokens alone
    (Target.greedy_tokens); a row that wants logprobs makes its rounds compute every
    logit. Outputs are `generate`'s either way. (Plain decoding: a draft head reads the
    lm_head too.)"""
    target = tiny_target(eos=None)
    engine = Engine(target)
    first, second = prompts(96, lengths=(7, 9))
    logits, tokens, inside = [], [], []
    real_head, real_tokens = type(target).lm_head, type(target).greedy_tokens

    def counted_head(t, h):  # the decoder's own calls, not greedy_tokens' (which takes
        if not inside:  # every logit where the CPU has no bf16 to screen them with)
            logits.append(1)
        return real_head(t, h)

    def counted_tokens(t, h):
        tokens.append(1), inside.append(1)
        try:
            return real_tokens(t, h)
        finally:
            inside.pop()

    monkeypatch.setattr(type(target), "lm_head", counted_head)
    monkeypatch.setattr(type(target), "greedy_tokens", counted_tokens)
    for wants_logprobs in (False, True):
        logits.clear(), tokens.clear()
        items = [
            ("first", first, DecodeConfig(mode="vanilla", max_new_tokens=12)),
            (
                "second",
                second,
                DecodeConfig(mode="vanilla", max_new_tokens=12, logprobs=wants_logprobs),
            ),
        ]
        out = dict(engine.generate_batch(items, batch_size=2))
        assert out["first"].token_ids == hf_greedy(target, first, 12)
        assert out["second"].token_ids == hf_greedy(target, second, 12)
        rounds = out["first"].stats.n_cycles
        if wants_logprobs:
            assert tokens == [] and len(logits) == 1 + rounds  # the prefill's, then each
        else:
            assert len(logits) == 1 and len(tokens) == rounds  # the prefill's first tokens
