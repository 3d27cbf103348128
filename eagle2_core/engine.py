"""The engine: a loaded target and draft head, and decoding by prompt.

`Engine` holds what outlives one batch: the prepared target, the draft head at inference
(lean_head.py) over its draft vocabulary, this device's cost table (cost.py, measured
on first use) and the planner's running calibration. Decoding itself is decoder.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Iterator
from pathlib import Path

import torch

from eagle2_core.config import DEFAULT_BATCH_SIZE, DecodeConfig
from eagle2_core.cost import (
    CONTEXT,
    MAX_AUTO_BATCH,
    CostModel,
    load_or_measure,
    shard_batch,
    throughput_batch,
)
from eagle2_core.decoder import BatchDecoder
from eagle2_core.draft import DraftHead, load_draft, new_draft_head, read_config
from eagle2_core.drafters import Drafter, StaticDrafter
from eagle2_core.eagle3 import Eagle3Head, LeanEagle3, is_eagle3, load_eagle3
from eagle2_core.generation import DecodeStats, Generation, PromptError, seeded_generator
from eagle2_core.kv import RESERVE_SLOTS
from eagle2_core.lean_head import LeanHead
from eagle2_core.models import Target, load_target
from eagle2_core.plan import MAX_NODES, Calibration, Planner, accept_ceiling
from eagle2_core.registry import DraftUnavailableError, draft_source, encode_chat
from eagle2_core.vocab import DraftVocab

__all__ = [
    "BatchDecoder",
    "DecodeStats",
    "Engine",
    "Generation",
    "PromptError",
    "load_engine",
    "load_head",
    "seeded_generator",
]

log = logging.getLogger(__name__)


def free_memory(device: torch.device) -> int:
    """Bytes free for the cache: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30  # no /proc (not Linux): assume a modest 8 GiB


