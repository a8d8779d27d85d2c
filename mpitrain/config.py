"""All of mpitrain's configuration, read in one place.

Precedence: keyword argument > ``MPITRAIN_*`` environment variable > its Horovod
alias (``HOROVOD_*``, :data:`ALIASES`) > default. Each setting is read through
:meth:`Setting.get` so that a test can change the environment and see the change
without re-importing anything. Aliases are resolved once, off that path: when this
module is imported and again by :func:`resolve_aliases` (``mt.init()`` calls it).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from .errors import ArgumentError

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 0/1/true/false, got {text!r}")


def _parse_size(text: str) -> int:
    """Parse a byte count with an optional K/M/G suffix (powers of 1024)."""
    stripped = text.strip().upper().removesuffix("B").removesuffix("I")
    factor = 1
    for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if stripped.endswith(suffix):
            stripped, factor = stripped[:-1], mult
            break
    value = int(float(stripped) * factor)
    if value < 0:
        raise ValueError(f"a size must be >= 0, got {text!r}")
    return value


def _parse_count(text: str) -> int:
    """Parse an integer >= 1."""
    value = int(text.strip())
    if value < 1:
        raise ValueError(f"expected an integer >= 1, got {text!r}")
    return value


@dataclass(frozen=True)
class _AliasValue:
    """A Horovod variable resolved for a setting: our spelling of its value, or why
    the value is not valid."""

    name: str
    text: str
    error: str = ""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One ``MPITRAIN_*`` variable: its name, parser, default and meaning.

    :meth:`get` reads the variable now. The collectives never call it: a communicator
    reads its settings once, into a :class:`Settings` snapshot.
    """

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str
    _alias: _AliasValue | None = field(default=None, repr=False, compare=False)

    def get(self, override: T | None = None) -> T:
        """Return ``override`` if given, else the parsed variable, else the default."""
        if override is not None:
            return override
        text = os.environ.get(self.name, "")
        if not text:
            alias = self._alias
            if alias is None:
                return self.default
            if alias.error:
                raise ArgumentError(alias.error)
            text = alias.text
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ArgumentError(f"{self.name}={text!r} is not valid: {exc}") from None


ALGORITHM = Setting("MPITRAIN_ALGORITHM", str, "auto",
                    "Default algorithm for every collective (auto, ring, mpi, ...).")
SEGMENT_BYTES = Setting("MPITRAIN_SEGMENT_BYTES", _parse_size, 0,
                        "Pipeline segment size of the ring in bytes (a chunk is cut into at "
                        "most 256 segments); 0 chooses by size.")
TUNING_FILE = Setting("MPITRAIN_TUNING_FILE", str, "",
                      "JSON file written by mpitrain-tune that overrides the selection table.")
CHECK = Setting("MPITRAIN_CHECK", _parse_bool, True,
                "Cross-rank validation of every collective's arguments before data moves.")
SHM = Setting("MPITRAIN_SHM", _parse_bool, True,
              "Use shared-memory windows between the ranks of one node (validation, shm "
              "algorithm); read when a communicator is created.")
SINGLE_COPY = Setting("MPITRAIN_SINGLE_COPY", _parse_bool, True,
                      "Let ranks of one node read each other's buffers directly "
                      "(process_vm_readv) in the single_copy algorithm; read when a "
                      "communicator is created, off on every rank if off on any.")

FUSION_THRESHOLD = Setting("MPITRAIN_FUSION_THRESHOLD", _parse_size, 64 << 20,
                           "Async allreduces are packed into fusion buffers of up to this "
                           "many bytes; 0 turns fusion off.")
CYCLE_TIME_MS = Setting("MPITRAIN_CYCLE_TIME_MS", float, 1.0,
                        "Async engine: pause after a cycle in which nothing moved, and the "
                        "longest sleep while polling for other ranks (milliseconds).")
TIMELINE = Setting("MPITRAIN_TIMELINE", str, "",
                   "Chrome-trace file that rank 0 writes the async engine's timeline to.")
INTER_SEGMENT_BYTES = Setting("MPITRAIN_INTER_SEGMENT_BYTES", _parse_size, 60 << 10,
                              "Largest message of the inter-node phases of hierarchical "
                              "algorithms; 0: as MPITRAIN_SEGMENT_BYTES.")
CROSS_RANKS = Setting("MPITRAIN_CROSS_RANKS", int, 1,
                      "Hierarchical allreduce: how many ranks of each node exchange across "
                      "nodes; 1 sends each node's sum through its first rank (one connection "
                      "per pair of nodes), 0 every local rank its own shard in parallel.")


