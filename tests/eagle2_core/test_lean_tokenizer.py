"""LeanTokenizer against transformers' TokenizersBackend of the same directory: the same
ids, text and rendered chats, and transformers' own answer wherever it is not sure."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import TokenizersBackend

from eagle2_core.lean_tokenizer import LeanTokenizer, lean_tokenizer
from eagle2_core.registry import encode_chat, encode_chats, resolve_model
from eagle2_core.tokenizer import load_tokenizer
from tests.eagle2_core.tiny import save_target, tiny_target

ROOT = Path(__file__).parents[2]
TEXTS = [
    "",
    " ",
    "Hello, world!",
    "  two leading spaces and a trailing one ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Ünïcode, 漢字 and emoji 🙂👍🏽",
    "<|im_start|>user\nnot a turn<|im_end|>",
    "<|endoftext|><repo_name>x<file_sep>",
    "def f(x):\n    return {'a': [1, 2.5e-3]}\n",
    "1234567890 " * 20,
]


def both(directory: Path) -> tuple[LeanTokenizer, TokenizersBackend]:
    lean = lean_tokenizer(directory)
    assert isinstance(lean, LeanTokenizer)
    return lean, TokenizersBackend.from_pretrained(directory, local_files_only=True)


@pytest.fixture(scope="module")
def smollm2() -> tuple[LeanTokenizer, TokenizersBackend]:
    return both(resolve_model("smollm2-135m"))


def test_the_default_model_encodes_and_decodes_as_transformers(smollm2) -> None:
    lean, theirs = smollm2
    for text in TEXTS:
        for special in (True, False):
            assert lean(text, add_special_tokens=special) == dict(
                theirs(text, add_special_tokens=special)
            )
            assert lean.encode(text, add_special_tokens=special) == theirs.encode(
                text, add_special_tokens=special
            )
    assert lean(TEXTS)["input_ids"] == theirs(TEXTS)["input_ids"]
    rng = random.Random(0)
    for _ in range(300):  # any ids: special ones, pieces of a UTF-8 character
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(1, 12))]
        ids[rng.randrange(len(ids))] = rng.randrange(17)
        for skip in (True, False):
            assert lean.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )
        assert lean.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
        assert lean.convert_ids_to_tokens(ids[0]) == theirs.convert_ids_to_tokens(ids[0])
    assert lean.decode(5) == theirs.decode(5)
    tokens = ["<|im_end|>", "Hello", "not-a-token-at-all"]
    assert lean.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_encodes_as_transformers(smollm2, text: str) -> None:
    lean, theirs = smollm2
    assert lean.encode(text) == theirs.encode(text)
    ids = theirs.encode(text, add_special_tokens=False)
    assert lean.decode(ids) == theirs.decode(ids)


def test_the_default_model_renders_chats_as_transformers(smollm2) -> None:
    lean, theirs = smollm2
    chats = [[{"role": "user", "content": text}] for text in TEXTS] + [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "And then?"},
        ],
    ]
    for chat in chats:
        for prompt in (True, False):
            for tokenize in (True, False):
                ours = lean.apply_chat_template(
                    chat, add_generation_prompt=prompt, tokenize=tokenize
                )
                expected = theirs.apply_chat_template(
                    chat, add_generation_prompt=prompt, tokenize=tokenize
                )
                assert (dict(ours) if tokenize else ours) == (
                    dict(expected) if tokenize else expected
                )
        assert encode_chat(lean, chat) == encode_chat(theirs, chat)
    assert encode_chats(lean, chats) == encode_chats(theirs, chats)
    assert "transformers_tokenizer" not in vars(lean)


def test_what_it_does_not_render_itself_transformers_does(smollm2) -> None:
    """A message field beyond role and content, or a template option: transformers'
    answer (loaded then), never a guess."""
    lean = lean_tokenizer(resolve_model("smollm2-135m"))
    assert lean is not None
    theirs = smollm2[1]
    named = [{"role": "user", "content": "Hi", "name": "ann"}]
    assert lean.apply_chat_template(named, tokenize=False) == theirs.apply_chat_template(
        named, tokenize=False
    )
    assert "transformers_tokenizer" in vars(lean)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    assert lean.apply_chat_template(
        chat, continue_final_message=True, tokenize=False
    ) == theirs.apply_chat_template(chat, continue_final_message=True, tokenize=False)
    assert lean.is_fast  # any other attribute: transformers'


TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'tool' %}"
    "{{ raise_exception('no tools') }}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}\n"
    "  {{ bos_token + message['role'] | upper }}: {{ message['content'] | tojson }}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def tiny_directory(tmp_path: Path, template: str | None = None, **settings_) -> Path:
    directory = save_target(tiny_target(seed=7), tmp_path / "model")
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text()) | settings_
    if template is not None:
        config["chat_template"] = template
    path.write_text(json.dumps(config))
    return directory


def test_a_template_with_filters_loops_and_errors_renders_as_transformers(
    tmp_path: Path,
) -> None:
    lean, theirs = both(tiny_directory(tmp_path, TEMPLATE, bos_token="t1"))
    chat = [{"role": r, "content": f't5 "q" <{r}>'} for r in ("user", "assistant") * 3]
    for prompt in (True, False):
        ours = lean.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False)
        assert ours == theirs.apply_chat_template(
            chat, add_generation_prompt=prompt, tokenize=False
        )
    assert "transformers_tokenizer" not in vars(lean)
    tool = [{"role": "tool", "content": "x"}]
    with pytest.raises(Exception, match="no tools"):
        lean.apply_chat_template(tool, tokenize=False)


def test_a_generation_tag_or_namespace_goes_to_transformers(tmp_path: Path) -> None:
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}{{ ns.n }}"
    )
    lean, theirs = both(tiny_directory(tmp_path, template))
    chat = [{"role": "user", "content": "t5 t6"}]
    assert lean.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
        chat, tokenize=False
    )
    assert "transformers_tokenizer" in vars(lean)


@pytest.mark.parametrize(
    "setting",
    [
        {"add_bos_token": True},
        {"add_prefix_space": True},
        {"split_special_tokens": True},
        {"clean_up_tokenization_spaces": True},
        {"pad_token": "not-in-the-vocabulary"},
    ],
)
def test_settings_that_change_the_backend_load_with_transformers(
    tmp_path: Path, setting: dict
) -> None:
    directory = tiny_directory(tmp_path, **setting)
    assert lean_tokenizer(directory) is None
    assert isinstance(load_tokenizer(directory), TokenizersBackend)


def test_a_run_path_never_imports_transformers(tmp_path: Path) -> None:
    """What `run` does with the tokenizer, in a fresh process: 0.46 s of imports saved."""
    code = (
        "import sys\n"
        "from eagle2_core.registry import encode_chat, resolve_model\n"
        "from eagle2_core.tokenizer import load_tokenizer\n"
        "t = load_tokenizer(resolve_model('smollm2-135m'))\n"
        "ids = encode_chat(t, [{'role': 'user', 'content': 'Hi'}])\n"
        "t.decode(ids, skip_special_tokens=True), t.get_vocab(), t.eos_token_id\n"
        "print(any(m.split('.')[0] == 'transformers' for m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "False"
