"""A job's settings as one frozen type: what `submit` and `run` store in the job row's
params and every worker reads back, and the one owner of their defaults (the command
line's defaults are these too). No database or torch here: `bench` imports it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from eagle2_core.config import JOB_DECODE_KEYS, DecodeConfig

# The decode settings of whatever a job and its line leave unset.
DECODE_DEFAULTS = DecodeConfig()
# Input lines per shard when a job does not say (the unit a worker takes, a resume redoes):
# several times the batch a worker decodes at once (--batch-size auto picks up to 128 rows on
# a CPU), since each shard ends with its batch draining (docker/README.md, "Shard size").
DEFAULT_SHARD_SIZE = 512
# Lost attempts (workers/heartbeat.py) after which a shard is given up, unless the job
# says otherwise (--max-attempts); workers/shards.py enforces it.
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_DTYPE = "auto"  # each device's best number format (eagle2_core/precision.py)
# --adapt-draft's first fine-tuning when --adapt-after is not given: after this many
# finished completions, or ADAPT_AFTER_SHARE of the job if that is fewer, but never fewer
# than ADAPT_AFTER_MIN (too few answers teach a head nothing). Each later round waits for
# ADAPT_GROWTH times the data of the last one.
ADAPT_AFTER = 2000
ADAPT_AFTER_SHARE = 0.05
ADAPT_AFTER_MIN = 200
ADAPT_GROWTH = 4


@dataclass(frozen=True)
class JobSettings:
    """How a job decodes, whatever its model: stored as the job row's params."""

    decode: Mapping[str, Any] = field(default_factory=dict)  # JOB_DECODE_KEYS it sets
    shard_size: int = DEFAULT_SHARD_SIZE
    system: str | None = None  # opens every conversation that has no system message
    n: int = 1  # completions of a line that does not say
    dtype: str = DEFAULT_DTYPE  # the number format workers decode in
    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # lost attempts before a shard is given up
    adapt_draft: bool = False  # fine-tune the draft head on the job's own outputs as it runs
    adapt_after: int | None = None  # completions before the first round (None: adapt_first)

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> JobSettings:
        """A job row's params read back (keys it does not know, such as the input's
        fingerprint, are the job's notes: no worker needs them)."""
        params = params or {}
        return cls(
            decode={k: params[k] for k in JOB_DECODE_KEYS if k in params},
            shard_size=params.get("shard_size", DEFAULT_SHARD_SIZE),
            system=params.get("system"),
            n=params.get("n", 1),
            dtype=params.get("dtype", DEFAULT_DTYPE),
            max_attempts=params.get("max_attempts", DEFAULT_MAX_ATTEMPTS),
            adapt_draft=params.get("adapt_draft", False),
            adapt_after=params.get("adapt_after"),
        )

    def to_params(self, **notes: Any) -> dict[str, Any]:
        """The job row's params, with `notes` beside them (the input's fingerprint,
        resume_from). Settings at their defaults are left out, so older jobs still match:
        `run` resumes them."""
        optional = {
            "system": (self.system, None),
            "n": (self.n, 1),
            "dtype": (self.dtype, DEFAULT_DTYPE),
            "max_attempts": (self.max_attempts, DEFAULT_MAX_ATTEMPTS),
            "adapt_draft": (self.adapt_draft, False),
            "adapt_after": (self.adapt_after, None),
        }
        return {
            **self.decode,
            "shard_size": self.shard_size,
            **{key: value for key, (value, default) in optional.items() if value != default},
            **notes,
        }

    def adapt_first(self, n_expected: int) -> int:
        """Finished completions before the first fine-tuning round (--adapt-after, else
        ADAPT_AFTER or ADAPT_AFTER_SHARE of the job, whichever is fewer, at least
        ADAPT_AFTER_MIN)."""
        if self.adapt_after is not None:
            return self.adapt_after
        return max(ADAPT_AFTER_MIN, min(ADAPT_AFTER, int(n_expected * ADAPT_AFTER_SHARE)))

    def decode_for(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """One sample's decode settings: the defaults < the job's < its line's overrides."""
        keys = JOB_DECODE_KEYS
        settings = {k: getattr(DECODE_DEFAULTS, k) for k in keys}
        settings.update({k: self.decode[k] for k in keys if self.decode.get(k) is not None})
        settings.update({k: v for k, v in overrides.items() if k in keys})
        return settings

    def greedy(self, overrides: Mapping[str, Any]) -> bool:
        """Whether a line with these overrides decodes greedily (temperature 0)."""
        return not overrides.get("temperature", self.decode.get("temperature"))
