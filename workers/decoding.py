"""Turn one manifest request into one samples-table row.

A worker process builds one `SampleDecoder` and keeps it for every shard it takes:
loading a target costs seconds to minutes, decoding a sample a fraction of that. A
sample that cannot be decoded becomes a row with status 'failed' and the error, never
an exception, so one bad prompt cannot stop its shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from eagle2_core.config import AUTO, MODES, DecodeConfig
from eagle2_core.engine import (
    BatchDecoder,
    Engine,
    Generation,
    PromptError,
    load_head,
    seeded_generator,
)
from eagle2_core.generation import DecodeStats
from eagle2_core.models import Target, load_target
from eagle2_core.precision import dtype_name
from eagle2_core.registry import DraftUnavailableError, draft_label, draft_source, encode_chat
from workers.job_settings import JobSettings
from workers.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowOrigin:
    """Where a shard's rows come from: the job and shard, the worker, the device (None:
    the decoder's own)."""

    job_id: str
    shard: int
    worker: str
    device: str | None = None


def describe_device(device: torch.device | str, dtype: torch.dtype) -> str:
    """'cpu fp32', or 'cuda:<i> <GPU name> bf16': rows tell which hardware, in which
    number format, produced them (bf16 greedy output can differ from fp32's)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} {dtype_name(dtype)}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} {torch.cuda.get_device_name(index)} {dtype_name(dtype)}"


class SampleDecoder:
    """A loaded target and draft head plus the row format of their outputs."""

    def __init__(
        self,
        engine: Engine,
        *,
        model: str,
        draft: str | None,
        mode: str = "eagle2",
        device: str | None = None,
        batch_size: int | str | None = None,
    ) -> None:
        """Wrap an already built engine (tests build tiny ones in code).

        `model` and `draft` are the names written to every row; `device` the
        hardware label (default: described from the target's device); `batch_size`
        the sequences decoded at once: a number, or `auto` (the default) for the size
        this device's cost table says decodes fastest (Engine.auto_batch_size, decided
        when first needed: it may measure the device).
        """
        batch_size = AUTO if batch_size is None else batch_size
        if batch_size != AUTO and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be 'auto' or >= 1, got {batch_size!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode != "vanilla" and engine.draft_head is None:
            raise DraftUnavailableError(f"mode {mode} needs a draft head; the engine has none")
        self.engine = engine
        self.model = model
        self.draft = draft if mode != "vanilla" else None
        self.mode = mode
        self.device = device or describe_device(engine.target.device, engine.target.dtype)
        self._batch_size = batch_size
        self._auto = batch_size == AUTO
        # (job, version) of the job head that drafts (workers/head_versions.py), None
        # for the head this decoder was loaded with
        self.head_of: tuple[str, int] | None = None
        self._first_engine = engine
        self.on_measure: Callable[[Path], object] | None = None  # told before costs are measured

    @property
    def batch_size(self) -> int:
        """Sequences decoded at once (auto resolved on first use)."""
        if self._batch_size == AUTO:
            self._batch_size = self.engine.auto_batch_size(self.on_measure)
            log.info("batch size auto: %d sequences at once", self._batch_size)
        return int(self._batch_size)

    def rows_for(self, samples: int) -> int:
        """Sequences at once for a shard of `samples`: the batch size given, or with an auto
        one the size that finishes the shard soonest (Engine.auto_rows_for: one wave of 80
        beats three of 32 where a step's cost per row is about flat past 32)."""
        if not self._auto:
            return self.batch_size
        return self.engine.auto_rows_for(samples, self.on_measure)

    @classmethod
    def load(
        cls,
        model: str,
        draft: str | None = None,
        mode: str = "eagle2",
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        target: Target | None = None,
        batch_size: int | str | None = None,
    ) -> SampleDecoder:
        """Load the target and draft head once.

        `draft`: a head directory, None for the head shipped with the model alias, or
        "random" for an untrained head (testing only). eagle1/eagle2 without any head
        is refused: decoding without the draft would silently measure something else.
        Pass a `target` already loaded for `model` to reuse it with another draft.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        source = draft_source(model, draft) if mode != "vanilla" else None
        if target is None:
            target = load_target(model, dtype=dtype, device=device)
        head, vocab = load_head(target, source) if mode != "vanilla" else (None, None)
        label = draft_label(model, draft, mode)
        engine = Engine(target, head, vocab)
        return cls(engine, model=model, draft=label, mode=mode, batch_size=batch_size)

    @property
    def head_version(self) -> int | None:
        """The version each row records: 0 the head it was loaded with, N a job's head
        version N, None without a draft."""
        if self.mode == "vanilla":
            return None
        return self.head_of[1] if self.head_of is not None else 0

    def use_head(self, directory: Path, job_id: str, version: int) -> None:
        """Draft with the head in `directory`, job `job_id`'s head `version`, from the next
        request on (a shard boundary: never mid-shard). Outputs do not change, only how
        many drafted tokens are accepted."""
        head, vocab = load_head(self.engine.target, directory)
        self.engine = self._first_engine.with_head(head, vocab)
        self.head_of = (job_id, version)

    def use_first_head(self) -> None:
        """Back to the head this decoder was loaded with (a job that does not adapt)."""
        self.engine, self.head_of = self._first_engine, None

    def config_for(self, request: Request, job_params: Mapping[str, Any]) -> dict[str, Any]:
        """The decode settings of one sample: defaults < job params < per-line overrides."""
        return JobSettings.from_params(job_params).decode_for(request.overrides)

    def decode_many(
        self, requests: Iterable[Request], job_params: Mapping[str, Any], origin: RowOrigin
    ) -> Iterator[dict[str, Any]]:
        """Answer every turn of every request, `batch_size` sequences at a time; yields one
        row (all of `workers.schema.SAMPLE_FIELDS`) per request as soon as it is done.

        A request's next turn joins the batch when its previous answer is in. Requests go
        in by prompt length (longest first): attention reads every row up to the longest
        one's length, so neighbours of similar length waste the least (outputs do not
        depend on the order; rows are stored by id). A prompt or settings that cannot be
        decoded give a 'failed' row; anything else (a bug, a lost device) raises, so the
        shard fails visibly and is retried rather than filled with failed rows.
        """
        ordered = sorted(requests, key=_prompt_chars, reverse=True)
        rows = self.rows_for(len(ordered))
        decoder = BatchDecoder(self.engine, max(1, min(rows, len(ordered))))
        chats: dict[str, _Chat] = {}
        pending = iter(ordered)
        while True:
            while decoder.active < rows and (request := next(pending, None)):
                chat = self._start(request, job_params, origin)
                failed = chat.row if chat.row.get("status") == "failed" else None
                failed = failed or self._next_turn(decoder, chat)
                if failed is not None:
                    yield failed
                else:
                    chats[request.sample_id] = chat
            if decoder.idle:
                return
            for sample_id, generation in decoder.step():
                chat = chats[sample_id]
                chat.turns.append(generation)
                done = self._next_turn(decoder, chat)
                if done is not None:
                    del chats[sample_id]
                    yield done

    def failed_rows(
        self,
        requests: Iterable[Request],
        job_params: Mapping[str, Any],
        origin: RowOrigin,
        error: Exception,
    ) -> Iterator[dict[str, Any]]:
        """A 'failed' row with `error` for each request, decoding none: what a shard that
        is given up stores (workers/shards.py)."""
        for request in requests:
            yield _fail(self._start(request, job_params, origin).row, error)

    def _start(self, request: Request, job_params: Mapping[str, Any], origin: RowOrigin) -> _Chat:
        settings = self.config_for(request, job_params)
        row: dict[str, Any] = {
            "job_id": origin.job_id,
            "sample_id": request.sample_id,
            "request_id": request.line_id,
            "choice_index": request.choice_index,
            "line_no": request.line_no,
            "shard": origin.shard,
            "custom_id": request.custom_id,
            "category": request.category,
            "mode": self.mode,
            "model": self.model,
            "draft": self.draft,
            "head_version": self.head_version,
            "temperature": float(settings["temperature"]),
            "top_p": float(settings["top_p"]),
            "seed": settings["seed"],
            "worker": origin.worker,
            "device": origin.device or self.device,
        }
        chat = _Chat(request, row, None, [], list(request.messages), None)
        try:
            chat.config = DecodeConfig.from_settings(self.mode, settings)
        except ValueError as exc:  # this sample's settings
            _fail(row, exc)
        else:
            chat.generator = seeded_generator(chat.config.seed)
        return chat

    def _next_turn(self, decoder: BatchDecoder, chat: _Chat) -> dict[str, Any] | None:
        """Queue the chat's next turn; its finished row when there is none (or it failed)."""
        turn = len(chat.turns)
        if turn > len(chat.request.followups):
            chat.row.update(_results(chat.turns), status="ok", error=None)
            chat.row["created_at"] = datetime.now(UTC)
            return chat.row
        if turn > 0:
            chat.conversation += [
                {"role": "assistant", "content": chat.turns[-1].text},
                {"role": "user", "content": chat.request.followups[turn - 1]},
            ]
        ids = encode_chat(self.engine.target.tokenizer, chat.conversation)
        try:
            decoder.add(chat.request.sample_id, ids, chat.config, generator=chat.generator)
        except PromptError as exc:
            return _fail(chat.row, exc)
        return None


