"""Public EAGLE-3 checkpoints load and draft losslessly; the prepared head is the module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle2_core.config import DecodeConfig
from eagle2_core.draft import DraftCheckpointError, draft_config_for
from eagle2_core.eagle3 import ARCHITECTURE, Eagle3Head, LeanEagle3, reference_layers, save_eagle3
from eagle2_core.engine import Engine, load_head
from eagle2_core.kv import BatchKV
from eagle2_core.llama import forward
from eagle2_core.plan import BEST_ACCEPT, accept_ceiling
from eagle2_core.vocab import DraftVocab
from tests.eagle2_core.tiny import hf_greedy, prompts, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(eos=None, layers=8)


def write_checkpoint(target, directory: Path, fmt: str = "safetensors", **config_extra) -> Path:
    """A random EAGLE-3 head in the published layout: config.json and the tensors."""
    torch.manual_seed(0)
    config = draft_config_for(target.model.config)
    vocab = DraftVocab(torch.arange(0, 96, 3))  # every third token
    named = config_extra.get("eagle_aux_hidden_state_layer_ids")  # layer outputs
    layers = [i + 1 for i in named] if named else reference_layers(8)
    head = Eagle3Head(config, vocab, tuple(layers))
    for p in head.parameters():
        p.data.normal_(0, 0.3)
    directory.mkdir(parents=True)
    raw = {**config.to_dict(), "architectures": [ARCHITECTURE], "draft_vocab_size": len(vocab)}
    raw.update(config_extra)
    (directory / "config.json").write_text(json.dumps(raw))
    state = {k: v.contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary")}
    if fmt == "safetensors":
        save_file(state, str(directory / "model.safetensors"))
    else:
        torch.save(state, directory / "pytorch_model.bin")
    return directory


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("mode", ["eagle2", "eagle1"])
def test_an_eagle3_checkpoint_drafts_and_greedy_output_is_generate(target, tmp_path, fmt, mode):
    source = write_checkpoint(target, tmp_path / "head", fmt)
    head, vocab = load_head(target, source)
    assert isinstance(head, Eagle3Head) and vocab is None
    assert head.layers_used == (2, 4, 5) and len(head.vocab) == 32
    engine = Engine(target, head)
    assert engine.lean_head.feature_layers == (2, 4, 5)
    accepted = 0
    for prompt in prompts(96):
        got = engine.generate(prompt, DecodeConfig(mode=mode, max_new_tokens=32, total_tokens=8))
        assert got.token_ids == hf_greedy(target, prompt, 32)
        accepted += sum(got.stats.accept_hist[1:])
    items = [(i, p, DecodeConfig(max_new_tokens=20)) for i, p in enumerate(prompts(96))]
    for i, generation in engine.generate_batch(items, batch_size=3):
        assert generation.token_ids == hf_greedy(target, prompts(96)[i], 20)


def test_the_held_out_agreement_round_trips_and_bounds_drafting(target, tmp_path):
    source = write_checkpoint(target, tmp_path / "head")
    head, _ = load_head(target, source)
    assert head.held_out_top1 is None and Engine(target, head).accept_ceiling == BEST_ACCEPT
    head.held_out_top1 = 0.3
    save_eagle3(head, tmp_path / "saved")
    loaded, _ = load_head(target, tmp_path / "saved")
    assert loaded.held_out_top1 == 0.3
    assert Engine(target, loaded).accept_ceiling == pytest.approx(accept_ceiling(0.3))


def test_the_config_names_the_feature_layers(target, tmp_path):
    source = write_checkpoint(target, tmp_path / "h", eagle_aux_hidden_state_layer_ids=[1, 3, 6])
    head, _ = load_head(target, source)
    assert head.layers_used == (2, 4, 7)  # the outputs of 1, 3, 6 enter layers 2, 4, 7
    prompt = prompts(96, lengths=(9,))[0]
    got = Engine(target, head).generate(prompt, DecodeConfig(max_new_tokens=24))
    assert got.token_ids == hf_greedy(target, prompt, 24)


@torch.inference_mode()
def test_the_features_are_the_hidden_states_transformers_reports(target):
    """hidden_states[i] of transformers is the input of layer i: the oracle for capture."""
    layers = (2, 4, 5)
    ids = torch.tensor([prompts(96, lengths=(7,))[0]])
    kv = BatchKV(
        len(target.lean.layers),
        target.lean.shape.kv_heads,
        target.lean.shape.dim,
        target.dtype,
        target.device,
    )
    keys, values = kv.add_row(7)
    _, got = forward(target.lean, ids, torch.arange(7)[None], keys, values, 0, None, layers)
    states = target.model(ids, output_hidden_states=True).hidden_states
    want = torch.cat([states[i] for i in layers], dim=-1)
    # the states grow to ~500 through the random layers: fp32 rounding, not a wrong layer (~200 off)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-2)


@torch.inference_mode()
def test_prepared_head_computes_what_the_module_computes(target, tmp_path):
    head, _ = load_head(target, write_checkpoint(target, tmp_path / "h"))
    lean = LeanEagle3.of(head, target)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 5, 3 * target.hidden_size, generator=g)
    tokens = torch.randint(0, 96, (1, 5), generator=g)
    positions = torch.arange(5)[None]
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    want, _ = head(
        target.embed(tokens),
        head.lift(features),
        positions,
        None,
        torch.zeros(1, 1, 5, 5).masked_fill(~causal, float("-inf")),
    )
    keys, values = lean.kv().add_row(5)  # a prefill of 5 slots
    got = lean.step(tokens, lean.lift(features), positions, keys, values, 0, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        lean.log_probs(got), torch.log_softmax(head.logits(want), -1), rtol=1e-4, atol=1e-4
    )


def test_checkpoints_that_do_not_fit_are_refused(target, tmp_path):
    source = write_checkpoint(target, tmp_path / "h", eagle_aux_hidden_state_layer_ids=[1, 3, 7])
    with pytest.raises(DraftCheckpointError, match="output of target layer 7"):
        load_head(target, source)
    source = write_checkpoint(target, tmp_path / "h2", draft_vocab_size=7)
    with pytest.raises(DraftCheckpointError, match="draft_vocab_size 7"):
        load_head(target, source)
    other = tiny_target(eos=None, layers=8, hidden=32)
    with pytest.raises(DraftCheckpointError, match="features but the target"):
        load_head(other, write_checkpoint(target, tmp_path / "h3"))
