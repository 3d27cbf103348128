"""Reading prompt files (JSON Lines or Parquet) as a stream of validated requests.

A job's input can be millions of lines and single lines of many megabytes, so the
file is never loaded whole: JSONL is read in binary one line at a time (a bounded
`readline`, so even a gigabyte without a newline costs at most `max_line_bytes`),
Parquet one bounded record batch at a time, each row capped at `max_line_bytes` too
(producer/parquet_input.py). Every non-blank line yields exactly one
`Request` or one `Rejected`, in file order, so a bad line never stops a job.
The rules for a record live in producer/validate.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from producer.parquet_input import InputFileError, parquet_records
from producer.prompt_length import TokenCounter, TokensAtLeast
from producer.seen_ids import SeenIds
from producer.validate import InvalidLine, Rejected, Request, quote, request_from_object
from workers.request import completion_id

__all__ = [
    "MAX_LINE_BYTES",
    "InputFileError",
    "Rejected",
    "Request",
    "Shard",
    "plan_shards",
    "read_requests",
    "shard_of",
]

# Well above any prompt a model context can hold (the benchmark lines are < 20 KB),
# small enough that one bad line cannot exhaust a producer's memory.
MAX_LINE_BYTES = 16 * 1024 * 1024
_SKIP_CHUNK = 1024 * 1024
_BOM = b"\xef\xbb\xbf"
# Records validated together: at most this many, and at most this many bytes of input (one
# line at least), so the prompts awaiting their length check stay bounded whatever their size.
_CHECK_WINDOW = 256
_CHECK_WINDOW_BYTES = 16 * 1024 * 1024
_JSON_SPACE = " \t\n\r"
_scan_once = json.JSONDecoder().scan_once

Record = tuple[int, Any, int]  # line (or row) number, parsed value, its size in bytes


def read_requests(
    path: str | os.PathLike[str],
    *,
    max_line_bytes: int = MAX_LINE_BYTES,
    count_prompt_tokens: TokenCounter | None = None,
    max_context: int | None = None,
    system: str | None = None,
    n: int = 1,
) -> Iterator[Request | Rejected]:
    """Stream `path` as Requests and Rejected lines, in file order.

    A `.parquet` suffix reads Parquet (row numbers, from 1, stand for line numbers);
    anything else is JSONL. `max_line_bytes` caps a JSONL line and a Parquet row alike.
    Blank lines are skipped and yield nothing. Pass `count_prompt_tokens` (a batch
    counter: producer/prompt_length.py) with `max_context` to refuse prompts that leave
    no room to generate; `system` to open every conversation without a system message
    with it; `n` for the completions of a line that does not say. Arguments are checked
    now; the file is opened on first iteration.
    """
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    validator = Validator(
        count_prompt_tokens=count_prompt_tokens, max_context=max_context, system=system, n=n
    )
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        records: Iterator[Record | Rejected] = parquet_records(path, max_line_bytes)
    else:
        records = _jsonl_records(path, max_line_bytes)
    return _checked(records, validator)


def _checked(
    records: Iterator[Record | Rejected], validator: Validator
) -> Iterator[Request | Rejected]:
    """The validator's verdicts, a window of records at a time (so the prompts that need
    exact tokenizing are tokenized together)."""
    try:
        window: list[Record | Rejected] = []
        size = 0
        for record in records:
            window.append(record)
            size += 0 if isinstance(record, Rejected) else record[2]
            if len(window) == _CHECK_WINDOW or size >= _CHECK_WINDOW_BYTES:
                yield from validator.check_many(window)
                window, size = [], 0
        yield from validator.check_many(window)
    finally:
        validator.close()


def _jsonl_records(path: Path, max_line_bytes: int) -> Iterator[Record | Rejected]:
    """(line number, parsed JSON, bytes) per non-blank line, or Rejected when the bytes
    are not a JSON document (too long, invalid UTF-8, invalid JSON)."""
    with open(path, "rb") as stream:
        readline = stream.readline
        line_no = 0
        while raw := readline(max_line_bytes + 1):
            line_no += 1
            if len(raw) > max_line_bytes and raw[-1:] != b"\n":
                yield Rejected(line_no, None, _skip_long_line(readline, len(raw), max_line_bytes))
                continue
            if line_no == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
            if not raw or raw.isspace():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield Rejected(
                    line_no,
                    None,
                    f"invalid UTF-8 at byte {exc.start + 1} (0x{raw[exc.start]:02x})",
                )
                continue
            try:
                yield line_no, _loads(text), len(raw)
            except json.JSONDecodeError as exc:
                reason = f"invalid JSON: {exc.msg}: column {exc.colno}"
                if raw[-1:] != b"\n":
                    reason += " (the last line has no newline: is the file truncated?)"
                yield Rejected(line_no, None, reason)
            except RecursionError:
                yield Rejected(line_no, None, "invalid JSON: nested too deeply")
            except ValueError as exc:  # e.g. an integer of more than 4300 digits
                yield Rejected(line_no, None, f"invalid JSON: {exc}")


def _loads(text: str) -> Any:
    """json.loads, about twice as fast on the usual line (an object, maybe a newline):
    the C scanner is called directly. Anything unusual, including every error, goes
    through json.loads itself, so messages and behaviour are exactly its own."""
    if text[:1] == "{":
        try:
            obj, end = _scan_once(text, 0)
        except StopIteration:
            return json.loads(text)
        if end == len(text) or not text[end:].strip(_JSON_SPACE):
            return obj
    return json.loads(text)


def _skip_long_line(readline: Callable[[int], bytes], seen: int, max_line_bytes: int) -> str:
    """Read past the rest of an over-long line in bounded chunks; the reason to report."""
    total = seen
    chunk = b""
    while chunk[-1:] != b"\n":
        chunk = readline(_SKIP_CHUNK)
        if not chunk:
            break
        total += len(chunk)
    length = total - (chunk[-1:] == b"\n")
    return f"line too long: {length} bytes, the limit is {max_line_bytes} (max_line_bytes)"


def shard_of(line_no: int, shard_size: int) -> int:
    """The shard a line belongs to: shards are fixed ranges of `shard_size` lines, so a
    sample's shard depends only on its line number (stable across resubmits)."""
    if line_no < 1 or shard_size < 1:
        raise ValueError(f"need line_no >= 1 and shard_size >= 1, got {line_no}, {shard_size}")
    return (line_no - 1) // shard_size


