"""Training data for a draft head: the target's own answers, turned into features.

Self-distillation, as in EAGLE: the head learns to predict the target's next final-norm
hidden state on text the target wrote itself, so training sees the contexts that
drafting will see. One target forward per conversation records the features of every
token; they are stored as safetensors shards (features in bf16), one file per fixed
group of conversations, so an interrupted extraction skips the shards already written.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from eagle2_core.models import Target, final_hidden_states, layer_hidden_states
from eagle2_core.registry import END_OF_TURN_TOKENS, encode_chat

VALIDATION_MODULUS = 50
SHARD_GLOB = "shard-*.safetensors"
FEATURE_BATCH_TOKENS = 4096  # padded tokens per target forward while extracting features


def is_validation(sample_id: str) -> bool:
    """The prompt set's split rule (datasets README): about 1 id in 50, spread over sources."""
    return int(hashlib.sha256(sample_id.encode()).hexdigest(), 16) % VALIDATION_MODULUS == 0


@dataclass(frozen=True)
class Conversation:
    """One training example as ids, and which of them are answer tokens (the loss's)."""

    id: str
    ids: tuple[int, ...]
    answer_mask: tuple[bool, ...]

    @classmethod
    def of(cls, sample_id: str, prompt_ids: Sequence[int], answer_ids: Sequence[int]):
        """A prompt and one answer to it."""
        ids = tuple(prompt_ids) + tuple(answer_ids)
        return cls(sample_id, ids, (False,) * len(prompt_ids) + (True,) * len(answer_ids))

    @property
    def answer_ids(self) -> tuple[int, ...]:
        return tuple(t for t, answer in zip(self.ids, self.answer_mask, strict=True) if answer)


@dataclass(frozen=True)
class FeatureSequence:
    """A conversation as the loss reads it: ids [T], features [T, H], answer mask [T], and
    for an EAGLE-3 head the inputs of its target layers, layer_states [T, k * H]."""

    input_ids: torch.Tensor
    features: torch.Tensor
    loss_mask: torch.Tensor
    layer_states: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@functools.lru_cache(maxsize=8)
def end_of_turn_id(tokenizer) -> int | None:
    """The token that closes an assistant turn (the answer text is stored without it).
    Cached: building the vocabulary dict costs ~30 ms, more than tokenizing an answer."""
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN_TOKENS:
        if token in vocab:
            return vocab[token]
    return tokenizer.eos_token_id


def make_conversation(
    tokenizer,
    sample_id: str,
    messages: list[dict],
    answer: str,
    stopped: bool,
    max_len: int,
) -> Conversation | None:
    """Tokenise prompt (chat template) and answer; None when no answer token fits max_len.

    A stopped answer gets its end-of-turn token back, so the head learns to draft it.
    """
    prompt_ids = encode_chat(tokenizer, messages)
    answer_ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    stop = end_of_turn_id(tokenizer)
    if stopped and stop is not None:
        answer_ids.append(stop)
    answer_ids = answer_ids[: max(0, max_len - len(prompt_ids))]
    if not answer_ids:
        return None
    return Conversation.of(sample_id, prompt_ids, answer_ids)


def conversation_from_messages(
    tokenizer, sample_id: str, messages: list[dict], max_len: int, closed: bool = True
) -> Conversation | None:
    """A whole conversation with its answers (assistant turns) as the loss's tokens, as
    decoding sees them: each answer tokenized after the chat template's prompt for the
    turns before it, closed by the end-of-turn token. None when no answer token fits.

    A template that does not render earlier turns as a prefix of later ones (some drop
    old reasoning, say) starts the example again at that turn: earlier answers are then
    context, not loss."""
    stop = end_of_turn_id(tokenizer)
    ids: list[int] = []
    mask: list[bool] = []
    for turn, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if len(ids) >= max_len:
            break  # the rest would be cut off: do not render ever longer prefixes
        prompt = encode_chat(tokenizer, messages[:turn])
        if prompt[: len(ids)] != ids:
            ids, mask = [], []
        mask += [False] * (len(prompt) - len(ids))
        ids = list(prompt)
        answer = list(tokenizer(message["content"], add_special_tokens=False)["input_ids"])
        last = all(m.get("role") != "assistant" for m in messages[turn + 1 :])
        answer += [stop] if stop is not None and (closed or not last) else []
        ids += answer
        mask += [True] * len(answer)
    ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask):
        return None
    return Conversation(sample_id, tuple(ids), tuple(mask))