def _parse_seconds(text: str) -> float:
    """Seconds as a float; 0 (or ``off``/``none``) turns the feature off."""
    if text.strip().lower() in ("off", "none", "never"):
        return 0.0
    value = float(text)
    if value < 0:
        raise ValueError(f"seconds must be >= 0, got {text!r}")
    return value


def _parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        lowered = text.strip().lower()
        if lowered not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return lowered
    return parse


STALL_WARNING_S = Setting("MPITRAIN_STALL_WARNING_S", _parse_seconds, 60.0,
                          "Warn when a collective has waited this long for other ranks (0: "
                          "never); read when a Communicator is created.")
STALL_TIMEOUT_S = Setting("MPITRAIN_STALL_TIMEOUT_S", _parse_seconds, 0.0,
                          "Raise StallError (or abort) after this long; 0: wait forever.")
STALL_ACTION = Setting("MPITRAIN_STALL_ACTION", _parse_choice("raise", "abort"), "raise",
                       "At the stall timeout: raise mt.StallError, or abort the whole job.")
ABORT_ON_EXCEPTION = Setting("MPITRAIN_ABORT_ON_EXCEPTION", _parse_bool, True,
                             "mt.init() installs an excepthook that ends the whole job when "
                             "one rank raises an uncaught exception.")
ELASTIC = Setting("MPITRAIN_ELASTIC", _parse_bool, False,
                  "The job runs under ULFM (mpitrain-run --elastic): a failing rank kills "
                  "itself by signal so that the survivors are notified.")
SUPERVISOR_FD = Setting("MPITRAIN_SUPERVISOR_FD", int, -1,
                        "Set by mpitrain-run --elastic on every rank: the pipe to the rank's "
                        "supervisor, which turns an early exit into a rank failure.")
MPIEXEC = Setting("MPITRAIN_MPIEXEC", str, "",
                  "mpiexec used by mpitrain-run (default: next to python, then PATH).")

CUDA_AWARE: Setting[bool | None] = Setting(
    "MPITRAIN_CUDA_AWARE", _parse_bool, None,
    "1: hand device buffers to MPI; 0: stage them through host memory; unset: ask MPI.")
DEVICE_LINKS = Setting("MPITRAIN_DEVICE_LINKS", _parse_choice("auto", "ipc", "nccl", "none"),
                       "auto",
                       "Device-to-device links that device buffers may take besides MPI: auto "
                       "(CUDA IPC inside a node, NCCL where every rank has its own GPU), ipc, "
                       "nccl, or none (MPI only: CUDA-aware or staged).")
STAGING_SLOTS = Setting("MPITRAIN_STAGING_SLOTS", _parse_count, 4,
                        "Pinned host segments per direction when staging device buffers.")
FALLBACK_NOTICE = Setting("MPITRAIN_FALLBACK_NOTICE", _parse_bool, True,
                          "mt.init() says once, on rank 0, when the engine runs without its "
                          "compiled core (slower), why, and how to build it; 0 silences it.")
LOG_LEVEL = Setting("MPITRAIN_LOG_LEVEL",
                    _parse_choice("debug", "info", "warning", "error", "critical"), "",
                    "Level of the 'mpitrain' logger; when set, its lines go to stderr "
                    "prefixed with the rank (unset: Python's logging configuration).")


def _parse_auto_size(text: str) -> int | None:
    """``auto`` (None) or a byte count as :func:`_parse_size` reads it."""
    return None if text.strip().lower() == "auto" else _parse_size(text)


GRAD_BATCH_BYTES: Setting[int | None] = Setting(
    "MPITRAIN_GRAD_BATCH_BYTES", _parse_auto_size, None,
    "DistributedOptimizer: hold final gradients until this many bytes are ready, then "
    "start their allreduces together (0: each as soon as it is final, as Horovod); unset "
    "or auto: 0, or 8M where host gradients are reduced on one node and no core is "
    "spare for the async engine's thread.")


