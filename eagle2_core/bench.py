"""Side-by-side speed of decoding modes on the same prompts, in one run.

`vanilla` is transformers' own `generate` (the baseline users compare with);
`engine-vanilla` is the engine's own plain decoding (`run --mode vanilla`), `eagle1`
and `eagle2` its speculative modes. For every question all modes run back to back, so
load on a shared machine hits them alike. Speedup is the mean of per-question tokens/s
of a mode over the same mean for vanilla (as in the EAGLE papers), and, where
engine-vanilla ran, over that too; tau is tokens per target verify pass.

`run_batch_bench` measures what a worker lives on instead: tokens/s of a whole shard
for batched `generate`, the engine's batched plain decoding, EAGLE-2 one sequence at a
time, and batched EAGLE-2.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from eagle2_core.config import DecodeConfig
from eagle2_core.engine import Engine
from eagle2_core.generation import DecodeStats
from eagle2_core.models import Target
from eagle2_core.registry import encode_chat

ENGINE_VANILLA = "engine-vanilla"  # the engine's own decoding without a draft
BENCH_MODES = ("vanilla", ENGINE_VANILLA, "eagle1", "eagle2")


@dataclass
class ModeResult:
    """Totals of one mode over the benchmark questions."""

    mode: str
    questions: int = 0
    tokens: int = 0
    seconds: float = 0.0
    stats: DecodeStats = field(default_factory=DecodeStats)
    per_question_tps: list[float] = field(default_factory=list)
    outputs: list[list[list[int]]] = field(default_factory=list)  # [question][turn] token ids

    @property
    def tau(self) -> float | None:
        return self.stats.tau

    @property
    def mean_tps(self) -> float:
        return sum(self.per_question_tps) / len(self.per_question_tps) if self.questions else 0.0

    def as_dict(self, baseline: ModeResult | None, plain: ModeResult | None = None) -> dict:
        row = {
            "mode": self.mode,
            "questions": self.questions,
            "new_tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tau": _rounded(self.tau, 3),
            "tree_size": _rounded(self.stats.mean_tree_size, 2),
            "tokens_per_s": round(self.mean_tps, 2),
            "speedup": _ratio(self, baseline),
        }
        if plain is not None:
            row["vs_engine_vanilla"] = _ratio(self, plain)
        return row


def _rounded(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None else None


def _ratio(result: ModeResult, baseline: ModeResult | None) -> float | None:
    if baseline is None or not baseline.mean_tps:
        return None
    return round(result.mean_tps / baseline.mean_tps, 3)


def hf_generate(target: Target, prompt_ids: list[int], config: DecodeConfig) -> list[int]:
    """The baseline: transformers' generate with the same stop tokens and sampling."""
    ids = torch.tensor([prompt_ids], device=target.device)
    sample = config.temperature > 0
    extra = {"temperature": config.temperature, "top_p": config.top_p} if sample else {}
    if sample and config.seed is not None:
        torch.manual_seed(config.seed)
    out = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=config.max_new_tokens,
        do_sample=sample,
        eos_token_id=sorted(target.stop_ids) or None,
        pad_token_id=target.tokenizer.pad_token_id or 0,
        **extra,
    )
    return out[0, len(prompt_ids) :].tolist()


def _vanilla_chat(
    target: Target, messages: list[dict], followups: list[str], config: DecodeConfig
) -> list[list[int]]:
    conversation, outputs = list(messages), []
    for followup in [None, *followups]:
        if followup is not None:
            text = target.tokenizer.decode(outputs[-1], skip_special_tokens=True)
            conversation += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": followup},
            ]
        outputs.append(hf_generate(target, encode_chat(target.tokenizer, conversation), config))
    return outputs