@torch.inference_mode()
def conversation_features(
    target: Target, conversations: Sequence[Conversation], layers: tuple[int, ...] = ()
) -> list[FeatureSequence]:
    """One target forward over a right-padded batch of conversations (prompt + answer);
    with layers, also the states entering those layers (an EAGLE-3 head's inputs).

    Right padding needs no attention mask: under causal attention a real token never sees
    a later pad. Each result's mask is True on exactly its answer tokens.
    """
    lengths = [len(c.ids) for c in conversations]
    ids = torch.zeros(len(conversations), max(lengths), dtype=torch.long)
    for row, conversation in enumerate(conversations):
        ids[row, : lengths[row]] = torch.tensor(conversation.ids)
    if layers:
        features, states = layer_hidden_states(target, ids.to(target.device), layers)
        states = states.to("cpu", torch.bfloat16)
    else:
        features, states = final_hidden_states(target, ids.to(target.device)), None
    features = features.to("cpu", torch.bfloat16)
    sequences = []
    for row, conversation in enumerate(conversations):
        mask = torch.tensor(conversation.answer_mask, dtype=torch.bool)
        n = lengths[row]
        row_states = states[row, :n] if states is not None else None
        sequences.append(FeatureSequence(ids[row, :n], features[row, :n], mask, row_states))
    return sequences


def length_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped by similar length, each group's padded size (count x longest) at
    most max_tokens (a longer single item gets a group of its own)."""
    batches: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        if batches and (len(batches[-1]) + 1) * lengths[index] <= max_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def batched_features(
    target: Target,
    conversations: Sequence[Conversation],
    batch_tokens: int = FEATURE_BATCH_TOKENS,
    on_batch: Callable[[int], object] | None = None,
    layers: tuple[int, ...] = (),
) -> list[FeatureSequence]:
    """Features of every conversation, in order, from forwards over length batches of at
    most batch_tokens padded tokens; on_batch(n) after each forward over n real tokens."""
    sequences: dict[int, FeatureSequence] = {}
    for group in length_batches([len(c.ids) for c in conversations], batch_tokens):
        batch = conversation_features(target, [conversations[i] for i in group], layers)
        sequences.update(zip(group, batch, strict=True))
        if on_batch is not None:
            on_batch(sum(len(conversations[i].ids) for i in group))
    return [sequences[i] for i in range(len(conversations))]


def _digest(conversations: Sequence[Conversation], model_name: str) -> str:
    """Identifies a shard's conversations, so a stale shard (other answers, other model)
    is redone."""
    h = hashlib.sha256(model_name.encode())
    for c in conversations:
        h.update(json.dumps([c.id, c.ids, c.answer_mask]).encode())
    return h.hexdigest()


def _shard_holds(path: Path, digest: str, layers: tuple[int, ...]) -> bool:
    """Whether the shard on disk holds these conversations with at least the features
    asked for: a shard with an EAGLE-3 head's layer states serves an EAGLE-2 head too."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception:  # a torn or foreign file: treat as missing and rewrite it
        return False
    stored = tuple(json.loads(metadata.get("layers", "[]")))
    return metadata.get("digest") == digest and (not layers or stored == tuple(layers))


