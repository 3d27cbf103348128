"""Decoding settings, free of torch: the producer validates jobs with them without
loading a model."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MODES = ("eagle2", "eagle1", "vanilla")
# Number formats a target decodes in (precision.py): auto is bf16 where the device
# multiplies it natively, fp32 elsewhere.
DTYPES = ("auto", "fp32", "bf16")
# Tokens a draft head proposes from (vocab.py): of SmolLM2's 49,152, the 8,192 most frequent
# in its answers give the same tau as all of them (BENCHMARKS.md, "Draft vocabulary").
DRAFT_VOCAB_SIZE = 8192
AUTO = "auto"  # total_tokens: size every round's tree by this device's costs (plan.py)
# The reference's fixed tree (width 10, depth 5, 60 nodes): a head's tau is measured on it,
# since auto trees, and so tau, follow the device and the batch.
REFERENCE_TREE_TOKENS = 60

# Sequences decoded at once unless told otherwise. Measured on the 2-core CPU (BENCHMARKS.md,
# "Batched decoding"): EAGLE-2 gives 3.7 / 5.8 / 8.8 tok/s at B = 1 / 4 / 16, plain
# batched generate 26 / 60 tok/s at B = 4 / 16; a GPU is further still from full at 16.
DEFAULT_BATCH_SIZE = 16


# EAGLE-1's default static tree (the reference's mc_sim_7b_63): each path lists the
# rank of the child taken at every level below the root.
DEFAULT_STATIC_TREE: tuple[tuple[int, ...], ...] = (
    (0,),
    (1,),
    (2,),
    (3,),
    (0, 0),
    (0, 1),
    (0, 2),
    (1, 0),
    (1, 1),
    (2, 0),
    (2, 1),
    (3, 0),
    (0, 0, 0),
    (0, 0, 1),
    (0, 0, 2),
    (0, 1, 0),
    (0, 1, 1),
    (0, 2, 0),
    (0, 2, 1),
    (1, 0, 0),
    (0, 0, 0, 0),
    (0, 0, 0, 1),
    (0, 0, 0, 2),
    (0, 0, 0, 0, 0),
    (0, 0, 0, 0, 1),
)


# Generation controls beyond temperature and top_p (README, "Generation controls"): each a
# DecodeConfig field, set per job or per line, exact under speculation.
CONTROL_KEYS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop_token_ids",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
)

# The DecodeConfig fields a job stores in its params and a line may override (with the
# mode and draft kept apart): what producer and workers agree a job's settings are.
JOB_DECODE_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "tree_width",
    "tree_depth",
    "total_tokens",
    "stop",
    *CONTROL_KEYS,
)

MAX_TOKEN_ID = 2**31 - 1  # fits a 32-bit column; the model's vocabulary is checked on decoding


@dataclass(frozen=True)
class Bound:
    """The range of a numeric control: integers, or finite numbers, from low to high."""

    integer: bool
    low: float
    high: float | None = None
    low_open: bool = False  # low itself is excluded

    def admits(self, value: object) -> bool:
        if type(value) is not int and (self.integer or type(value) is not float):
            return False
        if type(value) is float and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def expected(self) -> str:
        """What an error says was expected: 'an integer from 0 to 20', 'a number > 0'."""
        kind = "an integer" if self.integer else "a number"
        low = int(self.low) if self.low == int(self.low) else self.low
        if self.high is None:
            return f"{kind} {'>' if self.low_open else '>='} {low}"
        high = int(self.high) if self.high == int(self.high) else self.high
        return f"{kind} from {low} to {high}"


# The numeric controls' ranges, shared by the producer's line checks and DecodeConfig.
CONTROL_BOUNDS: dict[str, Bound] = {
    "top_k": Bound(True, 0, MAX_TOKEN_ID),  # 0: every token (transformers' and vLLM's off)
    "min_p": Bound(False, 0, 1),
    "repetition_penalty": Bound(False, 0, low_open=True),
    "presence_penalty": Bound(False, -2, 2),  # OpenAI's range
    "frequency_penalty": Bound(False, -2, 2),
    "min_tokens": Bound(True, 0, MAX_TOKEN_ID),
    "top_logprobs": Bound(True, 0, 20),  # OpenAI's range
}
LOGIT_BIAS_BOUND = Bound(False, -100, 100)  # OpenAI's range
TOKEN_ID_BOUND = Bound(True, 0, MAX_TOKEN_ID)


@dataclass(frozen=True)
class Sampling:
    """Target sampling parameters; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def format_text(response_format: Mapping[str, Any] | str | None) -> str | None:
    """A response_format as decoding takes it: its JSON text, keys in the order given (a
    schema's properties come in the answer in that order; Postgres's JSONB would sort an
    object's keys, so a line stores the text); None for {"type": "text"}, which constrains
    nothing (a line's overrides a job's format with it)."""
    if isinstance(response_format, Mapping):
        response_format = json.dumps(response_format)
    if response_format is None or json.loads(response_format).get("type") == "text":
        return None
    return response_format