def _prompt_chars(request: Request) -> int:
    """A request's prompt length in characters: the order a shard decodes in (no tokenizer
    pass for it)."""
    return sum(len(str(m.get("content") or "")) for m in request.messages)


@dataclass
class _Chat:
    """A request in flight: its row so far, its answered turns, its sampling generator."""

    request: Request
    row: dict[str, Any]
    config: DecodeConfig | None
    turns: list[Generation]
    conversation: list[dict]
    generator: torch.Generator | None


def _fail(row: dict[str, Any], exc: Exception) -> dict[str, Any]:
    row.update(_empty_results(), status="failed", error=f"{type(exc).__name__}: {exc}")
    row["created_at"] = datetime.now(UTC)
    return row


def _empty_results() -> dict[str, Any]:
    keys = (
        "output_text turn_outputs prompt_tokens completion_tokens finish_reason logprobs n_cycles "
        "mean_accept_length mean_tree_size accept_hist depth_attempts depth_accepts draft_ms "
        "verify_ms total_ms tokens_per_s"
    ).split()
    return dict.fromkeys(keys)


def _results(turns: list[Generation]) -> dict[str, Any]:
    total = DecodeStats.summed(t.stats for t in turns)
    completion = sum(t.completion_tokens for t in turns)
    return {
        "output_text": turns[-1].text,
        "turn_outputs": [t.text for t in turns],
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "completion_tokens": completion,
        "finish_reason": turns[-1].finish_reason,
        # the answer's (the last turn's), as OpenAI's choices[].logprobs
        "logprobs": _logprobs(turns[-1]),
        "n_cycles": total.n_cycles,
        "mean_accept_length": total.tau,
        "mean_tree_size": total.mean_tree_size,
        "accept_hist": total.accept_hist,
        "depth_attempts": total.depth_attempts,
        "depth_accepts": total.depth_accepts,
        "draft_ms": total.draft_ms,
        "verify_ms": total.verify_ms,
        "total_ms": total.total_ms,
        "tokens_per_s": completion / (total.total_ms / 1000) if total.total_ms > 0 else None,
    }


def _logprobs(generation: Generation) -> list[dict[str, Any]] | None:
    if generation.logprobs is None:
        return None
    return [entry.to_json() for entry in generation.logprobs]
