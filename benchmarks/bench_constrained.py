"""What structured output costs a decoded token (BENCHMARKS.md, "Structured output"): the
default model and head answer prompts asking for JSON, free and under a json_schema, in
EAGLE-2 and vanilla mode; per token the wall time, and the time spent in the grammar
(eagle2_core/grammar.py: masks of every tree node, and committing). Checks on the way that
the constrained answers are identical in both modes and parse as JSON fitting the schema.

    OMP_NUM_THREADS=1 python benchmarks/bench_constrained.py [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import torch

from eagle2_core import grammar
from eagle2_core.config import DecodeConfig
from eagle2_core.engine import load_engine
from eagle2_core.generation import DecodeStats
from eagle2_core.registry import DEFAULT_MODEL, encode_chat

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2030},
        "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["title", "year", "genres", "rating", "summary"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a famous film as JSON with its title, year, genres, rating and a summary.",
    "Give me a JSON record of a classic novel: title, year, genres, rating, summary.",
    "Return JSON about your favourite album: title, year, genres, rating, summary.",
]


class GrammarClock:
    """Seconds spent in Constraint.allowed and Constraint.commit while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.originals = {n: getattr(grammar.Constraint, n) for n in ("allowed", "commit")}
        for name, original in self.originals.items():
            setattr(grammar.Constraint, name, self._timed(original))

    def _timed(self, original):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = load_engine(DEFAULT_MODEL)
    tokenizer = engine.target.tokenizer
    clock = GrammarClock()
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    # Warm up: the first EAGLE-2 row loads (on a new machine, measures) the cost table.
    engine.generate(prompts[0], DecodeConfig.from_settings("eagle2", {"max_new_tokens": 4}))
    rows = []
    for label, extra in (("free", {}), ("json_schema", {"response_format": fmt})):
        outputs = {}
        for mode in ("vanilla", "eagle2"):
            config = DecodeConfig.from_settings(mode, {"max_new_tokens": args.tokens, **extra})
            tokens = wall = grammar_s = 0.0
            stats = DecodeStats()
            for i, ids in enumerate(prompts):
                clock.seconds = 0.0
                start = time.perf_counter()
                out = engine.generate(ids, config)
                wall += time.perf_counter() - start
                grammar_s += clock.seconds
                tokens += out.completion_tokens
                stats.add(out.stats)
                outputs[(mode, i)] = out
                if extra:
                    jsonschema.validate(json.loads(out.text), SCHEMA)
            tau = stats.tau if stats.tau is not None else float("nan")
            rows.append((label, mode, tokens, wall, grammar_s, tau))
        if extra:
            same = all(
                outputs[("eagle2", i)].token_ids == outputs[("vanilla", i)].token_ids
                for i in range(len(prompts))
            )
            print(f"json_schema answers identical in eagle2 and vanilla: {same}")
            print(f"first answer: {outputs[('eagle2', 0)].text}")
    print("| answers | mode | tokens | ms a token | grammar ms a token | tau |")
    print("|---|---|---|---|---|---|")
    for label, mode, tokens, wall, grammar_s, tau in rows:
        print(
            f"| {label} | {mode} | {int(tokens)} | {wall / tokens * 1e3:.1f} | "
            f"{grammar_s / tokens * 1e3:.2f} | {tau:.2f} |"
        )


if __name__ == "__main__":
    main()
