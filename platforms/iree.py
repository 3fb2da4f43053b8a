"""IREE as a compiler under test: ``iree:vulkan`` and ``iree:llvm-cpu``.

The route: an ExportedProgram (core ATen) -> ``iree.turbine.aot.export`` -> torch-dialect MLIR
(the case's artifact, ``program.mlir``) -> ``iree.compiler.compile_str(input_type="torch")`` for the
device -> a ``.vmfb`` -> ``iree.runtime`` on the Vulkan driver, or on the local-task driver for
``llvm-cpu``. ``iree:llvm-cpu`` is the control of ``iree:vulkan``: the same route on a mature device,
so a case that fails on Vulkan and passes there is the Vulkan compiler's fault, not the export's.

What is particular to IREE stays here:

- The Vulkan compile target is the adapter IREE opens: ``--iree-vulkan-target=llvmpipe`` on
  lavapipe (found by its name, not assumed); elsewhere IREE's default target, or
  ``$TAPML_IREE_VULKAN_TARGET`` (an IREE target name such as ``rdna3`` or ``ampere``).
- Results come back through a host-visible staging buffer from the device's own allocator:
  ``DeviceArray.to_host()`` imports a numpy allocation, which lavapipe refuses (its
  ``minImportedHostPointerAlignment`` is 4096).
- bfloat16 crosses as ``ml_dtypes.bfloat16`` arrays; every output's count, dtype and shape are
  held to the program's, never cast.
"""

from __future__ import annotations

import json
import os
import re
import struct

import torch
from pydantic import RootModel

from tapml.graph import dtype_name, torch_dtype
from tapml.platforms.backend import Backend, BackendRefused, Compiled, seconds_per_run
from tapml.schema import ClosedSchema, Count, SchemaError, Str, validate

#: env: the IREE Vulkan target to compile for (``--iree-vulkan-target``) instead of the one detected;
#: ``none``: no ``--iree-vulkan-target`` flag (IREE's generic SPIR-V)
VULKAN_TARGET_ENV = "TAPML_IREE_VULKAN_TARGET"
#: IREE's Vulkan target for Mesa's CPU Vulkan driver (lavapipe, which names its device "llvmpipe ...")
LAVAPIPE_TARGET = "llvmpipe"

_DRIVERS = {"iree:vulkan": "vulkan", "iree:llvm-cpu": "local-task"}
# a generic CPU, not "host": a compiled blob may be cached and loaded again on another machine
_LLVM_CPU_FLAGS = ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
                   "--iree-llvmcpu-target-cpu=generic"]
