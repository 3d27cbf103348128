"""Generation controls end to end: a file whose lines set controls (top level and in an
OpenAI body) under a job's own, through `eagle2-batch run` in EAGLE-2 and vanilla mode,
stored in Parquet and exported as OpenAI lines whose logprobs are transformers' fp32
log-softmax of the same model; bad controls are named bad lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle2_core.registry import encode_chat
from producer.cli import main
from tests.producer.test_run import run_cli, tiny  # noqa: F401 (a fixture)
from workers.parquet_sink import read_job_parquet

LINES = [
    {"id": "a", "prompt": "t5 t7 t9", "logprobs": True, "top_logprobs": 3},
    {"id": "b", "prompt": "t9 t3", "repetition_penalty": 1.5, "top_k": 4},
    {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": "t11 t12"}],
            "logprobs": True,
            "top_logprobs": 3,
            "frequency_penalty": 0.7,
            "presence_penalty": 0.2,
        },
    },
    {"id": "d", "prompt": "t8", "top_logprobs": 2},
    {"id": "e", "prompt": "t8", "logit_bias": {"x": 1}},
]


def run_job(model: Path, head: Path, mode: str, tmp_path: Path) -> tuple[Path, str, str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    out = tmp_path / mode
    # fp32: the logprobs are checked against transformers' fp32 forward
    done = run_cli(
        str(prompts), "--out", str(out), "--model", str(model), "--draft", str(head),
        "--mode", mode, "--max-new-tokens", "10", "--logit-bias", "9=2.5",
        "--min-tokens", "3", "--dtype", "fp32", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out, done.stdout.strip().splitlines()[-1], done.stderr


def test_controls_and_logprobs_through_run_and_the_openai_export(tiny, tmp_path):  # noqa: F811
    model, head = tiny
    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    outputs = {}
    for mode in ("eagle2", "vanilla"):
        out, job_id, stderr = run_job(model, head, mode, tmp_path)
        assert 'line 4: field "top_logprobs": expected "logprobs": true beside it' in stderr
        assert (
            'line 5: field "logit_bias": expected token ids as keys (decimal digits), got "x"'
            in stderr
        )
        table = {r["request_id"]: r for r in read_job_parquet(out, job_id).to_pylist()}
        assert set(table) == {"a", "b", "c"} and table["b"]["logprobs"] is None
        exported = tmp_path / f"{mode}.jsonl"
        url = f"sqlite:///{out / 'eagle2.db'}"
        args = ["export", job_id, "--format", "openai", "--out", str(exported), "--url", url]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        lines = {x["custom_id"]: x for x in map(json.loads, exported.read_text().splitlines())}
        for request_id, line in lines.items():
            choice = line["response"]["body"]["choices"][0]
            row = table[request_id]
            if row["logprobs"] is None:
                assert choice["logprobs"] is None
                continue
            content = choice["logprobs"]["content"]
            ids = [entry["token_id"] for entry in row["logprobs"]]
            assert len(content) == len(ids) == row["completion_tokens"] >= 3
            messages = [{"role": "user", "content": LINES[0]["prompt"]}]
            if request_id == "c":
                messages = LINES[2]["body"]["messages"]
            prompt = encode_chat(tokenizer, messages)
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + ids])).logits[0].float()
            oracle = logits.log_softmax(-1)[len(prompt) - 1 : -1]
            for position, (item, token) in enumerate(zip(content, ids, strict=True)):
                want = oracle[position]
                assert abs(item["logprob"] - float(want[token])) < 1e-3
                assert item["token"] == tokenizer.decode([token])
                assert bytes(item["bytes"]) == item["token"].encode()
                top = want.topk(3)
                got = [alt["logprob"] for alt in item["top_logprobs"]]
                assert torch.allclose(torch.tensor(got), top.values, atol=1e-3)
                assert [alt["token"] for alt in item["top_logprobs"]] == [
                    tokenizer.decode([t]) for t in top.indices.tolist()
                ]
        outputs[mode] = {k: r["output_text"] for k, r in table.items()}
    assert outputs["eagle2"] == outputs["vanilla"]  # greedy: the same answers in both modes


@pytest.mark.parametrize(
    "option,error",
    [
        (["--depth", "3"], "--depth was renamed --tree-depth"),
        (["--logit-bias", "12"], "'12' is not ID=BIAS"),
        (["--logit-bias", "12=200"], "expected a number from -100 to 100"),
        (["--min-p", "1.5"], "--min-p"),
        (["--logprobs", "21"], "--logprobs"),
    ],
)
def test_bad_control_options_are_usage_errors(tiny, tmp_path, option, error):  # noqa: F811
    model, _ = tiny
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "t5"}\n')
    done = run_cli(str(prompts), "--model", str(model), "--mode", "vanilla", *option, cwd=tmp_path)
    assert done.returncode == 2 and error in done.stderr, done.stderr
