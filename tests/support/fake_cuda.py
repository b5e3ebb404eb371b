"""A CPU tensor dressed as a CUDA one for DLPack consumers (TVM-FFI), on machines without a GPU.

:class:`FakeCuda` hands out a DLPack capsule with the tensor's shape, strides and dtype but
device ``(kDLCUDA, 0)`` and a made-up, suitably aligned address. A compiled kernel's TVM-FFI
entry then checks every argument (dtype, rank, strides, alignment, device) exactly as on a
GPU machine, and fails only when its host code first calls the CUDA runtime, which is how a
CPU test proves a call's arguments are what the kernel was compiled for. The address is
never dereferenced on the host.
"""

from __future__ import annotations

import ctypes
import itertools

import torch

__all__ = ["DRIVER_ERROR", "FakeCuda", "fake_cuda_args"]

# What a CuTe DSL host function raises on its first CUDA runtime call without a GPU/driver.
DRIVER_ERROR = r"cudaErrorInsufficientDriver|cudaErrorNoDevice|CUDA driver"

_KDL_CUDA = 2
_DL_CODES = {torch.bfloat16: (4, 16), torch.float16: (2, 16), torch.float32: (2, 32), torch.int32: (0, 32)}


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    pass


_Managed._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_addresses = itertools.count(1)


class FakeCuda:
    """``tensor``'s metadata as a CUDA DLPack tensor at a fresh 256-byte aligned fake address
    (plus ``misalign`` bytes). The structures stay alive with the object (no deleter)."""

    def __init__(self, tensor: torch.Tensor, misalign: int = 0) -> None:
        self.tensor = tensor
        self.address = (next(_addresses) << 28) + misalign
        self._keep: list[object] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_KDL_CUDA, 0)

    def __dlpack__(self, stream: object = None, **_: object) -> object:
        t = self.tensor
        shape = (ctypes.c_int64 * t.dim())(*t.shape)
        strides = (ctypes.c_int64 * t.dim())(*t.stride())
        code, bits = _DL_CODES[t.dtype]
        managed = _Managed()
        managed.dl_tensor = _DLTensor(
            self.address, _Device(_KDL_CUDA, 0), t.dim(), _DType(code, bits, 1), shape, strides, 0
        )
        self._keep += [managed, shape, strides]
        return _capsule_new(ctypes.addressof(managed), b"dltensor", None)


def fake_cuda_args(args: tuple) -> tuple:
    """``args`` with every torch tensor replaced by a :class:`FakeCuda`."""
    return tuple(FakeCuda(a) if isinstance(a, torch.Tensor) else a for a in args)