@dataclass(frozen=True)
class Settings:
    """The settings of one communicator, read once: a snapshot that its dispatcher, its
    async engine and the algorithms they plan are given.

    :meth:`from_environment` reads them (keyword argument > ``MPITRAIN_*`` > Horovod
    alias > default) when a :class:`~mpitrain.Communicator` is created; nothing reads
    the environment per call. A setting changed later reaches a communicator through
    :meth:`mpitrain.Communicator.configure` (collective), never by itself.

    The settings that decide which messages a collective sends (:data:`AGREED`) must
    be the same on every rank: a communicator compares them when it is created and at
    every ``configure``, and raises :class:`~mpitrain.MismatchError` on every rank if
    they differ.
    """

    algorithm: str = ALGORITHM.default
    segment_bytes: int = SEGMENT_BYTES.default
    tuning_file: str = TUNING_FILE.default
    check: bool = CHECK.default
    shm: bool = SHM.default
    single_copy: bool = SINGLE_COPY.default
    fusion_threshold: int = FUSION_THRESHOLD.default
    cycle_time_ms: float = CYCLE_TIME_MS.default
    inter_segment_bytes: int = INTER_SEGMENT_BYTES.default
    cross_ranks: int = CROSS_RANKS.default
    cuda_aware: bool | None = None
    device_links: str = DEVICE_LINKS.default
    staging_slots: int = STAGING_SLOTS.default
    stall_warning_s: float = STALL_WARNING_S.default
    stall_timeout_s: float = STALL_TIMEOUT_S.default
    stall_action: str = STALL_ACTION.default
    elastic: bool = ELASTIC.default

    def __post_init__(self) -> None:
        for name, setting in SETTING_OF.items():
            value = getattr(self, name)
            if isinstance(value, str) and setting.parse is not str:  # "" reads as unset
                object.__setattr__(self, name, _parsed(setting, value) if value.strip()
                                   else setting.default)
        if self.staging_slots < 1:
            raise ArgumentError(f"staging needs at least one pinned slot per direction, got "
                                f"staging_slots={self.staging_slots}; set "
                                "MPITRAIN_STAGING_SLOTS to 1 or more")
        object.__setattr__(self, "algorithm", self.algorithm.lower())

    @classmethod
    def from_environment(cls, **overrides: Any) -> Settings:
        """The settings as the environment gives them now, with ``overrides`` (keyword
        arguments named as the fields; ``None`` is no override).

        Raises:
            ArgumentError: a variable whose value is not valid, naming it.
        """
        unknown = sorted(set(overrides) - set(SETTING_OF))
        if unknown:
            raise ArgumentError(f"unknown settings {unknown}; the settings are "
                                f"{', '.join(SETTING_OF)}")
        values = {name: setting.get(overrides.get(name)) for name, setting in
                  SETTING_OF.items()}
        return cls(**values)

    def changed(self, **changes: Any) -> Settings:
        """These settings with ``changes`` (keyword arguments named as the fields; a
        text is parsed as the variable's value would be)."""
        unknown = sorted(set(changes) - set(SETTING_OF))
        if unknown:
            raise ArgumentError(f"unknown settings {unknown}; the settings are "
                                f"{', '.join(SETTING_OF)}")
        return dataclasses.replace(self, **changes)

    def agreed(self) -> tuple[tuple[str, Any], ...]:
        """The ``(name, value)`` of every setting in :data:`AGREED`."""
        return tuple((name, getattr(self, name)) for name in AGREED)


def _parsed(setting: Setting[Any], text: str) -> Any:
    try:
        return setting.parse(text)
    except ValueError as exc:
        raise ArgumentError(f"{setting.name}={text!r} is not valid: {exc}") from None


SETTING_OF: dict[str, Setting[Any]] = {
    "algorithm": ALGORITHM, "segment_bytes": SEGMENT_BYTES, "tuning_file": TUNING_FILE,
    "check": CHECK, "shm": SHM, "single_copy": SINGLE_COPY,
    "fusion_threshold": FUSION_THRESHOLD, "cycle_time_ms": CYCLE_TIME_MS,
    "inter_segment_bytes": INTER_SEGMENT_BYTES, "cross_ranks": CROSS_RANKS,
    "cuda_aware": CUDA_AWARE, "device_links": DEVICE_LINKS, "staging_slots": STAGING_SLOTS,
    "stall_warning_s": STALL_WARNING_S, "stall_timeout_s": STALL_TIMEOUT_S,
    "stall_action": STALL_ACTION, "elastic": ELASTIC,
}
"""The field of :class:`Settings` that each communicator setting fills."""

AGREED = ("algorithm", "segment_bytes", "check", "inter_segment_bytes", "cross_ranks",
          "device_links")
"""Settings that every rank of a communicator must share: they decide the algorithm of a
call, its messages and whether it is validated. The rules of the tuning file are
compared too (its contents, not its path, which may differ between nodes). The fusion
threshold needs no agreement: the ranks of a cycle use the smallest."""

