"""Draft-head training on tiny random targets: split rule, feature alignment, the EAGLE
objective, a short training run, checkpoints that resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from eagle2_core.bench import run_bench
from eagle2_core.config import DecodeConfig
from eagle2_core.draft import load_draft, new_draft_head, save_draft
from eagle2_core.engine import Engine
from eagle2_core.models import Target
from eagle2_core.registry import encode_chat
from eagle2_core.train import data as data_module
from eagle2_core.train.data import (
    Conversation,
    conversation_features,
    conversation_from_messages,
    is_validation,
    length_batches,
    load_shards,
    make_conversation,
    write_feature_shards,
)
from eagle2_core.train.loop import TrainConfig, collate, evaluate, train
from eagle2_core.train.loss import Batch, batch_loss, eagle_loss
from tests.eagle2_core.tiny import tiny_target


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny_target(seed=3)


def _answered(target: Target, n: int, seed: int = 0, max_new_tokens: int = 12) -> list:
    """n conversations: random word prompts answered greedily by the target itself."""
    engine = Engine(target)
    generator = torch.Generator().manual_seed(seed)
    conversations = []
    for i in range(n):
        words = torch.randint(2, 96, (int(torch.randint(3, 9, (1,), generator=generator)),))
        messages = [{"role": "user", "content": " ".join(f"t{w}" for w in words.tolist())}]
        gen = engine.generate(
            encode_chat(target.tokenizer, messages),
            DecodeConfig(mode="vanilla", max_new_tokens=max_new_tokens),
        )
        conversation = make_conversation(
            target.tokenizer, f"c{i}", messages, gen.text, gen.finish_reason == "stop", 256
        )
        if conversation is not None:
            conversations.append(conversation)
    return conversations


@pytest.mark.parametrize(
    ("sample_id", "held_out"),
    [
        ("alpaca-00056", True),
        ("alpaca-00085", True),
        ("alpaca-00122", True),
        ("alpaca-00000", False),
        ("alpaca-00001", False),
        ("dolly-00042", False),
    ],
)
def test_validation_split_rule(sample_id: str, held_out: bool) -> None:
    assert is_validation(sample_id) is held_out


def test_make_conversation_appends_end_of_turn_and_truncates(target: Target) -> None:
    messages = [{"role": "user", "content": "t5 t6"}]
    prompt = encode_chat(target.tokenizer, messages)
    stopped = make_conversation(target.tokenizer, "a", messages, "t7 t8", True, 100)
    assert stopped.ids == (*prompt, 7, 8, 1)  # t1 is the tiny tokenizer's EOS
    assert stopped.answer_ids == (7, 8, 1)
    cut = make_conversation(target.tokenizer, "a", messages, "t7 t8", False, len(prompt) + 1)
    assert cut.answer_ids == (7,)
    assert make_conversation(target.tokenizer, "a", messages, "t7", False, len(prompt)) is None


TURNS_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}t3 {{ m['content'] }} t1 "
    "{% else %}t2 {{ m['content'] }} t1 {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}t2{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "t5 t6"},
    {"role": "assistant", "content": "t7 t8"},
    {"role": "user", "content": "t9"},
    {"role": "assistant", "content": "t20"},  # not t1x: "t1" is EOS, matched inside words
]


def test_a_conversation_trains_on_every_answer_turn(target: Target) -> None:
    tokenizer = target.tokenizer
    tokenizer.chat_template = TURNS_TEMPLATE  # turns render as prefixes of later ones
    try:
        c = conversation_from_messages(tokenizer, "m", CONVERSATION, 100)
        assert c.ids == (3, 5, 6, 1, 2, 7, 8, 1, 3, 9, 1, 2, 20, 1)
        assert c.answer_ids == (7, 8, 1, 20, 1)  # each answer closed by end-of-turn t1
        assert c.answer_mask[:5] == (False,) * 5
        cut = conversation_from_messages(tokenizer, "m", CONVERSATION, 7)
        assert cut.ids == (3, 5, 6, 1, 2, 7, 8) and cut.answer_ids == (7, 8)
        assert conversation_from_messages(tokenizer, "m", CONVERSATION[:1], 100) is None
    finally:
        tokenizer.chat_template = None


def test_an_answer_cut_at_a_length_cap_stays_open(target: Target) -> None:
    tokenizer = target.tokenizer
    tokenizer.chat_template = TURNS_TEMPLATE
    try:
        c = conversation_from_messages(tokenizer, "m", CONVERSATION, 100, closed=False)
        # the earlier answer ended its turn; the last was cut: no end-of-turn after it
        assert c.answer_ids == (7, 8, 1, 20)
    finally:
        tokenizer.chat_template = None


def test_a_template_that_rewrites_history_restarts_at_the_turn(target: Target) -> None:
    # The plain fallback renders a turn without its end-of-turn token: not a prefix.
    c = conversation_from_messages(target.tokenizer, "m", CONVERSATION, 100)
    assert c.answer_ids == (20, 1)  # the first answer is context only
    assert list(c.ids[:-2]) == encode_chat(target.tokenizer, CONVERSATION[:3])


def test_features_align_with_tokens_and_mask_covers_the_answer(target: Target) -> None:
    conversation = Conversation.of("x", (4, 9, 12, 30), (40, 41, 42))
    (seq,) = conversation_features(target, [conversation])
    assert seq.input_ids.tolist() == [4, 9, 12, 30, 40, 41, 42]
    assert seq.features.shape == (7, target.hidden_size)
    assert seq.features.dtype == torch.bfloat16
    assert seq.loss_mask.tolist() == [False] * 4 + [True] * 3
    # Feature t is the final-norm state at token t: lm_head of it gives the target's logits.
    with torch.no_grad():
        logits = target.model(torch.tensor([list(conversation.ids)])).logits[0]
        from_features = target.lm_head(seq.features.float())
    assert torch.allclose(from_features, logits, atol=0.05 * logits.abs().max().item())
    assert (from_features.argmax(-1) == logits.argmax(-1)).float().mean() > 0.8


def test_batched_features_equal_one_conversation_at_a_time(target: Target) -> None:
    conversations = _answered(target, 6, seed=4)
    assert len({len(c.ids) for c in conversations}) > 1  # padding is exercised
    batched = conversation_features(target, conversations)
    for conversation, sequence in zip(conversations, batched, strict=True):
        (alone,) = conversation_features(target, [conversation])
        assert torch.equal(sequence.input_ids, alone.input_ids)
        assert torch.equal(sequence.loss_mask, alone.loss_mask)
        # bf16 storage: the batched matmuls may round a value to the neighbouring bf16.
        assert torch.allclose(sequence.features.float(), alone.features.float(), atol=0.05)


@pytest.mark.parametrize(
    ("lengths", "max_tokens", "expected"),
    [
        ([5, 3, 9, 4], 12, [[1, 3], [0], [2]]),
        ([5, 3, 9, 4], 100, [[1, 3, 0, 2]]),
        ([50, 3], 10, [[1], [0]]),  # longer than the budget: a group of its own
        ([], 10, []),
    ],
)
def test_length_batches_group_similar_lengths_within_the_budget(
    lengths: list[int], max_tokens: int, expected: list[list[int]]
) -> None:
    assert length_batches(lengths, max_tokens) == expected


def test_feature_shards_roundtrip_and_resume(
    target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conversations = _answered(target, 5)
    paths = write_feature_shards(target, conversations, tmp_path, shard_size=2, progress=False)
    assert [p.name for p in paths] == [f"shard-0000{i}.safetensors" for i in range(3)]
    loaded = load_shards(paths)
    assert [s.input_ids.tolist() for s in loaded] == [list(c.ids) for c in conversations]
    assert [int(s.loss_mask.sum()) for s in loaded] == [len(c.answer_ids) for c in conversations]
    (direct,) = conversation_features(target, [conversations[3]])
    assert torch.allclose(loaded[3].features.float(), direct.features.float(), atol=0.05)

    # A second run redoes only the shard whose conversations changed.
    calls = []
    real = data_module.conversation_features
    monkeypatch.setattr(
        data_module,
        "conversation_features",
        lambda t, cs, *layers: calls.extend(c.id for c in cs) or real(t, cs, *layers),
    )
    changed = [*conversations[:4], Conversation.of("new", (5, 6), (7,))]
    write_feature_shards(target, changed, tmp_path, shard_size=2, progress=False)
    assert calls == ["new"]  # shards 0 and 1 are unchanged
    # Shards holding an EAGLE-3 head's layer states serve an EAGLE-2 head as well, and
    # are read lazily: only what an item asks for.
    calls.clear()
    layered = write_feature_shards(
        target, changed, tmp_path, shard_size=2, progress=False, layers=(0, 1)
    )
    assert sorted(calls) == sorted(c.id for c in changed)  # old shards hold no layer states
    write_feature_shards(target, changed, tmp_path, shard_size=2, progress=False)
    assert len(calls) == len(changed)  # nothing redone for the EAGLE-2 head
    with_layers = load_shards(layered, with_layers=True)
    assert with_layers[4].layer_states.shape == (3, 2 * target.hidden_size)
    assert load_shards(layered)[4].layer_states is None
    plain = write_feature_shards(target, changed[:1], tmp_path / "plain", progress=False)
    with pytest.raises(ValueError, match="no layer states"):
        load_shards(plain, with_layers=True)
    # Fewer conversations than before: the surplus shard is removed.
    write_feature_shards(target, changed[:2], tmp_path, shard_size=2, progress=False)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["shard-00000.safetensors"]


def test_exact_prediction_gives_zero_regression_and_ce_equal_to_target_entropy() -> None:
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 50, bias=False)
    target = torch.randn(2, 7, 16)
    mask = torch.rand(2, 7) > 0.3
    exact = eagle_loss(target.clone(), target, lm_head, mask)
    p = torch.softmax(lm_head(target[mask]), -1)
    entropy = -(p * p.log()).sum(-1).mean()
    assert exact.regression.item() == pytest.approx(0.0, abs=1e-7)
    assert exact.ce.item() == pytest.approx(entropy.item(), rel=1e-5)
    assert exact.top1.item() == 1.0
    assert exact.positions == int(mask.sum())
    assert exact.loss.item() == pytest.approx(0.1 * entropy.item(), rel=1e-5)
    off = eagle_loss(target + 0.3 * torch.randn_like(target), target, lm_head, mask)
    assert off.regression > exact.regression and off.ce > exact.ce


class _Oracle(torch.nn.Module):
    """A 'head' that returns the true next features (looked up, not computed)."""

    def __init__(self, features: torch.Tensor):
        super().__init__()
        self.next_features = features[:, 1:]

    def forward(self, embeds, features, positions, cache, mask):
        assert embeds.shape == features.shape == self.next_features.shape
        return self.next_features, None


def test_batch_loss_pairs_position_t_with_the_next_feature(target: Target) -> None:
    seqs = conversation_features(target, _answered(target, 3))
    batch: Batch = collate(seqs)
    parts = batch_loss(
        _Oracle(batch.features.float()), target.embed, target.lm_head, batch, noise_width=0.0
    )
    assert parts.regression.item() == pytest.approx(0.0, abs=1e-7)
    assert parts.top1.item() == 1.0
    # Scored: every answer token x_{t+1}, i.e. the answer length of each conversation.
    assert parts.positions == sum(int(s.loss_mask.sum()) for s in seqs)
    with torch.no_grad():
        p = torch.softmax(target.lm_head(batch.features.float()[:, 1:][batch.loss_mask[:, 1:]]), -1)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).mean()
    assert parts.ce.item() == pytest.approx(entropy.item(), rel=1e-4)


def test_short_training_reduces_loss_and_writes_a_loadable_head(
    target: Target, tmp_path: Path
) -> None:
    conversations = _answered(target, 16)
    data = load_shards(write_feature_shards(target, conversations, tmp_path / "f", progress=False))
    head = new_draft_head(target.model.config, seed=0)
    config = TrainConfig(epochs=5, batch_size=4, lr=3e-3, warmup_steps=3, checkpoint_every=8)
    before = evaluate(head, target, data, config)
    result = train(
        head, target, data, config, tmp_path / "ck", validation_data=data[:4], progress=False
    )
    after = evaluate(head, target, data, config)
    assert result.steps == 20
    assert result.tokens_seen == 5 * sum(int(s.loss_mask.sum()) for s in data)
    assert after.loss < 0.8 * before.loss
    assert after.top1 > before.top1
    assert result.validation is not None and result.validation.positions > 0
    assert [h["step"] for h in result.history] == [8, 16, 20]
    assert (tmp_path / "ck" / "checkpoint.pt").exists()

    out = save_draft(head, tmp_path / "head", card="# test head\n")
    loaded = load_draft(out, target.model.config)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, head.state_dict()[key].to(torch.bfloat16)), key
    questions = [([{"role": "user", "content": "t5 t9 t30"}], [])]
    tau = run_bench(Engine(target, loaded), questions, ["eagle2"], DecodeConfig(max_new_tokens=6))[
        "eagle2"
    ].tau
    assert tau is not None and tau >= 1.0


class _Interrupted(list):
    """Training data that fails after `limit` conversations were read (a crash mid-epoch)."""

    def __init__(self, items, limit: int):
        super().__init__(items)
        self.limit = limit

    def __getitem__(self, index):
        self.limit -= 1
        if self.limit < 0:
            raise KeyboardInterrupt
        return super().__getitem__(index)


def test_resume_continues_the_step_count_and_matches_an_unbroken_run(
    target: Target, tmp_path: Path
) -> None:
    data = load_shards(
        write_feature_shards(target, _answered(target, 12), tmp_path / "f", progress=False)
    )
    # No input noise: an unbroken and a resumed run must then end with equal weights.
    config = TrainConfig(
        epochs=2, batch_size=4, lr=1e-3, warmup_steps=2, checkpoint_every=2, noise_width=0.0
    )
    unbroken = new_draft_head(target.model.config, seed=0)
    full = train(unbroken, target, data, config, tmp_path / "a", progress=False)
    assert full.steps == 6

    head = new_draft_head(target.model.config, seed=0)
    with pytest.raises(KeyboardInterrupt):  # dies while reading batch 5 (step 4 saved)
        train(head, target, _Interrupted(data, 4 * 4 + 1), config, tmp_path / "b", progress=False)
    saved = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 4

    resumed_head = new_draft_head(target.model.config, seed=0)
    resumed = train(resumed_head, target, data, config, tmp_path / "b", resume=True, progress=False)
    assert resumed.steps == 6
    assert resumed.tokens_seen == full.tokens_seen
    assert [h["step"] for h in resumed.history] == [2, 4, 6]
    for key, value in resumed_head.state_dict().items():
        assert torch.allclose(value, unbroken.state_dict()[key], atol=1e-6), key

    # Without --resume the checkpoint is ignored and training starts over.
    fresh = train(
        new_draft_head(target.model.config, seed=0),
        target,
        data,
        config,
        tmp_path / "b",
        progress=False,
    )
    assert fresh.steps == 6 and not math.isnan(fresh.train.loss)


def test_epoch_batches_group_similar_lengths_and_cover_every_conversation_once() -> None:
    from eagle2_core.train.loop import BUCKET_BATCHES, epoch_batches

    lengths = [int(x) for x in torch.randint(5, 1000, (8 * BUCKET_BATCHES * 3 + 5,))]
    batches = epoch_batches(lengths, 8, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert len(batches) == math.ceil(len(lengths) / 8)
    assert batches == epoch_batches(lengths, 8, seed=1, epoch=0)  # resumable
    assert batches != epoch_batches(lengths, 8, seed=1, epoch=1)  # a new order each epoch
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded < 1.2 * sum(lengths)  # random batches of 8 pad to ~1.8x here
