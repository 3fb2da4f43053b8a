"""tinygrad as a compiler under test: the ``tinygrad:webgpu`` and ``tinygrad:cpu`` TARGETs.

The route: the ExportedProgram -> torch's ONNX exporter (:mod:`tapml.platforms.onnx_route`, the same
ONNX bytes ``ort`` runs) -> tinygrad's own ONNX runner (``tinygrad.nn.onnx.OnnxRunner``, its supported
way in for a model from elsewhere) on one tinygrad device -> outputs. ``tinygrad:webgpu`` is tinygrad's
``WEBGPU`` device: WGSL run by Dawn (the ``dawn-python`` wheel) on the system's Vulkan adapter
(lavapipe here), what tinygrad ships for the browser; ``tinygrad:cpu`` is its ``CPU`` device (C
compiled by ``clang``).

What the route does that a user must see rather than have hidden:

- tinygrad is lazy: the runner builds a graph of tinygrad tensors and its kernels are generated and
  compiled by the device when the outputs are read, i.e. in :meth:`TinygradBackend.run`. A kernel the
  device rejects (WGSL that Dawn will not compile, a buffer past its binding limit) is an ``error``
  verdict of that case. An ONNX op tinygrad has no implementation of, or a model its parser cannot read
  (tinygrad 0.14 cannot read a bfloat16 scalar constant), is refused in :meth:`TinygradBackend.compile`:
  ``unsupported``.
- Outputs are returned as tinygrad made them (a dtype the exporter changed stays changed: the
  comparison reports it, as for ``ort``).
- No TinyJit: the runner turns some tensors into Python values while it builds the graph (shapes,
  Slice starts ...), and a JIT replays the first values it saw; a carved case runs once per replay
  (``--repeat N``: N times), and TinyJit replays only from its third call, so a capture would cost more
  than it saves. The runner's own cache of those Python values
  is cleared before each run for the same reason.

Controls: ``tinygrad:webgpu``'s control is ``tinygrad:cpu`` (the same exporter and ONNX runner, the
same tinygrad graph rewrites, on a mature device): a case that fails on both is the route's fault
(exporter or tinygrad's ONNX ops), one that fails on WebGPU alone is the WGSL/Dawn side. ``tinygrad:cpu``
names ``ort`` as its control: ONNX Runtime's CPU provider is the ONNX route's mature runner, so a case
that fails on tinygrad:cpu and on ort too is the exporter's fault, one that fails on tinygrad:cpu alone
is tinygrad's (its ONNX ops or its own lowering).
"""

from __future__ import annotations

import os
import platform
import shutil
import sys

import torch

from tapml.platforms.backend import Backend, BackendRefused, Compiled, seconds_per_run
from tapml.platforms.onnx_route import feed_names, onnx_feeds, onnx_model, opset, read_signature, refuse_dtypes

#: TARGET spec -> tinygrad's device name.
DEVICES = {"tinygrad:webgpu": "WEBGPU", "tinygrad:cpu": "CPU"}
#: platform.machine() and sys.platform -> the Dawn library of the dawn-python wheel.
_DAWN_LIBRARIES = {("x86_64", "linux"): "libwebgpu_dawn_x86_64.so", ("aarch64", "linux"): "libwebgpu_dawn_aarch64.so",
                   ("x86_64", "darwin"): "libwebgpu_dawn_x86_64.dylib", ("arm64", "darwin"): "libwebgpu_dawn_arm64.dylib"}


def dawn_environment() -> None:
    """Point tinygrad's WEBGPU device at the dawn-python wheel's Dawn on Vulkan (Metal on macOS):
    ``WEBGPU_PATH`` and ``WEBGPU_BACKEND``, set before tinygrad opens the device; a user's own
    settings are kept. Nothing is set when the wheel has no library for this machine."""
    import importlib.util
    spec = importlib.util.find_spec("pydawn")
    library = _DAWN_LIBRARIES.get((platform.machine().lower(), sys.platform))
    if spec is not None and spec.submodule_search_locations and library:
        path = os.path.join(list(spec.submodule_search_locations)[0], "lib", library)
        if os.path.isfile(path):
            os.environ.setdefault("WEBGPU_PATH", path)
    os.environ.setdefault("WEBGPU_BACKEND", "WGPUBackendType_Metal" if sys.platform == "darwin"
                          else "WGPUBackendType_Vulkan")


