"""The console script's exit: after a command that loaded torch it skips the
interpreter's teardown, and must still give the command's status, flush its output, run
atexit handlers and wait for non-daemon threads (a real process, as a user runs it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from pathlib import Path
    import click
    from producer.cli import entry, main

    out = Path(sys.argv[1])

    @main.command("probe")
    @click.option("--code", default=0)
    @click.option("--torch/--no-torch", "with_torch", default=True)
    def probe(code, with_torch):
        if with_torch:
            import torch  # noqa: F401
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        def late():
            time.sleep(0.3)
            (out / "thread").write_text("done")
        threading.Thread(target=late).start()
        click.echo("printed, not yet flushed", nl=False)
        if code:
            raise SystemExit(code)

    sys.argv = ["eagle2-batch", "probe", *sys.argv[2:]]
    entry()
    """
)


@pytest.mark.parametrize(
    "args, status",
    [([], 0), (["--code", "3"], 3), (["--no-torch", "--code", "4"], 4)],
)
def test_the_exit_keeps_status_output_atexit_and_threads(
    tmp_path: Path, args: list[str], status: int
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == status, done.stderr
    assert done.stdout == "printed, not yet flushed"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"


def test_a_usage_error_still_exits_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), "--no-such-option"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "No such option" in done.stderr