AT_CREATION = ("shm", "single_copy", "stall_warning_s", "stall_timeout_s", "stall_action",
               "elastic")
"""Settings that shape what a communicator is made of (its shared memory, its stall
inspector): fixed when it is created. ``configure`` refuses to change them."""


ALL_SETTINGS: tuple[Setting[Any], ...] = tuple(
    value for value in list(globals().values()) if isinstance(value, Setting))
OTHER_NAMES = frozenset({"MPITRAIN_RESTART", "MPITRAIN_COMPILE", "MPITRAIN_ELASTIC_REPORT",
                         "MPITRAIN_TEST_EVERY_CASE"})
"""Variables that are not settings: set by ``mpitrain-run --max-restarts`` for the
script, read by ``setup.py``, set by ``mpitrain-run --elastic`` for
:mod:`mpitrain.run_rank`, read by the test suite (``tests/conftest.py``)."""


HOROVOD_LOG_LEVELS = {"trace": "debug", "debug": "debug", "info": "info", "warning": "warning",
                      "error": "error", "fatal": "critical"}
"""Horovod's log levels and the ``MPITRAIN_LOG_LEVEL`` each becomes."""


def _same(text: str) -> str | None:
    return text


def _horovod_log_level(text: str) -> str | None:
    lowered = text.strip().lower()
    if lowered not in HOROVOD_LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(HOROVOD_LOG_LEVELS)}, got {text!r}")
    return HOROVOD_LOG_LEVELS[lowered]


def _horovod_timeline(text: str) -> str | None:
    """Horovod's ``DYNAMIC`` only allows ``start_timeline()``, which works here anyway."""
    return None if text.strip().upper() == "DYNAMIC" else text


def _horovod_stall_check_disable(text: str) -> str | None:
    return "0" if _parse_bool(text) else None


@dataclass(frozen=True)
class Alias:
    """A Horovod variable that sets one of our settings when ours is not set.

    ``translate`` turns Horovod's text into ours: ``None`` when that value changes
    nothing, ``ValueError`` when it is not valid.
    """

    name: str
    setting: Setting[Any]
    translate: Callable[[str], str | None] = _same
    note: str = ""


ALIASES: tuple[Alias, ...] = (
    Alias("HOROVOD_FUSION_THRESHOLD", FUSION_THRESHOLD,
          note="bytes in both (ours also takes K/M/G)"),
    Alias("HOROVOD_CYCLE_TIME", CYCLE_TIME_MS, note="milliseconds in both"),
    Alias("HOROVOD_TIMELINE", TIMELINE, _horovod_timeline,
          "`DYNAMIC` sets nothing (`hvd.start_timeline()` works without it)"),
    Alias("HOROVOD_STALL_CHECK_DISABLE", STALL_WARNING_S, _horovod_stall_check_disable,
          "`1` sets 0 (no warning) and wins over `HOROVOD_STALL_CHECK_TIME_SECONDS`"),
    Alias("HOROVOD_STALL_CHECK_DISABLE", STALL_TIMEOUT_S, _horovod_stall_check_disable,
          "`1` sets 0 (no timeout) and wins over `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`"),
    Alias("HOROVOD_STALL_CHECK_TIME_SECONDS", STALL_WARNING_S, note="seconds in both"),
    Alias("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", STALL_TIMEOUT_S,
          note="seconds in both; at the timeout a stalled collective raises `StallError` "
               "(`MPITRAIN_STALL_ACTION=abort` ends the job)"),
    Alias("HOROVOD_LOG_LEVEL", LOG_LEVEL, _horovod_log_level,
          "`trace` becomes `debug`, `fatal` becomes `critical`"),
)
"""Horovod's variables that mpitrain reads, in the order they are resolved."""

WITHOUT_COUNTERPART = {
    "HOROVOD_TIMELINE_MARK_CYCLES": "mpitrain's timeline has no cycle markers",
    "HOROVOD_CACHE_CAPACITY": "the engine's cache of operation names is not configurable",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "across nodes the selection table picks algorithm "
                                      "'hierarchical' for large messages; "
                                      "MPITRAIN_ALGORITHM=hierarchical forces it",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "across nodes the selection table picks algorithm "
                                      "'hierarchical' for large messages; "
                                      "MPITRAIN_ALGORITHM=hierarchical forces it",
    "HOROVOD_AUTOTUNE": "run mpitrain-tune once and set MPITRAIN_TUNING_FILE to its output",
}
"""Horovod variables often set that mpitrain does not read, with what to do instead."""


