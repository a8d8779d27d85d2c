"""Configuration: every MPITRAIN_* variable checked when mpitrain starts, unknown names
warned with the closest known one, and the rank-prefixed log level."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

import pytest

import mpitrain as mt
from mpitrain import config, session


@pytest.mark.parametrize("name, value", [
    ("MPITRAIN_FUSION_THRESHOLD", "lots"), ("MPITRAIN_CHECK", "perhaps"),
    ("MPITRAIN_STAGING_SLOTS", "0"), ("MPITRAIN_STALL_ACTION", "explode"),
    ("MPITRAIN_CYCLE_TIME_MS", "soon"), ("MPITRAIN_LOG_LEVEL", "loud"),
])
def test_an_invalid_value_is_refused_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(mt.ArgumentError, match=f"{name}='{value}' is not valid"):
        config.check_environment({name: value})


def test_valid_values_and_the_variables_that_are_not_settings_pass() -> None:
    env = {"MPITRAIN_FUSION_THRESHOLD": "1M", "MPITRAIN_CHECK": "0", "MPITRAIN_RESTART": "2",
           "MPITRAIN_COMPILE": "1", "MPITRAIN_LOG_LEVEL": "debug", "MPITRAIN_ALGORITHM": "",
           "OTHER": "x"}
    assert config.check_environment(env) == []


@pytest.mark.parametrize("name, closest", [
    ("MPITRAIN_ALGORTHM", "MPITRAIN_ALGORITHM"),
    ("MPITRAIN_FUSION_THRESHHOLD", "MPITRAIN_FUSION_THRESHOLD"),
    ("MPITRAIN_STALL_WARNING", "MPITRAIN_STALL_WARNING_S"),
])
def test_a_misspelt_name_is_warned_with_the_closest_known_one(name: str, closest: str) -> None:
    (warning,) = config.check_environment({name: "ring"})
    assert warning.startswith(f"{name} is not an mpitrain setting and is ignored")
    assert f"did you mean {closest}?" in warning


def test_a_name_close_to_nothing_points_to_the_list() -> None:
    (warning,) = config.check_environment({"MPITRAIN_FOO": "1"})
    assert "did you mean" not in warning and "describe()" in warning


def test_log_level_prefixes_the_rank(monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger("mpitrain")
    saved = (logger.level, logger.propagate, list(logger.handlers))
    monkeypatch.setenv("MPITRAIN_LOG_LEVEL", "info")
    monkeypatch.setattr(session, "_log_handler", None)
    try:
        session.configure_logging(3)
        logger.info("hello")
        logger.debug("not shown")
    finally:
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
        logger.handlers[:] = saved[2]
    err = capsys.readouterr().err
    assert "[rank 3] mpitrain INFO: hello" in err and "not shown" not in err


def test_init_warns_once_about_an_unknown_name() -> None:
    """A fresh process (one rank): init() refuses a bad value and warns on a typo."""
    code = "import mpitrain as mt; mt.init(); print('initialised')"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPITRAIN_")}
    env["MPITRAIN_ALGORTHM"] = "ring"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("MPITRAIN_ALGORTHM is not an mpitrain setting") == 1
    assert "did you mean MPITRAIN_ALGORITHM?" in run.stderr
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "MPITRAIN_FUSION_THRESHOLD": "lots"}, timeout=120,
                         check=False)
    assert bad.returncode != 0 and "initialised" not in bad.stdout
    assert "MPITRAIN_FUSION_THRESHOLD='lots' is not valid" in bad.stderr


def test_settings_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Settings snapshot reads every communicator setting from its variable once, takes
    overrides, parses texts in changed(), and stays what it was when the environment
    changes afterwards."""
    assert {f.name for f in dataclasses.fields(config.Settings)} == set(config.SETTING_OF)
    assert set(config.AGREED) | set(config.AT_CREATION) <= set(config.SETTING_OF)
    values = {"algorithm": ("RING", "ring"), "segment_bytes": ("4K", 4096),
              "tuning_file": ("t.json", "t.json"), "check": ("0", False),
              "shm": ("off", False), "single_copy": ("0", False),
              "fusion_threshold": ("1M", 1 << 20), "cycle_time_ms": ("2.5", 2.5),
              "inter_segment_bytes": ("0", 0), "cross_ranks": ("0", 0),
              "cuda_aware": ("1", True), "device_links": ("IPC", "ipc"),
              "staging_slots": ("7", 7),
              "stall_warning_s": ("off", 0.0), "stall_timeout_s": ("3", 3.0),
              "stall_action": ("abort", "abort"), "elastic": ("1", True)}
    assert set(values) == set(config.SETTING_OF)
    for name in values:
        monkeypatch.delenv(config.SETTING_OF[name].name, raising=False)
    default = config.Settings.from_environment()
    assert default == config.Settings()
    for name, (text, _) in values.items():
        monkeypatch.setenv(config.SETTING_OF[name].name, text)
    snapshot = config.Settings.from_environment(check=True)
    for name, (_, value) in values.items():
        want = True if name == "check" else value  # the override wins
        assert getattr(snapshot, name) == want, name
    monkeypatch.setenv("MPITRAIN_SEGMENT_BYTES", "8K")
    assert snapshot.segment_bytes == 4096, "a snapshot never rereads the environment"
    changed = default.changed(segment_bytes="64K", algorithm="Ring", check="no")
    assert (changed.segment_bytes, changed.algorithm, changed.check) == (65536, "ring", False)
    assert changed.agreed() == tuple((n, getattr(changed, n)) for n in config.AGREED)
    with pytest.raises(mt.ArgumentError, match="MPITRAIN_SEGMENT_BYTES='lots' is not valid"):
        default.changed(segment_bytes="lots")
    with pytest.raises(mt.ArgumentError, match="unknown settings"):
        default.changed(segments=4)
    with pytest.raises(mt.ArgumentError, match="MPITRAIN_STAGING_SLOTS to 1 or more"):
        default.changed(staging_slots=0)
    monkeypatch.setenv("MPITRAIN_CYCLE_TIME_MS", "soon")
    with pytest.raises(mt.ArgumentError, match="MPITRAIN_CYCLE_TIME_MS='soon'"):
        config.Settings.from_environment()


def test_a_setting_sees_each_new_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPITRAIN_CHECK", "0")
    assert config.CHECK.get() is False
    monkeypatch.setenv("MPITRAIN_CHECK", "yes")
    assert config.CHECK.get() is True
    monkeypatch.setenv("MPITRAIN_SEGMENT_BYTES", "2K")
    assert config.SEGMENT_BYTES.get() == 2048
    monkeypatch.setenv("MPITRAIN_SEGMENT_BYTES", "bad")
    with pytest.raises(mt.ArgumentError, match="MPITRAIN_SEGMENT_BYTES='bad' is not valid"):
        config.SEGMENT_BYTES.get()
