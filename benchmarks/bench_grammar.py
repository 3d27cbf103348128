"""Grammar engines on the CPU for structured output (BENCHMARKS.md, "Structured output"):
llguidance and, when it imports, xgrammar, on the default model's tokenizer and one JSON
schema. For each: the tokenizer's preparation, the schema's compile, and per answer token
the mask (filled, then the token consumed), along a JSON answer that fits the schema; the
two engines' masks are compared position by position. Last, what a draft tree's masks cost
in eagle2_core/grammar.py (each node's branch consumed, its mask filled, rolled back).

    OMP_NUM_THREADS=1 python benchmarks/bench_grammar.py   # xgrammar: PYTHONPATH=<its dir>
"""

from __future__ import annotations

import json
import statistics
import time
from importlib.metadata import version

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import AutoTokenizer

from eagle2_core.grammar import Grammars
from eagle2_core.registry import DEFAULT_MODEL, resolve_model
from eagle2_core.response_format import grammar_text

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "role", "active"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "tags": ["math", "engines", "poetry"],
    "role": "admin",
    "active": True,
}
REPEATS = 5


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def llguidance_run(tokenizer, vocab: int, stops: list[int], answer: list[int]):
    prepared, t_tok = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
    grammar = grammar_text({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    compiles = []
    for _ in range(REPEATS):
        matcher, t = timed(lambda: llguidance.LLMatcher(prepared, grammar, log_level=0))
        compiles.append(t)
    masks = torch.zeros(len(answer) + 1, (vocab + 31) // 32, dtype=torch.int32)
    steps = []
    for i, token in enumerate([*answer, None]):
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, masks, i)
        steps.append(time.perf_counter() - start)
        if token is not None:
            assert matcher.consume_token(token), (i, token)
    return t_tok, compiles, steps, masks


def xgrammar_run(tokenizer, vocab: int, stops: list[int], answer: list[int]):
    import xgrammar as xgr

    info, t_tok = timed(
        lambda: xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=stops
        )
    )
    schema = json.dumps(SCHEMA)
    compiles = []
    for _ in range(REPEATS):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(
            schema, any_whitespace=False, separators=(", ", ": "), strict_mode=True
        )
        compiles.append(time.perf_counter() - start)
    matcher = xgr.GrammarMatcher(compiled)
    masks = xgr.allocate_token_bitmask(len(answer) + 1, vocab)
    steps = []
    for i, token in enumerate([*answer, None]):
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(masks, i)
        steps.append(time.perf_counter() - start)
        if token is not None:
            assert matcher.accept_token(token), (i, token)
    return t_tok, compiles, steps, masks


def allowed(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (masks[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.bool().flatten(1)[:, :vocab]


def tree_cost(tokenizer, vocab: int, stops: frozenset[int], answer: list[int]) -> None:
    """A round's masks as decoding takes them: a chain of 8 nodes down the answer and 24
    siblings (each a branch the grammar refuses or allows), after each committed prefix."""
    grammars = Grammars(tokenizer, vocab, stops)
    fmt = json.dumps({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    per_node = []
    for cut in range(0, len(answer) - 8, 4):
        constraint = grammars.constraint(fmt)
        constraint.commit(answer[:cut])
        chain = answer[cut : cut + 8]
        paths = torch.full((32, 8), -1, dtype=torch.long)
        for depth in range(8):
            paths[depth, : depth + 1] = torch.tensor(chain[: depth + 1])
        for node in range(8, 32):
            depth = node % 8
            paths[node, :depth] = torch.tensor(chain[:depth])
            paths[node, depth] = (chain[depth] + node) % vocab
        start = time.perf_counter()
        constraint.allowed(paths, stops)
        per_node.append((time.perf_counter() - start) / 32)
    print(
        f"tree of 32 nodes, depth 8 (grammar.Constraint.allowed): "
        f"{ms(statistics.median(per_node))} a node (median over {len(per_node)} rounds)"
    )


def main() -> None:
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    vocab = len(tokenizer)
    stops = frozenset({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    answer = tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False)
    print(f"{DEFAULT_MODEL}: {vocab} tokens; answer of {len(answer)} tokens")
    results = {"llguidance " + llguidance.__version__: llguidance_run}
    try:
        import xgrammar  # noqa: F401

        results["xgrammar " + version("xgrammar")] = xgrammar_run
    except ImportError as exc:
        print(f"xgrammar: not importable here ({exc})")
    masks = {}
    for name, run in results.items():
        t_tok, compiles, steps, mask = run(tokenizer, vocab, sorted(stops), answer)
        masks[name] = allowed(mask, vocab)
        print(
            f"{name}: tokenizer {ms(t_tok)}; compile median {ms(statistics.median(compiles))} "
            f"(first {ms(compiles[0])}); mask a token median {ms(statistics.median(steps))}, "
            f"mean {ms(statistics.mean(steps))}, max {ms(max(steps))}"
        )
    if len(masks) == 2:
        (a, ma), (b, mb) = masks.items()
        differ = (ma != mb).any(dim=1)
        print(
            f"masks differ at {int(differ.sum())} of {len(differ)} positions "
            f"({int((ma & ~mb).sum())} tokens only {a} allows, {int((mb & ~ma).sum())} only {b})"
        )
        for i in differ.nonzero().flatten().tolist()[:6]:
            only_a = (ma[i] & ~mb[i]).nonzero().flatten().tolist()[:5]
            only_b = (mb[i] & ~ma[i]).nonzero().flatten().tolist()[:5]
            print(
                f"  position {i} after {tokenizer.decode(answer[:i])[-20:]!r}: "
                f"{a} only {tokenizer.convert_ids_to_tokens(only_a)}, "
                f"{b} only {tokenizer.convert_ids_to_tokens(only_b)}"
            )
    tree_cost(tokenizer, vocab, stops, answer)


if __name__ == "__main__":
    main()
