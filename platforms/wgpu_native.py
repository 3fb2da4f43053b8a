"""The wgpu-native platform: WGSL KernelPrograms on a local adapter (Vulkan, Metal, DX12, GL).

Compilation is :func:`tapml.platforms.wgsl.compile_graph` from this device's caps; running
uploads the inputs, records every kernel into one command submission, and reads back only
the outputs (intermediates never leave the device). Pipelines are cached by the hash of
their WGSL, so programs compiled elsewhere (``KernelProgram.from_json``) run as well. A
program's buffers and bind groups stay on the device between runs, and an input handed the
same unmodified tensor as last time is not uploaded again (weights cross once).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import tempfile
import time
import weakref

import torch

from tapml.errors import PlatformError, TapmlError, Unsupported
from tapml.graph import torch_dtype
from tapml.platforms.base import KernelProgram
from tapml.platforms.program_cache import ProgramCache
from tapml.platforms.wgsl.registry import low_precision_paths
from tapml.platforms.wgsl_platform import WgslPlatform

if not os.environ.get("XDG_RUNTIME_DIR"):
    # Mesa's EGL prints "XDG_RUNTIME_DIR is invalid" lines on every adapter query without one.
    _runtime_dir = os.path.join(tempfile.gettempdir(), f"tapml-xdg-{os.getuid()}")
    os.makedirs(_runtime_dir, mode=0o700, exist_ok=True)
    os.environ["XDG_RUNTIME_DIR"] = _runtime_dir

BACKENDS = {"vulkan": "Vulkan", "gl": "OpenGL", "metal": "Metal", "dx12": "D3D12"}
_LIMITS = ["max-storage-buffer-binding-size", "max-buffer-size", "max-storage-buffers-per-shader-stage",
           "max-compute-workgroups-per-dimension", "max-compute-invocations-per-workgroup",
           "max-compute-workgroup-size-x", "max-compute-workgroup-size-y", "max-compute-workgroup-size-z",
           "max-compute-workgroup-storage-size", "max-bind-groups", "max-bindings-per-bind-group",
           "min-storage-buffer-offset-alignment"]
_POISON = 0xFF  # every byte 0xFF: NaN for f32/f16, -1 for i32, an invalid bool for u32
#: Outputs are poisoned from a buffer of at most this many bytes (copied chunk by chunk), and an
#: output larger than this is read back through a staging buffer made for that read only: a
#: program keeps no second copy of a large tensor (on a CPU adapter device memory is host memory).
_STAGING_BYTES = 4 << 20
_UPLOAD_CHUNK = 64 << 20  # inputs are converted, written and staged this much at a time
#: Bytes of the guard region after each guarded buffer (enable_guards), and what fills it: a
#: word no kernel writes by accident (0x3CC35AA5: neither poison, zero, nor a small number).
GUARD_BYTES = 256
_SENTINEL = bytes([0xA5, 0x5A, 0xC3, 0x3C]) * (GUARD_BYTES // 4)


def _load_triton_first() -> None:
    """Import triton, where it is installed, before wgpu loads the Vulkan/GL drivers.

    torch's CUDA builds bring triton, whose native module carries an LLVM of its own. Imported
    after Mesa's lavapipe/llvmpipe driver has loaded the system's LLVM (as torch.export does on
    first use, through torch._dynamo), it kills the process with a segfault; imported first, both
    work (measured with torch 2.14.1+cu130, triton 3.8, Mesa 22.3).
    """
    if "triton" not in sys.modules and importlib.util.find_spec("triton") is not None:
        try:
            import triton  # noqa: F401
        except ImportError:
            pass


def _parse_types_quickly() -> None:
    """Make cffi parse wgpu-py's C type names against only the typedefs they name.

    wgpu-py asks cffi for each struct it builds by name (``ffi.new("WGPUTextureDescriptor *")``,
    about 40 names per process). cffi parses each name once, but together with a ``typedef int``
    line for every typedef of wgpu's header: 14 ms a name, half a second of every process that
    opens a device. Only the typedef names that occur in a type name change how it parses (what
    they stand for is looked up afterwards, in the full table), so the parse of a type name here
    declares only those. cffi parses types under its FFI lock; anything unexpected falls back to
    cffi's own parse."""
    try:
        from wgpu.backends.wgpu_native._ffi import ffi
        parser = ffi._parser
        full_parse = type(parser).parse_type_and_quals
    except (ImportError, AttributeError):
        return
    if getattr(parser, "_tapml_quick_types", False):
        return
    identifier = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

    def parse_type_and_quals(cdecl):
        names = set(identifier.findall(cdecl))
        declarations = parser._declarations
        try:
            parser._declarations = {key: value for key, value in declarations.items()
                                    if key.startswith("typedef ") and key[8:] in names}
            ast, macros = parser._parse("void __dummy(\n%s\n);" % cdecl)[:2]
        except Exception:  # noqa: BLE001 - cffi's own parse says what is wrong with the name
            return full_parse(parser, cdecl)
        finally:
            parser._declarations = declarations
        node = ast.ext[-1].type.args.params[0]
        if macros or not hasattr(node, "type"):
            return full_parse(parser, cdecl)
        return parser._get_type_and_quals(node.type)

    parser.parse_type_and_quals = parse_type_and_quals
    parser._tapml_quick_types = True


