"""The heads `train-draft` starts from and writes: a new or given head of either kind, its
files in the public layouts, snapshots on the way, and the tau it reaches."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle2_core.config import REFERENCE_TREE_TOKENS, DecodeConfig
from eagle2_core.registry import encode_chat, shipped_draft
from producer.training.data import TrainingError

if TYPE_CHECKING:  # torch: imported where used, so other commands start fast
    from eagle2_core.engine import Engine
    from eagle2_core.models import Target
    from eagle2_core.vocab import DraftVocab


def save_head(
    head: Any, directory: Path, vocab: DraftVocab | None, target: Target, card: str | None = None
) -> Path:
    """Write a head in its public layout: EAGLE-3 (its vocabulary inside) or EAGLE with
    the draft vocabulary beside it."""
    from eagle2_core.draft import save_draft
    from eagle2_core.eagle3 import Eagle3Head, save_eagle3

    if isinstance(head, Eagle3Head):
        where = save_eagle3(head, directory)
        if card is not None:
            (where / "README.md").write_text(card)
        return where
    where = save_draft(head, directory, card=card)
    if vocab is not None:
        vocab.save(where, target.vocab_size)
    return where


def snapshots(
    directory: Path, counts: list[int], vocab: DraftVocab | None, target: Target
) -> Callable[[int, int, Any], None]:
    """on_step for train(): a copy of the head each time tokens seen pass a count."""
    pending = list(counts)

    def on_step(step: int, tokens_seen: int, head: Any) -> None:
        while pending and tokens_seen >= pending[0]:
            where = save_head(head, directory / f"tokens-{pending.pop(0)}", vocab, target)
            (where / "snapshot.json").write_text(
                json.dumps({"step": step, "tokens_seen": tokens_seen})
            )

    return on_step


def starting_head(
    arch: str,
    init_head: str | None,
    model: str,
    seed: int,
    target: Target,
    vocab: DraftVocab | None,
) -> Any:
    """The head training starts from: init_head's (a folder or `shipped`), or a new one of
    arch (eagle2 or eagle3)."""
    import torch

    from eagle2_core.draft import DraftCheckpointError, new_draft_head
    from eagle2_core.eagle3 import Eagle3Head, new_eagle3_head
    from eagle2_core.engine import load_head
    from eagle2_core.vocab import DraftVocab

    if init_head is None:
        if arch == "eagle3":
            full = DraftVocab(torch.arange(target.vocab_size))
            return new_eagle3_head(target, vocab or full, seed=seed)
        return new_draft_head(target.config, seed=seed)
    try:
        head, _ = load_head(target, init_head_dir(init_head, model))
    except DraftCheckpointError as exc:
        raise TrainingError(f"--init-head: {exc}") from None
    if isinstance(head, Eagle3Head) != (arch == "eagle3"):
        raise TrainingError(
            f"--init-head {init_head} is not an {arch} head: pass --arch "
            f"{'eagle3' if isinstance(head, Eagle3Head) else 'eagle2'}"
        )
    return head


def init_head_dir(init_head: str, model: str) -> Path:
    """--init-head's folder: `shipped` names the package's head for a built-in alias."""
    if init_head != "shipped":
        return Path(init_head)
    shipped = shipped_draft(model)
    if shipped is None:
        raise TrainingError(f"--init-head shipped: the package ships no head for {model}")
    return shipped


def measure_tau(
    engine: Engine, questions: list[tuple[list[dict], list]], max_new_tokens: int, batch_size: int
) -> float | None:
    """Greedy EAGLE-2 tau (the reference's fixed tree) over the questions' first turns,
    decoded in batches."""
    from eagle2_core.generation import DecodeStats

    config = DecodeConfig(
        mode="eagle2", max_new_tokens=max_new_tokens, total_tokens=REFERENCE_TREE_TOKENS
    )
    tokenizer = engine.target.tokenizer
    items = [(i, encode_chat(tokenizer, m), config) for i, (m, _) in enumerate(questions)]
    generations = engine.generate_batch(items, batch_size)
    return DecodeStats.summed(generation.stats for _, generation in generations).tau