def write_feature_shards(
    target: Target,
    conversations: Sequence[Conversation],
    directory: str | Path,
    shard_size: int = 64,
    progress: bool = True,
    batch_tokens: int = FEATURE_BATCH_TOKENS,
    layers: tuple[int, ...] = (),
) -> list[Path]:
    """Extract features for every conversation into shard files; skips up-to-date shards.
    layers: also store the states entering these target layers (an EAGLE-3 head's inputs).

    Shard i holds conversations [i*shard_size, (i+1)*shard_size), in order, so a prefix
    of the shards is a prefix of the data. Conversations of similar length share a
    forward of at most batch_tokens padded tokens (one at a time is launch-bound on a
    GPU). Files are written to a temporary name and renamed, so a shard on disk is always
    whole. A shard that already holds these conversations with the layer states of an
    EAGLE-3 head is kept for an EAGLE-2 head (layers=()): one extraction serves both.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    chunks = [conversations[i : i + shard_size] for i in range(0, len(conversations), shard_size)]
    paths = [directory / f"shard-{i:05d}.safetensors" for i in range(len(chunks))]
    todo = [
        (path, chunk)
        for path, chunk in zip(paths, chunks, strict=True)
        if not _shard_holds(path, _digest(chunk, target.name), layers)
    ]
    bar = tqdm(
        total=sum(len(c.ids) for _, chunk in todo for c in chunk),
        desc=f"features {directory.name}",
        unit="tok",
        unit_scale=True,
        disable=not progress,
    )  # tokens, so the rate reads as the target's tokens/s
    for path, chunk in todo:
        sequences = batched_features(target, chunk, batch_tokens, bar.update, layers)
        _save_shard(path, sequences, _digest(chunk, target.name), [c.id for c in chunk], layers)
    bar.close()
    for stale in set(directory.glob(SHARD_GLOB)) - set(paths):
        stale.unlink()  # left by an earlier run over more conversations
    return paths


def _save_shard(
    path: Path,
    sequences: Sequence[FeatureSequence],
    digest: str,
    ids: list[str],
    layers: tuple[int, ...],
) -> None:
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in sequences]),
        "features": torch.cat([s.features for s in sequences]).contiguous(),
        "loss_mask": torch.cat([s.loss_mask for s in sequences]),
        "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.int64),
    }
    if sequences[0].layer_states is not None:
        tensors["layer_states"] = torch.cat([s.layer_states for s in sequences]).contiguous()
    metadata = {"digest": digest, "ids": json.dumps(ids), "layers": json.dumps(list(layers))}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ShardedSequences(Sequence[FeatureSequence]):
    """The conversations of feature shards, read from disk one conversation at a time.

    Millions of answer tokens are gigabytes of features (several times more with an
    EAGLE-3 head's layer states), more than memory holds: each item is a slice of the
    memory-mapped shard, read when a batch asks for it, so memory stays at a batch's size
    and the page cache keeps what fits. layer_states are read only with with_layers.
    """

    def __init__(self, paths: Iterable[str | Path], with_layers: bool = False):
        self._files = [safe_open(str(path), framework="pt") for path in paths]
        self._with_layers = with_layers
        self._index: list[tuple[int, int, int]] = []  # (file, start, end) per conversation
        for number, f in enumerate(self._files):
            if with_layers and "layer_states" not in f.keys():
                raise ValueError(f"{paths} has no layer states: extract them for an EAGLE-3 head")
            offsets = [0, *f.get_tensor("lengths").cumsum(0).tolist()]
            self._index += [(number, a, b) for a, b in zip(offsets, offsets[1:], strict=False)]

    def __len__(self) -> int:
        return len(self._index)

    @property
    def lengths(self) -> list[int]:
        """Tokens of each conversation, without reading it."""
        return [b - a for _, a, b in self._index]

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        number, a, b = self._index[i]
        f = self._files[number]
        states = f.get_slice("layer_states")[a:b] if self._with_layers else None
        return FeatureSequence(
            f.get_slice("input_ids")[a:b],
            f.get_slice("features")[a:b],
            f.get_slice("loss_mask")[a:b],
            states,
        )


def load_shards(paths: Iterable[str | Path], with_layers: bool = False) -> ShardedSequences:
    """All conversations of the given shards, in order, read lazily (features stay bf16)."""
    return ShardedSequences(list(paths), with_layers)


def sequence_lengths(sequences: Sequence[FeatureSequence]) -> list[int]:
    """Tokens of each conversation (read from the shards' index when they are lazy)."""
    if isinstance(sequences, ShardedSequences):
        return sequences.lengths
    return [len(s) for s in sequences]


def count_answer_tokens(sequences: Iterable[FeatureSequence]) -> int:
    """Answer tokens in the data: the size a model card reports."""
    return sum(int(s.loss_mask.sum()) for s in sequences)
