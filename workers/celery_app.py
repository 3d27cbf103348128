"""The one Celery app of eagle2-batch, configured from the environment (workers/settings.py).

Delivery is at-least-once by design: a shard is acknowledged only after it finished
(acks_late), a worker that dies leaves it to be redelivered (reject_on_worker_lost, and on
Redis the visibility timeout), and each worker process holds one shard at a time
(prefetch 1), so a long shard never strands others behind it. Redelivery is harmless
because every write is idempotent (workers/shards.py).
"""

from __future__ import annotations

import os
import re

from celery import Celery

from workers.settings import load_settings, number_setting

# Seconds a delivered, unacknowledged shard waits before Redis hands it out again. It must
# exceed the longest shard (docker/README.md "Shard size against the visibility timeout")
# and be the same in every client of the broker: producers, workers, Flower.
VISIBILITY_TIMEOUT_ENV = "EAGLE2_VISIBILITY_TIMEOUT"
DEFAULT_VISIBILITY_TIMEOUT = 21600

# Set by the launcher: the child's node name, so interleaved log lines say who speaks.
WORKER_NAME_ENV = "EAGLE2_WORKER_NAME"

QUEUE_PREFIX = "eagle2."
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def queue_for(model: str) -> str:
    """The queue of a model: 'eagle2.<alias>', or the name with unsafe characters as '-'.

    Workers serve one model each and consume only its queue, so a job never lands on a
    worker that would have to load a second model.
    """
    name = _UNSAFE.sub("-", model).strip("-.")
    if not name:
        raise ValueError(f"model name {model!r} gives no usable queue name")
    return QUEUE_PREFIX + name


def visibility_timeout() -> int:
    """`EAGLE2_VISIBILITY_TIMEOUT` in seconds (default 6 h); must be a positive integer."""
    return number_setting(
        VISIBILITY_TIMEOUT_ENV,
        DEFAULT_VISIBILITY_TIMEOUT,
        int,
        lambda v: v > 0,
        "a positive number of seconds",
    )


def transport_options(timeout: int) -> dict[str, int]:
    """Redis transport options: the visibility timeout and a restore sweep to match.

    kombu only scans for expired unacknowledged messages every interval x throttle
    seconds (10 x 10 by default): a shard whose worker was killed would wait up to 100 s
    past its timeout. Sweep every quarter of the timeout (1 s to 60 s) on every tick, so it
    comes back within 1.25 x the timeout; one small Redis query per sweep per worker.
    """
    return {
        "visibility_timeout": timeout,
        "unacked_restore_interval": max(1, min(60, timeout // 4)),
        "unacked_restore_throttle": 1,
    }


def make_app() -> Celery:
    """Build the app from the current environment."""
    settings = load_settings()
    app = Celery("eagle2", broker=settings.broker_url, include=["workers.tasks"])
    app.conf.update(
        # JSON only: a pickle-accepting worker executes whatever lands in the queue.
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        # Results live in the database, not in a Celery result backend.
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        # An overnight job outlives a broker restart of any length: never give up on it.
        broker_connection_max_retries=None,
        broker_transport_options=transport_options(visibility_timeout()),
        # Task events let Flower show which worker runs which shard.
        worker_send_task_events=True,
    )
    name = os.environ.get(WORKER_NAME_ENV, "").replace("%", "%%")
    if name:
        app.conf.worker_log_format = f"[%(asctime)s: %(levelname)s/{name}] %(message)s"
        app.conf.worker_task_log_format = (
            f"[%(asctime)s: %(levelname)s/{name}] %(task_name)s[%(task_id)s]: %(message)s"
        )
    return app


app = make_app()