def _resolve(alias: Alias, raw: str) -> _AliasValue | None:
    """``raw`` (the alias's value) in our spelling, checked; ``None`` if it sets nothing."""
    try:
        text = alias.translate(raw)
        if text is None:
            return None
        alias.setting.parse(text)
    except ValueError as exc:
        return _AliasValue(alias.name, "", f"{alias.name}={raw!r} is not valid: {exc}; fix "
                                           "or unset it")
    return _AliasValue(alias.name, text)


def resolve_aliases(environ: Mapping[str, str] | None = None) -> list[tuple[int, str]]:
    """Give each setting the value of its Horovod alias (:data:`ALIASES`) where the
    alias is set and our variable is not; a setting's earlier alias wins.

    Runs when this module is imported and in ``mt.init()``; :meth:`Setting.get` only
    reads the result. An alias whose value is not valid makes the setting's ``get()``
    raise, naming the alias.

    Returns:
        What to log, as ``(logging level, message)``: each alias in use (INFO), each
        alias ignored because our variable or an earlier alias is set (WARNING).
    """
    env = os.environ if environ is None else environ
    chosen: dict[str, _AliasValue] = {}
    messages = []
    for alias in ALIASES:
        raw = env.get(alias.name, "")
        target = alias.setting.name
        if not raw:
            continue
        if env.get(target, ""):
            messages.append((logging.WARNING, f"{alias.name}={raw!r} is ignored: "
                             f"{target}={env[target]!r} is set and takes precedence"))
            continue
        value = _resolve(alias, raw)
        if value is None:
            continue
        if target in chosen:
            messages.append((logging.WARNING, f"{alias.name}={raw!r} is ignored: "
                             f"{chosen[target].name} already sets {target}"))
            continue
        chosen[target] = value
        if not value.error:
            messages.append((logging.INFO, f"{alias.name}={raw!r} is read as "
                             f"{target}={value.text!r}"))
    for setting in ALL_SETTINGS:
        object.__setattr__(setting, "_alias", chosen.get(setting.name))
    return messages


def _check_horovod(env: Mapping[str, str]) -> list[str]:
    """Raise for the first alias whose value is not valid; warn for each ``HOROVOD_*``
    variable that mpitrain does not read."""
    warnings = []
    aliased = {alias.name for alias in ALIASES}
    for name in sorted(n for n in env if n.startswith("HOROVOD_")):
        if name not in aliased:
            hint = WITHOUT_COUNTERPART.get(
                name, "the HOROVOD_* variables that mpitrain reads are in "
                      "docs/configuration.md")
            warnings.append(f"{name} has no effect in mpitrain ({hint})")
            continue
        for alias in ALIASES:
            value = _resolve(alias, env[name]) if alias.name == name and env[name] else None
            if value is not None and value.error:
                raise ArgumentError(value.error)
    return warnings


def check_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """Parse every ``MPITRAIN_*`` variable and every Horovod alias that is set; return a
    warning for each name that mpitrain does not know, with the closest known name, and
    for each ``HOROVOD_*`` variable that has no effect here.

    Raises:
        ArgumentError: naming the first variable whose value is not valid.
    """
    env = os.environ if environ is None else environ
    known = {setting.name: setting for setting in ALL_SETTINGS}
    warnings = []
    for name in sorted(n for n in env if n.startswith("MPITRAIN_")):
        setting = known.get(name)
        if setting is not None:
            if env[name]:
                try:
                    setting.parse(env[name])
                except ValueError as exc:
                    raise ArgumentError(f"{name}={env[name]!r} is not valid: {exc}; fix or "
                                        "unset it") from None
        elif name not in OTHER_NAMES:
            suffixes = {n.removeprefix("MPITRAIN_"): n for n in [*known, *OTHER_NAMES]}
            close = difflib.get_close_matches(name.removeprefix("MPITRAIN_"), suffixes, n=1,
                                              cutoff=0.6)
            hint = f"did you mean {suffixes[close[0]]}?" if close else \
                "python -c 'import mpitrain.config as c; print(c.describe())' lists them"
            warnings.append(f"{name} is not an mpitrain setting and is ignored ({hint})")
    return warnings + _check_horovod(env)


def describe() -> str:
    """Return a human-readable table of every setting and its current value."""
    lines = []
    for setting in ALL_SETTINGS:
        lines.append(f"{setting.name:32s} = {setting.get()!r:12}  {setting.doc}")
    return "\n".join(lines)


parse_size = _parse_size
parse_bool = _parse_bool
resolve_aliases()
