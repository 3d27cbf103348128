"""The draft vocabulary: chosen by frequency, stored in EAGLE-3's format, lossless."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from eagle2_core.config import DecodeConfig
from eagle2_core.engine import Engine
from eagle2_core.vocab import VOCAB_FILE, DraftVocab, count_tokens
from tests.eagle2_core.tiny import hf_greedy, prompts, tiny_head, tiny_target


def test_most_frequent_ids_ascending_ties_to_the_smaller_id():
    counts = Counter({5: 10, 2: 7, 9: 7, 1: 3, 50: 99})
    vocab = DraftVocab.most_frequent(counts, size=3, vocab_size=20)  # 50 is out of range
    assert vocab.ids.tolist() == [2, 5, 9]
    assert DraftVocab.most_frequent(counts, size=2, vocab_size=20).ids.tolist() == [2, 5]
    assert vocab.coverage(counts) == pytest.approx(24 / 126)


def test_saved_in_eagle3_format_and_loaded_back(tmp_path):
    vocab = DraftVocab(torch.tensor([0, 3, 4, 10]))
    path = vocab.save(tmp_path, vocab_size=12)
    assert path.name == VOCAB_FILE
    from safetensors.torch import load_file

    stored = load_file(str(path))
    assert stored["d2t"].tolist() == [0, 2, 2, 7]  # target id = draft id + d2t[draft id]
    assert stored["t2d"].nonzero().flatten().tolist() == [0, 3, 4, 10]
    assert DraftVocab.load(tmp_path).ids.tolist() == [0, 3, 4, 10]
    assert DraftVocab.load(tmp_path / "elsewhere") is None


def test_inconsistent_mappings_are_refused():
    t2d = torch.zeros(12, dtype=torch.bool)
    t2d[[0, 1]] = True
    with pytest.raises(ValueError, match="different draft vocabularies"):
        DraftVocab.from_mapping(torch.tensor([0, 2]), t2d)


def test_count_tokens():
    assert count_tokens([[1, 2, 2], [2]]) == Counter({2: 3, 1: 1})


@pytest.mark.parametrize("mode", ["eagle1", "eagle2"])
def test_a_small_draft_vocabulary_stays_lossless(mode):
    """Half of the tokens can never be drafted: the target still emits them."""
    target = tiny_target(eos=None)
    vocab = DraftVocab(torch.arange(0, 96, 2))
    engine = Engine(target, tiny_head(target), vocab)
    emitted_odd = False
    for prompt in prompts(96):
        expected = hf_greedy(target, prompt, 32)
        got = engine.generate(prompt, DecodeConfig(mode=mode, max_new_tokens=32))
        assert got.token_ids == expected
        emitted_odd |= any(t % 2 for t in expected)
    assert emitted_odd, "the outputs never needed a token outside the vocabulary"
