"""Start one Celery worker process per GPU (or per CPU slot) and supervise them.

Each child is a plain `celery worker --pool solo`: one process, one model, one shard at a
time, pinned to its GPU with CUDA_VISIBLE_DEVICES. This parent never imports torch (so
never initialises CUDA): it counts GPUs with CUDA_VISIBLE_DEVICES or `nvidia-smi -L`.
It forwards SIGTERM/SIGINT to the children (Celery's warm shutdown: the running shard
finishes; one cut off is redelivered, acks_late) and exits when they have exited.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType

from workers.celery_app import WORKER_NAME_ENV, queue_for
from workers.tasks import (
    WORKER_BATCH_ENV,
    WORKER_DEVICE_ENV,
    WORKER_DRAFT_ENV,
    WORKER_DTYPE_ENV,
    WORKER_MODEL_ENV,
)

# eagle2_core.models.DEFAULT_MODEL, repeated so this parent need not import torch
# (tests/workers/test_worker_integration.py checks that the two agree).
DEFAULT_MODEL = "smollm2-135m"
_THREAD_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

CONCURRENCY_NOTE = """\
How `eagle2-batch worker` uses a host:
- One Celery worker process per GPU (or per --cpu slot), each with --pool solo: the task
  runs in that process, which loads the target and draft head once and keeps them on its
  GPU. A prefork pool would fork children that each load their own copy of the model.
- Each process holds one shard at a time (prefetch 1, late acknowledgement): a long shard
  never keeps another shard waiting behind it in a busy worker, and a shard whose worker
  died is handed out again (after the visibility timeout, EAGLE2_VISIBILITY_TIMEOUT).
- Within a process, --batch-size samples of the shard are decoded at once (default 16):
  one target forward verifies every sequence's draft tree, and a finished sequence's
  place goes to the shard's next sample. Outputs do not depend on it.
- CPU workers split the cores between them (OMP_NUM_THREADS = cores / N unless set).
- SIGTERM or Ctrl-C: every process finishes its current shard, then exits; a second
  Ctrl-C stops at once (the unfinished shard is redelivered; stored samples are kept).