def _adapters():
    _load_triton_first()
    import wgpu
    _parse_types_quickly()
    try:
        return wgpu.gpu.enumerate_adapters_sync()
    except Exception as e:  # noqa: BLE001 - no driver at all is "no adapters"
        raise TapmlError(f"wgpu cannot enumerate adapters ({e}); install a Vulkan/GL driver "
                         "(e.g. mesa-vulkan-drivers for lavapipe)") from None


#: A storage binding's declaration: ``var<storage, ACCESS> NAME:``.
_BINDING = re.compile(r"var<storage,[^>]*>\s*([A-Za-z_][A-Za-z0-9_]*)\s*:")
_BUFFER_NAME = re.compile(r"\b(buf_[A-Za-z0-9_]*)\b")


_NOSYNC = ["READ_NOSYNC"]  # emptied when this wgpu-py lacks the mode


def map_for_read(buffer) -> None:
    """Map a MAP_READ ``buffer`` that a copy already submitted has filled. wgpu-py's map for READ
    first submits an empty command buffer (for wgpu-native#305: data a ``write_buffer`` queued that
    no submit has flushed yet), one more round trip through the queue on every read: 0.2-0.3 ms of
    a 2.3 ms decode step on lavapipe (benchmarks/NOTES.md). Every buffer mapped here was filled
    by a submitted copy, so it maps without that submit where wgpu-py has the mode for it."""
    if _NOSYNC:
        try:
            buffer.map_sync(_NOSYNC[0])
            return
        except (KeyError, ValueError, TypeError, AttributeError):
            if buffer.map_state != "unmapped":
                raise
            _NOSYNC.clear()
    import wgpu
    buffer.map_sync(wgpu.MapMode.READ)


def canonical_bindings(wgsl: str) -> str:
    """``wgsl`` with its storage bindings renamed ``tap_b0``, ``tap_b1``... in the order they are
    declared: two kernels that differ only in the names of the buffers they bind (one op at two
    places of a model) become one shader, compiled once. Bind groups address bindings by index,
    so nothing else changes. Example: ``var<storage, read> buf_o44: array<f16>;`` -> ``... tap_b0: ...``.
    Only tapml's codegen names bindings ``buf_*``: a shader written by hand (a ``--kernel`` file)
    stays as written, so that the device's messages quote its own names."""
    names = list(dict.fromkeys(_BINDING.findall(wgsl)))
    if not names or not all(n.startswith("buf_") for n in names):
        return wgsl
    rename = {n: f"tap_b{i}" for i, n in enumerate(names)}
    return _BUFFER_NAME.sub(lambda m: rename.get(m.group(1), m.group(1)), wgsl)


