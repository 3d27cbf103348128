"""Built-in names: which models come with a shipped draft head."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle2_core.registry import (
    DEFAULT_MODEL,
    HEADS_DIR,
    RANDOM_DRAFT,
    DraftUnavailableError,
    draft_label,
    draft_source,
    encode_chat,
    encode_chats,
    shipped_draft,
)
from tests.eagle2_core.tiny import tiny_tokenizer


def test_the_default_alias_ships_a_head() -> None:
    assert shipped_draft(DEFAULT_MODEL) == HEADS_DIR / DEFAULT_MODEL
    assert (HEADS_DIR / DEFAULT_MODEL / "model.safetensors").exists()


def test_a_model_folder_is_never_taken_for_a_shipped_head(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a model folder has a config.json too
    assert shipped_draft(str(model)) is None
    assert shipped_draft("no-such-alias") is None


def test_draft_source_names_the_head_or_says_how_to_get_one(tmp_path: Path) -> None:
    assert draft_source(DEFAULT_MODEL, None) == HEADS_DIR / DEFAULT_MODEL
    assert draft_source("anything", str(tmp_path)) == tmp_path
    assert draft_source("anything", RANDOM_DRAFT) is None
    with pytest.raises(DraftUnavailableError, match="--draft DIR.*--mode vanilla"):
        draft_source(str(tmp_path), None)


def test_draft_label_names_the_shipped_head_and_nothing_for_vanilla() -> None:
    assert draft_label(DEFAULT_MODEL, None, "eagle2") == f"shipped:{DEFAULT_MODEL}"
    assert draft_label(DEFAULT_MODEL, "/heads/mine", "eagle1") == "/heads/mine"
    assert draft_label(DEFAULT_MODEL, None, "vanilla") is None


@pytest.mark.parametrize(
    "template", [None, "{% for m in messages %}{{ m['content'] }} {% endfor %}t2"]
)
def test_encode_chats_is_encode_chat_of_each(template: str | None) -> None:
    tokenizer = tiny_tokenizer(96)
    tokenizer.chat_template = template
    chats = [[{"role": "user", "content": "t5 t6"}], [{"role": "user", "content": "t7"}] * 3]
    assert encode_chats(tokenizer, chats) == [encode_chat(tokenizer, m) for m in chats]
    assert encode_chats(tokenizer, []) == []