class TinygradProgram:
    """An ONNX model held by tinygrad's runner on one device: ``feeds`` is the ONNX input fed from
    each program input (None where the exporter dropped an unused one), ``outputs`` the ONNX outputs."""

    def __init__(self, runner, feeds: list[str | None], outputs: tuple[str, ...]):
        self.runner = runner
        self.feeds = feeds
        self.outputs = outputs
        #: the model's own values (initializers); a run adds every intermediate tensor to them
        self.constants = dict(runner.graph_values)


class TinygradBackend(Backend):
    """tinygrad's ONNX runner on its ``WEBGPU`` device (Dawn on Vulkan) or its ``CPU`` device (clang).

    Example: ``tapml replay STORE --target tinygrad:webgpu --target tinygrad:cpu``.
    """

    forms = tuple(DEVICES)
    needs = ("tinygrad and dawn-python (tinygrad:webgpu), clang (tinygrad:cpu), onnx and onnxscript: "
             "pip install 'tapml[backends]' and apt-get install clang (the README's setup installs them)")
    #: The control of each form (see the module docstring); the class names tinygrad:webgpu's, as IreeBackend does.
    CONTROLS = {"tinygrad:webgpu": "tinygrad:cpu", "tinygrad:cpu": "ort"}
    control = CONTROLS["tinygrad:webgpu"]

    def __init__(self, spec: str):
        super().__init__(spec)
        if spec not in DEVICES:
            raise BackendRefused(f"unknown target {spec!r}; tinygrad takes: {', '.join(DEVICES)}")
        self.control = self.CONTROLS[spec]
        self.device = DEVICES[spec]
        # tinygrad keeps compiled kernels in a pickle database under ~/.cache/tinygrad; tapml's runs neither
        # read nor write it (a value you set yourself is kept), as they read no pickle from anywhere
        os.environ.setdefault("CACHELEVEL", "0")
        # nor does tinygrad spawn its pool of compiler processes: tapml kills a worker that hangs, and the
        # pool's processes would outlive it
        os.environ.setdefault("PARALLEL", "0")
        if self.device == "WEBGPU":
            dawn_environment()
        elif not shutil.which("clang"):
            raise BackendRefused("tinygrad's CPU device compiles with clang, which is not on PATH: "
                                 "apt-get install clang (the README's setup installs it)")
        from tinygrad import Device
        self._name = None
        try:
            self._device = Device[self.device]
        except Exception as e:  # noqa: BLE001 - a device tinygrad cannot open says why
            raise BackendRefused(f"tinygrad could not open its {self.device} device: {type(e).__name__}: {e}") from None

    def describe(self) -> dict:
        from importlib.metadata import version
        tinygrad_version = version("tinygrad")
        if self._name is None:
            self._name = self._device_name()
        info = {"device": self._name, "tinygrad_device": self.device, "tinygrad": tinygrad_version,
                "opset": opset(), "route": f"torch.onnx exporter (dynamo) -> ONNX -> tinygrad OnnxRunner on {self.device}"}
        import onnxscript
        key = f"tinygrad {tinygrad_version}, torch {torch.__version__}, onnxscript {onnxscript.__version__}, opset {opset()}"
        if self.device == "WEBGPU":
            info["dawn-python"] = version("dawn-python")
            key += f", dawn-python {info['dawn-python']}"
        # the exporter makes the ONNX and tinygrad (with Dawn) runs it: all of them key the compile cache
        return {**info, "version": key}

    def _device_name(self) -> str:
        if self.device == "CPU":
            return f"cpu ({platform.machine()}, tinygrad CPU device, clang)"
        import ctypes
        from tinygrad.runtime.autogen import webgpu
        info = webgpu.WGPUAdapterInfo()
        if webgpu.wgpuDeviceGetAdapterInfo(self._device.device_res, info) != webgpu.WGPUStatus_Success:
            return "webgpu (Dawn; the adapter did not say its name)"

        def text(view) -> str:
            return ctypes.string_at(view.data, view.length).decode(errors="replace") if view.data else ""
        try:
            backend = {webgpu.WGPUBackendType_Vulkan: "Vulkan", webgpu.WGPUBackendType_Metal: "Metal"}.get(info.backendType, "")
            name = text(info.device) or text(info.description) or "unknown adapter"
        finally:
            webgpu.wgpuAdapterInfoFreeMembers(info)
        return f"{name} (Dawn{f' on {backend}' if backend else ''})"

    def refuse(self, program) -> str | None:
        reason = refuse_dtypes(program)
        if reason or self.device != "WEBGPU":
            return reason
        for node in program.graph.nodes:
            meta = node.meta.get("val")
            for value in meta if isinstance(meta, (list, tuple)) else (meta,):
                if isinstance(value, torch.Tensor) and value.dtype == torch.float64:
                    return f"{node.name} is float64: WGSL has no 64-bit floats and tinygrad's WEBGPU device does not emulate them"
        return None

    def compile(self, program) -> Compiled:
        model, signature = onnx_model(program)
        return Compiled(handle=self._program(model, signature), artifact=model, artifact_name="model.onnx", blob=model)

    def load(self, blob: bytes) -> TinygradProgram:
        """The runner of the ONNX bytes :meth:`compile` made (its signature in the model's metadata)."""
        return self._program(blob, read_signature(blob))

    def _program(self, model: bytes, signature: dict) -> TinygradProgram:
        from tinygrad import Tensor
        from tinygrad.nn.onnx import OnnxRunner
        try:
            # parsed on the CPU (tinygrad's WEBGPU device has no 64-bit integers for the parser's reads)
            runner = OnnxRunner(Tensor(model, device=parse_device())).to(self.device)
        except Exception as e:  # noqa: BLE001 - tinygrad's parser's refusal is the route's verdict
            raise BackendRefused(f"tinygrad's ONNX runner could not load model.onnx: {type(e).__name__}: {e}") from None
        feeds = feed_names(signature, list(runner.graph_inputs), len(runner.graph_outputs))
        missing = sorted({op for op in (n.op for n in runner.graph_nodes) if op not in runner.onnx_ops})
        if missing:
            raise BackendRefused(f"tinygrad's ONNX runner has no implementation of ONNX {', '.join(missing)}")
        return TinygradProgram(runner, feeds, runner.graph_outputs)

    def run(self, compiled: Compiled, inputs: list) -> list:
        program: TinygradProgram = compiled.handle
        if len(inputs) != len(program.feeds):
            raise ValueError(f"{len(inputs)} inputs given; the program takes {len(program.feeds)}")
        runner = program.runner
        runner._python_const_cache.clear()  # values read from the last run's tensors must not stand for this run's
        feeds = {name: to_tinygrad(t, self.device) for name, t in zip(program.feeds, inputs) if name}
        try:
            results = runner(feeds)
            return [to_torch(results[name]) for name in program.outputs]
        finally:  # the run's intermediate tensors hold device memory until the next run: let them go now
            runner.graph_values = dict(program.constants)

    def time_resident(self, compiled: Compiled, inputs: list, repeat: int) -> float:
        """Seconds per run with the feeds realized on the device once and the results realized
        there (not copied out), the device synchronized after each run."""
        from tinygrad import Device, Tensor
        program: TinygradProgram = compiled.handle
        runner = program.runner
        feeds = {name: to_tinygrad(t, self.device).realize() for name, t in zip(program.feeds, inputs) if name}

        def once():
            runner._python_const_cache.clear()
            try:
                results = runner(feeds)
                Tensor.realize(*[results[name] for name in program.outputs])
                Device[self.device].synchronize()
            finally:
                runner.graph_values = dict(program.constants)
        return seconds_per_run(once, repeat)

    def repro_runner(self) -> str:
        """A module that runs a case's ``model.onnx`` with tinygrad alone on this device (for ``tapml
        repro`` folders): ``pip install tinygrad dawn-python onnx``; bfloat16 travels as float32."""
        import inspect
        return ('"""Run model.onnx with tinygrad alone: pip install tinygrad dawn-python onnx (and clang for CPU)."""\n\n'
                "import os\nimport platform\nimport shutil\nimport sys\n\n"
                f"DEVICE = {self.device!r}\n_DAWN_LIBRARIES = {_DAWN_LIBRARIES!r}\n\n\n"
                + "\n\n".join(inspect.getsource(f) for f in (dawn_environment, onnx_feeds, parse_device, run_onnx)) + "\n\n\n"
                "def run(artifact, inputs, dtypes):\n    return run_onnx(artifact, inputs, dtypes, DEVICE)\n")

    def close(self) -> None:
        self._device = None


