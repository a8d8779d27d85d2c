"""All of mpitrain's configuration, read in one place.

Precedence: keyword argument > ``MPITRAIN_*`` environment variable > default.
Each setting is read through :func:`get` so that a test can change the environment
and see the change without re-importing anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

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
class Setting(Generic[T]):
    """One ``MPITRAIN_*`` variable: its name, parser, default and meaning."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    def get(self, override: T | None = None) -> T:
        """Return ``override`` if given, else the parsed variable, else the default."""
        if override is not None:
            return override
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ArgumentError(f"{self.name}={raw!r} is not valid: {exc}") from None


ALGORITHM = Setting("MPITRAIN_ALGORITHM", str, "auto",
                    "Default algorithm for every collective (auto, ring, mpi, ...).")
SEGMENT_BYTES = Setting("MPITRAIN_SEGMENT_BYTES", _parse_size, 0,
                        "Pipeline segment size of the ring in bytes; 0 chooses by size.")
TUNING_FILE = Setting("MPITRAIN_TUNING_FILE", str, "",
                      "JSON file written by mpitrain-tune that overrides the selection table.")

CUDA_AWARE: Setting[bool | None] = Setting(
    "MPITRAIN_CUDA_AWARE", _parse_bool, None,
    "1: hand device buffers to MPI; 0: stage them through host memory; unset: ask MPI.")
STAGING_SLOTS = Setting("MPITRAIN_STAGING_SLOTS", _parse_count, 4,
                        "Pinned host segments per direction when staging device buffers.")

ALL_SETTINGS: tuple[Setting[object], ...] = (  # type: ignore[assignment]
    ALGORITHM, SEGMENT_BYTES, TUNING_FILE, CUDA_AWARE, STAGING_SLOTS)


def describe() -> str:
    """Return a human-readable table of every setting and its current value."""
    lines = []
    for setting in ALL_SETTINGS:
        lines.append(f"{setting.name:32s} = {setting.get()!r:12}  {setting.doc}")
    return "\n".join(lines)


parse_size = _parse_size
parse_bool = _parse_bool
