"""Stop strings end the output exactly where plain decoding with the same stop would, in
every mode, even when the string spans tokens or a speculative round accepts past it."""

from __future__ import annotations

import pytest

from eagle2_core.config import DecodeConfig
from eagle2_core.engine import Engine
from eagle2_core.sequence import stop_window
from tests.eagle2_core.tiny import OracleDrafter, hf_greedy, prompts, tiny_head, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(eos=None)


def plain_stop(target, tokens: list[int], stop: str) -> tuple[list[int], str]:
    """The rule on generate's own output: stop at the first token whose text holds `stop`."""
    for k in range(1, len(tokens) + 1):
        text = target.tokenizer.decode(tokens[:k], skip_special_tokens=True)
        if stop in text:
            return tokens[:k], text[: text.index(stop)]
    raise AssertionError(f"{stop!r} never appears")


def spanning_stop(target, tokens: list[int], at: int) -> str:
    """A stop string across the boundary of tokens at and at+1 (last char, space, first)."""
    left = target.tokenizer.decode(tokens[: at + 1])
    return left[-1] + " " + target.tokenizer.decode([tokens[at + 1]])[:2]


@pytest.mark.parametrize("mode", ["vanilla", "eagle1", "eagle2"])
def test_a_stop_string_spanning_tokens_cuts_as_plain_decoding_does(target, mode) -> None:
    engine = Engine(target, tiny_head(target))
    prompt = prompts(96, lengths=(7,))[0]
    full = hf_greedy(target, prompt, 40)
    stop = spanning_stop(target, full, 20)
    want_tokens, want_text = plain_stop(target, full, stop)
    got = engine.generate(prompt, DecodeConfig(mode=mode, max_new_tokens=40, stop=(stop,)))
    assert (got.token_ids, got.text, got.finish_reason) == (want_tokens, want_text, "stop")
    assert stop not in got.text and len(got.token_ids) < 40


def test_a_stop_inside_a_long_accepted_round_still_cuts_at_its_token(target) -> None:
    engine = Engine(target)
    prompt = prompts(96, lengths=(9,))[0]
    full = hf_greedy(target, prompt, 40)
    stop = spanning_stop(target, full, 13)
    want_tokens, want_text = plain_stop(target, full, stop)
    config = DecodeConfig(max_new_tokens=40, total_tokens=16, stop=("never-there", stop))
    got = engine.generate(prompt, config, drafter=OracleDrafter(prompt, full, 96))
    assert (got.token_ids, got.text, got.finish_reason) == (want_tokens, want_text, "stop")
    assert got.stats.tau > 3  # rounds accepted several tokens: the stop fell inside one


def test_the_first_of_several_stop_strings_wins_and_batches_keep_their_own(target) -> None:
    engine = Engine(target, tiny_head(target))
    a, b = prompts(96, lengths=(6, 8))
    full_a, full_b = hf_greedy(target, a, 30), hf_greedy(target, b, 30)
    early, late = spanning_stop(target, full_a, 5), spanning_stop(target, full_a, 15)
    items = [
        ("a", a, DecodeConfig(max_new_tokens=30, total_tokens=8, stop=(late, early))),
        ("b", b, DecodeConfig(max_new_tokens=30, total_tokens=8)),
    ]
    got = dict(engine.generate_batch(items, batch_size=2))
    assert got["a"].token_ids == plain_stop(target, full_a, early)[0]
    assert got["b"].token_ids == full_b and got["b"].finish_reason == "length"


@pytest.mark.parametrize("bad", [("",), ["x"], (3,)])
def test_bad_stop_values_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="stop must be"):
        DecodeConfig(stop=bad)


def test_the_stop_check_decodes_a_tail_and_still_cuts_late(target, monkeypatch) -> None:
    engine = Engine(target)
    prompt = prompts(96, lengths=(5,))[0]
    full = hf_greedy(target, prompt, 300)
    for at in range(150, 298):  # a stop whose first occurrence is far beyond the window
        stop = spanning_stop(target, full, at)
        want_tokens, want_text = plain_stop(target, full, stop)
        if len(want_tokens) > 150:
            break
    assert len(want_tokens) > 150
    lengths: list[int] = []
    decode = target.tokenizer.decode

    def counting(ids, **kwargs):
        lengths.append(len(ids))
        return decode(ids, **kwargs)

    monkeypatch.setattr(target.tokenizer, "decode", counting)
    got = engine.generate(prompt, DecodeConfig(mode="vanilla", max_new_tokens=300, stop=(stop,)))
    assert (got.token_ids, got.text, got.finish_reason) == (want_tokens, want_text, "stop")
    checks = lengths[:-1]  # the last decode is the finished text, once
    assert len(checks) == len(want_tokens) and max(checks) == stop_window((stop,))
