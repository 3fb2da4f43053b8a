"""Host <-> device tensor conversion for WGSL buffers.

WGSL has no 64-bit integers, no bool storage and no f64: int64 travels as i32 (checked at
upload: a value that does not fit raises, it is never wrapped silently) or, where a program
holds it in two words (platforms/wgsl/int64.py), as ``i64``: its own bytes, bool as one u32 per
element, float16 as f16 with shader-f16 and else packed two to a u32 (``f16p``: the same
bytes), bfloat16 packed two to a u32 (``bf16p``: the same bytes as torch's bfloat16).
"""

from __future__ import annotations

import numpy as np
import torch

from tapml.judging.compare import I32_RANGE, INT64_OUTSIDE_I32, first_outside_i32
from tapml.errors import PlatformError, Unsupported
from tapml.graph import TensorMeta, torch_dtype


def to_device(t: torch.Tensor, storage: str, name: str = "tensor") -> bytes:
    """Bytes of ``t`` in the WGSL storage type ``storage`` (f32, f16, f16p, bf16p, i32, u32)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.float64:
        raise Unsupported(f"{name}: float64: WGSL has no 64-bit floats")
    if storage == "f32":
        arr = t.to(torch.float32).numpy()
    elif storage in ("f16", "f16p"):
        arr = t.to(torch.float16).numpy()
    elif storage == "bf16p":
        arr = t.to(torch.bfloat16).view(torch.int16).numpy()
    elif storage == "u32":
        arr = (t != 0).numpy().astype(np.uint32)
    elif storage == "i32":
        bad = first_outside_i32(t)
        if bad is not None:  # the int64 policy of tapml.judging.compare: the same reason as for an output
            raise Unsupported(f"{name}: {INT64_OUTSIDE_I32}: int64 value {bad} does not fit in i32 "
                              f"(values must lie in [{I32_RANGE[0]}, {I32_RANGE[1]}])")
        arr = t.to(torch.int32).numpy()
    elif storage == "i64":  # two words, low first: the bytes of a little-endian int64
        arr = t.to(torch.int64).numpy().astype("<i8")
    elif storage == "u64":  # the same for a uint64
        arr = t.to(torch.uint64).numpy().astype("<u8")
    elif storage == "c64":  # real, imaginary: torch's own complex64 bytes
        arr = torch.view_as_real(t.to(torch.complex64)).numpy()
    elif storage == "c32":  # real, imaginary float16 in one word: torch's own complex32 bytes
        arr = torch.view_as_real(t.to(torch.complex32).resolve_conj()).numpy()
    else:
        raise ValueError(f"unknown storage type {storage!r}")
    data = arr.tobytes()
    if len(data) % 4:
        data += b"\0" * (4 - len(data) % 4)
    return data


#: the bytes one element takes in each WGSL storage type (packed halves: two to a u32)
STORAGE_BYTES = {"f32": 4, "f16": 2, "f16p": 2, "bf16p": 2, "i32": 4, "u32": 4, "i64": 8, "c64": 8, "u64": 8, "c32": 4}


def to_device_chunks(t: torch.Tensor, storage: str, name: str = "tensor", chunk_bytes: int = 64 << 20):
    """:func:`to_device` of ``t`` a chunk at a time: yields ``(byte offset, bytes)`` of at most
    about ``chunk_bytes`` each, so that a 1 GB weight is never converted (or staged) whole. Once a
    chunk is converted, the host pages it was read from are handed back to the kernel
    (:func:`page_out`): a store's tensors are memory-mapped, and a weight that now lives on the
    device need not stay resident on the host too."""
    flat = t.detach().cpu().reshape(-1)
    size = STORAGE_BYTES[storage]
    step = max(2, chunk_bytes // size // 2 * 2)  # even: packed halves never straddle two chunks
    for start in range(0, max(flat.numel(), 1), step):
        part = flat[start:start + step]
        yield start * size, to_device(part, storage, name)
        page_out(part)


_MADV_PAGEOUT = 21  # Linux 5.4+; semantics-preserving: clean file pages are dropped, the rest kept


def page_out(t: torch.Tensor, min_bytes: int = 1 << 20) -> None:
    """Ask the kernel to reclaim the host pages under ``t`` (``madvise(MADV_PAGEOUT)``): the
    values stay the same (file-backed pages are read again on the next touch). A hint: where the
    call is not available it does nothing."""
    import sys
    nbytes = t.numel() * t.element_size()
    if sys.platform != "linux" or t.device.type != "cpu" or nbytes < min_bytes or not t.is_contiguous():
        return
    global _madvise
    if _madvise is None:
        import ctypes
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        except (OSError, AttributeError):
            fn = False
        _madvise = fn
    if _madvise:
        import mmap
        start = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor only
        end = (t.data_ptr() + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            _madvise(start, end - start, _MADV_PAGEOUT)


_madvise = None


_NP = {"f32": np.float32, "f16": np.float16, "f16p": np.float16, "bf16p": np.int16, "i32": np.int32,
       "u32": np.uint32, "i64": np.dtype("<i8"), "c64": np.complex64, "u64": np.dtype("<u8")}


def from_device(data, storage: str, meta: TensorMeta) -> torch.Tensor:
    """The tensor ``meta`` describes, from a buffer's bytes (int results back to int64)."""
    n = meta.numel
    if storage == "c32":  # float16 pairs
        pairs = np.frombuffer(bytes(data), dtype=np.float16, count=2 * n) if n else np.zeros(0, np.float16)
        return torch.view_as_complex(torch.from_numpy(pairs.copy()).reshape(*meta.shape, 2))
    arr = np.frombuffer(bytes(data), dtype=_NP[storage], count=n) if n else np.zeros(0, _NP[storage])
    dtype = torch_dtype(meta.dtype)
    if storage == "u32":
        t = torch.from_numpy(arr.astype(np.bool_))
    elif storage == "bf16p":
        t = torch.from_numpy(arr.copy()).view(torch.bfloat16).to(dtype)
    else:
        t = torch.from_numpy(arr.copy()).to(dtype)
    return t.reshape(meta.shape)


def unwritten_bools(data, meta: TensorMeta) -> int:
    """Elements of a u32 bool buffer that hold neither 0 nor 1 (left unwritten: poison)."""
    arr = np.frombuffer(bytes(data), dtype=np.uint32, count=meta.numel)
    return int(((arr != 0) & (arr != 1)).sum())


def read_output(data, storage: str, meta: TensorMeta, name: str) -> torch.Tensor:
    """Output ``name`` from its buffer's bytes; raises PlatformError when a bool output has
    elements no kernel wrote (still poison), since those would read back as ``True``."""
    if storage == "u32":
        bad = unwritten_bools(data, meta)
        if bad:
            raise PlatformError(f"{bad} elements of bool output {name} were never written")
    return from_device(data, storage, meta)