class Engine:
    """Decodes prompts with a target and (optionally) an EAGLE draft head."""

    def __init__(
        self,
        target: Target,
        draft_head: DraftHead | Eagle3Head | None = None,
        vocab: DraftVocab | None = None,
    ):
        self.target = target
        self.draft_head = draft_head.to(target.device, target.dtype) if draft_head else None
        self.vocab = vocab
        self.lean_head: LeanHead | LeanEagle3 | None = None
        if isinstance(self.draft_head, Eagle3Head):
            self.lean_head = LeanEagle3.of(self.draft_head, target)  # its vocabulary is inside
        elif self.draft_head is not None:
            self.lean_head = LeanHead.of(self.draft_head, target, vocab)
        self.calibration = Calibration()
        # the most a batch's drafting is judged by before the head reads a prompt
        self.accept_ceiling = accept_ceiling(draft_head.held_out_top1 if draft_head else None)
        self._costs: CostModel | None = None

    def with_head(
        self, draft_head: DraftHead | Eagle3Head, vocab: DraftVocab | None = None
    ) -> Engine:
        """The same target with another head of the same shape (a job's newer version):
        the cost table carries over, the confidence calibration starts afresh."""
        engine = Engine(self.target, draft_head, vocab)
        engine._costs = self._costs
        return engine

    def costs(
        self,
        batch_size: int = DEFAULT_BATCH_SIZE,
        on_measure: Callable[[Path], object] | None = None,
    ) -> CostModel:
        """This device's cost table, up to DEFAULT_BATCH_SIZE rows at least, so one
        measurement serves one sequence and a worker's batches alike (cached on disk)."""
        largest = max(batch_size, DEFAULT_BATCH_SIZE)
        if self._costs is None or max(self._costs.batch_grid) < largest:
            self._costs = load_or_measure(self.target, self.lean_head, largest, on_measure)
        return self._costs

    def auto_batch_size(self, on_measure: Callable[[Path], object] | None = None) -> int:
        """--batch-size auto: the rows at once that maximise plain decoding's tokens/s in
        this device's cost table (measured up to MAX_AUTO_BATCH rows: 128 on a CPU, 256 on
        a GPU), within what half of the free memory holds as cache rows of RESERVE_SLOTS
        tokens."""
        largest = MAX_AUTO_BATCH.get(self.target.device.type, MAX_AUTO_BATCH["cpu"])
        costs = self.costs(largest, on_measure)
        return throughput_batch(costs, self.auto_batch_limit(), largest)

    def auto_rows_for(
        self, samples: int, on_measure: Callable[[Path], object] | None = None
    ) -> int:
        """--batch-size auto for a shard of `samples`: the rows at once that finish it
        soonest by this device's cost table (cost.shard_batch), within auto_batch_limit."""
        largest = MAX_AUTO_BATCH.get(self.target.device.type, MAX_AUTO_BATCH["cpu"])
        costs = self.costs(largest, on_measure)
        return shard_batch(costs, samples, self.auto_batch_limit(), largest)

    def drafts_at(self, rows: int, config: DecodeConfig) -> bool:
        """Whether a batch of `rows` rows of `config` drafts at all on this device: plain
        decoding never; fixed trees always; trees sized by cost where any could pay
        (Planner.could_pay at the cost table's context). What `run` tells a user before
        decoding; the decoder checks each batch's own prompts."""
        if config.mode == "vanilla" or self.lean_head is None:
            return False
        if config.mode != "eagle2" or not config.planned:
            return True
        width, depth = config.tree_width, config.tree_depth
        caps = [MAX_NODES] * rows
        planner = Planner(self.costs(rows), self.calibration, rows, CONTEXT, caps, width, depth)
        return planner.could_pay(self.accept_ceiling)

    def auto_batch_limit(self) -> int:
        """The most rows an auto batch may take: the largest size measured, and what half
        the free memory holds as cache rows of RESERVE_SLOTS tokens."""
        lean, target = self.target.lean, self.target
        element = torch.empty((), dtype=target.dtype).element_size()
        row = 2 * len(lean.layers) * lean.shape.kv_heads * lean.shape.dim * element
        max_rows = max(1, int(free_memory(target.device) / 2 // (row * RESERVE_SLOTS)))
        largest = MAX_AUTO_BATCH.get(target.device.type, MAX_AUTO_BATCH["cpu"])
        return min(max_rows, largest)

    def drafter_for(self, config: DecodeConfig) -> Drafter | None:
        """A row-by-row drafter for the mode: EAGLE-1's static tree, or none (plain
        decoding). EAGLE-2 rows draft together inside the batch decoder."""
        if config.mode == "vanilla":
            return None
        if self.lean_head is None:
            raise ValueError(f"mode {config.mode} needs a draft head; none is loaded")
        return StaticDrafter(self.lean_head, config.static_tree)

    def chat(
        self, messages: list[dict], followups: list[str], config: DecodeConfig
    ) -> list[Generation]:
        """Answer the conversation, then each follow-up turn after the previous answer."""
        generator = seeded_generator(config.seed)
        conversation = list(messages)
        turns = []
        for followup in [None, *followups]:
            if followup is not None:
                conversation += [
                    {"role": "assistant", "content": turns[-1].text},
                    {"role": "user", "content": followup},
                ]
            ids = encode_chat(self.target.tokenizer, conversation)
            turns.append(self.generate(ids, config, generator=generator))
        return turns

    def generate(
        self,
        prompt_ids: list[int],
        config: DecodeConfig,
        drafter: Drafter | None = None,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """Decode one prompt (a batch of one). A drafter passed in overrides the mode's."""
        decoder = BatchDecoder(self, batch_size=1)
        decoder.add(None, prompt_ids, config, drafter, generator)
        while True:
            for _, generation in decoder.step():
                return generation

    def generate_batch(
        self,
        items: Iterable[tuple[Hashable, list[int], DecodeConfig]],
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> Iterator[tuple[Hashable, Generation]]:
        """Decode (key, prompt_ids, config) items, up to batch_size at once, yielding each
        (key, generation) as it finishes; the next item joins in its place."""
        decoder, pending = BatchDecoder(self, batch_size), iter(items)
        while True:
            while decoder.active < batch_size and (item := next(pending, None)) is not None:
                decoder.add(*item)
            if decoder.idle:
                return
            yield from decoder.step()


def load_head(
    target: Target, source: Path | None
) -> tuple[DraftHead | Eagle3Head, DraftVocab | None]:
    """The head at `source` (checked against the target): an EAGLE-3 checkpoint (its
    vocabulary inside), or an EAGLE-1/2 one with the draft vocabulary stored beside it;
    an untrained EAGLE-2 head over the full vocabulary for None."""
    if source is not None:
        raw = read_config(source)
        if is_eagle3(raw):
            return load_eagle3(Path(source), raw, target.config), None
        return load_draft(source, target.config), DraftVocab.load(source)
    log.warning(
        "USING A RANDOM, UNTRAINED DRAFT HEAD for %s: outputs are correct but nothing is "
        "sped up (tau ~ 1). This is for testing only: pass a trained head.",
        target.name,
    )
    return new_draft_head(target.config), None


def load_engine(
    model: str,
    draft: str | None = None,
    *,
    needs_draft: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Engine:
    """Target + draft by name (see draft_source); without needs_draft a model with no
    shipped head loads without one."""
    try:
        source = draft_source(model, draft)
    except DraftUnavailableError:
        if needs_draft:
            raise
        return Engine(load_target(model, dtype=dtype, device=device))
    target = load_target(model, dtype=dtype, device=device)
    return Engine(target, *load_head(target, source))
