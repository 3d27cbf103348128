"""A job's settings: what the producer stores is what a worker reads back, and settings at
their defaults stay out of the stored params (so `run` still resumes older jobs)."""

from __future__ import annotations

from eagle2_core.config import JOB_DECODE_KEYS
from workers.job_settings import (
    ADAPT_AFTER,
    ADAPT_AFTER_MIN,
    DECODE_DEFAULTS,
    DEFAULT_SHARD_SIZE,
    JobSettings,
)


def test_defaults_stay_out_of_the_params_and_read_back_as_defaults() -> None:
    settings = JobSettings({"temperature": 0.5, "seed": None})
    assert settings.to_params() == {"temperature": 0.5, "seed": None, "shard_size": 512}
    assert JobSettings.from_params(settings.to_params()) == settings
    assert JobSettings.from_params(None) == JobSettings()
    assert JobSettings().shard_size == DEFAULT_SHARD_SIZE


def test_every_setting_round_trips_and_notes_are_not_settings() -> None:
    settings = JobSettings({"max_new_tokens": 9}, 7, "Be brief.", 3, "bf16", 5, True, 300)
    params = settings.to_params(input_size=10, resume_from="old")
    assert params == {
        "max_new_tokens": 9,
        "shard_size": 7,
        "system": "Be brief.",
        "n": 3,
        "dtype": "bf16",
        "max_attempts": 5,
        "adapt_draft": True,
        "adapt_after": 300,
        "input_size": 10,
        "resume_from": "old",
    }
    assert JobSettings.from_params(params) == settings


def test_a_sample_takes_defaults_then_the_job_then_its_line() -> None:
    settings = JobSettings({"temperature": 0.5, "seed": None, "top_p": 0.9})
    decode = settings.decode_for({"top_p": 0.8, "n": 2})
    assert set(decode) == set(JOB_DECODE_KEYS)
    assert decode["temperature"] == 0.5 and decode["top_p"] == 0.8
    assert decode["seed"] == DECODE_DEFAULTS.seed  # unset in the job: the default
    assert settings.greedy({"temperature": 0}) and not settings.greedy({})
    assert JobSettings().greedy({})


def test_the_first_adaptation_waits_for_a_share_of_the_job_within_bounds() -> None:
    adapting = JobSettings(adapt_draft=True)
    assert adapting.adapt_first(1_000) == ADAPT_AFTER_MIN  # 5% is 50: too few to learn from
    assert adapting.adapt_first(10_000) == 500
    assert adapting.adapt_first(1_000_000) == ADAPT_AFTER
    assert JobSettings(adapt_draft=True, adapt_after=7).adapt_first(1_000_000) == 7