# the blob is this magic, the output metas' JSON length (4 bytes, little-endian), the JSON, then the vmfb
_BLOB_MAGIC = b"TAPML-IREE-VMFB-1\n"
_MAX_META_BYTES = 1 << 20
_ERROR_LINE_CHARS = 240


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    found = {}
    for package in ("iree-base-compiler", "iree-base-runtime", "iree-turbine"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "unknown"
    return found


def _cpu_name() -> str:
    import platform
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _numpy_dtype(dtype: torch.dtype):
    import ml_dtypes
    import numpy as np
    if dtype == torch.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty((), dtype=dtype).numpy().dtype


def _to_numpy(t: torch.Tensor):
    """A CPU tensor as a numpy array of the same dtype (bfloat16 as ml_dtypes.bfloat16)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_numpy_dtype(torch.bfloat16))
    return t.numpy()


def _to_torch(a, dtype: torch.dtype) -> torch.Tensor:
    """A numpy array from the device as a tensor of ``dtype``, which must be its own (no casts)."""
    import numpy as np
    if a.dtype != _numpy_dtype(dtype):
        raise TypeError(f"is {a.dtype}, the program's output is {dtype}")
    if dtype == torch.bfloat16:
        # (np.ascontiguousarray would make a 0-d array 1-d)
        return torch.from_numpy(np.array(a, copy=True).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True))


def _output_metas(program) -> list[dict]:
    """Shape and dtype of each output of an ExportedProgram, as its graph declares them."""
    out = next(n for n in program.graph.nodes if n.op == "output")
    metas = []
    for value in out.args[0]:
        val = getattr(value, "meta", {}).get("val")
        if not isinstance(val, torch.Tensor):
            raise BackendRefused(f"output {len(metas)} is not a tensor ({type(val).__name__})")
        # a data-dependent size (nonzero, masked_select) is a symbol: None, checked by the runtime alone
        shape = [s if isinstance(s, int) else None for s in val.shape]
        metas.append({"shape": shape, "dtype": dtype_name(val.dtype)})
    return metas


def pack_blob(metas: list[dict], vmfb: bytes) -> bytes:
    """The compiled form kept by a cache: the outputs' metas and the vmfb, in one byte string."""
    head = json.dumps(metas, separators=(",", ":")).encode()
    return _BLOB_MAGIC + struct.pack("<I", len(head)) + head + vmfb


class OutputMetaJSON(ClosedSchema):
    """An output's shape (``null`` for a size only known at run time) and dtype name, as a blob's
    header holds it."""

    shape: list[Count | None]
    dtype: Str


class BlobMetasJSON(RootModel[list[OutputMetaJSON]]):
    """The header of a tapml IREE blob: one :class:`OutputMetaJSON` per output."""


def unpack_blob(blob: bytes) -> tuple[list[dict], bytes]:
    """``(metas, vmfb)`` of a :func:`pack_blob` byte string; ValueError when it is not one."""
    if not isinstance(blob, (bytes, bytearray)) or not blob.startswith(_BLOB_MAGIC):
        raise ValueError("not a tapml IREE blob (bad magic)")
    at = len(_BLOB_MAGIC)
    if len(blob) < at + 4:
        raise ValueError("tapml IREE blob is truncated")
    (n,) = struct.unpack_from("<I", blob, at)
    if n > _MAX_META_BYTES or len(blob) < at + 4 + n:
        raise ValueError("tapml IREE blob is truncated or its header is too long")
    try:
        metas = json.loads(bytes(blob[at + 4:at + 4 + n]))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"tapml IREE blob has a malformed header ({e})") from None
    try:
        metas = validate(BlobMetasJSON, metas, "metas").root
    except SchemaError as e:
        raise ValueError(f"tapml IREE blob has malformed output metas: {e}") from None
    for m in metas:
        torch_dtype(m.dtype)  # a closed list of names: ValueError for any other
    return [{"shape": list(m.shape), "dtype": m.dtype} for m in metas], bytes(blob[at + 4 + n:])


