"""What `train-draft` learns from: prompts for the target to answer, conversations that
have answers, both picked in a fixed hash order so a larger pick keeps a smaller one as
its prefix (and the answers and feature shards already made stay valid)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from producer.inputs import json_objects
from producer.jobs import JobError

if TYPE_CHECKING:  # torch: imported where used, so other commands start fast
    from eagle2_core.models import Target
    from eagle2_core.train.data import Conversation

Prompt = tuple[str, list[dict]]  # (id, the messages of its first user turn)


class TrainingError(JobError):
    """The head cannot be trained as asked (a bad data file, a missing head): why, in one line."""


def selection_rank(sample_id: object) -> str:
    """Where an id falls in train-draft's fixed pick order (prompts, conversations, a job's
    answers alike)."""
    return hashlib.sha256(f"select:{sample_id}".encode()).hexdigest()


def _messages(obj: dict[str, Any]) -> list[dict] | None:
    """The first user turn of a prompt line (`prompt`, `messages` or benchmark `turns`)."""
    if isinstance(obj.get("prompt"), str):
        return [{"role": "user", "content": obj["prompt"]}]
    if isinstance(obj.get("messages"), list):
        return obj["messages"]
    if isinstance(obj.get("turns"), list) and obj["turns"]:
        return [{"role": "user", "content": obj["turns"][0]}]
    return None


def prompt_lines(path: Path) -> Iterator[Prompt]:
    """(id, messages) per usable line; the id is the line's `id`, else its line number."""
    for line_no, obj in json_objects(path, TrainingError):
        messages = _messages(obj)
        if messages is not None:
            yield str(obj.get("id", obj.get("question_id", line_no))), messages


def select_prompts(path: Path, max_train: int, max_val: int) -> tuple[list[Prompt], list[Prompt]]:
    """Hash-ordered training and validation prompts: an even spread over the file's sources.

    The order is fixed by the ids alone, so a larger --max-samples keeps the earlier
    selection as its prefix and the answers and shards already made stay valid.
    """
    from eagle2_core.train.data import is_validation

    items = sorted(prompt_lines(path), key=lambda item: selection_rank(item[0]))
    train_items = [i for i in items if not is_validation(i[0])][:max_train]
    val_items = [i for i in items if is_validation(i[0])][:max_val]
    return train_items, val_items


def build_conversations(
    target: Target, items: list[Prompt], answers: dict, max_len: int
) -> list[Conversation]:
    """Conversations of the prompts that have an answer, in selection order."""
    from eagle2_core.train.data import make_conversation

    conversations = []
    for sample_id, messages in items:
        row = answers.get(sample_id)
        if row is None:
            continue
        conversation = make_conversation(
            target.tokenizer,
            sample_id,
            messages,
            row["output_text"],
            row["finish_reason"] == "stop",
            max_len,
        )
        if conversation is not None:
            conversations.append(conversation)
    return conversations


def read_conversations(
    target: Target, path: Path, max_train: int, max_val: int, max_len: int
) -> tuple[list[Conversation], list[Conversation]]:
    """Hash-ordered training and validation conversations of a file with answers (as
    select_prompts orders prompts: a larger pick keeps the smaller as its prefix). A line
    whose `finish_reason` is `length` (an answer cut at a token cap, as in a job's
    export) keeps its last answer open: no end-of-turn token the target never wrote."""
    from eagle2_core.train.data import conversation_from_messages, is_validation

    lines = []
    for line_no, obj in json_objects(path, TrainingError):
        if not isinstance(obj.get("messages"), list):
            raise TrainingError(f"{path}:{line_no}: no `messages` list")
        obj.setdefault("id", f"line-{line_no}")
        lines.append(obj)
    lines.sort(key=lambda obj: selection_rank(obj["id"]))
    train_lines = [o for o in lines if not is_validation(str(o["id"]))]
    val_lines = [o for o in lines if is_validation(str(o["id"]))][:max_val]
    if max_train:
        train_lines = train_lines[:max_train]

    def convert(objs: list[dict]) -> list[Conversation]:
        made = (
            conversation_from_messages(
                target.tokenizer,
                str(o["id"]),
                o["messages"],
                max_len,
                closed=o.get("finish_reason") != "length",
            )
            for o in objs
        )
        return [c for c in made if c is not None]

    return convert(train_lines), convert(val_lines)


def job_conversations(
    target: Target, answers: Iterable[dict[str, Any]], max_train: int, max_val: int, max_len: int
) -> tuple[list[Conversation], list[Conversation]]:
    """A finished job's answers (workers.job_answers) as training and validation
    conversations: each prompt (system message and all) with its answers, turn by turn.

    Split by the request's id with the usual hash rule, so the n completions of one
    prompt land on the same side; picked in the same hash order as the other sources (a
    larger --max-conversations keeps a smaller pick as its prefix)."""
    from eagle2_core.train.data import conversation_from_messages, is_validation

    items = sorted(answers, key=lambda a: (selection_rank(a["request_id"]), a["sample_id"]))
    train = [a for a in items if not is_validation(str(a["request_id"]))]
    val = [a for a in items if is_validation(str(a["request_id"]))][:max_val]
    if max_train:
        train = train[:max_train]

    def convert(rows: list[dict[str, Any]]) -> list[Conversation]:
        made = []
        for a in rows:
            messages = list(a["messages"])
            user_turns = [None, *a["followups"]][: len(a["turn_outputs"])]
            for user, answer in zip(user_turns, a["turn_outputs"], strict=True):
                if user is not None:
                    messages.append({"role": "user", "content": user})
                messages.append({"role": "assistant", "content": answer})
            closed = a["finish_reason"] != "length"
            made.append(
                conversation_from_messages(
                    target.tokenizer, str(a["sample_id"]), messages, max_len, closed=closed
                )
            )
        return [c for c in made if c is not None]

    return convert(train), convert(val)