def run_onnx(artifact: bytes, inputs: list, dtypes: list, device: str) -> list:
    """Run model.onnx (made by tapml's ONNX route) with tinygrad's ONNX runner on ``device``: numpy
    arrays in and out, in the program's order (its input names in the model's ``tapml.program``
    metadata), bfloat16 as float32 (``dtypes`` names each input's dtype). What a repro folder's runner calls."""
    import json

    import numpy as np
    import onnx
    if device == "WEBGPU":
        dawn_environment()
    from tinygrad import Tensor
    from tinygrad import dtypes as tiny
    from tinygrad.nn.onnx import OnnxRunner
    model = onnx.load_model_from_string(artifact)
    names = json.loads(next(p.value for p in model.metadata_props if p.key == "tapml.program"))["inputs"]
    runner = OnnxRunner(Tensor(artifact, device=parse_device())).to(device)
    feeds = {name: Tensor(np.ascontiguousarray(a), device=device).cast(tiny.bfloat16) if d == "bfloat16"
             else Tensor(np.ascontiguousarray(a), device=device)
             for name, a, d in zip(onnx_feeds(list(runner.graph_inputs), names), inputs, dtypes) if name}
    results = runner(feeds)
    return [results[name].float().numpy() if results[name].dtype == tiny.bfloat16 else results[name].numpy()
            for name in runner.graph_outputs]


