"""Tensors to and from the comm layer without copies.

A CPU tensor goes to the comm layer as a numpy view of its own memory
(``tensor.detach().numpy()``; bfloat16, which numpy lacks, as an int16 view
reinterpreted as ``ml_dtypes.bfloat16``), so an in-place collective writes straight
into the tensor. A tensor on a device goes through the :class:`DeviceTensors` in use
(:data:`DEVICES`): for CUDA tensors, as the tensor itself, which the comm layer's
:func:`~mpitrain.backends.backend_for` hands to the GPU backend (a zero-copy CuPy view
through DLPack); its data is produced on torch's current stream of its device, which
:func:`producer_stream` names to the async calls, so the engine reads it only once that
work is done. Results come back the same ways: ``torch.from_numpy`` for host arrays,
the device's ``from_buffer`` (``torch.from_dlpack``) for device arrays, on the input's
device.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from ..backends import backend_for
from ..dtypes import BFLOAT16
from ..errors import DtypeError


class DeviceTensors(Protocol):
    """How the tensors of one kind of device reach the comm layer."""

    def owns(self, tensor: torch.Tensor) -> bool:
        """True for tensors of this device."""

    def to_buffer(self, tensor: torch.Tensor) -> Any:
        """What the comm layer takes for ``tensor`` (writing into it writes the tensor)."""

    def from_buffer(self, array: Any) -> torch.Tensor | None:
        """A tensor sharing a comm-layer result's memory; ``None`` if not this device's."""

    def stream(self, tensor: torch.Tensor) -> Any:
        """The stream whose work produces ``tensor``'s data (``None``: the current one)."""

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in host memory (for what mpitrain reduces on the host only)."""

    def to_device(self, result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A host ``result`` moved to ``like``'s device."""


class CudaTensors:
    """CUDA tensors: handed to the comm layer as they are (the CuPy backend wraps them
    through DLPack), results back through ``torch.from_dlpack``; their data is produced
    on torch's current stream of their device."""

    def owns(self, tensor: torch.Tensor) -> bool:
        """True for CUDA tensors."""
        return tensor.is_cuda

    def to_buffer(self, tensor: torch.Tensor) -> Any:
        """The tensor itself, once a GPU backend is known to take it."""
        try:
            backend_for(tensor)
        except DtypeError:
            raise DtypeError(f"{tensor.device.type} tensors need an mpitrain GPU backend "
                             "(cupy), which is not available here; install cupy or move the "
                             "tensor to the CPU with .cpu()") from None
        return tensor

    def from_buffer(self, array: Any) -> torch.Tensor | None:
        """``torch.from_dlpack`` of a device result."""
        if not hasattr(array, "__dlpack__"):
            return None
        return torch.from_dlpack(array)

    def stream(self, tensor: torch.Tensor) -> Any:
        """torch's current stream of the tensor's device."""
        return torch.cuda.current_stream(tensor.device)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor.cpu()``."""
        return tensor.cpu()

    def to_device(self, result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``result.to(like.device)``."""
        return result.to(like.device)


DEVICES: list[DeviceTensors] = [CudaTensors()]
"""The device kinds tried, in order, for a tensor that is not in host memory (tests put
a fake GPU first, which claims CPU tensors, to run the device path without a GPU)."""


def device_of(tensor: torch.Tensor) -> DeviceTensors | None:
    """The device kind that owns ``tensor``, or ``None`` for host tensors."""
    for device in DEVICES:
        if device.owns(tensor):
            return device
    return None


def require_tensor(tensor: Any) -> torch.Tensor:
    """``tensor`` if it is a :class:`torch.Tensor`, else a :class:`~mpitrain.DtypeError`
    that names what it is (the check of every collective's tensor arguments)."""
    if not isinstance(tensor, torch.Tensor):
        raise DtypeError(f"expected a torch.Tensor, got {type(tensor).__name__}: {tensor!r:.60}")
    return tensor


def as_buffer(tensor: torch.Tensor) -> Any:
    """A zero-copy array view of ``tensor``'s memory that the comm layer accepts."""
    t = require_tensor(tensor).detach()
    if t.is_sparse:
        raise DtypeError("sparse tensors cannot be reduced directly; use "
                         "DistributedOptimizer(sparse_as_dense=True) or tensor.to_dense()")
    device = device_of(t)
    if device is not None:
        return device.to_buffer(t)
    if not t.is_cpu:
        raise DtypeError(f"{t.device.type} tensors need an mpitrain GPU backend (cupy), "
                         "which is not available here; install cupy or move the tensor to "
                         "the CPU with .cpu()")
    return host_view(t)


def host_view(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """The numpy view of a CPU tensor's memory (bfloat16 through ml_dtypes)."""
    if t.dtype == torch.bfloat16:
        if BFLOAT16 is None:
            raise DtypeError("bfloat16 tensors need ml_dtypes: pip install 'mpitrain[bf16]'")
        return t.view(torch.int16).numpy().view(BFLOAT16)
    if t.dtype == torch.bool:
        raise DtypeError(f"dtype {t.dtype} is not supported; cast with .to(torch.uint8)")
    return t.numpy()


def from_host(array: np.ndarray[Any, Any]) -> torch.Tensor:
    """A CPU tensor sharing a numpy array's memory (bfloat16 through an int16 view)."""
    if BFLOAT16 is not None and array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def from_buffer(array: Any) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (a comm-layer result)."""
    if isinstance(array, torch.Tensor):
        return array
    if type(array) is np.ndarray:
        return from_host(array)
    for device in DEVICES:
        tensor = device.from_buffer(array)
        if tensor is not None:
            return tensor
    if isinstance(array, np.ndarray):
        return from_host(array)
    raise DtypeError(f"cannot make a tensor of a {type(array).__name__}")


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor; a host tensor itself."""
    device = device_of(tensor)
    return device.host_copy(tensor) if device is not None else tensor


def to_device_of(like: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """A host ``result`` of the device tensor ``like``'s operation, on ``like``'s device
    (``result`` itself where ``like`` is a host tensor)."""
    device = device_of(like)
    return device.to_device(result, like) if device is not None else result


def producer_stream(tensor: torch.Tensor) -> Any:
    """The stream that produces a device tensor's data, for the async calls' ``stream=``
    (``None`` for host tensors)."""
    device = device_of(tensor)
    return device.stream(tensor) if device is not None else None