@dataclass(frozen=True)
class DecodeConfig:
    """What to generate and how. tree_width and tree_depth bound the EAGLE-2 tree (the
    reference's values); total_tokens fixes its size, or with AUTO lets the planner size it.
    The controls after `stop` change the target's distribution (eagle2_core/processors.py)
    or add logprobs to the output; README's "Generation controls" defines each."""

    mode: str = "eagle2"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    tree_width: int = 10
    tree_depth: int = 5
    total_tokens: int | str = AUTO  # nodes verified per round (EAGLE-2), or AUTO
    static_tree: tuple[tuple[int, ...], ...] = DEFAULT_STATIC_TREE
    # the output ends before the first of these strings (OpenAI's `stop`; finish "stop")
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token, with logprobs
    response_format: str | None = None  # its JSON text (eagle2_core/response_format.py)

    @property
    def planned(self) -> bool:
        """Whether the planner sizes each round's tree by this device's costs (plan.py)."""
        return self.total_tokens == AUTO

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if not isinstance(self.stop, tuple) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if self.total_tokens != AUTO and (
            isinstance(self.total_tokens, bool)
            or not isinstance(self.total_tokens, int)
            or self.total_tokens < 1
        ):
            raise ValueError(
                f"total_tokens must be {AUTO!r} or an integer >= 1, got {self.total_tokens!r}"
            )
        self._check_controls()

    def _check_controls(self) -> None:
        for name, bound in CONTROL_BOUNDS.items():
            value = getattr(self, name)
            if not bound.admits(value):
                raise ValueError(f"{name} must be {bound.expected()}, got {value!r}")
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or not all(
            TOKEN_ID_BOUND.admits(t) and LOGIT_BIAS_BOUND.admits(b) for t, b in self.logit_bias
        ):
            raise ValueError(
                f"logit_bias must pair distinct token ids with biases from -100 to 100, "
                f"got {self.logit_bias!r}"
            )
        if not all(TOKEN_ID_BOUND.admits(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        if self.response_format is not None and self.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with response_format: the grammar decides "
                "where the answer may end"
            )

    @classmethod
    def from_settings(cls, mode: str, settings: Mapping[str, Any]) -> DecodeConfig:
        """The config of settings as JSON holds them (a job's params, a line's overrides):
        lists become tuples, logit_bias's {"token id": bias} sorted pairs and a
        response_format its JSON text (`format_text`)."""
        given = dict(settings)
        for name in ("stop", "stop_token_ids"):
            if name in given:
                given[name] = tuple(given[name])
        if "logit_bias" in given:
            bias = given["logit_bias"]
            pairs = bias.items() if isinstance(bias, Mapping) else bias
            given["logit_bias"] = tuple(sorted((int(t), float(b)) for t, b in pairs))
        if "response_format" in given:
            given["response_format"] = format_text(given["response_format"])
        return cls(mode=mode, **given)

    @property
    def processed(self) -> bool:
        """Whether the target's logits are processed before choosing (penalties, biases,
        min_tokens, a grammar): rows that are not never pay for it."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.response_format is not None
        )

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, self.min_p)
