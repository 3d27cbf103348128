"""The workers' numeric settings from the environment: the default where unset or empty,
the value where it keeps the variable's rule, and an error naming the variable, the rule
and the value where not."""

from __future__ import annotations

import pytest

from workers.celery_app import visibility_timeout
from workers.heartbeat import heartbeat_period
from workers.shards import flush_retry_s
from workers.tasks import db_retries

# (reader, variable, default, {value: read}, values refused, the rule its error states)
READERS = [
    (heartbeat_period, "EAGLE2_HEARTBEAT_S", 10.0, {"2.5": 2.5, "inf": float("inf")},
     ["0", "-1", "nan", "soon"], "a positive number of seconds"),
    (visibility_timeout, "EAGLE2_VISIBILITY_TIMEOUT", 21600, {"54000": 54000},
     ["0", "-5", "1.5", "soon"], "a positive number of seconds"),
    (db_retries, "EAGLE2_DB_RETRIES", 10, {"0": 0, "3": 3},
     ["-1", "+3", "2.0", "many"], "a whole number of retries"),
    (flush_retry_s, "EAGLE2_DB_WRITE_RETRY_S", 60.0, {"0": 0.0, "0.5": 0.5},
     ["-1", "inf", "nan", "soon"], "a number of seconds, 0 or more"),
]  # fmt: skip


@pytest.mark.parametrize(("read", "name", "default", "good", "bad", "rule"), READERS)
def test_a_setting_reads_its_variable_or_names_what_is_wrong(
    monkeypatch, read, name, default, good, bad, rule
):
    monkeypatch.delenv(name, raising=False)
    assert read() == default
    monkeypatch.setenv(name, "")
    assert read() == default
    for value, expected in good.items():
        monkeypatch.setenv(name, value)
        assert read() == expected
    for value in bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError) as refused:
            read()
        assert str(refused.value) == f"{name} must be {rule}: {value!r}"
