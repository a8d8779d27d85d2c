"""Horovod's HOROVOD_* variables as aliases of MPITRAIN_* settings: every alias, the
precedence of ours, the messages once per process, unknown names and bad values."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import mpitrain as mt
from mpitrain import config


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No MPITRAIN_*/HOROVOD_* variable from outside; aliases re-resolved afterwards."""
    for name in list(os.environ):
        if name.startswith(("MPITRAIN_", "HOROVOD_")):
            monkeypatch.delenv(name)
    config.resolve_aliases()
    yield
    monkeypatch.undo()
    config.resolve_aliases()


def use(monkeypatch: pytest.MonkeyPatch, **env: str) -> list[tuple[int, str]]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return config.resolve_aliases()


@pytest.mark.parametrize("name, value, setting, expected", [
    ("HOROVOD_FUSION_THRESHOLD", "33554432", config.FUSION_THRESHOLD, 32 << 20),
    ("HOROVOD_FUSION_THRESHOLD", "0", config.FUSION_THRESHOLD, 0),
    ("HOROVOD_CYCLE_TIME", "3.5", config.CYCLE_TIME_MS, 3.5),
    ("HOROVOD_TIMELINE", "/tmp/t.json", config.TIMELINE, "/tmp/t.json"),
    ("HOROVOD_TIMELINE", "DYNAMIC", config.TIMELINE, ""),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "30", config.STALL_WARNING_S, 30.0),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "120", config.STALL_TIMEOUT_S, 120.0),
    ("HOROVOD_STALL_CHECK_DISABLE", "1", config.STALL_WARNING_S, 0.0),
    ("HOROVOD_STALL_CHECK_DISABLE", "1", config.STALL_TIMEOUT_S, 0.0),
    ("HOROVOD_STALL_CHECK_DISABLE", "0", config.STALL_WARNING_S, 60.0),
    ("HOROVOD_LOG_LEVEL", "TRACE", config.LOG_LEVEL, "debug"),
    ("HOROVOD_LOG_LEVEL", "fatal", config.LOG_LEVEL, "critical"),
    ("HOROVOD_LOG_LEVEL", "warning", config.LOG_LEVEL, "warning"),
])
def test_each_alias_sets_its_setting(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                     setting: config.Setting[Any], expected: Any) -> None:
    use(monkeypatch, **{name: value})
    assert setting.get() == expected
    assert setting.get(override=expected or 7) == (expected or 7)  # the keyword still wins
    assert config.check_environment() == []


def test_every_alias_is_tested_here() -> None:
    tested = {"HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_TIMELINE",
              "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
              "HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_LOG_LEVEL"}
    assert {alias.name for alias in config.ALIASES} == tested


def test_an_alias_in_use_is_said_at_info(monkeypatch: pytest.MonkeyPatch) -> None:
    messages = use(monkeypatch, HOROVOD_FUSION_THRESHOLD="1048576")
    assert messages == [(logging.INFO, "HOROVOD_FUSION_THRESHOLD='1048576' is read as "
                                       "MPITRAIN_FUSION_THRESHOLD='1048576'")]


def test_ours_wins_and_the_alias_is_said_to_be_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    messages = use(monkeypatch, HOROVOD_CYCLE_TIME="9", MPITRAIN_CYCLE_TIME_MS="2")
    assert config.CYCLE_TIME_MS.get() == 2.0
    assert messages == [(logging.WARNING, "HOROVOD_CYCLE_TIME='9' is ignored: "
                                          "MPITRAIN_CYCLE_TIME_MS='2' is set and takes precedence")]
    monkeypatch.delenv("MPITRAIN_CYCLE_TIME_MS")  # ours is read live; the alias was not chosen
    assert config.CYCLE_TIME_MS.get() == 1.0
    config.resolve_aliases()
    assert config.CYCLE_TIME_MS.get() == 9.0


def test_stall_check_disable_wins_over_the_stall_times(monkeypatch: pytest.MonkeyPatch) -> None:
    messages = use(monkeypatch, HOROVOD_STALL_CHECK_DISABLE="true",
                   HOROVOD_STALL_CHECK_TIME_SECONDS="5",
                   HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="50")
    assert config.STALL_WARNING_S.get() == 0.0 and config.STALL_TIMEOUT_S.get() == 0.0
    ignored = [m for level, m in messages if level == logging.WARNING]
    assert ignored == [
        "HOROVOD_STALL_CHECK_TIME_SECONDS='5' is ignored: HOROVOD_STALL_CHECK_DISABLE already "
        "sets MPITRAIN_STALL_WARNING_S",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='50' is ignored: HOROVOD_STALL_CHECK_DISABLE "
        "already sets MPITRAIN_STALL_TIMEOUT_S"]


