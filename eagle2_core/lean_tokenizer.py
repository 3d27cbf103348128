"""A model's tokenizer without importing transformers, where that gives the same ids and text.

transformers' import scans its whole source tree to build its lazy modules: 0.46 s of
every `run` on the 2-core VMs, plus ~0.1 s to build its tokenizer object, for what is a
`tokenizers.Tokenizer` and a Jinja chat template underneath. For a directory that
transformers 5 saved with its `TokenizersBackend` class (our GGUF copies of the default
model are such) and whose settings this module knows to leave the backend as saved,
LeanTokenizer does what the engine and job creation call (encode, decode, the chat
template, special ids, vocabularies) straight on the backend, as TokenizersBackend does.
Anything else (another call, a message with fields beyond role and content, template
options) goes to the transformers tokenizer, loaded the first time it is needed, so no
caller sees a difference but time. tests/eagle2_core/test_lean_tokenizer.py compares the
two on the tokenizers the project ships and tests with.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

# tokenizer_config.json keys whose values LeanTokenizer reproduces; any other key (for
# example add_bos_token, add_prefix_space, split_special_tokens, extra special tokens)
# may make transformers change the backend at load time, so such a directory is loaded
# by transformers.
KNOWN_SETTINGS = frozenset(
    {
        "backend",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "is_local",
        "local_files_only",
        "model_max_length",
        "tokenizer_class",
        "clean_up_tokenization_spaces",
        "chat_template",
    }
)
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# transformers patches pre-tokenizers of vocabularies above this size (Mistral's regex)
LARGEST_VOCAB = 100_000
# Templates that use what only transformers' environment defines (its generation tag, its
# restricted namespace and dict) go to transformers.
TRANSFORMERS_ONLY = re.compile(r"\{%-?\s*generation\b|\bnamespace\s*\(|\bdict\s*[(.]")


def _special_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _plain(message: Any) -> bool:
    """A message of a string role and content and nothing else."""
    return (
        isinstance(message, dict)
        and set(message) == {"role", "content"}
        and all(isinstance(v, str) for v in message.values())
    )


def lean_tokenizer(directory: Path) -> LeanTokenizer | None:
    """The directory's LeanTokenizer, or None where only transformers loads it exactly."""
    try:
        settings = json.loads((directory / "tokenizer_config.json").read_text())
        backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception:  # OSError, bad JSON, or tokenizers' own parse error (a bare Exception)
        return None
    if not set(settings) <= KNOWN_SETTINGS or settings.get("clean_up_tokenization_spaces"):
        return None
    if backend.post_processor is None or backend.truncation or backend.padding:
        return None
    if backend.get_vocab_size() > LARGEST_VOCAB:
        return None
    added = {t.content: t.special for t in backend.get_added_tokens_decoder().values()}
    specials = {name: _special_content(settings.get(name)) for name in SPECIAL_NAMES}
    if any(added.get(token) is not True for token in specials.values() if token is not None):
        return None
    template = settings.get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        return None  # a list of named templates: transformers picks among them
    return LeanTokenizer(directory, backend, specials, template)


class LeanTokenizer:
    """TokenizersBackend's encode, decode and chat template on the backend directly; every
    other attribute is the transformers tokenizer's (loaded on first use)."""

    def __init__(
        self,
        directory: Path,
        backend: Tokenizer,
        specials: dict[str, str | None],
        chat_template: str | None,
    ) -> None:
        self.name_or_path = str(directory)
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map = {k: v for k, v in specials.items() if v is not None}
        for name, token in specials.items():
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else backend.token_to_id(token))

    @cached_property
    def transformers_tokenizer(self) -> Any:
        """transformers' tokenizer of the same directory, for everything not done here."""
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(self.name_or_path, local_files_only=True)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "transformers_tokenizer":
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer, name)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **options: Any):
        if options:
            return self.transformers_tokenizer(
                text, add_special_tokens=add_special_tokens, **options
            )
        batch = [text] if isinstance(text, str) else list(text)
        ids = [
            e.ids
            for e in self.backend_tokenizer.encode_batch(
                batch, add_special_tokens=add_special_tokens
            )
        ]
        masks = [[1] * len(x) for x in ids]
        if isinstance(text, str):
            return {"input_ids": ids[0], "attention_mask": masks[0]}
        return {"input_ids": ids, "attention_mask": masks}

    def encode(self, text: str, add_special_tokens: bool = True, **options: Any) -> list[int]:
        if options:
            return self.transformers_tokenizer.encode(
                text, add_special_tokens=add_special_tokens, **options
            )
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any, skip_special_tokens: bool = False, **options: Any) -> str:
        if options:
            return self.transformers_tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, **options
            )
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        added = sorted(self.backend_tokenizer.get_added_tokens_decoder().items())
        return {token.content: i for i, token in added}

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str] | None:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Unknown tokens map to the unknown token's id, as in transformers."""
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(
        self,
        conversation: list[dict] | list[list[dict]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **options: Any,
    ) -> Any:
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        chats = conversation if batched else [conversation]
        if options or not self._renders(chats):
            return self.transformers_tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                return_dict=return_dict,
                **options,
            )
        texts = [
            self._template.render(
                messages=[dict(m) for m in chat],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens_map,
            )
            for chat in chats
        ]
        if not tokenize:
            return texts if batched else texts[0]
        encoded = self(texts if batched else texts[0], add_special_tokens=False)
        return encoded if return_dict else encoded["input_ids"]

    def _renders(self, chats: list) -> bool:
        """Whether this class renders these chats as transformers would: a template that
        needs nothing of transformers' own, and messages of a string role and content
        only (transformers rewrites other fields, reasoning ones for example)."""
        return (
            self._template is not None
            and bool(chats)
            and all(chat and all(_plain(m) for m in chat) for chat in chats)
        )

    @cached_property
    def _template(self) -> Any:
        """The chat template compiled in a sandbox set as transformers sets its own:
        blocks trimmed, loop controls, tojson without HTML escapes, raise_exception and
        strftime_now; None where there is none or it needs transformers' own."""
        if not self.chat_template or TRANSFORMERS_ONLY.search(self.chat_template):
            return None
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                value,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        return environment.from_string(self.chat_template)
