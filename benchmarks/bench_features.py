"""Feature extraction for train-draft: one conversation per target forward vs length batches.

32 training prompts (chat template, cut to 400 tokens) each followed by 100 answer
tokens, on the default model; prints both times, the padding and the largest feature
difference (bf16 storage rounds a few values differently in a batch).

    python benchmarks/bench_features.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from eagle2_core.models import load_target
from eagle2_core.registry import encode_chat
from eagle2_core.train.data import (
    FEATURE_BATCH_TOKENS,
    Conversation,
    batched_features,
    conversation_features,
    length_batches,
)

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "train_prompts.jsonl"


def main() -> None:
    target = load_target("smollm2-135m")
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[:384:12]
    conversations = [
        Conversation.of(
            str(i),
            tuple(
                encode_chat(
                    target.tokenizer, [{"role": "user", "content": json.loads(line)["prompt"]}]
                )[:400]
            ),
            tuple(range(1000, 1100)),
        )
        for i, line in enumerate(lines)
    ]
    lengths = [len(c.ids) for c in conversations]
    conversation_features(target, conversations[:2])  # warm-up

    start = time.perf_counter()
    alone = [conversation_features(target, [c])[0] for c in conversations]
    one_s = time.perf_counter() - start

    start = time.perf_counter()
    batched = batched_features(target, conversations)
    batched_s = time.perf_counter() - start

    groups = length_batches(lengths, FEATURE_BATCH_TOKENS)
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    diff = max(
        (batched[i].features.float() - alone[i].features.float()).abs().max().item()
        for i in range(len(conversations))
    )
    print(
        f"{len(conversations)} conversations, {sum(lengths)} tokens: one at a time "
        f"{one_s:.1f} s, batched {batched_s:.1f} s in {len(groups)} forwards "
        f"({padded} padded tokens), {one_s / batched_s:.2f}x; largest difference {diff:.3g}"
    )


if __name__ == "__main__":
    main()
