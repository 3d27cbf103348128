"""The prompt-length check decides exactly as counting tokens would, without counting
where a bound settles it, and tokenizes in batches of bounded bytes: checked against a
tiny tokenizer and the default model's."""

from __future__ import annotations

import random

import pytest
from tokenizers import normalizers
from transformers import AutoTokenizer

from eagle2_core.registry import encode_chat, encode_chats, resolve_model
from producer import prompt_length
from producer.prompt_length import (
    TemplateBytes,
    TokensAtLeast,
    longest_token_bytes,
    prompt_token_counter,
)
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


class SpyEncode:
    """Calls the real encode_chats and records the text bytes of each call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, tokenizer, conversations):
        self.calls.append([sum(len(m["content"].encode()) for m in c) for c in conversations])
        return encode_chats(tokenizer, conversations)


def long_conversations(rng: random.Random, n: int) -> list[list[dict[str, str]]]:
    """Prompts of a few bytes to ~60 KB, so some are refused by bytes alone."""
    words = [*WORDS, " " * 40, "-" * 30]
    return [
        [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(k))}]
        for k in (int(rng.paretovariate(0.6)) for _ in range(n))
    ]


def test_exact_counts_go_in_batches_of_bounded_bytes(smollm_tokenizer, monkeypatch):
    spy = SpyEncode()
    monkeypatch.setattr(prompt_length, "encode_chats", spy)
    monkeypatch.setattr(prompt_length, "EXACT_BATCH_BYTES", 2000)
    cases = long_conversations(random.Random(1), 200)
    exact = [len(encode_chat(smollm_tokenizer, m)) for m in cases]
    counts = prompt_token_counter(smollm_tokenizer, 4)([request(m) for m in cases])
    for got, want in zip(counts, exact, strict=True):
        assert got == want or (isinstance(got, TokensAtLeast) and want >= got >= 4)
    assert len(spy.calls) >= 3
    for call in spy.calls:  # one prompt alone may be larger; never two beyond the bound
        assert len(call) == 1 or sum(call) <= 2000


@pytest.mark.parametrize("max_context", [16, 256, 8192])
def test_what_cannot_fit_is_refused_before_tokenizing(smollm_tokenizer, monkeypatch, max_context):
    spy = SpyEncode()
    monkeypatch.setattr(prompt_length, "encode_chats", spy)
    longest = longest_token_bytes(smollm_tokenizer)
    cases = long_conversations(random.Random(max_context), 150)
    cases.append([{"role": "user", "content": "t5 " * (max_context * longest // 3 + 1)}])
    counts = prompt_token_counter(smollm_tokenizer, max_context)([request(m) for m in cases])
    tokenized = sum(len(call) for call in spy.calls)
    early = [i for i, n in enumerate(counts) if isinstance(n, TokensAtLeast)]
    assert len(cases) - 1 in early and tokenized + len(early) <= len(cases)
    for i, messages in enumerate(cases):
        want = len(encode_chat(smollm_tokenizer, messages))
        assert (counts[i] >= max_context) == (want >= max_context)  # the same decision
        if i in early:
            assert want >= counts[i] >= max_context  # a true lower bound


def test_only_a_bpe_without_unknown_token_bounds_a_tokens_bytes(smollm_tokenizer, tiny_tokenizer):
    longest = longest_token_bytes(smollm_tokenizer)
    vocab = smollm_tokenizer.backend_tokenizer.get_vocab()
    assert longest == max(len(token.encode()) for token in vocab)
    assert longest_token_bytes(tiny_tokenizer) is None  # word-level: an unknown word is one


def test_the_vocabulary_is_read_once_and_only_for_a_prompt_near_the_context(
    smollm_tokenizer, monkeypatch
):
    """Reading every token's bytes costs ~40 ms: a job whose prompts are all short never
    pays it, and one with many long prompts pays it once."""
    reads = []
    real = prompt_length.longest_token_bytes
    monkeypatch.setattr(
        prompt_length, "longest_token_bytes", lambda tok: reads.append(1) or real(tok)
    )
    counts = prompt_token_counter(smollm_tokenizer, 256)
    short = [request([{"role": "user", "content": "Name a colour."}])] * 3
    assert all(n < 256 for n in counts(short)) and reads == []
    long = [request([{"role": "user", "content": "t5 " * 15000}])] * 3  # 45 KB: > 256 x 162
    assert all(isinstance(n, TokensAtLeast) for n in counts(long)) and reads == [1]
