"""The prompt-length check decides exactly as counting tokens would, without counting
where a bound settles it: checked against a tiny tokenizer and the default model's."""

from __future__ import annotations

import random

import pytest
from tokenizers import normalizers
from transformers import AutoTokenizer

from eagle2_core.registry import encode_chat, resolve_model
from producer.prompt_length import TemplateBytes, prompt_token_counter
from tests.eagle2_core.tiny import tiny_target
from tests.producer.test_jobs import CHAT_TEMPLATE
from workers.request import Request

WORDS = ["t5", "t17", "unknown-word", "ü", "ünï", '"quoted"', "a\\b", "<b>x</b>", "&amp;", "✓"]


def request(messages: list[dict[str, str]]) -> Request:
    return Request(sample_id="x", line_no=1, messages=messages)


def conversations(rng: random.Random, n: int) -> list[list[dict[str, str]]]:
    """Random role sequences (system or not, several turns) of random contents."""
    out = []
    for _ in range(n):
        text = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 40)))  # noqa: E731
        messages = [{"role": "system", "content": text()}] if rng.random() < 0.4 else []
        for _ in range(rng.randrange(0, 3)):
            messages += [{"role": "user", "content": text()}]
            messages += [{"role": "assistant", "content": rng.choice(["", text()])}]
        out.append([*messages, {"role": "user", "content": text()}])
    return out


@pytest.fixture(scope="module")
def smollm_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"), local_files_only=True)


@pytest.fixture
def tiny_tokenizer():
    tokenizer = tiny_target().tokenizer
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def rendered(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(text.encode("utf-8"))


def test_template_bytes_equal_the_rendered_bytes(smollm_tokenizer, tiny_tokenizer):
    rng = random.Random(5)
    for tokenizer in (smollm_tokenizer, tiny_tokenizer):
        template = TemplateBytes(tokenizer)
        for messages in conversations(rng, 150):
            assert template.rendered_bytes(messages) == rendered(tokenizer, messages)


def test_a_template_that_escapes_contents_is_rendered(tiny_tokenizer):
    tiny_tokenizer.chat_template = "{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
    template = TemplateBytes(tiny_tokenizer)
    assert template.fixed_bytes(("user",)) is None  # the probes expand: no shortcut
    messages = [{"role": "user", "content": 'say "ü"\n'}]
    assert template.rendered_bytes(messages) == rendered(tiny_tokenizer, messages)


@pytest.mark.parametrize("which", ["smollm", "tiny"])
def test_prompt_counter_decides_exactly_like_the_tokenizer(which, smollm_tokenizer, tiny_tokenizer):
    """A bound only ever replaces a count when both are under the context."""
    tokenizer = smollm_tokenizer if which == "smollm" else tiny_tokenizer
    rng = random.Random(3)
    cases = conversations(rng, 120)
    exact = [len(encode_chat(tokenizer, m)) for m in cases]
    for max_context in sorted({8, 40, 128, *rng.sample(exact, 5)}):
        counts = prompt_token_counter(tokenizer, max_context)([request(m) for m in cases])
        for got, want in zip(counts, exact, strict=True):
            assert (got >= max_context) == (want >= max_context)
            assert got >= want
            if got >= max_context:  # tokenized, in one batch: the very count
                assert got == want


def test_prompt_counter_is_exact_for_tokenizers_with_a_normalizer(tiny_tokenizer):
    tiny_tokenizer.backend_tokenizer.normalizer = normalizers.NFKC()
    count = prompt_token_counter(tiny_tokenizer, 10_000)
    messages = [{"role": "user", "content": "t5 t6 t7"}]
    assert count([request(messages)]) == [len(encode_chat(tiny_tokenizer, messages))] == [6]
