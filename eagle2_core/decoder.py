"""The decoding loop for a batch: prefill, then rounds of draft -> verify -> accept ->
commit until every sequence stops.

The same loop runs plain decoding (root-only trees), EAGLE-1 (static trees) and EAGLE-2
(dynamic trees, sized by cost: plan.py), so the three compare on equal terms. A round
syncs with the host once to read what was accepted (and the planner reads the draft's
confidences once per draft level); trees, masks, acceptance and the cache commit are
tensor operations that run on any device.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from eagle2_core import cpu_kernels
from eagle2_core.config import DEFAULT_BATCH_SIZE, DecodeConfig
from eagle2_core.controls import controls_for, draft_adjust, process_trees
from eagle2_core.cost import CostModel
from eagle2_core.drafters import Drafter
from eagle2_core.dynamic import DynamicDrafter, FixedPlan, Fresh, cat_fresh, extend_fresh
from eagle2_core.generation import DecodeStats, Generation, PromptError, seeded_generator
from eagle2_core.lean_head import LeanHead
from eagle2_core.llama import forward
from eagle2_core.logprobs import TokenLogprob, path_logprobs, token_logprobs
from eagle2_core.models import Target
from eagle2_core.plan import MAX_NODES, Calibration, Planner
from eagle2_core.sequence import (
    Joining,
    Prefill,
    Sequence,
    SharedPrefix,
    completion,
    finish_reason,
)
from eagle2_core.tree import TreeBatch, root_only, roots_only, select, stack
from eagle2_core.verify import Accepted, Uniforms, accept, choose_token, draw, target_probs

MAX_REST = 16  # the longest pause from drafting when it does not pay
# Padded tokens per prefill forward. On the AVX2 EPYC (2026-12-03) the 80 MT-bench prompts
# (7,988 tokens) prefilled in 19.8-22.7 s one by one and 16.4-17.8 s in groups of up to
# 256-512 (fp32 products run ~100 GFLOP/s at 100 rows, ~125 at 500); larger groups
# pad more than they gain.
PREFILL_TOKENS = 512
# What one more prefill forward costs beyond its slots, in slots: its per-layer ops and the
# slower products of fewer rows. The 80 MT-bench prompts' prefill in bf16 on the
# AVX512-BF16 EPYC (2026-12-05): 4.91 s at 0 (a forward each), 4.15 s at 20, 4.21 s at 60,
# 4.27 s filling each group in turn.
GROUP_COST_TOKENS = 20
# The fewest leading tokens that new prompts must share for their prefill to run them once
# (a chat template's system prompt: 24 of SmolLM2's tokens).
SHARED_PREFIX_MIN = 16


class Speculator(Protocol):
    """What a decoder needs of its engine (engine.Engine)."""

    target: Target
    lean_head: LeanHead | None
    calibration: Calibration
    accept_ceiling: float  # plan.accept_ceiling of the head

    def drafter_for(self, config: DecodeConfig) -> Drafter | None: ...

    def costs(self, batch_size: int) -> CostModel: ...


class BatchDecoder:
    """Decodes many sequences at once: every round drafts each sequence's own tree, then
    verifies all trees in one batched target forward.

    Callers `add` sequences whenever they like (continuous batching) and call `step`
    for one round; the sequences added since the last step are prefilled together at its
    start, and finished sequences leave the batch. Each sequence is decoded exactly
    as it would be alone (its own tree, acceptance, cache length, stop and generator);
    only how much is speculated depends on the batch (see plan.py). A batch drafts with
    the engine's EAGLE-2 (all rows share one tree shape) or row by row (EAGLE-1, plain
    decoding, a drafter passed in), not both. Time is attributed per sequence: its
    prefill and drafting share, plus the batched verify split in proportion to tree size.
    """

    shares_prefill = True  # a prompt prefilled once for all its sequences (Prefill)

    def __init__(self, engine: Speculator, batch_size: int = DEFAULT_BATCH_SIZE):
        self.engine = engine
        self.target = engine.target
        self.batch_size = batch_size  # expected rows at once: sizes the cost table
        self.kv = self.target.kv()
        self.rows: list[Sequence] = []
        self.finished: list[tuple[Hashable, Generation]] = []
        self.dynamic: DynamicDrafter | None = None
        self.fresh: Fresh | None = None  # the dynamic rows' tokens to catch up on
        self.shape: tuple[int, int] | None = None  # (tree_width, tree_depth) of EAGLE-2 rows
        self.rest = self.backoff = 0  # rounds to skip drafting, and the last such pause
        self.retired = False  # EAGLE-2 rows decode plain until the batch empties (_retire)
        self.joining: list[Joining] = []  # added, to be prefilled at the next step
        self.prefill: Prefill | None = None
        self.shared: SharedPrefix | None = None  # leading tokens the last prompts shared
        self.lowered: CostModel | None = None  # the cost table, once a round corrected it

    @property
    def active(self) -> int:
        return len(self.rows) + len(self.joining)

    @property
    def idle(self) -> bool:
        return not self.rows and not self.joining and not self.finished

    @torch.inference_mode()
    def add(
        self,
        key: Hashable,
        prompt_ids: list[int],
        config: DecodeConfig,
        drafter: Drafter | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        """Queue a prompt to join the batch at the next `step`, which prefills every queued
        prompt (_join); raises PromptError for an undecodable one (ControlError for
        controls the model cannot follow), before anything is changed.

        The first row that sizes its trees by cost has the cost table loaded (measured,
        on a new machine) before its clock starts: that is the machine's, not its time."""
        planned = config.mode == "eagle2" and config.planned and drafter is None
        if planned and self.engine.lean_head is not None:
            self.engine.costs(self.batch_size)
        start = time.perf_counter()
        target = self.target
        if not prompt_ids:
            raise PromptError("the prompt is empty: there is nothing to continue")
        if len(prompt_ids) >= target.max_context:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context holds "
                f"{target.max_context}; shorten the prompt"
            )
        controls = controls_for(config, prompt_ids, target)  # ControlError: nothing changed yet
        stats = DecodeStats()
        if config.max_new_tokens == 0:
            empty = [] if config.logprobs else None
            self.finished.append((key, Generation([], "", "length", len(prompt_ids), stats, empty)))
            return
        eagle2 = drafter is None and config.mode == "eagle2" and self.engine.lean_head is not None
        dynamic = self._check_kind(eagle2, config)
        if drafter is None and not eagle2:
            drafter = self.engine.drafter_for(config)
        if drafter is not None:
            drafter.reset()
        generator = generator if generator is not None else seeded_generator(config.seed)
        joining = Joining(key, prompt_ids, config, drafter, generator, controls, stats, dynamic)
        self.joining.append(joining)
        stats.total_ms += (time.perf_counter() - start) * 1000

    def _join(self) -> None:
        """The queued prompts join: prefilled together (_prefill), each row's first token
        chosen from one lm_head product over all of them."""
        joining, self.joining = self.joining, []
        if not joining:
            return
        start = time.perf_counter()
        target = self.target
        starting = not self.rows
        if starting:  # the batch's cache at once, each row as long as this one may get
            longest = max(
                len(j.prompt_ids) + j.config.max_new_tokens + _budget(j.config) for j in joining
            )
            self.kv.reserve_batch(self.batch_size, min(longest, target.max_context))
        prefilled = self._prefill(joining)
        if starting and self.dynamic is not None and not self._drafting_could_pay(joining):
            self._retire()
            prefilled = [(replace(join, dynamic=False), *rest) for join, *rest in prefilled]
        lasts = target.lm_head(torch.stack([last for _, last, _ in prefilled]))
        prompt_tokens = sum(len(j.prompt_ids) for j in joining)
        seconds = time.perf_counter() - start
        drafting = []
        for (join, _, features), logits in zip(prefilled, lasts, strict=True):
            join.stats.total_ms += seconds * 1000 * len(join.prompt_ids) / prompt_tokens
            next_tokens = self._start(join, features, logits)
            if join.dynamic:
                drafting.append((join, features, next_tokens))
        if drafting:
            self._join_dynamic(drafting)
        self._drop_finished()

    def _start(self, join: Joining, features: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """A prefilled prompt becomes a row: its first token from the prompt's last logits.
        Returns its committed tokens after the first (the prompt's, then that one)."""
        start = time.perf_counter()
        target, config, controls = self.target, join.config, join.controls
        uniforms = Uniforms(join.generator)
        first = 0.0 if config.sampling.greedy else uniforms.take(1)[0]
        chosen = logits if controls is None else controls.first_logits(logits)
        root = choose_token(chosen, config.sampling, first)
        prompt = torch.tensor(join.prompt_ids, device=target.device)
        next_tokens = torch.cat([prompt[1:], torch.tensor([root], device=target.device)])
        seq = Sequence(
            key=join.key,
            config=config,
            drafter=join.drafter,
            uniforms=uniforms,
            prompt_len=len(join.prompt_ids),
            stats=join.stats,
            output=[root],
            context_len=len(join.prompt_ids),
            features=None if join.dynamic else features,
            next_tokens=None if join.dynamic else next_tokens,
            controls=controls,
        )
        if controls is not None:
            controls.commit([root])
        if config.logprobs:
            seq.logprobs = token_logprobs(logits[None], next_tokens[-1:], config.top_logprobs)
        seq.finish = finish_reason(seq, target)
        self.rows.append(seq)
        seq.stats.total_ms += (time.perf_counter() - start) * 1000
        return next_tokens

    def _prefill(self, joining: list[Joining]) -> list[tuple[Joining, torch.Tensor, torch.Tensor]]:
        """New cache rows holding the joining prompts, in the order they were added to the
        cache, each with its final state at its last token and its features.

        Prompts go through the target in padded groups of up to PREFILL_TOKENS slots,
        longest first (a forward of a few hundred tokens runs its products faster than
        one of a single prompt). A prompt seen before in this queue, or the newest one
        prefilled before it whose row is still here (the n completions of one request),
        copies that row instead of running the target again: the same numbers, a copy
        instead of a forward (Prefill)."""
        held: dict[tuple[int, ...], tuple[int, torch.Tensor, torch.Tensor]] = {}
        last = self.prefill  # held: prompt -> (cache row holding it, last state, features)
        if self.shares_prefill and last is not None:
            source = next((i for i, s in enumerate(self.rows) if s.key == last.key), None)
            if source is not None:
                held[tuple(last.prompt_ids)] = (source, last.last_hidden, last.features)
        firsts, copies, seen = [], [], set(held)
        for join in joining:
            prompt = tuple(join.prompt_ids)
            if self.shares_prefill and prompt in seen:
                copies.append(join)
            else:
                seen.add(prompt)
                firsts.append(join)
        firsts.sort(key=lambda j: len(j.prompt_ids), reverse=True)
        shared = self._shared_prefix(firsts) if self.shares_prefill else None
        sharing, whole = [], []
        for join in firsts:
            extends = shared is not None and _extends(join.prompt_ids, shared.ids)
            (sharing if extends else whole).append(join)
        done: list[tuple[Joining, torch.Tensor, torch.Tensor]] = []
        for members, prefix in ((sharing, shared), (whole, None)):
            for group in _groups(members, len(prefix.ids) if prefix is not None else 0):
                prefilled = self._prefill_group(group, prefix)
                for join, last_hidden, features in zip(group, *prefilled, strict=True):
                    row = len(self.rows) + len(done)
                    held[tuple(join.prompt_ids)] = (row, last_hidden, features)
                    done.append((join, last_hidden, features))
        for join in copies:
            source, last_hidden, features = held[tuple(join.prompt_ids)]
            self.kv.add_row(len(join.prompt_ids))
            self.kv.copy_prefix(source, self.kv.rows - 1, len(join.prompt_ids))
            done.append((join, last_hidden, features))
        newest = joining[-1]
        _, last_hidden, features = held[tuple(newest.prompt_ids)]
        self.prefill = Prefill(newest.key, newest.prompt_ids, last_hidden, features)
        return done

    def _prefill_group(
        self, group: list[Joining], shared: SharedPrefix | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One target forward over prompts padded to the longest: new rows, one per prompt.
        With a shared prefix, each row's first slots copy its cache and only the rest of
        each prompt goes through the target. Causal attention keeps each real token from
        the padding after it."""
        device = self.target.device
        skip = len(shared.ids) if shared is not None else 0
        lengths = [len(j.prompt_ids) for j in group]
        width = max(lengths) - skip
        ids = torch.zeros(len(group), width, dtype=torch.long)
        for row, join in enumerate(group):
            ids[row, : lengths[row] - skip] = torch.tensor(join.prompt_ids[skip:])
        first = self.kv.rows
        keys, values = self.kv.add_rows(lengths, skip + width)
        if shared is not None:
            keys[:, :, :, :skip] = shared.keys
            values[:, :, :, :skip] = shared.values
            self.kv.hold_prefix(range(first, self.kv.rows), shared.keys, shared.values)
        positions = torch.arange(skip, skip + width, device=device)[None].expand(len(group), width)
        hidden, features = self._forward(ids.to(device), positions, keys, values, skip, None)
        rest = [features[row, : n - skip] for row, n in enumerate(lengths)]
        return (
            [hidden[row, n - skip - 1] for row, n in enumerate(lengths)],
            rest if shared is None else [torch.cat([shared.features, f]) for f in rest],
        )

    def _shared_prefix(self, firsts: list[Joining]) -> SharedPrefix | None:
        """Leading tokens that new prompts share, run through the target once
        (SharedPrefix): a new one where the most of them that open alike (two or more)
        share at least SHARED_PREFIX_MIN tokens (more than the held one), else the one
        held from an earlier join if any of them extends it. The prompts that extend it
        copy it; the rest (a line with a system prompt of its own) are prefilled whole."""
        prompts = [j.prompt_ids for j in firsts]
        held = self.shared
        if held is not None and not any(_extends(p, held.ids) for p in prompts):
            held = None
        alike: dict[tuple[int, ...], list[list[int]]] = {}
        for prompt in prompts:
            if len(prompt) > SHARED_PREFIX_MIN:
                alike.setdefault(tuple(prompt[:SHARED_PREFIX_MIN]), []).append(prompt)
        most = max(alike.values(), key=len, default=[])
        length = common_length(most) if len(most) > 1 else 0
        if length >= SHARED_PREFIX_MIN + (len(held.ids) if held is not None else 0):
            ids = most[0][:length]
            kv = self.target.kv()
            keys, values = kv.add_rows([length], length)
            positions = torch.arange(length, device=self.target.device)[None]
            tokens = torch.tensor([ids], device=self.target.device)
            _, features = self._forward(tokens, positions, keys, values, 0, None)
            cached = (keys[:, :, :, :length], values[:, :, :, :length])
            held = self.shared = SharedPrefix(ids, *cached, features[0])
        return held

    def _check_kind(self, eagle2: bool, config: DecodeConfig) -> bool:
        """Whether a row of `config` drafts with the batch's EAGLE-2 head (eagle2: its mode
        and the engine would have it; not in a batch that stopped drafting, _retire),
        checked against the rows decoding; a new batch starts drafting again."""
        busy = bool(self.rows or self.joining)
        if not busy:
            self.retired = False
        dynamic = eagle2 and not self.retired
        if busy and (self.dynamic is not None) != dynamic:
            raise ValueError(
                "a batch drafts either with the engine's EAGLE-2 head or row by row, not both"
            )
        shape = (config.tree_width, config.tree_depth)
        if dynamic and busy and shape != self.shape:
            raise ValueError(
                f"a batch's EAGLE-2 rows share tree_width and tree_depth: {self.shape} "
                f"is decoding, {shape} was added"
            )
        if dynamic and not busy:
            self.shape = shape
            self.dynamic = DynamicDrafter(self.engine.lean_head, config.tree_depth)
            self.fresh = None
            self.rest = self.backoff = 0
        if not dynamic and not busy:
            self.dynamic = self.fresh = None
        return dynamic

    def _drafting_could_pay(self, joining: list[Joining]) -> bool:
        """At a batch's start, for rows that size their trees by cost: whether any tree
        could pay at this many rows for a head right as often as this one could be
        (Planner.could_pay at the engine's accept_ceiling). Where not, the batch stops
        drafting before the head reads a prompt (_retire): at 80 rows on a 2-core CPU in
        bf16 the head's prefill and its probe rounds until the batch stopped drafting
        cost 0.5-1.2 s of an 18 s job."""
        if not all(j.config.planned for j in joining):
            return True
        room = self.target.max_context
        caps = [min(_budget(j.config), room - len(j.prompt_ids)) for j in joining]
        costs = self.engine.costs(self.batch_size)
        rows, calibration = len(joining), self.engine.calibration
        planner = Planner(costs, calibration, rows, self.kv.slots, caps, *self.shape)
        return planner.could_pay(self.engine.accept_ceiling)

    def _join_dynamic(self, joins: list[tuple[Joining, torch.Tensor, torch.Tensor]]) -> None:
        """The new rows' (join, features, next_tokens) draft caches take all but their last
        committed token, in padded groups like the target's prefill; that one is each row's
        first round's fresh token. Its time goes to the rows by prompt length."""
        start = time.perf_counter()
        self.dynamic.add_rows([(f, t) for _, f, t in joins], PREFILL_TOKENS)
        rows = Fresh(
            torch.stack([f[-1:] for _, f, _ in joins]),
            torch.stack([t[-1:] for _, _, t in joins]),
            torch.ones(len(joins), dtype=torch.long, device=joins[0][1].device),
        )
        self.fresh = rows if self.fresh is None else cat_fresh(self.fresh, rows)
        ms = (time.perf_counter() - start) * 1000
        tokens = sum(len(t) for _, _, t in joins)
        for join, _, t in joins:
            join.stats.total_ms += ms * len(t) / tokens

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, Generation]]:
        """The queued prompts join, then one draft + verify round for every sequence;
        returns those that finished."""
        self._join()
        for seq in self.rows:
            if self.target.max_context - seq.context_len < 1:
                seq.finish = "context"
        self._drop_finished()
        if self.rows:
            self._round()
        finished, self.finished = self.finished, []
        return finished

    def _round(self) -> None:
        self._sort_rows()
        started = time.perf_counter()
        context_lens = [s.context_len for s in self.rows]
        caps = [
            min(_budget(s.config), self.target.max_context - c)
            for s, c in zip(self.rows, context_lens, strict=True)
        ]
        skipped = False
        if self.dynamic is not None:
            trees, planner, skipped = self._draft_dynamic(context_lens, caps)
        else:
            trees, planner = self._draft_rows(caps), None
        drafted = time.perf_counter()
        step = self._verify(trees, context_lens, skipped)
        finished = time.perf_counter()
        if planner is not None:
            self._calibrate(planner, trees, step.lengths, finished - started)
            self._correct_costs(planner.costs, trees.width, context_lens, finished - drafted)
        self._attribute(drafted - started, finished - drafted, step.sizes)
        self._advance(step)
        self._drop_finished()

    def _draft_rows(self, caps: list[int]) -> TreeBatch:
        """Each row's tree from its own drafter (the root alone without one). A batch of
        plain decoding builds its roots at once: no per-row tree objects."""
        if all(seq.drafter is None for seq in self.rows):
            roots = torch.tensor([seq.output[-1] for seq in self.rows], device=self.target.device)
            return roots_only(roots)
        return stack(
            [
                seq.drafter.draft(seq.features, seq.next_tokens, seq.context_len, cap)
                if seq.drafter is not None
                else root_only(seq.output[-1])
                for seq, cap in zip(self.rows, caps, strict=True)
            ],
            self.target.device,
        )

    def _draft_dynamic(
        self, context_lens: list[int], caps: list[int]
    ) -> tuple[TreeBatch, Planner | None, bool]:
        """The EAGLE-2 trees of all rows: planned by cost where total_tokens is auto; and
        whether drafting was skipped.

        When the planner finds that a round, drafting included, did not beat plain
        decoding, the next rounds skip drafting (1, 2, 4 .. MAX_REST rounds, doubling while
        it keeps not paying): plain decoding, while the fresh tokens wait to be caught up
        on in one head forward. So a useless draft costs a draft step every MAX_REST + 1
        rounds, until a round after a pause of MAX_REST finds that it would not pay even
        with drafting free: then the batch stops drafting (_retire)."""
        top_k, depth = self.shape
        device = self.target.device
        auto = all(s.config.planned for s in self.rows)
        if auto and self.rest > 0:
            self.rest -= 1
            return roots_only(self.fresh.roots()), None, True
        lens = torch.tensor(context_lens, device=device)
        planner = None
        if auto:
            costs = self.engine.costs(self.batch_size)
            planner = Planner(
                costs, self.engine.calibration, len(self.rows), self.kv.slots, caps, top_k, depth
            )
            plan = planner
        else:
            plan = FixedPlan(top_k, depth)
        controls = [s.controls for s in self.rows]
        adjust = draft_adjust(controls, self.engine.lean_head.token_ids, self.target.vocab_size)
        pool, max_depth = self.dynamic.draft(self.fresh, lens, plan, adjust)
        sizes = planner.sizes(pool) if planner is not None else caps
        trees = select(pool, self.fresh.roots(), sizes, max_depth)
        if planner is not None:
            if not planner.verifying_pays and self.backoff == MAX_REST:
                self._retire()
            self.backoff = 0 if planner.pays else min(max(2 * self.backoff, 1), MAX_REST)
            self.rest = self.backoff
        return trees, planner, False

    def _retire(self) -> None:
        """Drafting has not paid through the longest pause, and would not even if it cost
        nothing: at this batch size verifying more nodes costs more than this head's
        drafts bring. Not sooner: one round's drafts can be near worthless where the
        text is hard to guess, at any batch size (stopping after two such rounds in a row
        cut one sequence's tau from 1.5 to 1.06 in bf16). The rows decode plain from now
        on, rows joining meanwhile skip the head's prefill, and the next batch (once this
        one empties) drafts again. Where a few more nodes cost a verify forward next to
        nothing (one or a few rows, on most devices), any draft with some confidence
        beats plain decoding when it is free, so such a batch never stops. A batch where
        no tree could pay even for a far better head stops at its start
        (_drafting_could_pay)."""
        self.retired = True
        self.dynamic = self.fresh = None

    def _verify(self, trees: TreeBatch, context_lens: list[int], skipped: bool) -> _Step:
        """One target forward over every row's tree; accept, commit, and what each row
        emits (read to the host once)."""
        target, device = self.target, self.target.device
        start = self.kv.reserve_new(trees.width)
        positions = torch.tensor(context_lens, device=device)[:, None] + trees.depths
        keys, values = self.kv.layer_views()
        mask = self.kv.tree_mask(trees.ancestors)
        hidden, drafts_read = self._forward(
            trees.tokens, positions, keys, values, start, mask, self.kv.prefix_reads()
        )
        if self._plain_greedy():  # the tokens alone (Target.greedy_tokens)
            logits, accepted = None, accept(trees, target.greedy_tokens(hidden))
        else:
            logits = target.lm_head(hidden)
            accepted = self._accept(trees, logits)
        lengths = accepted.lengths.tolist()
        width = max(lengths)
        nodes = accepted.nodes[:, :width]
        self.kv.commit(start, nodes, accepted.lengths)
        after = torch.cat([nodes[:, 1:], nodes[:, :1]], dim=1)  # the node after each
        emitted = trees.tokens.gather(1, after)
        last = torch.arange(width, device=device)[None] == (accepted.lengths - 1)[:, None]
        emitted = torch.where(last, accepted.bonus[:, None], emitted)  # bonus after the path
        features = drafts_read.gather(1, nodes[:, :, None].expand(-1, -1, drafts_read.shape[-1]))
        leaf = nodes.gather(1, (accepted.lengths - 1)[:, None])
        offered = trees.has_children().gather(1, leaf)[:, 0]
        configs = [s.config for s in self.rows]
        logprobs = (
            None if logits is None else path_logprobs(logits, nodes, emitted, lengths, configs)
        )
        if self.dynamic is not None:  # what the draft has to catch up on next
            fresh = Fresh(features, emitted, accepted.lengths)
            self.fresh = extend_fresh(self.fresh, fresh) if skipped else fresh
        return _Step(
            lengths,
            emitted.tolist(),
            offered.tolist(),
            trees.sizes.tolist(),
            features,
            emitted,
            logprobs,
        )

    def _advance(self, step: _Step) -> None:
        """Each row takes its emitted tokens, up to its stop."""
        for row, seq in enumerate(self.rows):
            n = step.lengths[row]
            seq.context_len += n
            if self.dynamic is None and seq.drafter is not None:  # row by row: its own state
                seq.features = step.features[row, :n]
                seq.next_tokens = step.emitted[row, :n]
            if not seq.config.sampling.greedy:
                seq.uniforms.take(n)
            kept = 0
            for token in step.emitted_host[row][:n]:  # token by token, as plain decoding stops
                seq.output.append(token)
                kept += 1
                seq.finish = finish_reason(seq, self.target)
                if seq.finish is not None:
                    break
            if seq.controls is not None:
                seq.controls.commit(seq.output[-kept:])
            if seq.logprobs is not None:
                seq.logprobs += step.logprobs[row][:kept]
            seq.stats.record(step.sizes[row], n - 1, n - 1 + step.offered[row], kept)

    def _forward(
        self, ids, positions, keys, values, start, mask, prefix=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's final-norm states [B, T, H] and what the draft head reads of them:
        the same states, or for an EAGLE-3 head the inputs of its three layers [B, T, 3H]."""
        head = self.engine.lean_head
        layers = head.feature_layers if head is not None else ()
        hidden, captured = forward(
            self.target.lean, ids, positions, keys, values, start, mask, layers, prefix
        )
        return hidden, captured if captured is not None else hidden

    def _plain_greedy(self) -> bool:
        """Whether every row takes the argmax of its raw logits: greedy, no processors,
        no logprobs (then no round needs the logits themselves)."""
        return all(
            seq.config.sampling.greedy and seq.controls is None and not seq.config.logprobs
            for seq in self.rows
        )

    def _accept(self, trees: TreeBatch, logits: torch.Tensor) -> Accepted:
        """The target's token at every node (argmax, or a sampled row's draws from its own
        uniforms: verify.py), then each row's matching path."""
        controls = [seq.controls for seq in self.rows]
        if any(c is not None for c in controls):  # rows with processors: their own logits
            logits = process_trees(logits, trees, controls)
        choices = cpu_kernels.greedy_tokens(logits)
        for row, seq in enumerate(self.rows):
            sampling = seq.config.sampling
            if not sampling.greedy:
                ahead = torch.tensor(seq.uniforms.peek(trees.width), device=logits.device)
                probs = target_probs(logits[row], sampling)
                choices[row] = draw(probs, ahead[trees.depths[row]])
        return accept(trees, choices)

    def _calibrate(
        self, planner: Planner, trees: TreeBatch, lengths: list[int], seconds: float
    ) -> None:
        drafted = trees.real.clone()
        drafted[:, 0] = False
        predicted = float(trees.scores.exp().where(drafted, 0.0).sum())
        calibration = self.engine.calibration
        calibration.record(predicted, sum(lengths) - len(lengths), planner.chosen)
        modelled = planner.draft_ms + float(planner.verify_ms[planner.chosen])
        calibration.record_overhead(seconds * 1000 - modelled)

    def _correct_costs(
        self, costs: CostModel, width: int, context_lens: list[int], seconds: float
    ) -> None:
        """A round that ran the full lm_head, as the cost table's forwards do, lowers an
        entry it beats (CostModel.lower); the table is kept when the batch empties
        (_drop_finished). Rows that read a shared prefix from one copy in cache count
        their own slots only: the table's rows read all of theirs from memory."""
        if self._plain_greedy() and self.target.screened is not None:
            return  # the screened lm_head: cheaper than the table's
        shared = self.kv.prefix_reads()
        if shared is not None:
            context_lens = [c - p for c, p in zip(context_lens, shared.lens.tolist(), strict=True)]
        if costs.lower(width, context_lens, seconds * 1000):
            self.lowered = costs

    def _attribute(self, draft_s: float, verify_s: float, sizes: list[int]) -> None:
        """Drafting time is shared evenly, verify time by tree size."""
        total = sum(sizes)
        for seq, size in zip(self.rows, sizes, strict=True):
            draft_ms = draft_s * 1000 / len(self.rows)
            verify_ms = verify_s * 1000 * size / total
            seq.stats.draft_ms += draft_ms
            seq.stats.verify_ms += verify_ms
            seq.stats.total_ms += draft_ms + verify_ms

    def _drop_finished(self) -> None:
        gone = [i for i, seq in enumerate(self.rows) if seq.finish is not None]
        if not gone:
            return
        self.finished += [(self.rows[i].key, completion(self.rows[i], self.target)) for i in gone]
        order = self.kv.remove_rows(gone)
        if self.dynamic is not None and self.dynamic.remove_rows(gone) != order:
            raise AssertionError("the draft cache's rows left the target's order")
        self._follow(order)
        if not self.rows and self.lowered is not None:
            self.lowered.keep()
            self.lowered = None

    def _sort_rows(self) -> None:
        """Rows longest first again when chunked attention would read much less so
        (RaggedKV.sorting_order); the draft cache and each row's state follow."""
        order = self.kv.sorting_order()
        if order is None:
            return
        self.kv.reorder(order)
        if self.dynamic is not None:
            self.dynamic.kv.reorder(order)
        self._follow(order)

    def _follow(self, order: list[int]) -> None:
        """The per-row state takes the caches' new row order (new row i = old order[i])."""
        if self.dynamic is not None and order:
            index = torch.tensor(order, device=self.target.device)
            self.fresh = Fresh(
                self.fresh.features[index], self.fresh.tokens[index], self.fresh.lengths[index]
            )
        self.rows = [self.rows[i] for i in order]


