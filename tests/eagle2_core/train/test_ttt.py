"""EAGLE-3 training: the unrolled steps are what drafting computes, and training works."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle2_core.config import DecodeConfig
from eagle2_core.eagle3 import Eagle3Head, LeanEagle3, new_eagle3_head, save_eagle3
from eagle2_core.engine import Engine, load_head
from eagle2_core.models import Target, layer_hidden_states
from eagle2_core.train.data import load_shards, write_feature_shards
from eagle2_core.train.loop import TrainConfig, evaluate, loss_head, train
from eagle2_core.train.loss import Batch
from eagle2_core.train.ttt import ttt_loss, unroll
from eagle2_core.vocab import DraftVocab
from tests.eagle2_core.tiny import hf_greedy, prompts, tiny_target
from tests.eagle2_core.train.test_train import _answered


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target(seed=3, layers=6)


def _head(target: Target) -> Eagle3Head:
    head = new_eagle3_head(target, DraftVocab(torch.arange(0, 96, 2)), seed=0)
    for p in head.parameters():  # weights large enough that the steps differ visibly
        p.data.normal_(0, 0.2)
    return head.eval()


@torch.inference_mode()
def _drafted(lean: LeanEagle3, ids: torch.Tensor, states: torch.Tensor, base: int, steps: int):
    """What drafting computes: the committed pairs 0..base on the target's states, then
    each deeper step on the previous output, one token further (a chain in a tree)."""
    keys, values = lean.kv().add_row(base + steps)
    n = base + 1
    out = lean.step(
        ids[:, 1 : n + 1], lean.lift(states[:, :n]), torch.arange(n)[None], keys, values, 0, None
    )
    outs, hidden = [out[:, -1]], out[:, -1:]
    for j in range(1, steps):
        visible = torch.ones(1, 1, 1, n + j, dtype=torch.bool)
        hidden = lean.step(
            ids[:, n + j : n + j + 1],
            hidden,
            torch.tensor([[base + j]]),
            keys,
            values,
            n + j - 1,
            visible,
        )
        outs.append(hidden[:, -1])
    return outs


@torch.inference_mode()
def test_every_unrolled_step_is_what_a_draft_of_that_depth_computes(target: Target) -> None:
    head = _head(target)
    lean = LeanEagle3.of(head, target)
    ids = torch.tensor([prompts(96, lengths=(12,))[0]])
    _, states = layer_hidden_states(target, ids, head.layers_used)
    outs = unroll(head, target.embed, ids, states, steps=4)
    assert [o.shape[1] for o in outs] == [11, 10, 9, 8]
    for base in (0, 3, 7):
        for j, want in enumerate(_drafted(lean, ids, states, base, 4)):
            torch.testing.assert_close(outs[j][:, base], want, rtol=1e-4, atol=1e-4)
    # a deeper step reads the head's own output, not the target's: it differs
    assert not torch.allclose(outs[1][:, 3], outs[0][:, 4], atol=1e-3)


def test_the_loss_scores_each_step_against_the_target_further_along(target: Target) -> None:
    head = _head(target)
    ids = torch.tensor([prompts(96, lengths=(10,))[0]])
    final, states = layer_hidden_states(target, ids, head.layers_used)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 4:] = True
    target_logits = loss_head(target, head.vocab.ids)
    parts = ttt_loss(head, target.embed, target_logits, Batch(ids, final, mask, states), steps=2)
    outs = unroll(head, target.embed, ids, states, steps=2)
    want = []
    for j in range(2):  # pairs whose input token (x_{t+j+1}) is an answer token
        n = outs[j].shape[1]
        scored = mask[:, 1 + j : 1 + j + n]
        p = torch.softmax(target_logits(final[:, 1 + j : 1 + j + n][scored]), -1)
        logq = torch.log_softmax(head.logits(outs[j][scored]), -1)
        want.append(-(p * logq).sum(-1).mean())
    torch.testing.assert_close(parts.loss, (want[0] + 0.8 * want[1]) / 1.8)
    assert parts.positions == 6 and len(parts.top1_by_step) == 2  # inputs x_4..x_9


def test_training_an_eagle3_head_lowers_its_loss_and_it_drafts_exactly(
    target: Target, tmp_path: Path
) -> None:
    conversations = _answered(target, 16)
    head = new_eagle3_head(target, DraftVocab(torch.arange(96)), seed=0)
    shards = write_feature_shards(
        target, conversations, tmp_path / "f", progress=False, layers=head.layers_used
    )
    data = load_shards(shards, with_layers=True)
    assert data[0].layer_states.shape[-1] == 3 * target.hidden_size
    config = TrainConfig(epochs=6, batch_size=4, lr=3e-3, warmup_steps=3, ttt_steps=3)
    ids = head.vocab.ids
    before = evaluate(head, target, data, config, ids)
    result = train(head, target, data, config, tmp_path / "ck", progress=False, vocab_ids=ids)
    after = evaluate(head, target, data, config, ids)
    assert result.steps == 24
    assert after.loss < 0.8 * before.loss
    assert after.top1 > before.top1 and len(after.top1_by_step) == 3

    loaded, vocab = load_head(target, save_eagle3(head, tmp_path / "head"))
    assert isinstance(loaded, Eagle3Head) and vocab is None
    assert loaded.layers_used == head.layers_used
    engine = Engine(target, loaded)
    for prompt in prompts(96, lengths=(5, 9)):
        got = engine.generate(prompt, DecodeConfig(max_new_tokens=16, total_tokens=8))
        assert got.token_ids == hf_greedy(target, prompt, 16)
