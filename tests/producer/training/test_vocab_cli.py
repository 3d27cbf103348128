"""`eagle2-batch draft-vocab`: a head's draft vocabulary from answer files."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from eagle2_core.vocab import DraftVocab
from producer.cli import main
from tests.eagle2_core.tiny import tiny_target


def test_vocabulary_from_conversations_exports_and_parquet(tmp_path: Path) -> None:
    target = tiny_target(eos=1)
    model = tmp_path / "model"
    target.model.save_pretrained(model)
    target.tokenizer.save_pretrained(model)
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "t90 t91"},
                    {"role": "assistant", "content": "t5 t5 t6"},
                ]
            }
        )
        + "\n\n"
    )
    export = tmp_path / "export.jsonl"
    export.write_text(json.dumps({"sample_id": "a", "output_text": "t5 t7 t7 t7"}) + "\n")
    parquet = tmp_path / "shard=0.parquet"
    pq.write_table(pa.table({"turn_outputs": [["t8", "t8 t9"]]}), parquet)
    out = tmp_path / "head"
    args = ["draft-vocab", str(conversations), str(export), str(parquet)]
    result = CliRunner().invoke(
        main, [*args, "--model", str(model), "--out", str(out), "--size", "4"]
    )
    assert result.exit_code == 0, result.output
    # Each file weighs the same: t5 (2/4 of the first, 1/5 of the second), t7 (3/5 of the
    # second), t8 (2/5 of the third) and the end-of-turn t1 (closing every answer) lead.
    assert DraftVocab.load(out).ids.tolist() == [1, 5, 7, 8]
    assert "4 tokens written to" in result.output and "75.0% covered" in result.output


def test_bad_lines_and_empty_files_are_named(tmp_path: Path) -> None:
    target = tiny_target()
    model = tmp_path / "model"
    target.model.save_pretrained(model)
    target.tokenizer.save_pretrained(model)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"output_text": "t3"}\n{nope\n')
    result = CliRunner().invoke(
        main, ["draft-vocab", str(broken), "--model", str(model), "--out", str(tmp_path / "h")]
    )
    assert result.exit_code == 1 and f"{broken}:2: not JSON" in result.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": "no answers here"}\n')
    result = CliRunner().invoke(
        main, ["draft-vocab", str(empty), "--model", str(model), "--out", str(tmp_path / "h")]
    )
    assert result.exit_code == 1 and "holds no answers" in result.output
