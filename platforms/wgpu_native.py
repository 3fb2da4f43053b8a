"""The wgpu-native platform: WGSL KernelPrograms on a local adapter (Vulkan, Metal, DX12, GL).

Compilation is :func:`tapml.platforms.wgsl.compile_graph` from this device's caps; running
uploads the inputs, records every kernel into one command submission, and reads back only
the outputs (intermediates never leave the device). Pipelines are cached by the hash of
their WGSL, so programs compiled elsewhere (``KernelProgram.from_json``) run as well.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import torch

from tapml.errors import PlatformError, TapmlError, Unsupported
from tapml.graph import Graph, Node
from tapml.platforms.base import KernelProgram, Platform

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


class WgpuPlatform(Platform):
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
        features = []
        if "shader-f16" in chosen.features:
            features.append("shader-f16")
        limits = {k: chosen.limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size",
                                               "max-storage-buffers-per-shader-stage") if k in chosen.limits}
        try:
            self.device = chosen.request_device_sync(required_features=features, required_limits=limits)
        except Exception as e:  # noqa: BLE001
            raise TapmlError(f"wgpu could not open a device on {_describe(chosen)}: {e}") from None
        self._caps_cache = None
        self._pipelines: dict[str, object] = {}
        self._compiled: dict[str, KernelProgram] = {}

    # --- caps / support ------------------------------------------------------------------
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

    def _supports(self, node: Node) -> str | None:
        from tapml.platforms.wgsl import supports
        return supports(node, self.caps())

    # --- compile -------------------------------------------------------------------------
    def _compile(self, graph: Graph) -> KernelProgram:
        from tapml.platforms.wgsl import compile_graph
        program = compile_graph(graph, self.caps())
        self._prepare(program)
        return program

    def _pipeline(self, wgsl: str, entry: str):
        key = hashlib.sha256(f"{entry}\0{wgsl}".encode()).hexdigest()
        pipe = self._pipelines.get(key)
        if pipe is None:
            try:
                module = self.device.create_shader_module(code=wgsl)
                pipe = self.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": entry})
            except Exception as e:  # noqa: BLE001 - a shader that does not compile is a verdict
                raise PlatformError(f"WGSL compile failed on {self.name}: {e}\n--- shader ---\n{wgsl}") from e
            self._pipelines[key] = pipe
        return pipe

    def _prepare(self, program: KernelProgram) -> None:
        if program.kind != "wgsl":
            raise PlatformError(f"{self.name} runs wgsl programs, not {program.kind!r}")
        if program.key in self._compiled:
            return
        for kern in program.kernels:
            self._pipeline(kern.wgsl, kern.entry)
        self._compiled[program.key] = program

    # --- run -----------------------------------------------------------------------------
    def _run(self, program: KernelProgram, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        import wgpu

        from tapml.platforms.wgsl.tensors import from_device, to_device, unwritten_bools
        self._prepare(program)
        limits = self.caps()["limits"]
        max_groups = limits.get("max-compute-workgroups-per-dimension", 65535)
        dev = self.device
        bufs = {b.name: b for b in program.buffers}
        gpu: dict[str, object] = {}
        storage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        try:
            for name, t, meta in zip(program.inputs, inputs, program.input_meta):
                spec = bufs[name]
                if spec.size == 0:
                    continue
                data = to_device(t, spec.dtype, f"input {name}")
                gpu[name] = dev.create_buffer_with_data(data=data, usage=storage)
            for spec in program.buffers:
                if spec.name in gpu or spec.size == 0 or spec.role == "input":
                    continue
                if spec.role == "const":
                    gpu[spec.name] = dev.create_buffer_with_data(data=spec.data, usage=storage)
                    continue
                gpu[spec.name] = dev.create_buffer(size=spec.size, usage=storage)
                if spec.role == "output":  # poison, so elements no kernel wrote show up as NaN / -1
                    dev.queue.write_buffer(gpu[spec.name], 0, bytes([_POISON]) * spec.size)
            encoder = dev.create_command_encoder()
            cpass = encoder.begin_compute_pass()
            for kern in program.kernels:
                if any(g > max_groups for g in kern.workgroups):
                    raise Unsupported(f"kernel {kern.name} dispatches {kern.workgroups} workgroups; "
                                      f"the device allows {max_groups} per dimension")
                pipe = self._pipeline(kern.wgsl, kern.entry)
                entries = [{"binding": i, "resource": {"buffer": gpu[name], "offset": 0, "size": gpu[name].size}}
                           for i, (name, _access) in enumerate(kern.bindings)]
                group = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)
                cpass.set_pipeline(pipe)
                cpass.set_bind_group(0, group)
                cpass.dispatch_workgroups(*kern.workgroups)
            cpass.end()
            readback = {}
            for name in dict.fromkeys(program.outputs):
                if name in gpu:
                    rb = dev.create_buffer(size=bufs[name].size, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
                    encoder.copy_buffer_to_buffer(gpu[name], 0, rb, 0, bufs[name].size)
                    readback[name] = rb
            dev.queue.submit([encoder.finish()])
            out = []
            for name, meta in zip(program.outputs, program.output_meta):
                spec = bufs[name]
                if name not in readback:
                    out.append(torch.empty(meta.shape, dtype=_torch_dtype(meta.dtype)))
                    continue
                rb = readback[name]
                rb.map_sync(wgpu.MapMode.READ)
                data = rb.read_mapped()
                rb.unmap()
                if spec.dtype == "u32":
                    bad = unwritten_bools(data, meta)
                    if bad:
                        raise PlatformError(f"{bad} elements of bool output {name} were never written")
                out.append(from_device(data, spec.dtype, meta))
            return out
        except (Unsupported, PlatformError):
            raise
        except Exception as e:  # noqa: BLE001
            raise PlatformError(f"{self.name}: {type(e).__name__}: {e}") from e
        finally:
            for b in gpu.values():
                try:
                    b.destroy()
                except Exception:  # noqa: BLE001
                    pass

    def close(self) -> None:
        dev, self.device = getattr(self, "device", None), None
        self._pipelines = {}
        if dev is not None:
            try:
                dev.destroy()
            except Exception:  # noqa: BLE001
                pass


def _torch_dtype(name: str):
    from tapml.graph import torch_dtype
    return torch_dtype(name)


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
