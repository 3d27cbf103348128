"""The `eagle2-batch` command line: a thin click group over the package's modules.

Each command lives in a module of this package that parses options, calls the library
(producer/*.py) and prints. A command's module is imported only when the command is
looked up, so `bench` runs where no database library is installed
(benchmarks/gpu_check.sh) and no command loads what the others need.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading
from typing import Any

import click

# name: "module:attribute" under producer.cli, in the order the commands were added
COMMANDS = {
    "db": "db:db",
    "stats": "stats:stats",
    "export": "export:export",
    "run": "run:run",
    "submit": "submit:submit",
    "status": "jobs:status",
    "cancel": "jobs:cancel",
    "resume": "jobs:resume",
    "verify": "jobs:verify",
    "worker": "worker:worker",
    "train-draft": "train:train_draft",
    "draft-vocab": "vocab:draft_vocab",
    "models": "models:models",
    "bench": "bench:bench",
    "adapt": "adapt:adapt",
}


class LazyGroup(click.Group):
    """A group that imports a command's module when the command is first looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        # An unknown name loads them all: click's "Did you mean" picks from self.commands.
        for name in [cmd_name] if cmd_name in COMMANDS else COMMANDS:
            if name not in self.commands:
                module, attribute = COMMANDS[name].split(":")
                command = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
                self.add_command(command)
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="eagle2-batch")
def main() -> None:
    """Large offline generation jobs with lossless EAGLE-2 speculative decoding."""


def entry() -> None:
    """The console script: `main`, then, once torch is loaded, an exit that skips the
    interpreter's teardown. Freeing torch's modules and its C++ state took 0.35-0.6 s
    after every command that decoded (2-core VMs), a sixth of a small job's start-up.
    By then every row is committed and every file closed; non-daemon threads are joined
    and atexit handlers (logging, multiprocessing) run first, as at a normal exit."""
    try:
        main()
        code: Any = 0
    except SystemExit as stop:
        code = stop.code
    if "torch" not in sys.modules:
        sys.exit(code)
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or stream
            pass
    os._exit(code or 0)