def _describe(a) -> str:
    info = a.info
    return f"{info.get('backend_type')}: {info.get('device')} ({info.get('description')})"


class WgpuPlatform(WgslPlatform):
    """WebGPU through wgpu-native. ``backend`` is None (best adapter), ``"vulkan"``, ``"gl"``,
    ``"metal"`` or ``"dx12"``; raises TapmlError naming the adapters that exist when the
    requested backend has none.

    Example: ``WgpuPlatform("vulkan").run(program, [x])``.
    """

    def __init__(self, backend: str | None = None):
        if backend is not None and backend not in BACKENDS:
            raise TapmlError(f"unknown wgpu backend {backend!r}; use one of {', '.join(BACKENDS)} "
                             "(or no backend for the best adapter)")
        adapters = _adapters()
        if backend is None:
            chosen = _best(adapters)
        else:
            matching = [a for a in adapters if a.info.get("backend_type") == BACKENDS[backend]]
            chosen = matching[0] if matching else None
        if chosen is None:
            have = "; ".join(_describe(a) for a in adapters) or "none"
            want = f"{BACKENDS[backend]} adapter" if backend else "adapter"
            raise TapmlError(f"wgpu found no {want}; adapters on this machine: {have}")
        self.adapter = chosen
        self.backend = {v: k for k, v in BACKENDS.items()}.get(chosen.info.get("backend_type"),
                                                              str(chosen.info.get("backend_type")).lower())
        self.name = f"wgpu:{self.backend}"
        # subgroup: matmul variants that share loads between lanes (platforms/wgsl/matmul.py)
        # timestamp-query: per-program device times for `replay --profile` (tapml/driving/profile.py)
        features = [f for f in ("shader-f16", "subgroup", "timestamp-query") if f in chosen.features]
        limits = {k: chosen.limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size",
                                               "max-storage-buffers-per-shader-stage") if k in chosen.limits}
        try:
            self.device = chosen.request_device_sync(required_features=features, required_limits=limits)
        except Exception as e:  # noqa: BLE001
            raise TapmlError(f"wgpu could not open a device on {_describe(chosen)}: {e}") from None
        # close() drains the device through this, once; a platform dropped without close() too
        self._drain = weakref.finalize(self, _stop_polling, self.device)
        self._drain.atexit = False
        self._caps_cache = None
        self.guards = False
        super().__init__()
        # compute pipelines by WGSL hash, shared by every program that has the same kernel
        self._pipelines = ProgramCache()

    # --- caps ----------------------------------------------------------------------------
    def _caps(self) -> dict:
        if self._caps_cache is None:
            info = self.adapter.info
            lim = self.device.limits
            features = sorted(str(f) for f in self.device.features)
            self._caps_cache = {
                "adapter": f"{info.get('device')} ({info.get('description')})".strip(),
                "backend": self.backend, "cpu_adapter": str(info.get("adapter_type", "")).upper() == "CPU",
                "features": features,
                "limits": {k: int(lim[k]) for k in _LIMITS if k in lim},
                "dtypes": ["float32", "float16", "bfloat16", "int64", "int32", "bool"],
                "low_precision": low_precision_paths(features)}
        return self._caps_cache

    # --- runtime hooks -------------------------------------------------------------------
    def _pipeline(self, wgsl: str, entry: str):
        # the same kernel over other buffers is the same pipeline: bindings go by index, not name
        code = canonical_bindings(wgsl)
        key = hashlib.sha256(f"{entry}\0{code}".encode()).hexdigest()
        pipe = self._pipelines.get(key)
        if pipe is None:
            try:
                module = self.device.create_shader_module(code=code)
                pipe = self.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": entry})
            except Exception as e:  # noqa: BLE001 - a shader that does not compile is a verdict
                raise PlatformError(f"WGSL compile failed on {self.name}: {e}\n--- shader ---\n{wgsl}") from e
            self._pipelines.put(key, pipe)
        return pipe

    def _check_compiled(self, program: KernelProgram) -> None:
        for kern in program.kernels:  # the device compiles every shader now: its errors are compile errors
            self._pipeline(kern.wgsl, kern.entry)

    def _prepare(self, program: KernelProgram) -> tuple["_Resident", int]:
        """The program's pipelines, device buffers and bind groups, made once and reused by every
        run (least recently used ones are released past the cache's limits)."""
        res = _Resident(self, program)  # releases what it made when it raises
        return res, res.nbytes

    def _release(self, key: str, res: "_Resident") -> None:
        res.release()

    def enable_guards(self) -> bool:
        """Guard every buffer a kernel writes (outputs, temps) with :data:`GUARD_BYTES` of
        sentinel after its end, inside its binding so that a write past the tensor lands there
        instead of being discarded or clamped by WGSL's robustness rules; each run refills the
        guards, snapshots them after every kernel, and raises PlatformError at the first kernel
        that changed one. Programs already prepared are made again. Returns True."""
        if not self.guards:
            self.guards = True
            self.programs.clear()
        return True

    def _execute(self, program: KernelProgram, res: "_Resident", inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._run_resident(program, inputs, [])

    def _run_resident(self, program: KernelProgram, inputs: list, keep: list[int]) -> list:
        """Resident inputs are copied device-side from the output buffer of the run that made
        them into this program's input buffer; kept outputs stay in their buffers, unread."""
        from tapml.platforms.base import ResidentTensor
        from tapml.platforms.wgsl.tensors import read_output
        res = self.prepared(program)
        sources = {}
        for i, t in enumerate(inputs):
            if isinstance(t, ResidentTensor):
                src = self.programs.get(t.program)
                if src is None:
                    raise PlatformError(f"input {i}: the program holding that resident tensor was released "
                                        "(program cache full); raise TAPML_PROGRAM_CACHE")
                sources[i] = src.buffers.get(src.program.outputs[t.output])
        skip = {program.outputs[i] for i in keep}
        try:
            res.upload([None if i in sources else t for i, t in enumerate(inputs)])
            encoder = self.device.create_command_encoder()
            for i, buf in sources.items():
                name = program.inputs[i]
                res.last_inputs.pop(name, None)
                dst = res.buffers.get(name)
                if buf is not None and dst is not None and buf is not dst:
                    encoder.copy_buffer_to_buffer(buf, 0, dst, 0, res.specs[name].size)
            res.record(encoder, repeat=1, poison=True, readback=True, guards=bool(res.guarded), skip=skip)
            self.device.queue.submit([encoder.finish()])
            res.check_guards()
            out = []
            for name, meta, data in zip(program.outputs, program.output_meta, res.read_outputs(skip)):
                if name in skip or data is None:
                    out.append(None if name in skip else torch.empty(meta.shape, dtype=torch_dtype(meta.dtype)))
                else:
                    out.append(read_output(data, res.specs[name].dtype, meta, name))
            return out
        except (Unsupported, PlatformError):
            raise
        except Exception as e:  # noqa: BLE001
            self.forget(program.key)
            raise PlatformError(f"{self.name}: {type(e).__name__}: {e}") from e

    def _read_resident(self, handle) -> torch.Tensor:
        import wgpu
        from tapml.platforms.wgsl.tensors import read_output
        res = self.programs.get(handle.program)
        if res is None:
            raise PlatformError("the program holding that resident tensor was released (program cache full)")
        name = res.program.outputs[handle.output]
        spec = res.specs[name]
        if name not in res.buffers:
            return torch.empty(handle.meta.shape, dtype=torch_dtype(handle.meta.dtype))
        rb = self.device.create_buffer(size=spec.size, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        try:
            encoder = self.device.create_command_encoder()
            encoder.copy_buffer_to_buffer(res.buffers[name], 0, rb, 0, spec.size)
            self.device.queue.submit([encoder.finish()])
            map_for_read(rb)
            data = rb.read_mapped()
            rb.unmap()
        finally:
            rb.destroy()
        return read_output(data, spec.dtype, handle.meta, name)

    def benchmark(self, program: KernelProgram, inputs: list[torch.Tensor], repeat: int = 10) -> float:
        """Seconds one run of ``program``'s kernels takes on the device, inputs already
        resident: ``repeat`` runs are recorded into one submission and waited for together,
        so host transfers and submission overhead are left out (best of three such batches)."""
        return self._seconds_per_run(program, inputs, repeat, together=True)

    def time_resident(self, program: KernelProgram, inputs: list[torch.Tensor], repeat: int = 3) -> float:
        """Seconds one run of ``program`` takes with its inputs resident and its outputs left on the
        device, each run recorded, submitted and waited for alone (wall clock, best of three batches
        of ``repeat``): what :meth:`Backend.time_resident` measures for another compiler."""
        return self._seconds_per_run(program, inputs, repeat, together=False)

    def _seconds_per_run(self, program: KernelProgram, inputs: list[torch.Tensor], repeat: int, together: bool) -> float:
        """Best of three batches of ``repeat`` runs with the inputs resident: recorded into one
        submission (``together``) or each submitted and waited for alone."""
        if repeat < 1:
            raise ValueError("repeat must be at least 1")
        self.run(program, inputs)  # validates, uploads, compiles pipelines, warms up
        res = self.prepared(program.device_program())  # what run prepared (parts of split tensors)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for runs in ([repeat] if together else [1] * repeat):
                encoder = self.device.create_command_encoder()
                res.record(encoder, repeat=runs, poison=False, readback=False)
                res.fence(encoder)
                self.device.queue.submit([encoder.finish()])
                res.wait_fence()
            best = min(best, (time.perf_counter() - start) / repeat)
        return best

    def device_times(self, program: KernelProgram, inputs: list[torch.Tensor], runs: int = 5) -> tuple[list[float], str]:
        """Milliseconds of each of ``runs`` runs of ``program``'s kernels on the device, inputs
        resident, and how they were taken: ``"timestamp"`` (GPU timestamps written at the start
        and end of each run's compute pass, all runs in one submission) when the device has
        ``timestamp-query``, else ``"wall"`` (each run the host clock of a :meth:`benchmark`
        batch). Example: ``median(platform.device_times(program, [x])[0])``."""
        import wgpu
        if runs < 1:
            raise ValueError("runs must be at least 1")
        if "timestamp-query" not in self.device.features:
            return [self.benchmark(program, inputs, repeat=3) * 1e3 for _ in range(runs)], "wall"
        self.run(program, inputs)  # validates, uploads, compiles pipelines, warms up
        res = self.prepared(program.device_program())  # what run prepared (parts of split tensors)
        if not res.dispatches:
            return [0.0] * runs, "timestamp"
        queries = self.device.create_query_set(type=wgpu.QueryType.timestamp, count=2 * runs)
        resolved = self.device.create_buffer(size=16 * runs, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
        readback = self.device.create_buffer(size=16 * runs, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        try:
            encoder = self.device.create_command_encoder()
            for r in range(runs):
                res.record(encoder, repeat=1, poison=False, readback=False,
                           timestamp_writes={"query_set": queries, "beginning_of_pass_write_index": 2 * r,
                                             "end_of_pass_write_index": 2 * r + 1})
            encoder.resolve_query_set(queries, 0, 2 * runs, resolved, 0)
            encoder.copy_buffer_to_buffer(resolved, 0, readback, 0, 16 * runs)
            self.device.queue.submit([encoder.finish()])
            map_for_read(readback)
            ticks = memoryview(readback.read_mapped()).cast("Q").tolist()
            readback.unmap()
        finally:
            for b in (resolved, readback, queries):
                b.destroy()
        # WebGPU timestamps are nanoseconds; a clock that went backwards counts as no time
        return [max(0, end - begin) / 1e6 for begin, end in zip(ticks[0::2], ticks[1::2])], "timestamp"

    def close(self) -> None:
        super().close()  # releases every program's buffers
        self._pipelines.clear()
        dev, self.device = getattr(self, "device", None), None
        drain = getattr(self, "_drain", None)
        # a device whose poll thread did not end is left alive rather than pulled from under a poll
        if dev is not None and drain is not None and drain():
            try:
                dev.destroy()
            except Exception:  # noqa: BLE001
                pass


def _stop_polling(dev) -> bool:
    """Wait for ``dev``'s queue to drain and its poll thread to end, so that destroying the device
    never happens under a poll. wgpu-py's own stop joins that thread for 1 s only, and a blocking
    poll still running on a destroyed or released device can abort the process (seen once in a
    full test run; benchmarks/NOTES.md). The poller is wgpu-py's per-device thread (0.30+); where a
    wgpu-py has none, there is nothing to wait for."""
    poller = getattr(dev, "_poller", None)
    if poller is None:
        return True
    try:
        dev._poll_wait()  # a blocking poll here: the queue's work is done when it returns
    except Exception:  # noqa: BLE001
        pass
    poller.stop()
    poller.join(timeout=30)
    if poller.is_alive():
        return False
    dev._poller = None
    return True


class _Resident:
    """One program's device state, kept between runs: a buffer per BufferSpec (constants
    uploaded once), a bind group per kernel, readback buffers for the outputs, and a poison
    buffer copied over the outputs before each run so that elements no kernel wrote show up.
    An input buffer is not written again when it is handed the very same tensor, unmodified
    (same object, same ``_version``), as last time: weights cross to the device once."""

    def __init__(self, platform: WgpuPlatform, program: KernelProgram):
        self.nbytes = 0
        self.buffers: dict[str, object] = {}
        self.readback: dict[str, object] = {}
        self.poison = self.fence_buf = self.sentinel = self.guard_readback = None
        self.guarded: dict[str, int] = {}  # guarded buffer -> where its guard starts
        self.snapshots: list[tuple[int, str]] = []  # (kernel index, buffer) per guard snapshot
        self.last_inputs: dict[str, tuple] = {}  # input -> (weak reference to the tensor, its _version)
        self.staged = 0  # bytes written since the last submit
        try:
            self._make(platform, program)
        except BaseException:
            self.release()
            raise

    def _make(self, platform: WgpuPlatform, program: KernelProgram) -> None:
        import wgpu
        self.device = dev = platform.device
        self.platform = platform
        self.program = program
        self.specs = {b.name: b for b in program.buffers}
        storage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.nbytes = 0
        written = {name for kern in program.kernels for name, access, *_ in kern.bindings if access == "read_write"}
        limits = platform.caps()["limits"]
        room = min(limits.get("max-storage-buffer-binding-size", 128 << 20), limits.get("max-buffer-size", 256 << 20))
        for spec in program.buffers:
            if spec.size == 0:
                continue
            if spec.role == "const":
                self.buffers[spec.name] = dev.create_buffer_with_data(data=spec.data, usage=storage)
                platform.upload_bytes += spec.size
            elif platform.guards and spec.name in written and spec.size + GUARD_BYTES <= room:
                self.buffers[spec.name] = dev.create_buffer(size=spec.size + GUARD_BYTES, usage=storage)
                self.guarded[spec.name] = spec.size
            else:
                self.buffers[spec.name] = dev.create_buffer(size=spec.size, usage=storage)
            self.nbytes += self.buffers[spec.name].size
        self.dispatches = []
        for kern in program.kernels:
            pipe = platform._pipeline(kern.wgsl, kern.entry)
            entries = [{"binding": i, "resource": {"buffer": self.buffers[name], "offset": window[0] if window else 0,
                                                   "size": window[1] if window else self.buffers[name].size}}
                       for i, (name, _access, *window) in enumerate(kern.bindings)]
            group = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)
            self.dispatches.append((pipe, group, tuple(kern.workgroups)))
        self.outputs = [n for n in dict.fromkeys(program.outputs) if n in self.buffers]
        read = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
        self.readback = {n: dev.create_buffer(size=self.specs[n].size, usage=read) for n in self.outputs
                         if self.specs[n].size <= _STAGING_BYTES}
        poison = min(_STAGING_BYTES, max((self.specs[n].size for n in self.outputs if self.specs[n].role == "output"),
                                         default=0))
        self.poison = dev.create_buffer_with_data(data=bytes([_POISON]) * poison, usage=storage) if poison else None
        self.nbytes += poison + sum(b.size for b in self.readback.values())
        if self.guarded:
            self.sentinel = dev.create_buffer_with_data(data=_SENTINEL, usage=storage)
            self.snapshots = [(i, name) for i, kern in enumerate(program.kernels)
                              for name in dict.fromkeys(n for n, access, *_ in kern.bindings if access == "read_write")
                              if name in self.guarded]
            self.guard_readback = dev.create_buffer(size=max(1, len(self.snapshots)) * GUARD_BYTES, usage=read)
            self.nbytes += (1 + len(self.snapshots)) * GUARD_BYTES
        # an input buffer some kernel writes must be uploaded on every run
        self.written = {name for kern in program.kernels for name, access, *_ in kern.bindings if access == "read_write"}

    def upload(self, inputs: list[torch.Tensor]) -> None:
        from tapml.platforms.wgsl.tensors import to_device_chunks
        for name, t in zip(self.program.inputs, inputs):
            if name not in self.buffers or t is None:  # None: filled on the device (a resident tensor)
                continue
            last = self.last_inputs.get(name)
            if last is not None and last[0]() is t and last[1] == t._version and name not in self.written:
                continue
            self.last_inputs.pop(name, None)
            for offset, data in to_device_chunks(t, self.specs[name].dtype, f"input {name}", _UPLOAD_CHUNK):
                self.device.queue.write_buffer(self.buffers[name], offset, data)
                self.staged += len(data)
                if self.staged >= _UPLOAD_CHUNK:  # write_buffer keeps a staged copy until a submit: bound them
                    self.device.queue.submit([])
                    self.staged = 0
                self.platform.upload_bytes += len(data)
            self.last_inputs[name] = (weakref.ref(t), t._version)

    def record(self, encoder, repeat: int, poison: bool, readback: bool, timestamp_writes: dict | None = None,
               guards: bool = False, skip=()) -> None:
        if poison and self.poison is not None:
            for n in self.outputs:
                if self.specs[n].role == "output":
                    size = self.specs[n].size
                    for at in range(0, size, self.poison.size):
                        encoder.copy_buffer_to_buffer(self.poison, 0, self.buffers[n], at, min(self.poison.size, size - at))
        if guards:
            self._record_guarded(encoder, repeat)
        elif self.dispatches:
            cpass = encoder.begin_compute_pass(timestamp_writes=timestamp_writes)
            for _ in range(repeat):
                for pipe, group, groups in self.dispatches:
                    cpass.set_pipeline(pipe)
                    cpass.set_bind_group(0, group)
                    cpass.dispatch_workgroups(*groups)
            cpass.end()
        if readback:
            import wgpu
            for n in self.outputs:
                if n not in skip:
                    if n not in self.readback:  # a large output: staging for this read only (read_outputs drops it)
                        self.readback[n] = self.device.create_buffer(
                            size=self.specs[n].size, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
                    encoder.copy_buffer_to_buffer(self.buffers[n], 0, self.readback[n], 0, self.specs[n].size)

    def _record_guarded(self, encoder, repeat: int) -> None:
        """The dispatches with refilled guards, each kernel in its own pass followed by a copy
        of the guards it could have written, so that a bad write is pinned to its kernel."""
        for name, start in self.guarded.items():
            encoder.copy_buffer_to_buffer(self.sentinel, 0, self.buffers[name], start, GUARD_BYTES)
        for _ in range(repeat):
            for i, (pipe, group, groups) in enumerate(self.dispatches):
                cpass = encoder.begin_compute_pass()
                cpass.set_pipeline(pipe)
                cpass.set_bind_group(0, group)
                cpass.dispatch_workgroups(*groups)
                cpass.end()
                for slot, (kernel, name) in enumerate(self.snapshots):
                    if kernel == i:
                        encoder.copy_buffer_to_buffer(self.buffers[name], self.guarded[name], self.guard_readback,
                                                      slot * GUARD_BYTES, GUARD_BYTES)

    def check_guards(self) -> None:
        """After a submitted ``record(guards=True)``: PlatformError naming the first kernel that
        wrote into a guard, the buffer and the first bad byte (nothing when guards are off)."""
        if not self.snapshots:
            return
        map_for_read(self.guard_readback)
        try:
            data = bytes(self.guard_readback.read_mapped())
        finally:
            self.guard_readback.unmap()
        for slot, (kernel, name) in enumerate(self.snapshots):
            guard = data[slot * GUARD_BYTES:(slot + 1) * GUARD_BYTES]
            if guard != _SENTINEL:
                first = next(i for i, (a, b) in enumerate(zip(guard, _SENTINEL)) if a != b)
                last = max(i for i, (a, b) in enumerate(zip(guard, _SENTINEL)) if a != b)
                spec = self.specs[name]
                what = f"{spec.role} {spec.dtype}" + (f"[{'x'.join(map(str, spec.meta.shape))}]" if spec.meta else "")
                raise PlatformError(f"kernel {self.program.kernels[kernel].name} wrote past buffer {name} ({what}, "
                                    f"{spec.size} bytes): first bad byte at offset +{first} after its end "
                                    f"(last at +{last} of the {GUARD_BYTES}-byte guard)")

    def read_outputs(self, skip=()) -> list:
        """Bytes of each program output (None for an empty one or one in ``skip``), after a
        submitted record()."""
        data = {}
        for n in self.outputs:
            if n in skip:
                continue
            rb = self.readback[n]
            map_for_read(rb)
            data[n] = rb.read_mapped()
            rb.unmap()
            if rb.size > _STAGING_BYTES:
                del self.readback[n]
                rb.destroy()
        return [data.get(n) for n in self.program.outputs]

    def fence(self, encoder) -> None:
        """Record a 4-byte copy whose mapping waits for everything submitted before it."""
        import wgpu
        if self.fence_buf is None:
            self.fence_buf = self.device.create_buffer(size=4, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        src = next(iter(self.buffers.values()), None)
        if src is not None:
            encoder.copy_buffer_to_buffer(src, 0, self.fence_buf, 0, 4)

    def wait_fence(self) -> None:
        if self.fence_buf is not None and self.buffers:
            map_for_read(self.fence_buf)
            self.fence_buf.unmap()

    def release(self) -> None:
        for b in [*self.buffers.values(), *self.readback.values(), self.poison, self.fence_buf, self.sentinel,
                  self.guard_readback]:
            if b is not None:
                try:
                    b.destroy()
                except Exception:  # noqa: BLE001
                    pass
        self.buffers, self.readback, self.last_inputs = {}, {}, {}


def _best(adapters):
    """Prefer discrete > integrated > CPU; Vulkan/Metal/D3D12 over OpenGL."""
    if not adapters:
        return None
    rank_type = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
    rank_backend = {"Vulkan": 0, "Metal": 0, "D3D12": 1, "OpenGL": 2}
    return min(adapters, key=lambda a: (rank_type.get(a.info.get("adapter_type"), 4),
                                        rank_backend.get(a.info.get("backend_type"), 3)))


_SHARED: dict = {}


def shared_platform(backend: str | None = None) -> WgpuPlatform:
    """One WgpuPlatform per backend for the whole process (tests share a device)."""
    if backend not in _SHARED:
        _SHARED[backend] = WgpuPlatform(backend)
    return _SHARED[backend]


def available_backends() -> list[str]:
    """Backends (``vulkan``, ``gl``, ...) that have an adapter on this machine."""
    try:
        adapters = _adapters()
    except TapmlError:
        return []
    names = {v: k for k, v in BACKENDS.items()}
    return sorted({names[a.info.get("backend_type")] for a in adapters if a.info.get("backend_type") in names})


__all__ = ["WgpuPlatform", "BACKENDS", "shared_platform", "available_backends"]