@dataclass(frozen=True, slots=True)
class Shard:
    """The results of one shard's line range, lines first_line..last_line inclusive."""

    index: int
    first_line: int
    last_line: int
    requests: list[Request]
    rejected: list[Rejected]


def plan_shards(items: Iterable[Request | Rejected], shard_size: int) -> Iterator[Shard]:
    """Group `read_requests` output into shards, in order, holding one shard at a time.

    Shards with no non-blank line are not yielded; a shard of only rejected lines is,
    so that its rejections get recorded.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    index = -1
    last_line = 0
    requests: list[Request] = []
    rejected: list[Rejected] = []
    for item in items:
        if item.line_no <= last_line:
            raise ValueError(f"line {item.line_no} comes after line {last_line}: not in file order")
        last_line = item.line_no
        item_shard = shard_of(item.line_no, shard_size)
        if item_shard != index:
            if requests or rejected:
                yield _shard(index, shard_size, requests, rejected)
            index, requests, rejected = item_shard, [], []
        if isinstance(item, Rejected):
            rejected.append(item)
        else:
            requests.append(item)
    if requests or rejected:
        yield _shard(index, shard_size, requests, rejected)


def _shard(index: int, shard_size: int, requests: list[Request], rejected: list[Rejected]) -> Shard:
    first_line = index * shard_size + 1
    return Shard(index, first_line, first_line + shard_size - 1, requests, rejected)


def json_objects(path: Path, error: Callable[[str], Exception]) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSONL data file; a line that is not
    JSON raises error("PATH:LINE: not JSON (why)"). For the training and vocabulary data,
    which stop at the first bad line (a job's input instead keeps its good lines)."""
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}:{line_no}: not JSON ({exc.msg})") from None