"""


class LaunchError(RuntimeError):
    """The workers cannot be started as asked; the message says why."""


@dataclass(frozen=True)
class WorkerSpec:
    """One child process: its node name, command line and environment overrides."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """Ids of the GPUs this process may use, without initialising CUDA.

    CUDA_VISIBLE_DEVICES when set (as CUDA reads it: up to the first invalid entry),
    else one id per line of `nvidia-smi -L`; none without a driver.
    """
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = []
        for item in env["CUDA_VISIBLE_DEVICES"].split(","):
            item = item.strip()
            if not item or item.startswith("-"):
                break
            ids.append(item)
        return ids
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def select_gpus(spec: str, visible: Sequence[str]) -> list[str]:
    """'all', or a comma list of indices into the visible GPUs; returns their ids."""
    if spec.strip() == "all":
        return list(visible)
    chosen = []
    for item in spec.split(","):
        try:
            index = int(item)
        except ValueError:
            raise LaunchError(f"--gpus takes 'all' or indices like 0,2; got {spec!r}") from None
        if not 0 <= index < len(visible):
            raise LaunchError(f"GPU {index} is not visible: {len(visible)} GPU(s) found")
        chosen.append(visible[index])
    if len(set(chosen)) != len(chosen):
        raise LaunchError(f"--gpus lists a GPU twice: {spec!r}")
    return chosen


def plan_workers(
    *,
    gpus: Sequence[str] = (),
    cpu: int = 0,
    hostname: str | None = None,
    model: str | None = None,
    draft: str | None = None,
    batch_size: int | str | None = None,
    dtype: str | None = None,
    queues: Sequence[str] = (),
    loglevel: str = "INFO",
    cpu_count: int | None = None,
) -> list[WorkerSpec]:
    """The child processes for GPU ids `gpus`, or `cpu` CPU workers (exactly one of them).

    Node names are gpu<id>@host / cpu<i>@host; they land in every row's `worker` column.
    Without --queues a worker consumes its model's queue (the default model's if none).
    """
    if bool(gpus) == bool(cpu):
        raise LaunchError("give GPUs or a number of CPU workers (not both, not neither)")
    host = hostname or socket.gethostname()
    common: dict[str, str] = {}
    if model or not queues:  # a named model (or the default one) is loaded at start
        common[WORKER_MODEL_ENV] = model or DEFAULT_MODEL
    if draft:
        common[WORKER_DRAFT_ENV] = draft
    if batch_size:
        common[WORKER_BATCH_ENV] = str(batch_size)
    if dtype:
        common[WORKER_DTYPE_ENV] = dtype
    queues = list(queues) or [queue_for(common[WORKER_MODEL_ENV])]
    slots: list[tuple[str, dict[str, str]]]
    if gpus:
        slots = [
            (
                f"gpu{gpu if gpu.isdigit() else i}@{host}",
                {"CUDA_VISIBLE_DEVICES": gpu, WORKER_DEVICE_ENV: "cuda"},
            )
            for i, gpu in enumerate(gpus)
        ]
    else:
        threads = str(max(1, (cpu_count or os.cpu_count() or 1) // cpu))
        cpu_env = {"CUDA_VISIBLE_DEVICES": "", WORKER_DEVICE_ENV: "cpu"}
        cpu_env.update({k: threads for k in _THREAD_ENVS if k not in os.environ})
        slots = [(f"cpu{i}@{host}", dict(cpu_env)) for i in range(cpu)]
    specs = []
    for name, env in slots:
        # No revokes or peer events are used: --without-mingle/gossip skip the start-up
        # sync and the chatter between workers.
        argv = [sys.executable, "-m", "celery", "-A", "workers.celery_app:app", "worker"]
        argv += ["--pool", "solo", "--concurrency", "1", "--hostname", name]
        argv += ["--queues", ",".join(queues), "--loglevel", loglevel]
        argv += ["--without-mingle", "--without-gossip"]
        specs.append(WorkerSpec(name, argv, {**common, **env, WORKER_NAME_ENV: name}))
    return specs


def _die_with_parent() -> None:
    # In the child before exec: if the launcher is killed outright (SIGKILL), the worker
    # gets SIGTERM (a warm shutdown) instead of running on unsupervised.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_workers(specs: Sequence[WorkerSpec], poll_s: float = 0.5) -> int:
    """Start the children, forward SIGTERM/SIGINT to them, wait; returns the exit code.

    When one child exits on its own (crash, model that would not load) the others are
    stopped too, so a supervisor (Docker's restart policy) sees the host fail as a whole.
    0 when every child exited cleanly after a signal; else the first non-zero code, or 1.
    """
    children: dict[str, subprocess.Popen[bytes]] = {}
    stopping = False

    def stop(signum: int) -> None:
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signum)

    def forward(signum: int, _frame: FrameType | None) -> None:
        # Celery: SIGTERM is a warm shutdown (exit 0), SIGQUIT a cold one. A first Ctrl-C
        # is sent on as SIGTERM (Celery's own SIGINT warm shutdown exits 1), a second one
        # as SIGQUIT: stop now, the unfinished shard is redelivered.
        nonlocal stopping
        cold = signum == signal.SIGINT and stopping
        stopping = True
        stop(signal.SIGQUIT if cold else signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        for spec in specs:
            children[spec.name] = subprocess.Popen(
                spec.argv,
                env={**os.environ, **spec.env},
                # Own process group: a terminal's Ctrl-C reaches only this parent, which
                # decides what the children get.
                process_group=0,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        running = dict(children)
        while running:
            time.sleep(poll_s)
            for name, child in list(running.items()):
                rc = child.poll()
                if rc is None:
                    continue
                del running[name]
                if rc != 0 and code == 0:
                    code = rc if rc > 0 else 128 - rc  # killed by a signal: 128 + signum
                if not stopping:
                    print(
                        f"eagle2-batch worker: {name} exited with code {rc}; stopping the others",
                        file=sys.stderr,
                    )
                    code = code or 1
                    stopping = True
                    stop(signal.SIGTERM)
    finally:
        stop(signal.SIGTERM)  # only reached with children alive if starting one failed
        for child in children.values():
            child.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return code