def run_bench(
    engine: Engine,
    questions: Iterable[tuple[list[dict], list[str]]],
    modes: list[str],
    config: DecodeConfig,
    on_question: Callable[[int], None] | None = None,
) -> dict[str, ModeResult]:
    """Decode every question with every mode; returns per-mode totals."""
    results = {mode: ModeResult(mode) for mode in modes}
    target = engine.target
    if "eagle2" in modes and engine.lean_head is not None:
        engine.costs(1)  # measured (on a new machine) before any clock runs
    warm = encode_chat(target.tokenizer, [{"role": "user", "content": "Hi"}])
    hf_generate(target, warm, DecodeConfig(max_new_tokens=4))  # first-call overheads
    for index, (messages, followups) in enumerate(questions):
        for mode in modes:
            result = results[mode]
            start = time.perf_counter()
            if mode == "vanilla":
                outputs = _vanilla_chat(target, messages, followups, config)
            else:
                engine_mode = "vanilla" if mode == ENGINE_VANILLA else mode
                mode_config = DecodeConfig(**{**config.__dict__, "mode": engine_mode})
                turns = engine.chat(messages, followups, mode_config)
                outputs = [t.token_ids for t in turns]
                for turn in turns:
                    result.stats.add(turn.stats)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o) for o in outputs)
            result.questions += 1
            result.tokens += tokens
            result.seconds += elapsed
            result.per_question_tps.append(tokens / elapsed if elapsed > 0 else 0.0)
            result.outputs.append(outputs)
        if on_question is not None:
            on_question(index)
    return results


def identical_outputs(results: dict[str, ModeResult]) -> int:
    """How many questions produced the same tokens in every mode (expected: all, greedy fp32)."""
    runs = [r.outputs for r in results.values()]
    return sum(all(run[i] == runs[0][i] for run in runs) for i in range(len(runs[0])))


@dataclass
class ShardResult:
    """One way of decoding the whole prompt set: throughput and where the time went."""

    name: str
    batch_size: int
    tokens: int
    seconds: float
    stats: DecodeStats = field(default_factory=DecodeStats)
    outputs: dict[int, list[int]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        busy = self.stats.draft_ms + self.stats.verify_ms
        return {
            "name": self.name,
            "batch_size": self.batch_size,
            "new_tokens": self.tokens,
            "seconds": round(self.seconds, 2),
            "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else None,
            "tau": _rounded(self.stats.tau, 3),
            "tree_size": _rounded(self.stats.mean_tree_size, 2),
            "draft_share": round(self.stats.draft_ms / busy, 3) if busy else None,
        }


def hf_generate_batch(
    target: Target, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """The batched baseline: greedy `generate` on left-padded prompts, cut at a stop token."""
    pad = target.tokenizer.pad_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=target.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = target.model.generate(
        ids,
        attention_mask=mask.to(target.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(target.stop_ids) or None,
        pad_token_id=pad,
    )
    answers = []
    for row in out[:, width:].tolist():
        stop = next((i for i, t in enumerate(row) if t in target.stop_ids), len(row) - 1)
        answers.append(row[: stop + 1])
    return answers


def _engine_shard(
    engine: Engine, prompts: list[list[int]], config: DecodeConfig, batch_size: int, name: str
) -> ShardResult:
    start = time.perf_counter()
    items = [(i, p, config) for i, p in enumerate(prompts)]
    result = ShardResult(name, batch_size, 0, 0.0)
    for key, generation in engine.generate_batch(items, batch_size):
        result.outputs[key] = generation.token_ids
        result.tokens += generation.completion_tokens
        result.stats.add(generation.stats)
    result.seconds = time.perf_counter() - start
    return result


def run_batch_bench(
    engine: Engine,
    prompts: list[list[int]],
    config: DecodeConfig,
    batch_sizes: list[int],
    on_result: Callable[[ShardResult], None] | None = None,
) -> list[ShardResult]:
    """(a) HF batched generate at B, (d) the engine's batched plain decoding and (c)
    batched EAGLE-2 (config.mode) at B, for each B; (b) EAGLE-2 at B=1 once; all on the
    same prompts in one run. Batched outputs are checked against B=1 by the caller
    (`outputs`)."""
    target = engine.target
    if config.mode == "eagle2" and engine.lean_head is not None:
        engine.costs(max(batch_sizes))  # measured (on a new machine) before any clock runs
    hf_generate_batch(target, prompts[:2], 4)  # first-call overheads
    results = []

    def record(result: ShardResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    record(_engine_shard(engine, prompts, config, 1, f"{config.mode} B=1"))
    for b in batch_sizes:
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(prompts), b):
            tokens += sum(
                map(len, hf_generate_batch(target, prompts[i : i + b], config.max_new_tokens))
            )
        record(ShardResult("hf generate", b, tokens, time.perf_counter() - start))
        plain = DecodeConfig(**{**config.__dict__, "mode": "vanilla"})
        record(_engine_shard(engine, prompts, plain, b, f"{ENGINE_VANILLA} batched"))
        record(_engine_shard(engine, prompts, config, b, f"{config.mode} batched"))
    return results
