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
import os
import tempfile
import time

import torch

from tapml.errors import PlatformError, TapmlError, Unsupported
from tapml.graph import torch_dtype
from tapml.platforms.base import KernelProgram
from tapml.platforms.program_cache import ProgramCache
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
           "max-compute-workgroup-storage-size", "max-bind-groups", "max-bindings-per-bind-group"]
_POISON = 0xFF  # every byte 0xFF: NaN for f32/f16, -1 for i32, an invalid bool for u32


def _adapters():
    import wgpu
    try:
        return wgpu.gpu.enumerate_adapters_sync()
    except Exception as e:  # noqa: BLE001 - no driver at all is "no adapters"
        raise TapmlError(f"wgpu cannot enumerate adapters ({e}); install a Vulkan/GL driver "
                         "(e.g. mesa-vulkan-drivers for lavapipe)") from None


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
        features = [f for f in ("shader-f16", "subgroup") if f in chosen.features]
        limits = {k: chosen.limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size",
                                               "max-storage-buffers-per-shader-stage") if k in chosen.limits}
        try:
            self.device = chosen.request_device_sync(required_features=features, required_limits=limits)
        except Exception as e:  # noqa: BLE001
            raise TapmlError(f"wgpu could not open a device on {_describe(chosen)}: {e}") from None
        self._caps_cache = None
        super().__init__()
        # compute pipelines by WGSL hash, shared by every program that has the same kernel
        self._pipelines = ProgramCache()

    # --- caps ----------------------------------------------------------------------------
    def _caps(self) -> dict:
        if self._caps_cache is None:
            info = self.adapter.info
            lim = self.device.limits
            features = sorted(str(f) for f in self.device.features)
            dtypes = ["float32", "int64", "int32", "bool"] + (["float16"] if "shader-f16" in features else [])
            self._caps_cache = {
                "adapter": f"{info.get('device')} ({info.get('description')})".strip(),
                "backend": self.backend, "features": features,
                "limits": {k: int(lim[k]) for k in _LIMITS if k in lim}, "dtypes": dtypes}
        return self._caps_cache

    # --- runtime hooks -------------------------------------------------------------------
    def _pipeline(self, wgsl: str, entry: str):
        key = hashlib.sha256(f"{entry}\0{wgsl}".encode()).hexdigest()
        pipe = self._pipelines.get(key)
        if pipe is None:
            try:
                module = self.device.create_shader_module(code=wgsl)
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

    def _execute(self, program: KernelProgram, res: "_Resident", inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        from tapml.platforms.wgsl.tensors import read_output
        try:
            res.upload(inputs)
            encoder = self.device.create_command_encoder()
            res.record(encoder, repeat=1, poison=True, readback=True)
            self.device.queue.submit([encoder.finish()])
            out = []
            for name, meta, data in zip(program.outputs, program.output_meta, res.read_outputs()):
                if data is None:
                    out.append(torch.empty(meta.shape, dtype=torch_dtype(meta.dtype)))
                else:
                    out.append(read_output(data, res.specs[name].dtype, meta, name))
            return out
        except (Unsupported, PlatformError):
            raise
        except Exception as e:  # noqa: BLE001
            self.forget(program.key)
            raise PlatformError(f"{self.name}: {type(e).__name__}: {e}") from e

    def benchmark(self, program: KernelProgram, inputs: list[torch.Tensor], repeat: int = 10) -> float:
        """Seconds one run of ``program``'s kernels takes on the device, inputs already
        resident: ``repeat`` runs are recorded into one submission and waited for together,
        so host transfers and submission overhead are left out (best of three such batches)."""
        if repeat < 1:
            raise ValueError("repeat must be at least 1")
        self.run(program, inputs)  # validates, uploads, compiles pipelines, warms up
        res = self.prepared(program)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            encoder = self.device.create_command_encoder()
            res.record(encoder, repeat=repeat, poison=False, readback=False)
            res.fence(encoder)
            self.device.queue.submit([encoder.finish()])
            res.wait_fence()
            best = min(best, (time.perf_counter() - start) / repeat)
        return best

    def close(self) -> None:
        super().close()  # releases every program's buffers
        self._pipelines.clear()
        dev, self.device = getattr(self, "device", None), None
        if dev is not None:
            try:
                dev.destroy()
            except Exception:  # noqa: BLE001
                pass


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
        self.poison = self.fence_buf = None
        self.last_inputs: dict[str, tuple] = {}
        try:
            self._make(platform, program)
        except BaseException:
            self.release()
            raise

    def _make(self, platform: WgpuPlatform, program: KernelProgram) -> None:
        import wgpu
        self.device = dev = platform.device
        self.program = program
        self.specs = {b.name: b for b in program.buffers}
        storage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.nbytes = 0
        for spec in program.buffers:
            if spec.size == 0:
                continue
            if spec.role == "const":
                self.buffers[spec.name] = dev.create_buffer_with_data(data=spec.data, usage=storage)
            else:
                self.buffers[spec.name] = dev.create_buffer(size=spec.size, usage=storage)
            self.nbytes += spec.size
        self.dispatches = []
        for kern in program.kernels:
            pipe = platform._pipeline(kern.wgsl, kern.entry)
            entries = [{"binding": i, "resource": {"buffer": self.buffers[name], "offset": 0,
                                                   "size": self.buffers[name].size}}
                       for i, (name, _access) in enumerate(kern.bindings)]
            group = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)
            self.dispatches.append((pipe, group, tuple(kern.workgroups)))
        self.outputs = [n for n in dict.fromkeys(program.outputs) if n in self.buffers]
        read = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
        self.readback = {n: dev.create_buffer(size=self.specs[n].size, usage=read) for n in self.outputs}
        poison = max((self.specs[n].size for n in self.outputs if self.specs[n].role == "output"), default=0)
        self.poison = dev.create_buffer_with_data(data=bytes([_POISON]) * poison, usage=storage) if poison else None
        self.nbytes += 2 * poison + sum(self.specs[n].size for n in self.outputs)
        # an input buffer some kernel writes must be uploaded on every run
        self.written = {name for kern in program.kernels for name, access in kern.bindings if access == "read_write"}

    def upload(self, inputs: list[torch.Tensor]) -> None:
        from tapml.platforms.wgsl.tensors import to_device
        for name, t in zip(self.program.inputs, inputs):
            if name not in self.buffers:
                continue
            last = self.last_inputs.get(name)
            if last is not None and last[0] is t and last[1] == t._version and name not in self.written:
                continue
            self.last_inputs.pop(name, None)
            self.device.queue.write_buffer(self.buffers[name], 0, to_device(t, self.specs[name].dtype, f"input {name}"))
            self.last_inputs[name] = (t, t._version)

    def record(self, encoder, repeat: int, poison: bool, readback: bool) -> None:
        if poison and self.poison is not None:
            for n in self.outputs:
                if self.specs[n].role == "output":
                    encoder.copy_buffer_to_buffer(self.poison, 0, self.buffers[n], 0, self.specs[n].size)
        if self.dispatches:
            cpass = encoder.begin_compute_pass()
            for _ in range(repeat):
                for pipe, group, groups in self.dispatches:
                    cpass.set_pipeline(pipe)
                    cpass.set_bind_group(0, group)
                    cpass.dispatch_workgroups(*groups)
            cpass.end()
        if readback:
            for n in self.outputs:
                encoder.copy_buffer_to_buffer(self.buffers[n], 0, self.readback[n], 0, self.specs[n].size)

    def read_outputs(self) -> list:
        """Bytes of each program output (None for an empty one), after a submitted record()."""
        import wgpu
        data = {}
        for n in self.outputs:
            rb = self.readback[n]
            rb.map_sync(wgpu.MapMode.READ)
            data[n] = rb.read_mapped()
            rb.unmap()
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
        import wgpu
        if self.fence_buf is not None and self.buffers:
            self.fence_buf.map_sync(wgpu.MapMode.READ)
            self.fence_buf.unmap()

    def release(self) -> None:
        for b in [*self.buffers.values(), *self.readback.values(), self.poison, self.fence_buf]:
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
