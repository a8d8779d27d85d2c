"""Tensors to and from the comm layer without copies.

A CPU tensor goes to the comm layer as a numpy view of its own memory
(``tensor.detach().numpy()``; bfloat16, which numpy lacks, as an int16 view
reinterpreted as ``ml_dtypes.bfloat16``), so an in-place collective writes straight
into the tensor. A CUDA tensor goes as it is: the comm layer's
:func:`~mpitrain.backends.backend_for` hands it to the GPU backend that owns it
(through ``__cuda_array_interface__``/DLPack). Results come back the same ways:
``torch.from_numpy`` for host arrays, ``torch.from_dlpack`` for device arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..backends import backend_for
from ..dtypes import BFLOAT16
from ..errors import DtypeError


def as_buffer(tensor: torch.Tensor) -> Any:
    """A zero-copy array view of ``tensor``'s memory that the comm layer accepts."""
    if not isinstance(tensor, torch.Tensor):
        raise DtypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    t = tensor.detach()
    if t.is_sparse:
        raise DtypeError("sparse tensors cannot be reduced directly; use "
                         "DistributedOptimizer(sparse_as_dense=True) or tensor.to_dense()")
    if t.device.type == "cpu":
        if t.dtype == torch.bfloat16:
            if BFLOAT16 is None:
                raise DtypeError("bfloat16 tensors need ml_dtypes: pip install 'mpitrain[bf16]'")
            return t.view(torch.int16).numpy().view(BFLOAT16)
        if t.dtype == torch.bool:
            raise DtypeError(f"dtype {t.dtype} is not supported; cast with .to(torch.uint8)")
        return t.numpy()
    try:
        backend_for(t)
    except DtypeError:
        raise DtypeError(f"{t.device.type} tensors need an mpitrain GPU backend (cupy), which "
                         "is not available here; install cupy or move the tensor to the CPU "
                         "with .cpu()") from None
    return t


def from_buffer(array: Any) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (a comm-layer result)."""
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        if BFLOAT16 is not None and array.dtype == BFLOAT16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    return torch.from_dlpack(array)