@dataclass(frozen=True)
class _Step:
    """What one verify round settled for each row."""

    lengths: list[int]  # tokens committed (root and accepted drafts) = tokens emitted
    emitted_host: list[list[int]]  # the emitted tokens (accepted drafts, then the bonus)
    offered: list[int]  # 1 where the tree went deeper than the accepted path
    sizes: list[int]  # tree nodes verified
    features: torch.Tensor  # [B, W, H] target features of the committed tokens
    emitted: torch.Tensor  # [B, W]
    logprobs: list[list[TokenLogprob] | None] | None  # per row that asks, of its emitted


def _budget(config: DecodeConfig) -> int:
    return MAX_NODES if config.planned else config.total_tokens


def _groups(joining: list[Joining], skip: int = 0) -> list[list[Joining]]:
    """Consecutive prompts (longest first) in groups, each padded to its first one's length
    less the `skip` tokens they share, of at most PREFILL_TOKENS padded slots (a longer
    prompt goes alone), cut where the padded slots plus GROUP_COST_TOKENS a forward are
    fewest. Filling each group in turn padded the 80 MT-bench prompts' 6,068 tokens to
    6,491 slots in 16 forwards; this cut pads them to 6,221 in 21."""
    lengths = [len(join.prompt_ids) - skip for join in joining]
    cost = [0] * (len(lengths) + 1)  # cost[j]: the cheapest cut of the first j prompts
    cut = [0] * (len(lengths) + 1)  # where that cut's last group starts
    for end in range(1, len(lengths) + 1):
        cost[end] = cost[end - 1] + lengths[end - 1] + GROUP_COST_TOKENS
        cut[end] = end - 1
        for first in range(end - 2, -1, -1):  # the group joining[first:end]
            padded = lengths[first] * (end - first)
            if padded > PREFILL_TOKENS:
                break
            if cost[first] + padded + GROUP_COST_TOKENS <= cost[end]:  # ties: larger groups
                cost[end], cut[end] = cost[first] + padded + GROUP_COST_TOKENS, first
    groups: list[list[Joining]] = []
    end = len(joining)
    while end:
        groups.append(joining[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def _extends(prompt: list[int], prefix: list[int]) -> bool:
    """Whether the prompt starts with the prefix and has at least one token after it."""
    return len(prompt) > len(prefix) and prompt[: len(prefix)] == prefix


def common_length(prompts: list[list[int]]) -> int:
    """How many leading tokens all the prompts share, leaving each at least one of its own
    (its last state starts its decoding)."""
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for n in range(limit):
        if any(p[n] != first[n] for p in prompts):
            return n
    return limit