def _ids(request: Request) -> list[str]:
    """The line's sample id, and with n > 1 those of its completions."""
    if request.n == 1:
        return [request.sample_id]
    return [request.sample_id, *(completion_id(request.sample_id, k) for k in range(request.n))]


def _window_counts(
    parsed: list[Request | Rejected], ids: dict[int, list[str]], count: TokenCounter
) -> dict[int, int]:
    """Prompt tokens by position, from one call to the counter. A request naming an id
    that an earlier line of the window names is left out: whether it is a duplicate
    depends on that line's fate, so `_admit` counts it only if it gets that far."""
    named: set[str] = set()
    candidates = []
    for i, taken in ids.items():
        if named.isdisjoint(taken):
            candidates.append(i)
        named.update(taken)
    counted = count([parsed[i] for i in candidates])
    return dict(zip(candidates, counted, strict=True))


class Validator:
    """Checks records of one file in order. Stateful: it remembers the id of every
    accepted request and of its completions (producer/seen_ids.py: on disk for a large
    file) to refuse duplicates, so no two samples of a job share an id.

    `count_prompt_tokens` and `max_context` come from the caller, which owns the
    tokenizer: a request whose prompt leaves no room to generate is refused. `system`
    (the job's --system) opens every conversation that has no system message of its own,
    before the length check; `n` is the completions of a line that does not say.
    """

    def __init__(
        self,
        *,
        count_prompt_tokens: TokenCounter | None = None,
        max_context: int | None = None,
        system: str | None = None,
        n: int = 1,
    ) -> None:
        if (count_prompt_tokens is None) != (max_context is None):
            raise ValueError("count_prompt_tokens and max_context go together")
        if max_context is not None and max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        self._count, self._max_context = count_prompt_tokens, max_context
        self._seen = SeenIds()
        self._system = {"role": "system", "content": system} if system is not None else None
        self._n = n

    def check_many(self, records: list[Record | Rejected]) -> list[Request | Rejected]:
        """The Request for each record, or why it is refused, in order; a Rejected record
        stays as it is.

        The decisions are those of checking one record after another: a line's ids are
        refused when an earlier accepted line took them, and a prompt too long for the
        context is refused without taking them. Only the counting is batched.
        """
        parsed = [r if isinstance(r, Rejected) else self._parse(r[0], r[1]) for r in records]
        ids = {i: _ids(r) for i, r in enumerate(parsed) if not isinstance(r, Rejected)}
        counts = _window_counts(parsed, ids, self._count) if self._count is not None else {}
        return [
            self._admit(item, ids[i], counts.get(i)) if i in ids else item
            for i, item in enumerate(parsed)
        ]

    def _parse(self, line_no: int, obj: object) -> Request | Rejected:
        try:
            request = request_from_object(obj, line_no, self._n)
        except InvalidLine as exc:
            return Rejected(line_no, exc.sample_id, str(exc))
        if self._system is not None and request.messages[0]["role"] != "system":
            request = replace(request, messages=[dict(self._system), *request.messages])
        return request

    def _admit(self, request: Request, ids: list[str], n_tokens: int | None) -> Request | Rejected:
        """The request unless an id of it is taken or its prompt leaves no room to
        generate (`n_tokens`: its count, None when not counted yet)."""
        line_no, sample_id = request.line_no, request.sample_id
        for taken in ids:
            first = self._seen.first_line(taken)
            if first is not None:
                return Rejected(
                    line_no,
                    sample_id,
                    f"duplicate sample id {quote(taken)}: first used on line {first}",
                )
        if self._count is not None and self._max_context is not None:
            if n_tokens is None:  # its ids were named earlier in the window: decided now
                n_tokens = self._count([request])[0]
            if n_tokens >= self._max_context:
                at_least = "at least " if isinstance(n_tokens, TokensAtLeast) else ""
                return Rejected(
                    line_no,
                    sample_id,
                    f"prompt is {at_least}{n_tokens} tokens; the model's context is "
                    f"{self._max_context} tokens, which leaves no room to generate",
                )
        self._seen.add(ids, line_no)
        return request

    def close(self) -> None:
        """Drop the ids seen (and their file on disk, for a large input)."""
        self._seen.close()
