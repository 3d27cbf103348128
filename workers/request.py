"""One sample to generate, as it travels from the producer through the queue to a worker.

It lives below both: the producer builds it from an input line (producer/validate.py),
workers decode it; in the manifest (the database) it is the JSON of `to_payload`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

# The most completions one request may ask for (OpenAI's own limit on `n`).
MAX_COMPLETIONS = 128


@dataclass(frozen=True)
class Request:
    """One sample to generate, the same whatever format the line came in.

    `messages` ends with the first user turn to answer; each of `followups` is a
    further user turn, answered in order after the previous answer (multi-turn).
    `overrides` holds any of max_new_tokens, temperature, top_p, seed, stop and the
    generation controls (eagle2_core.config.CONTROL_KEYS) that replace the job's
    parameters for this sample only.

    A line asking for `n` completions is one Request as read (`n` set, `choice_index` 0)
    and n as stored and decoded (`completions`): each its own sample, with `request_id`
    the line's id.
    """

    sample_id: str
    line_no: int
    messages: list[dict[str, str]]
    followups: list[str] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    custom_id: str | None = None
    category: str | None = None
    n: int = 1
    choice_index: int = 0
    request_id: str | None = None  # the line's id; None: the same as sample_id

    @property
    def line_id(self) -> str:
        """The id of the line this sample answers (shared by its n completions)."""
        return self.request_id if self.request_id is not None else self.sample_id

    def completions(self, job_seed: int | None = None) -> list[Request]:
        """The line's n samples. With n > 1, completion k has the id `<id>#<k>` and the seed
        `completion_seed(seed, k)` of the line's seed (else the job's), so a rerun
        reproduces every one; with n == 1 the request is its own only completion."""
        if self.n == 1:
            return [self]
        seed = self.overrides.get("seed", job_seed)
        out = []
        for k in range(self.n):
            overrides = dict(self.overrides)
            if seed is not None:
                overrides["seed"] = completion_seed(seed, k)
            out.append(
                replace(
                    self,
                    sample_id=completion_id(self.sample_id, k),
                    overrides=overrides,
                    choice_index=k,
                    request_id=self.sample_id,
                )
            )
        return out

    def prompt_payload(self) -> dict[str, Any]:
        """The conversation alone, JSON-safe: what the n completions of one request share,
        stored once for all of them (workers/db.py's prompts table)."""
        payload: dict[str, Any] = {"messages": [dict(m) for m in self.messages]}
        if self.followups:
            payload["followups"] = list(self.followups)
        return payload

    def to_payload(self, prompt: bool = True) -> dict[str, Any]:
        """A JSON-safe dict for the database (copies, never aliases). Fields at their
        defaults are left out: a manifest holds millions of these, and `from_payload`
        restores them. Without `prompt` the conversation is left out too (it is stored
        once per request: `prompt_payload`); `from_payload` then needs it merged in."""
        payload: dict[str, Any] = {"sample_id": self.sample_id, "line_no": self.line_no}
        if prompt:
            payload.update(self.prompt_payload())
        if self.overrides:
            payload["overrides"] = dict(self.overrides)
        for name in ("custom_id", "category", "request_id"):
            if getattr(self, name) is not None:
                payload[name] = getattr(self, name)
        if self.n != 1:
            payload["n"] = self.n
            payload["choice_index"] = self.choice_index
        return payload

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Request:
        """Inverse of `to_payload`; optional keys may be missing (older payloads)."""
        return cls(
            sample_id=payload["sample_id"],
            line_no=payload["line_no"],
            messages=[dict(m) for m in payload["messages"]],
            followups=list(payload.get("followups") or ()),
            overrides=dict(payload.get("overrides") or {}),
            custom_id=payload.get("custom_id"),
            category=payload.get("category"),
            n=payload.get("n", 1),
            choice_index=payload.get("choice_index", 0),
            request_id=payload.get("request_id"),
        )


def completion_id(line_id: str, k: int) -> str:
    """The sample id of completion k of a line that asks for several."""
    return f"{line_id}#{k}"


def completion_seed(seed: int, k: int) -> int:
    """The seed of completion k of a request seeded `seed`: `seed` itself for the first (so
    n=1 and the first of n agree), then a hash of both, in [0, 2**63) like every seed."""
    if k == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{k}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
