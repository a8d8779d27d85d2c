"""Whether the GPU tests can run here: CuPy importable and at least one CUDA device.

``requires_gpu`` skips a test (or module) cleanly, naming what is missing.
"""

from __future__ import annotations

from typing import Any

import pytest


def _probe() -> tuple[Any, str]:
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, driver too old, no device
        return None, f"no usable CUDA device ({exc})"
    if count == 0:
        return None, "no CUDA device"
    return cupy, ""


cupy, SKIP_REASON = _probe()
requires_gpu = pytest.mark.skipif(cupy is None, reason=f"GPU tests skipped: {SKIP_REASON}")


def use_local_device(local_rank: int) -> int:
    """Make GPU ``local_rank % count`` current (ranks of a node share GPUs); its id."""
    assert cupy is not None
    device = local_rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    return device


_SPIN = r"""
extern "C" __global__ void spin(unsigned long long nanoseconds) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < nanoseconds);
}
"""


def occupy_default_stream(seconds: float) -> Any:
    """Queue a kernel that keeps the legacy default stream (CuPy's null stream, torch's
    default stream) busy for about ``seconds`` (by the GPU's nanosecond timer), and
    return an event recorded after it: work that waits for that stream is done only
    once the event is."""
    assert cupy is not None
    kernel = cupy.RawKernel(_SPIN, "spin")
    with cupy.cuda.Stream.null:
        kernel((1,), (1,), (cupy.uint64(int(seconds * 1e9)),))
        busy = cupy.cuda.Event(disable_timing=True)
        busy.record()
    return busy