@pytest.mark.parametrize("name, value, setting", [
    ("HOROVOD_FUSION_THRESHOLD", "lots", config.FUSION_THRESHOLD),
    ("HOROVOD_FUSION_THRESHOLD", "-5", config.FUSION_THRESHOLD),
    ("HOROVOD_CYCLE_TIME", "soon", config.CYCLE_TIME_MS),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "-1", config.STALL_WARNING_S),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "later", config.STALL_TIMEOUT_S),
    ("HOROVOD_STALL_CHECK_DISABLE", "perhaps", config.STALL_WARNING_S),
    ("HOROVOD_LOG_LEVEL", "loud", config.LOG_LEVEL),
])
def test_a_bad_alias_value_is_refused_naming_the_alias(
        monkeypatch: pytest.MonkeyPatch, name: str, value: str,
        setting: config.Setting[Any]) -> None:
    use(monkeypatch, **{name: value})
    expected = f"{name}='{value}' is not valid: .*fix or unset it"
    with pytest.raises(mt.ArgumentError, match=expected):
        config.check_environment()
    with pytest.raises(mt.ArgumentError, match=expected):
        setting.get()
    assert setting.get(override=setting.default or 1) is not None  # a keyword needs no variable


@pytest.mark.parametrize("name, hint", [
    ("HOROVOD_TIMELINE_MARK_CYCLES", "no cycle markers"),
    ("HOROVOD_CACHE_CAPACITY", "not configurable"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "MPITRAIN_ALGORITHM=hierarchical"),
    ("HOROVOD_AUTOTUNE", "mpitrain-tune"),
    ("HOROVOD_GPU_OPERATIONS", "docs/configuration.md"),
])
def test_a_horovod_name_without_counterpart_is_warned(name: str, hint: str) -> None:
    (warning,) = config.check_environment({name: "1"})
    assert warning.startswith(f"{name} has no effect in mpitrain (") and hint in warning


def test_resolving_a_mapping_does_not_leak_into_other_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, HOROVOD_TIMELINE="x.json")
    assert config.TIMELINE.get() == "x.json" and config.FUSION_THRESHOLD.get() == 64 << 20
    monkeypatch.delenv("HOROVOD_TIMELINE")
    config.resolve_aliases()
    assert config.TIMELINE.get() == ""


def run_init(env: dict[str, str], code: str = "pass") -> subprocess.CompletedProcess[str]:
    script = f"import mpitrain as mt; mt.init(); {code}; mt.shutdown(); mt.init(); print('ok')"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MPITRAIN_", "HOROVOD_"))}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**base, **env}, timeout=120, check=False)


def test_init_logs_each_message_once_per_process() -> None:
    """A fresh process (one rank), initialised twice: every line appears once."""
    run = run_init({"HOROVOD_CYCLE_TIME": "4", "MPITRAIN_CYCLE_TIME_MS": "2",
                    "HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_AUTOTUNE": "1",
                    "MPITRAIN_LOG_LEVEL": "info"},
                   "from mpitrain import config; assert config.FUSION_THRESHOLD.get() == 1024")
    assert run.returncode == 0, run.stderr
    err = run.stderr
    assert err.count("HOROVOD_CYCLE_TIME='4' is ignored: MPITRAIN_CYCLE_TIME_MS='2' is set") == 1
    assert err.count("HOROVOD_FUSION_THRESHOLD='1024' is read as "
                     "MPITRAIN_FUSION_THRESHOLD='1024'") == 1
    assert err.count("HOROVOD_AUTOTUNE has no effect in mpitrain") == 1


def test_init_refuses_a_bad_alias_and_horovod_log_level_applies() -> None:
    bad = run_init({"HOROVOD_FUSION_THRESHOLD": "lots"})
    assert bad.returncode != 0 and "ok" not in bad.stdout
    assert "HOROVOD_FUSION_THRESHOLD='lots' is not valid" in bad.stderr
    info = run_init({"HOROVOD_LOG_LEVEL": "INFO", "HOROVOD_CYCLE_TIME": "3"})
    assert info.returncode == 0, info.stderr
    assert "[rank 0] mpitrain INFO: mpitrain: HOROVOD_CYCLE_TIME='3' is read as" in info.stderr