def parse_device() -> str:
    """The tinygrad device that parses ONNX bytes: CPU when clang is there to compile its kernels,
    else tinygrad's pure-Python device (slow, but model.onnx holds small constants only: weights are inputs)."""
    return "CPU" if shutil.which("clang") else "PYTHON"


def to_tinygrad(tensor: torch.Tensor, device: str):
    """A CPU torch tensor as a tinygrad tensor on ``device``, bit for bit (bfloat16 through its 16-bit pattern)."""
    from tinygrad import Tensor, dtypes
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return Tensor(tensor.view(torch.uint16).numpy(), device=device).bitcast(dtypes.bfloat16)
    return Tensor(tensor.numpy(), device=device)


def to_torch(tensor) -> torch.Tensor:
    """A tinygrad tensor as a CPU torch tensor of the dtype tinygrad made (bfloat16 bit for bit)."""
    from tinygrad import dtypes
    if tensor.dtype == dtypes.bfloat16:
        return torch.from_numpy(tensor.bitcast(dtypes.uint16).numpy().copy()).view(torch.bfloat16)
    return torch.from_numpy(tensor.numpy().copy())


__all__ = ["DEVICES", "TinygradBackend", "TinygradProgram", "dawn_environment", "onnx_feeds", "run_onnx", "to_tinygrad", "to_torch"]

