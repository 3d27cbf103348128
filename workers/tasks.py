"""The shard task and the producer's helper that enqueues it.

A worker process serves one model. Its target is loaded once: at process start when the
launcher names the model (`eagle2-batch worker --model M`, so a model that cannot load
stops the worker before it takes any shard), else by the first shard, whose model it then
keeps. Loading happens in the process that runs tasks (worker_process_init, or lazily),
never in a parent that forks. torch is imported only there: the producer imports this
module just to enqueue.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import Task
from celery.signals import worker_process_init
from sqlalchemy import Engine, text
from sqlalchemy.exc import InterfaceError, OperationalError

from eagle2_core.config import AUTO
from workers import db
from workers.celery_app import app, queue_for
from workers.job_settings import JobSettings
from workers.settings import Settings, load_settings, number_setting
from workers.shards import RETRYABLE_DB_ERRORS, load_job, mark_failed, process_shard
from workers.watchdog import start_watchdog

if TYPE_CHECKING:
    from eagle2_core.models import Target
    from workers.decoding import SampleDecoder

log = logging.getLogger(__name__)

# Set by the launcher for each worker process it starts.
WORKER_MODEL_ENV = "EAGLE2_WORKER_MODEL"  # the one model this process serves
WORKER_DRAFT_ENV = "EAGLE2_WORKER_DRAFT"  # this host's draft head, instead of the job's
WORKER_DEVICE_ENV = "EAGLE2_WORKER_DEVICE"  # 'cuda' or 'cpu'
WORKER_BATCH_ENV = "EAGLE2_WORKER_BATCH_SIZE"  # sequences at once (unset or 'auto': measured)
WORKER_DTYPE_ENV = "EAGLE2_WORKER_DTYPE"  # this host's dtype, instead of the job's
DB_RETRIES_ENV = "EAGLE2_DB_RETRIES"


class WrongModelError(RuntimeError):
    """A shard asks for a model this worker does not serve (a routing mistake)."""


@dataclass
class _ProcessState:
    settings: Settings | None = None
    engine: Engine | None = None
    model: str | None = None
    target: Target | None = None
    decoder_key: tuple[str, str | None, str, Any] | None = None
    decoder: SampleDecoder | None = None


_state = _ProcessState()


def _settings() -> Settings:
    if _state.settings is None:
        _state.settings = load_settings()
    return _state.settings


def _db() -> Engine:
    # Created in the process that uses it: pooled connections must not cross a fork.
    if _state.engine is None:
        _state.engine = db.make_engine(_settings().database_url)
    return _state.engine


def _device_and_dtype(job_dtype: str = "auto") -> tuple[str, Any]:
    """This process's device, and the dtype it decodes in: the worker's --dtype, else the
    job's, resolved on the device (auto: bf16 where native, eagle2_core/precision.py)."""
    import torch

    from eagle2_core.precision import resolve_dtype

    device = os.environ.get(WORKER_DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, resolve_dtype(os.environ.get(WORKER_DTYPE_ENV) or job_dtype, device)


def _load_target(model: str, job_dtype: str = "auto") -> Target:
    from eagle2_core.models import load_target

    device, dtype = _device_and_dtype(job_dtype)
    log.info("loading model %s on %s (%s)", model, device, dtype)
    target = load_target(model, dtype=dtype, device=device)
    _state.model, _state.target = model, target
    return target


@worker_process_init.connect
def _preload_served_model(**_: Any) -> None:
    """Load the launcher-named model (and check its draft) before taking shards; exit if
    either is unusable.

    A worker that cannot load its model would otherwise take shard after shard and fail
    each one. SystemExit, unlike an Exception, is not swallowed by the signal dispatch.
    """
    model = os.environ.get(WORKER_MODEL_ENV)
    if not model:
        return
    try:
        target = _load_target(model)
    except Exception as exc:
        log.critical("cannot load model %s: %s: %s", model, type(exc).__name__, exc)
        raise SystemExit(1) from exc
    _check_served_draft(target)


@worker_process_init.connect
def _start_watchdog(**_: Any) -> None:
    """Every worker process watches for stalled shards of any job (workers/watchdog.py)."""
    start_watchdog(_db(), enqueue_shards)


def _check_served_draft(target: Target) -> None:
    """Read the launcher-named draft head once at start; exit if it is unusable.

    A corrupt head, or one trained for another model, would otherwise fail every shard
    this worker takes; refusing to start leaves the shards queued for a healthy worker.
    """
    from eagle2_core.registry import RANDOM_DRAFT

    draft = os.environ.get(WORKER_DRAFT_ENV)
    if not draft or draft == RANDOM_DRAFT:
        return
    from eagle2_core.draft import load_draft

    try:
        load_draft(draft, target.config)
    except Exception as exc:
        log.critical("cannot use draft head %s: %s: %s", draft, type(exc).__name__, exc)
        raise SystemExit(1) from exc


def decoder_for(job: dict[str, Any]) -> SampleDecoder:
    """This process's decoder for the job's model, draft and mode; loaded once, then reused.

    The draft named by the worker (`--draft`) wins over the job's: head paths are per host.
    A new draft or mode reuses the loaded target; another model is refused.
    """
    from workers.decoding import SampleDecoder

    served = os.environ.get(WORKER_MODEL_ENV) or _state.model
    if served is not None and job["model"] != served:
        raise WrongModelError(
            f"this worker serves model {served!r} but job {job['id']} asks for "
            f"{job['model']!r}: start a worker with --model {job['model']} (queue "
            f"{queue_for(job['model'])})"
        )
    draft = os.environ.get(WORKER_DRAFT_ENV) or job["draft"]
    job_dtype = JobSettings.from_params(job["params"]).dtype
    device, dtype = _device_and_dtype(job_dtype)
    key = (job["model"], draft, job["mode"], dtype)
    if _state.decoder is not None and _state.decoder_key == key:
        return _state.decoder
    target = _state.target
    if target is None or _state.model != job["model"] or target.dtype != dtype:
        target = _load_target(job["model"], job_dtype)
    given = os.environ.get(WORKER_BATCH_ENV) or AUTO
    batch_size = int(given) if given.isdigit() else AUTO
    decoder = SampleDecoder.load(
        job["model"],
        draft,
        job["mode"],
        device=device,
        dtype=dtype,
        target=target,
        batch_size=batch_size,
    )
    _state.decoder_key, _state.decoder = key, decoder
    return decoder


def db_retries() -> int:
    """`EAGLE2_DB_RETRIES`: Celery retries of a shard whose database failed mid-shard
    (default 10); a non-negative integer."""
    return number_setting(
        DB_RETRIES_ENV,
        10,
        lambda raw: int(raw) if raw.isdigit() else None,
        lambda v: True,
        "a whole number of retries",
    )


def _wait_for_database(engine: Engine) -> None:
    """Block until the database answers, before the shard is taken. A task that failed at
    once would spend its retries in seconds while the database is down and be dropped,
    its shard queued for good; waiting holds this one message (prefetch 1), so no other
    is consumed and every one runs once the database is back."""
    pause = 1.0
    while True:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return
        except (OperationalError, InterfaceError) as exc:
            log.warning("database unreachable, retrying in %.0f s: %s", pause, exc)
            time.sleep(pause)
            pause = min(2 * pause, 30.0)


@app.task(
    name="eagle2.run_shard",
    bind=True,
    # The database went away mid-shard (restart, failover): retry, nothing is lost. A retry
    # waits for it at its start, so an outage does not use them up; if they run out, the
    # shard stalls and the watchdog re-enqueues it.
    autoretry_for=RETRYABLE_DB_ERRORS,
    retry_backoff=2,
    retry_backoff_max=300,
    retry_jitter=True,
    max_retries=db_retries(),
)
def run_shard(self: Task, job_id: str, shard: int) -> dict[str, Any]:
    """Process one shard of a job (workers/shards.py); returns a summary for the log."""
    engine = _db()
    worker = self.request.hostname or socket.gethostname()
    _wait_for_database(engine)
    job = load_job(engine, job_id)
    try:
        decoder = decoder_for(job)
    except Exception as exc:  # wrong model, unloadable model or draft: fail the shard visibly
        mark_failed(engine, job_id, shard, worker, exc)
        raise
    result = process_shard(
        engine, decoder, job_id, shard, _settings().output_dir, worker, decoder.device
    )
    return {
        "job_id": job_id,
        "shard": result.shard,
        "state": result.state,
        "decoded": result.decoded,
        "failed": result.failed,
        "skipped": result.skipped,
        "job_state": result.job_state,
        "decode_s": round(result.decode_ms / 1000, 3),
        "wall_s": round(result.wall_s, 3),
    }


_PIPELINE = 1000  # messages per Redis pipeline when enqueueing a job's shards


def enqueue_shards(job_id: str, shards: Iterable[int], model: str) -> int:
    """Send shards of a job to its model's queue, one Celery task each; returns how many.

    Write the job, its manifest and its shards to the database first: the tasks read
    them. One broker connection, messages in Redis pipelines of 1,000 (kombu's
    Producer.batch: 0.15 ms a task instead of 0.36); those not yet flushed when this
    raises are not sent, and `resume` sends them."""
    queue = queue_for(model)
    sent = 0
    with app.producer_or_acquire() as producer, producer.batch(max_size=_PIPELINE):
        for shard in shards:
            run_shard.apply_async(args=(job_id, int(shard)), queue=queue, producer=producer)
            sent += 1
    return sent
