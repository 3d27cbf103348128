"""One sample to generate, as it travels from the producer through the queue to a worker.

It lives below both: the producer builds it from an input line (producer/validate.py),
workers decode it; on the queue and in the database it is the JSON of `to_payload`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Request:
    """One sample to generate, the same whatever format the line came in.

    `messages` ends with the first user turn to answer; each of `followups` is a
    further user turn, answered in order after the previous answer (multi-turn).
    `overrides` holds any of max_new_tokens, temperature, top_p, seed, stop that replace
    the job's parameters for this sample only.
    """

    sample_id: str
    line_no: int
    messages: list[dict[str, str]]
    followups: list[str] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    custom_id: str | None = None
    category: str | None = None

    def to_payload(self) -> dict[str, Any]:
        """A JSON-safe dict for the queue and the database (copies, never aliases)."""
        return {
            "sample_id": self.sample_id,
            "line_no": self.line_no,
            "messages": [dict(m) for m in self.messages],
            "followups": list(self.followups),
            "overrides": dict(self.overrides),
            "custom_id": self.custom_id,
            "category": self.category,
        }

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
        )
