"""`eagle2-batch train-draft` end to end on a tiny random model saved to a folder:
answers through the real embedded `run`, features, training, evaluation, the head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import producer.training.pipeline as train_cli
from eagle2_core.config import DecodeConfig
from eagle2_core.draft import load_draft, new_draft_head, save_draft
from eagle2_core.eagle3 import Eagle3Head
from eagle2_core.engine import Engine, load_head
from eagle2_core.models import load_target
from eagle2_core.train.data import is_validation
from eagle2_core.vocab import DraftVocab
from producer.cli import main
from tests.eagle2_core.tiny import hf_greedy, tiny_target

VALIDATION_IDS = ["alpaca-00056", "alpaca-00085", "alpaca-00087"]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    target = tiny_target(seed=5)
    directory = tmp_path / "tiny-model"
    target.model.save_pretrained(directory)
    target.tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    ids = [f"alpaca-{i:05d}" for i in range(10)] + VALIDATION_IDS
    lines = [{"id": i, "prompt": f"t{7 + n} t{20 + n} t{3 * n + 2}"} for n, i in enumerate(ids)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_select_prompts_keeps_validation_out_and_grows_as_a_prefix(prompts: Path) -> None:
    train, val = train_cli.select_prompts(prompts, 4, 2)
    assert len(train) == 4 and len(val) == 2
    assert not any(is_validation(i) for i, _ in train)
    assert all(is_validation(i) for i, _ in val)
    more, _ = train_cli.select_prompts(prompts, 8, 2)
    assert more[:4] == train


def test_train_draft_end_to_end_and_resume(
    model_dir: Path, prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    args = ["train-draft", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out)]
    args += "--max-samples 8 --val-samples 2 --epochs 2 --batch-size 4".split()
    args += "--max-new-tokens 10 --checkpoint-every 2 --eval-samples 2".split()
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "head written to" in result.output

    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_conversations"] == 8
    assert summary["validation_conversations"] == 2
    assert summary["steps"] == 4
    assert summary["validation"]["positions"] > 0
    assert summary["tau"] >= 1.0
    card = (out / "head" / "README.md").read_text()
    assert "4 steps" in card and "top-1" in card
    target = load_target(str(model_dir))
    head = load_draft(out / "head", target.model.config)
    assert head.fc.weight.shape == (target.hidden_size, 2 * target.hidden_size)
    # what the planner bounds this head's drafting by (plan.accept_ceiling)
    assert head.held_out_top1 == pytest.approx(summary["validation"]["top1"], abs=1e-4)
    features = sorted(p.name for p in (out / "features" / "train").iterdir())
    assert features == ["shard-00000.safetensors"]
    # The draft vocabulary: the tokens of the 8 training answers (at most 80 of 96 here).
    vocab = DraftVocab.load(out / "head")
    assert vocab is not None and 1 < len(vocab) <= 8 * 10 < target.vocab_size
    assert summary["draft_vocab"] == len(vocab) and "draft vocabulary: the" in card

    # Again with --resume: no decoding, no features redone, training ends at its last step.
    def fail(*_args, **_kwargs):
        raise AssertionError("answers were generated again")

    monkeypatch.setattr(train_cli, "generate_answers", fail)
    monkeypatch.setattr(
        "eagle2_core.train.data.conversation_features",
        lambda *a: pytest.fail("features were extracted again"),
    )
    result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert json.loads((out / "summary.json").read_text())["steps"] == 4

    # A larger selection sends only the new prompt to `run`.
    sent: list[list[str]] = []
    monkeypatch.setattr(
        train_cli,
        "generate_answers",
        lambda path, *a: sent.append([json.loads(x)["id"] for x in path.read_text().splitlines()]),
    )
    train, val = train_cli.select_prompts(prompts, 9, 2)
    settings = train_cli.AnswerSettings(str(model_dir), 10, 0.0, 0, "cpu", 4)
    train_cli.ensure_answers(out, train + val, settings)
    assert sent == [[train[8][0]]]


def test_init_head_fine_tunes_the_given_head(
    model_dir: Path, prompts: Path, tmp_path: Path
) -> None:
    target = load_target(str(model_dir))
    start = save_draft(new_draft_head(target.model.config, seed=11), tmp_path / "start")
    args = ["train-draft", "--model", str(model_dir), "--prompts", str(prompts)]
    args += "--max-samples 4 --val-samples 0 --epochs 1 --batch-size 4 --max-new-tokens 6".split()
    args += "--eval-samples 0 --lr 1e-9 --warmup-steps 0".split()
    out = tmp_path / "out"
    result = CliRunner().invoke(main, [*args, "--out", str(out), "--init-head", str(start)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    # One step at lr 1e-9 leaves the weights where they started (up to bf16 rounding) ...
    trained, initial = load_draft(out / "head"), load_draft(start)
    fresh = new_draft_head(target.model.config, seed=0)
    assert torch.equal(trained.fc.weight, initial.fc.weight)
    assert not torch.allclose(trained.fc.weight.float(), fresh.fc.weight)
    assert f"starting from the head `{start}`" in (out / "head" / "README.md").read_text()

    # ... and a folder that holds no head is named in the error, before any training.
    bad = CliRunner().invoke(
        main, [*args, "--out", str(out), "--init-head", str(tmp_path / "nowhere")]
    )
    assert bad.exit_code != 0 and "--init-head" in bad.output and "nowhere" in bad.output
    shipped = CliRunner().invoke(main, [*args, "--out", str(out), "--init-head", "shipped"])
    assert shipped.exit_code != 0 and "ships no head" in shipped.output


def test_train_draft_on_conversations_decodes_nothing_and_snapshots(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [f"alpaca-{i:05d}" for i in range(12)] + VALIDATION_IDS
    lines = [
        {
            "id": i,
            "messages": [
                {"role": "user", "content": f"t{7 + n} t{20 + n}"},
                {
                    "role": "assistant",
                    "content": " ".join(f"t{30 + (n + k) % 40}" for k in range(8)),
                },
            ],
        }
        for n, i in enumerate(ids)
    ]
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    monkeypatch.setattr(
        train_cli, "generate_answers", lambda *a: pytest.fail("conversations need no decoding")
    )
    out = tmp_path / "out"
    args = ["train-draft", "--model", str(model_dir), "--conversations", str(path)]
    args += ["--out", str(out), *"--max-conversations 10 --val-samples 2 --epochs 2".split()]
    args += "--batch-size 4 --eval-samples 0 --snapshot-tokens 40,90".split()
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_conversations"] == 10 and summary["validation_conversations"] == 2
    assert summary["train_answer_tokens"] == 10 * 9  # 8 words and the end-of-turn each
    assert summary["prompts"] is None and summary["conversations"] == ["conversations.jsonl"]
    assert "answer turns of `conversations.jsonl`" in (out / "head" / "README.md").read_text()
    for count in (40, 90):
        snapshot = out / "snapshots" / f"tokens-{count}"
        assert json.loads((snapshot / "snapshot.json").read_text())["tokens_seen"] >= count
        assert load_draft(snapshot) is not None and DraftVocab.load(snapshot) is not None
    bad = CliRunner().invoke(main, ["train-draft", "--model", str(model_dir), "--out", str(out)])
    assert bad.exit_code == 2 and "give --prompts, --conversations or --from-job" in bad.output


def test_train_draft_arch_eagle3_writes_a_public_eagle3_head_that_decodes_exactly(
    tmp_path: Path,
) -> None:
    target = tiny_target(seed=5, layers=6)
    model_dir = tmp_path / "tiny-model"
    target.model.save_pretrained(model_dir)
    target.tokenizer.save_pretrained(model_dir)
    ids = [f"c{n}" for n in range(12)] + VALIDATION_IDS
    answers = [" ".join(f"t{30 + (n + k) % 40}" for k in range(8)) for n in range(len(ids))]
    lines = [
        {
            "id": i,
            "messages": [
                {"role": "user", "content": f"t{7 + n} t{20 + n}"},
                {"role": "assistant", "content": answers[n]},
            ],
        }
        for n, i in enumerate(ids)
    ]
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    args = ["train-draft", "--model", str(model_dir), "--conversations", str(path)]
    args += ["--out", str(out), "--arch", "eagle3", "--ttt-steps", "2", "--epochs", "2"]
    args += ["--batch-size", "4", "--eval-samples", "0", "--snapshot-tokens", "40"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arch"] == "eagle3" and summary["steps"] == 6
    assert len(summary["validation"]["top1_by_step"]) == 2  # held-out top-1 per draft step
    config = json.loads((out / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]  # inputs of layers 2, 3, 3
    assert "training-time" in (out / "head" / "README.md").read_text()
    loaded = load_target(str(model_dir))
    head, vocab = load_head(loaded, out / "head")
    assert isinstance(head, Eagle3Head) and vocab is None
    assert head.held_out_top1 == pytest.approx(summary["validation"]["top1"], abs=1e-4)
    assert (out / "snapshots" / "tokens-40" / "config.json").exists()
    engine = Engine(loaded, head)
    prompt = [5, 9, 30, 31]
    got = engine.generate(prompt, DecodeConfig(max_new_tokens=12, total_tokens=8))
    assert got.token_ids == hf_greedy(loaded, prompt, 12)
    bad = CliRunner().invoke(
        main, [*args[:-2], "--init-head", "shipped", "--model", "smollm2-135m"]
    )
    assert bad.exit_code != 0


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)]
)
def test_train_draft_from_a_finished_job_learns_its_answers(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A job run with `run` (a system prompt, a bad line, a failed sample, n = 2) is the
    training data: its ok answers with the prompts they answered, split by the hash rule."""
    from tests.producer.test_jobs import save_tiny_model
    from workers.db import make_engine
    from workers.job_answers import iter_job_answers

    model, _ = save_tiny_model(tmp_path, with_draft=False)
    url = request.getfixturevalue(f"{backend}_url")
    ids = [f"alpaca-{i:05d}" for i in range(6)] + VALIDATION_IDS[:2]
    lines = [json.dumps({"id": i, "prompt": f"t{7 + n} t{20 + n}"}) for n, i in enumerate(ids)]
    lines.insert(3, '{"id": "broken", "prompt": ')  # rejected: never an answer
    lines.append(json.dumps({"id": "hot", "prompt": "t9", "temperature": -1}))  # rejected
    lines.append(json.dumps({"id": "twice", "prompt": "t11 t12", "n": 2, "temperature": 0.5}))
    prompts = tmp_path / "job.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    run = CliRunner().invoke(
        main,
        ["run", str(prompts), "--model", str(model), "--mode", "vanilla", "--out",
         str(tmp_path / "job"), "--db-url", url, "--max-new-tokens", "6", "--system", "t30 t31"],
    )  # fmt: skip
    assert run.exit_code == 0, run.output + repr(run.exception)
    job_id = run.output.strip().splitlines()[-1]
    engine = make_engine(url)
    try:
        answers = list(iter_job_answers(engine, job_id))
    finally:
        engine.dispose()
    assert sorted(a["sample_id"] for a in answers) == sorted([*ids, "twice#0", "twice#1"])
    assert all(a["messages"][0] == {"role": "system", "content": "t30 t31"} for a in answers)
    assert {a["request_id"] for a in answers if a["sample_id"].startswith("twice")} == {"twice"}

    out = tmp_path / "out"
    args = ["train-draft", "--model", str(model), "--from-job", job_id, "--db-url", url]
    args += ["--out", str(out), *"--epochs 1 --batch-size 4 --eval-samples 0".split()]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["from_job"] == job_id
    assert summary["validation_conversations"] == 2  # the two validation-split ids
    assert summary["train_conversations"] == len(answers) - 2
    wrong = CliRunner().invoke(main, [*args[:2], "smollm2-135m", *args[3:]])
    assert wrong.exit_code != 0 and "pass --model" in wrong.output