def read_back(device, result):
    """A result of an IREE call as a numpy array; a device array copied through a host-visible staging
    buffer from ``device``'s own allocator (``DeviceArray.to_host()`` imports a numpy allocation,
    which lavapipe refuses: its minImportedHostPointerAlignment is 4096)."""
    import iree.runtime as rt
    import numpy as np
    if not isinstance(result, rt.DeviceArray):
        return np.asarray(result)
    view = result._buffer_view  # noqa: SLF001 - the public to_host() is what fails on lavapipe
    dtype = result._get_raw_dtype()  # noqa: SLF001
    source = view.get_buffer()
    nbytes = source.byte_length()
    if nbytes == 0:
        return np.empty(view.shape, dtype=result.dtype)
    staging = device.allocator.allocate_buffer(
        memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
        allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
        allocation_size=nbytes)
    semaphore = device.create_semaphore(0)
    device.queue_copy(source, staging, wait_semaphores=rt.HalFence.create_at(semaphore, 0),
                      signal_semaphores=rt.HalFence.create_at(semaphore, 1))
    rt.HalFence.create_at(semaphore, 1).wait()
    count = int(np.prod(view.shape, dtype=np.int64))
    host = np.array(staging.map().asarray([nbytes // np.dtype(dtype).itemsize], dtype)[:count], copy=True)
    host = host.reshape(view.shape)
    return host.astype(result.dtype) if result.dtype != dtype else host  # IREE holds bool as i8


def run_mlir(artifact: bytes, inputs: list, dtypes: list, driver: str, flags: list) -> list:
    """Compile torch-dialect MLIR with ``flags`` and run it on IREE's ``driver``: numpy arrays in and
    out, bfloat16 as float32 (``dtypes`` names each input's dtype). What a repro folder's runner calls."""
    import iree.compiler
    import iree.runtime as rt
    import ml_dtypes
    import numpy as np
    vmfb = iree.compiler.compile_str(artifact.decode(), input_type="torch", extra_args=flags)
    config = own_config(driver)
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    args = [np.asarray(a).astype(ml_dtypes.bfloat16) if d == "bfloat16" else np.asarray(a) for a, d in zip(inputs, dtypes)]
    results = context.modules.module["main"](*args)
    results = results if isinstance(results, (list, tuple)) else [results]
    out = [read_back(config.device, r) for r in results]
    return [o.astype(np.float32) if o.dtype == ml_dtypes.bfloat16 else o for o in out]


def own_config(driver: str):
    """An ``iree.runtime.Config`` on a device of ``driver`` that nothing else holds: freed with the
    Config. ``Config(driver)`` would open the device through iree.runtime's process-wide cache,
    which keeps it, and the threads of a Vulkan device on lavapipe spin without pause (2 CPU-seconds
    per second, runs or not) until the process ends (benchmarks/NOTES.md, "IREE's lavapipe
    threads never rest")."""
    import iree.runtime as rt
    from iree.runtime.system_setup import get_device
    return rt.Config(device=get_device(driver, cache=False))


class _Loaded:
    """A vmfb loaded on the backend's device: its ``main`` function and the outputs it must give."""

    def __init__(self, function, metas: list[dict]):
        self.function = function
        self.metas = metas


class IreeBackend(Backend):
    """IREE 3.x through iree-turbine: ``iree:vulkan`` (SPIR-V on the Vulkan adapter IREE opens) and
    ``iree:llvm-cpu`` (the local-task CPU driver; the control of ``iree:vulkan``).

    Example::

        tapml replay STORE --target iree:vulkan
    """

    forms = ("iree:vulkan", "iree:llvm-cpu")
    needs = "pip install 'tapml[backends]' (iree-base-compiler, iree-base-runtime, iree-turbine, ml_dtypes)"
    #: the same route on the CPU; ``iree:llvm-cpu`` itself has none (set per instance)
    control = "iree:llvm-cpu"

    def __init__(self, spec: str):
        super().__init__(spec)
        import iree.compiler  # noqa: F401 - fail here, with the install hint, not at the first compile
        import iree.runtime as rt
        import iree.turbine.aot  # noqa: F401
        if spec not in _DRIVERS:
            raise ValueError(f"IreeBackend takes {', '.join(self.forms)}, not {spec!r}")
        self.control = "iree:llvm-cpu" if spec == "iree:vulkan" else None
        self.driver = _DRIVERS[spec]
        devices = rt.get_driver(self.driver).query_available_devices()
        if not devices:
            raise RuntimeError(f"IREE's {self.driver} driver finds no device")
        # Config opens the driver's default device: the first one it lists (the CPU's is named "default")
        self.device_name = str(devices[0].get("name") or "") if self.driver == "vulkan" else f"{_cpu_name()} (local-task)"
        self.config = own_config(self.driver)
        self.compile_flags = self._compile_flags()

    def _compile_flags(self) -> list[str]:
        if self.driver != "vulkan":
            return list(_LLVM_CPU_FLAGS)
        target = os.environ.get(VULKAN_TARGET_ENV) or (LAVAPIPE_TARGET if "llvmpipe" in self.device_name else None)
        flags = ["--iree-hal-target-device=vulkan"]
        return flags + [f"--iree-vulkan-target={target}"] if target and target != "none" else flags

    def describe(self) -> dict:
        versions = _versions()
        return {"device": self.device_name, "driver": self.driver, "compile_flags": self.compile_flags,
                "versions": versions,
                # the compile cache keys on this: a change of IREE or of the compile target recompiles
                "version": f"iree {versions['iree-base-compiler']} runtime {versions['iree-base-runtime']} "
                           f"turbine {versions['iree-turbine']} {' '.join(self.compile_flags)}"}

    def refuse(self, program) -> str | None:
        if not any(n.op == "output" for n in program.graph.nodes):
            return "the program has no output"
        return None

    def compile(self, program) -> Compiled:
        import iree.compiler
        import iree.turbine.aot
        from iree.turbine.aot.decompositions import current_aot_decompositions
        metas = _output_metas(program)
        try:
            # iree-turbine applies its own decompositions only to a module it exports itself; a program
            # handed to it gets them here, so the route is the one its users run (batch norm decomposed)
            program = program.run_decompositions(current_aot_decompositions())
            mlir = str(iree.turbine.aot.export(program).mlir_module)
        except Exception as e:  # noqa: BLE001 - the route's own failure, said as such
            raise BackendRefused(f"iree-turbine could not import the program: {type(e).__name__}: {e}") from None
        try:
            vmfb = iree.compiler.compile_str(mlir, input_type="torch", extra_args=self.compile_flags)
        except iree.compiler.CompilerToolError as e:
            raise BackendRefused(f"iree-compile failed: {_compiler_message(e)}", artifact=mlir.encode(),
                                 artifact_name="program.mlir") from None  # the MLIR, kept for the case's repro
        blob = pack_blob(metas, bytes(vmfb))
        return Compiled(handle=self._load(metas, bytes(vmfb)), artifact=mlir.encode(), artifact_name="program.mlir",
                        blob=blob)

    def load(self, blob: bytes) -> object:
        return self._load(*unpack_blob(blob))

    def _load(self, metas: list[dict], vmfb: bytes) -> _Loaded:
        import iree.runtime as rt
        context = rt.SystemContext(config=self.config)
        context.add_vm_module(rt.VmModule.copy_buffer(self.config.vm_instance, vmfb))
        return _Loaded(context.modules.module["main"], metas)

    def run(self, compiled: Compiled, inputs: list) -> list:
        loaded = compiled.handle if isinstance(compiled, Compiled) else compiled
        results = loaded.function(*[_to_numpy(t) for t in inputs])
        results = list(results) if isinstance(results, (list, tuple)) else [results]
        if len(results) != len(loaded.metas):
            raise RuntimeError(f"IREE returned {len(results)} outputs; the program has {len(loaded.metas)}")
        outputs = []
        for i, (result, meta) in enumerate(zip(results, loaded.metas)):
            dtype = torch_dtype(meta["dtype"])
            try:
                tensor = _to_torch(read_back(self.config.device, result), dtype)
            except TypeError as e:
                raise RuntimeError(f"output {i} {e}") from None
            if len(tensor.shape) != len(meta["shape"]) or any(
                    want is not None and got != want for got, want in zip(tensor.shape, meta["shape"])):
                raise RuntimeError(f"output {i} has shape {list(tensor.shape)}; the program's is {meta['shape']}")
            outputs.append(tensor)
        return outputs

    def time_resident(self, compiled: Compiled, inputs: list, repeat: int) -> float:
        """Seconds per run with the inputs in device buffers made once (``asdevicearray``) and the
        results left in theirs: IREE's exported function waits for its work before it returns."""
        import iree.runtime as rt
        loaded = compiled.handle if isinstance(compiled, Compiled) else compiled
        args = [rt.asdevicearray(self.config.device, _to_numpy(t)) for t in inputs]
        return seconds_per_run(lambda: loaded.function(*args), repeat)

    def repro_runner(self) -> str:
        """A module that runs a case's ``program.mlir`` with IREE alone (for ``tapml repro`` folders):
        the same compile flags and driver, the same staging readback; bfloat16 travels as float32."""
        import inspect
        return ('"""Run program.mlir with IREE alone: pip install iree-base-compiler iree-base-runtime ml_dtypes."""\n\n'
                f"DRIVER = {self.driver!r}\nFLAGS = {self.compile_flags!r}\n\n\n"
                + inspect.getsource(read_back) + "\n\n" + inspect.getsource(own_config) + "\n\n"
                + inspect.getsource(run_mlir) + "\n\n"
                "def run(artifact, inputs, dtypes):\n    return run_mlir(artifact, inputs, dtypes, DRIVER, FLAGS)\n")

    def close(self) -> None:
        self.config = None


def _compiler_message(error) -> str:
    """iree-compile's diagnostics, what matters of them: each ``error:`` line (its location and the
    target attribute it may print, kilobytes long, cut off) with the torch op it points at, without
    the generic "failed to run translation" line, the command line and the hint about temporary files."""
    lines = str(error).splitlines()
    errors = []
    for i, line in enumerate(lines):
        if "error: " not in line:
            continue
        text = re.sub(r'\s*loc\(".*$', "", line.split("error: ", 1)[1].strip())[:_ERROR_LINE_CHARS]
        source = next((m.group(0) for m in (re.search(r"torch\.aten\.[\w.]+", s) for s in lines[i + 1:i + 2]) if m), None)
        errors.append(f"{text} (at {source})" if source and source not in text else text)
    specific = [e for e in errors if not e.startswith("failed to run translation")]
    if specific or errors:
        return " | ".join(dict.fromkeys(specific or errors))
    text = str(error).split("Invoked with:", 1)[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip())[:_ERROR_LINE_CHARS * 2]
