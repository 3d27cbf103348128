"""Loading a target from its files: the lean forward straight from the safetensors, the
same numbers as from transformers' model, and no transformers modeling code imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle2_core.llama import forward
from eagle2_core.models import Target, load_target, read_weights, stop_token_ids
from tests.eagle2_core.tiny import save_target, tiny_target, tiny_tokenizer


def logits(target: Target, ids: torch.Tensor) -> torch.Tensor:
    kv = target.kv()
    keys, values = kv.add_row(ids.shape[1])
    positions = torch.arange(ids.shape[1])[None]
    hidden = forward(target.lean, ids, positions, keys[:, :1], values[:, :1], 0)[0]
    return target.lm_head(hidden)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("deduplicate", [False, True])
def test_loaded_from_files_computes_what_the_model_does(
    tmp_path: Path, tied: bool, deduplicate: bool
) -> None:
    built = tiny_target(seed=3, layers=3, tied=tied)
    assert (built.lm_weight.data_ptr() == built.lean.embed.data_ptr()) == tied
    directory = save_target(built, tmp_path / "model", deduplicate)
    stored = read_weights(directory)
    assert stored is not None
    loaded = load_target(str(directory))
    assert loaded._model is None  # decoding builds no transformers model
    assert loaded.stop_ids == built.stop_ids and loaded.max_context == built.max_context
    ids = torch.tensor([[5, 17, 3, 40, 41, 2, 9]])
    assert torch.equal(logits(loaded, ids), logits(built, ids))
    with torch.no_grad():  # and the lazily loaded transformers model is the same one
        expected = built.model(ids).logits
        assert torch.equal(loaded.model(ids).logits, expected)


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_load_converts_every_weight(tmp_path: Path, tied: bool) -> None:
    """Each weight is cast as it is prepared (the stacked ones while stacking): the same
    numbers as a model cast to bf16 whole, and a tied table is still one table."""
    directory = save_target(tiny_target(seed=4, tied=tied), tmp_path / "model")
    loaded = load_target(str(directory), dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    assert loaded.lean.embed.dtype == loaded.lean.norm.dtype == loaded.lm_weight.dtype
    assert loaded.lean.embed.dtype == torch.bfloat16
    assert (loaded.lm_weight is loaded.lean.embed) == tied
    ids = torch.tensor([[5, 17, 3, 40, 41, 2, 9]])
    cast = tiny_target(seed=4, tied=tied, dtype=torch.bfloat16)
    assert torch.equal(logits(loaded, ids), logits(cast, ids))
    assert loaded.model.dtype == torch.bfloat16


def test_sharded_checkpoints_load_every_shard(tmp_path: Path) -> None:
    built = tiny_target(seed=5)
    directory = tmp_path / "model"
    built.model.save_pretrained(directory, max_shard_size="40KB")
    built.tokenizer.save_pretrained(directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = load_target(str(directory))
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    assert torch.equal(logits(loaded, ids), logits(built, ids))


def test_loading_imports_no_transformers_modeling_code(tmp_path: Path) -> None:
    """Importing transformers' modeling stack took ~1.8 s of every command's start, and
    its Llama config module (through type_validators) ~0.7 s more."""
    directory = save_target(tiny_target(seed=6), tmp_path / "model")
    code = (
        "import sys\n"
        "from eagle2_core.engine import load_engine\n"
        f"engine = load_engine({str(directory)!r}, None, needs_draft=False)\n"
        "heavy = [m for m in sys.modules if m.startswith(('transformers.modeling_utils',"
        " 'transformers.models.llama.modeling_llama', 'transformers.utils.type_validators'))]\n"
        "assert not heavy, heavy\n"
        "print(engine.target.vocab_size)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2]
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "96"


def test_stop_ids_hold_the_end_of_turn_tokens_the_vocab_has_and_never_unk() -> None:
    tokenizer = tiny_tokenizer(8, eos=3)  # unknown tokens map to t0
    assert stop_token_ids(None, tokenizer) == {3}
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>", "</s>"]})
    im_end, end = tokenizer.convert_tokens_to_ids(["<|im_end|>", "</s>"])
    assert stop_token_ids([5], tokenizer) == {3, 5, im_end, end}
