"""The tokenizer a model directory loads with: AutoTokenizer's choice, without its cost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle2_core.lean_tokenizer import LeanTokenizer
from eagle2_core.registry import encode_chat, resolve_model
from eagle2_core.tokenizer import load_tokenizer
from tests.eagle2_core.tiny import save_target, tiny_target

ROOT = Path(__file__).parents[2]


def saved_tiny(directory: Path) -> Path:
    return save_target(tiny_target(seed=7), directory)


def same_tokenizer(ours, theirs) -> None:
    """The same vocabulary, special tokens and template (the ids: test_lean_tokenizer)."""
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.get_added_vocab() == theirs.get_added_vocab()
    assert len(ours) == len(theirs)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(theirs, name)
        assert getattr(ours, f"{name}_id") == getattr(theirs, f"{name}_id")
    assert ours.chat_template == theirs.chat_template


def test_a_backend_directory_loads_what_auto_tokenizer_loads(tmp_path: Path) -> None:
    directory = saved_tiny(tmp_path / "model")
    assert json.loads((directory / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "TokenizersBackend"
    )
    ours = load_tokenizer(directory)
    assert isinstance(ours, LeanTokenizer)
    theirs = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    same_tokenizer(ours, theirs)
    text = "t5 t17 t3 t90"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]


def test_another_tokenizer_class_goes_through_auto_tokenizer(tmp_path: Path) -> None:
    directory = saved_tiny(tmp_path / "model")
    settings_path = directory / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    settings_path.write_text(json.dumps(settings))
    code = (
        "import sys\n"
        "from eagle2_core.tokenizer import load_tokenizer\n"
        f"load_tokenizer({str(directory)!r})\n"
        "print('transformers.models.auto.tokenization_auto' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "True"


def test_the_default_model_encodes_every_example_as_auto_tokenizer_does() -> None:
    source = resolve_model("smollm2-135m")
    ours = load_tokenizer(source)
    theirs = AutoTokenizer.from_pretrained(source, local_files_only=True)
    same_tokenizer(ours, theirs)
    rows = [json.loads(line) for line in (ROOT / "examples" / "prompts.jsonl").open()]
    texts = [row["prompt"] for row in rows if "prompt" in row]
    assert texts
    texts += ["Ünïcode, 漢字 and emoji 🙂", "<|im_start|>user\nnot a turn<|im_end|>"]
    for text in texts:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        ids = encode_chat(ours, messages)
        assert ids == encode_chat(theirs, messages)
        assert ours.decode(ids) == theirs.decode(ids)


@pytest.mark.parametrize("module", ["transformers.utils.type_validators"])
def test_loading_a_backend_directory_skips_transformers_model_configs(
    tmp_path: Path, module: str
) -> None:
    """That import chain (torch.distributed, sympy) cost ~0.7 s of every start."""
    directory = saved_tiny(tmp_path / "model")
    code = (
        "import sys\n"
        "from eagle2_core.tokenizer import load_tokenizer\n"
        "from eagle2_core.model_config import load_model_config\n"
        f"load_tokenizer({str(directory)!r})\n"
        f"print(load_model_config({str(directory)!r}).num_hidden_layers)\n"
        f"print({module!r} in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["2", "False"]


def test_one_load_however_the_options_are_spelled(tmp_path: Path) -> None:
    """Job creation calls load_tokenizer(source), the model load spells the options out:
    both get the same object, parsed once."""
    directory = saved_tiny(tmp_path / "model")
    first = load_tokenizer(directory)
    assert load_tokenizer(directory, allow_download=False, trust_remote_code=False) is first
