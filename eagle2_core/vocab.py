"""The draft vocabulary: the target tokens a draft head may propose.

Drafting scores every candidate through an lm_head; over SmolLM2's 49,152 tokens that is
a 113 MB product per draft step, more than the draft layer itself. The target's own
answers use few of them (on held-out answers the 8,192 most frequent tokens cover ~91%,
16,384 ~96%; benchmarks/bench_draft_vocab.py), so the head proposes from the N most
frequent target tokens only, as FR-Spec and EAGLE-3 do.

Lossless all the same: verification runs the target over its full vocabulary and accepts
a drafted token only where the target itself would emit it (greedy: its argmax; sampling:
with the target's own probability, see verify.py). A token outside the draft vocabulary
can never be drafted, so it always comes from the target's bonus draw: it costs speed,
never correctness.

Stored in EAGLE-3's format, beside a head as `draft_vocab.safetensors` (or inside an
EAGLE-3 checkpoint): `d2t` [N] (target id = draft id + d2t[draft id], draft ids in
ascending target order) and `t2d` [V] bool (the target ids in the vocabulary).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VOCAB_FILE = "draft_vocab.safetensors"


@dataclass(frozen=True)
class DraftVocab:
    """Target ids [N] of the draft vocabulary, ascending."""

    ids: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]

    @classmethod
    def from_mapping(cls, d2t: torch.Tensor, t2d: torch.Tensor | None = None) -> DraftVocab:
        ids = torch.arange(d2t.shape[0]) + d2t.long().cpu()
        if t2d is not None and not torch.equal(t2d.bool().cpu().nonzero().flatten(), ids):
            raise ValueError("d2t and t2d describe different draft vocabularies")
        return cls(ids)

    @classmethod
    def most_frequent(cls, counts: Counter[int], size: int, vocab_size: int) -> DraftVocab:
        """The `size` most frequent ids (ties to the smaller id); rarer ids never make it."""
        known = [(t, c) for t, c in counts.items() if 0 <= t < vocab_size]
        ranked = sorted(known, key=lambda kv: (-kv[1], kv[0]))[:size]
        ids = sorted(t for t, _ in ranked)
        return cls(torch.tensor(ids, dtype=torch.long))

    def d2t(self) -> torch.Tensor:
        return self.ids - torch.arange(len(self))

    def t2d(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.ids] = True
        return mask

    def save(self, directory: str | Path, vocab_size: int) -> Path:
        path = Path(directory) / VOCAB_FILE
        save_file({"d2t": self.d2t(), "t2d": self.t2d(vocab_size)}, str(path))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> DraftVocab | None:
        """The vocabulary stored beside a head, or None when it has none."""
        path = Path(directory) / VOCAB_FILE
        if not path.exists():
            return None
        tensors = load_file(str(path))
        return cls.from_mapping(tensors["d2t"], tensors.get("t2d"))

    def coverage(self, counts: Counter[int]) -> float:
        """The share of the counted tokens that the vocabulary can draft."""
        inside = set(self.ids.tolist())
        total = sum(counts.values())
        return sum(c for t, c in counts.items() if t in inside) / total if total else 0.0


def count_tokens(sequences: Iterable[Iterable[int]]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for ids in sequences:
        counts.update(ids)
    return counts


def count_answers(tokenizer, answers: Iterable[str], end_of_turn: int | None) -> Counter[int]:
    """Token counts of answer texts, each closed by the end-of-turn token the target
    emits after it (so the draft can propose the end of an answer)."""
    counts: Counter[int] = Counter()
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            counts.update(ids)
        if end_of_turn is not None:
            counts[end_of_turn] += len(batch)
        batch.clear()

    for text in answers:
        batch.append(text)
        if len(batch) == 1000:
            flush()
    if batch:
        flush()
    return counts


def mix(sources: Iterable[Counter[int]]) -> Counter[float]:
    """Token frequencies of several corpora, each weighing the same whatever its size."""
    mixed: Counter = Counter()
    for counts in sources:
        total = sum(counts.values())
        for token, count in counts.items():
            mixed[token] += count / total
    return mixed
