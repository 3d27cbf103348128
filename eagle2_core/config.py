"""Decoding settings, free of torch: the producer validates jobs with them without
loading a model."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("eagle2", "eagle1", "vanilla")
# Number formats a target decodes in (precision.py): auto is bf16 where the device
# multiplies it natively, fp32 elsewhere.
DTYPES = ("auto", "fp32", "bf16")
# Tokens a draft head proposes from (vocab.py): of SmolLM2's 49,152, the 8,192 most frequent
# in its answers give the same tau as all of them (BENCHMARKS.md, "Draft vocabulary").
DRAFT_VOCAB_SIZE = 8192
AUTO = "auto"  # total_tokens: size every round's tree by this device's costs (plan.py)
# The reference's fixed tree (top_k 10, depth 5, 60 nodes): a head's tau is measured on it,
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


# The DecodeConfig fields a job stores in its params and a line may override (with the
# mode and draft kept apart): what producer and workers agree a job's settings are.
JOB_DECODE_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "top_k",
    "depth",
    "total_tokens",
    "stop",
)


@dataclass(frozen=True)
class Sampling:
    """Target sampling parameters; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class DecodeConfig:
    """What to generate and how. top_k and depth bound the EAGLE-2 tree (the reference's
    values); total_tokens fixes its size, or with AUTO lets the planner size it."""

    mode: str = "eagle2"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 10
    depth: int = 5
    total_tokens: int | str = AUTO  # nodes verified per round (EAGLE-2), or AUTO
    static_tree: tuple[tuple[int, ...], ...] = DEFAULT_STATIC_TREE
    # the output ends before the first of these strings (OpenAI's `stop`; finish "stop")
    stop: tuple[str, ...] = ()

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

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p)
