"""Built-in names: which models come with a shipped draft head."""

from __future__ import annotations

from pathlib import Path

from eagle2_core.registry import DEFAULT_MODEL, HEADS_DIR, shipped_draft


def test_the_default_alias_ships_a_head() -> None:
    assert shipped_draft(DEFAULT_MODEL) == HEADS_DIR / DEFAULT_MODEL
    assert (HEADS_DIR / DEFAULT_MODEL / "model.safetensors").exists()


def test_a_model_folder_is_never_taken_for_a_shipped_head(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a model folder has a config.json too
    assert shipped_draft(str(model)) is None
    assert shipped_draft("no-such-alias") is None
