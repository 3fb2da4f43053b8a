"""The platform interface: what every target (reference, wgpu, browser, remote) implements.

A :class:`Platform` turns a :class:`~tapml.graph.Graph` into a :class:`KernelProgram`
(``compile``) and runs it on torch tensors (``run``). Subclasses implement the ``_caps``,
``_supports``, ``_compile`` and ``_run`` hooks; the public methods validate and time.

:class:`RuntimePlatform` is the plumbing shared by platforms that execute KernelPrograms on a
runtime that keeps them (wgpu-native, a browser page, a device server, a device worker): one
:class:`~tapml.platforms.program_cache.ProgramCache` of prepared programs and two hooks,
``_prepare(program)`` and ``_execute(program, prepared, inputs)``.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from pydantic import Field

from tapml.errors import PlatformError, Unsupported
from tapml.graph import Graph, Node, TensorMeta, TensorMetaJSON
from tapml.schema import ClosedSchema, Count, Str, validate


#: WebGPU's largest min-storage-buffer-offset-alignment: an offset that is a multiple of it is
#: aligned on every device, so it stands in for a device that does not report its own.
MAX_OFFSET_ALIGNMENT = 256

#: The device limits the compiler reads (and :meth:`Platform.force_limits` may lower).
LIMIT_NAMES = ("max-storage-buffer-binding-size", "max-buffer-size", "max-storage-buffers-per-shader-stage",
               "max-compute-workgroups-per-dimension", "min-storage-buffer-offset-alignment")


#: The WGSL element types a buffer holds, with their sizes in bytes (``f16p``/``bf16p``: 16-bit
#: values packed two to a ``u32``, for devices without ``shader-f16``).
WGSL_TYPES = {"f32": 4, "f16": 2, "f16p": 2, "bf16p": 2, "i32": 4, "u32": 4, "i64": 8, "c64": 8, "u64": 8, "c32": 4}
BUFFER_ROLES = ("input", "output", "temp", "const")
ACCESS = ("read", "read_write")
#: An entry point's name: a WGSL identifier of at most 128 characters.
IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"

_Name = Annotated[Str, Field(min_length=1, max_length=256)]
_Access = Literal["read", "read_write"]
_Role = Literal["input", "output", "temp", "const"]


class BufferJSON(ClosedSchema):
    """A :class:`BufferSpec` as a program's JSON holds it; ``data`` (const buffers) is hex."""

    name: _Name
    dtype: Literal["f32", "f16", "f16p", "bf16p", "i32", "u32", "i64", "c64", "u64", "c32"]
    size: Annotated[Count, Field(multiple_of=4)]
    role: _Role
    meta: TensorMetaJSON | None = None
    data: Annotated[Str, Field(pattern=r"^(?:[0-9a-fA-F]{2})*$")] | None = None


class KernelJSON(ClosedSchema):
    """A :class:`Kernel` as a program's JSON holds it. A binding is ``[buffer, access]`` or
    ``[buffer, access, offset, size]`` (a byte window of the buffer)."""

    name: Str
    wgsl: Str
    entry: Annotated[Str, Field(pattern=IDENTIFIER)] = "main"
    bindings: list[tuple[_Name, _Access] | tuple[_Name, _Access, Count, Annotated[Count, Field(gt=0)]]]
    workgroups: tuple[Count, Count, Count]
    loop_iterations: Count | None = None


class SplitTensorJSON(ClosedSchema):
    """A :class:`SplitTensor` as a program's JSON holds it: parts are ``[buffer, start, count]``."""

    name: _Name
    role: _Role
    meta: TensorMetaJSON
    parts: list[tuple[_Name, Count, Count]]


class ProgramJSON(ClosedSchema):
    """A :class:`KernelProgram` as it travels (to a device server, a worker, a browser page, a
    cache): the one declaration its JSON is read with. What a schema cannot say (names that
    refer to buffers, parts that cover their tensor, the server's limits) is checked by
    :func:`tapml.remote.limits.check_program`."""

    kind: Literal["wgsl", "graph"]
    inputs: list[_Name]
    outputs: list[_Name]
    buffers: list[BufferJSON] = []
    kernels: list[KernelJSON] = []
    graph: dict[str, Any] | None = None
    input_meta: list[TensorMetaJSON] = []
    output_meta: list[TensorMetaJSON] = []
    parts: list[SplitTensorJSON] = []


def _meta(m: TensorMetaJSON | None) -> TensorMeta | None:
    return None if m is None else TensorMeta(m.shape, m.dtype)


@dataclass
class BufferSpec:
    """A device buffer of a KernelProgram.

    ``role`` is ``input`` (filled from the i-th program input), ``output`` (read back as a
    program output), ``temp`` (device-only intermediate) or ``const`` (filled from ``data``).
    ``dtype`` is the WGSL element type (``f32``, ``f16``, ``i32``, ``u32``) and ``meta`` the
    torch-side tensor (shape, torch dtype) the buffer holds.
    """

    name: str
    dtype: str
    size: int
    role: str
    meta: TensorMeta | None = None
    data: bytes | None = None

    def to_json(self) -> dict:
        d = {"name": self.name, "dtype": self.dtype, "size": self.size, "role": self.role}
        if self.meta is not None:
            d["meta"] = self.meta.to_json()
        if self.data is not None:
            d["data"] = self.data.hex()
        return d

    @classmethod
    def from_json(cls, d: dict) -> "BufferSpec":
        """The buffer of parsed JSON ``d``, validated against :class:`BufferJSON`."""
        return cls.of(validate(BufferJSON, d, "buffer"))

    @classmethod
    def of(cls, b: BufferJSON) -> "BufferSpec":
        """The buffer a validated :class:`BufferJSON` declares."""
        return cls(name=b.name, dtype=b.dtype, size=b.size, role=b.role, meta=_meta(b.meta),
                   data=None if b.data is None else bytes.fromhex(b.data))


@dataclass
class Kernel:
    """One compute dispatch: WGSL source, entry point, the buffers bound at group 0 in binding
    order, and the workgroup counts. A binding is ``(buffer, access)`` (``read`` or
    ``read_write``), the whole buffer, or ``(buffer, access, offset, size)``: that byte window of
    it (a buffer over the device's binding limit is bound through several windows).
    ``loop_iterations`` is how many loop iterations one invocation runs at most, all loops
    together (nested ones multiplied), as the compiler counted them; None when it could not
    (a loop whose trip count it does not know). Devices may end an invocation's loops past a
    budget (lavapipe: 65 535): the preflight holds this count to the measured one."""

    name: str
    wgsl: str
    bindings: list[tuple]
    workgroups: tuple[int, int, int]
    entry: str = "main"
    loop_iterations: int | None = None

    def to_json(self) -> dict:
        d = {"name": self.name, "wgsl": self.wgsl, "entry": self.entry,
             "bindings": [list(b) for b in self.bindings], "workgroups": list(self.workgroups)}
        if self.loop_iterations is not None:
            d["loop_iterations"] = self.loop_iterations
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Kernel":
        """The kernel of parsed JSON ``d``, validated against :class:`KernelJSON`."""
        return cls.of(validate(KernelJSON, d, "kernel"))

    @classmethod
    def of(cls, k: KernelJSON) -> "Kernel":
        """The kernel a validated :class:`KernelJSON` declares."""
        return cls(name=k.name, wgsl=k.wgsl, entry=k.entry, bindings=[tuple(b) for b in k.bindings],
                   workgroups=k.workgroups, loop_iterations=k.loop_iterations)


#: Loop iterations the loop-cap probe asks one invocation for (:meth:`Platform.loop_limits`): past
#: any cap a device is known to have, and still quick where there is none.
LOOP_PROBE_ITERATIONS = 1 << 20


@dataclass
class SplitTensor:
    """A tensor over the device's ``max-buffer-size``, held in several device buffers (*parts*).

    ``name`` is the buffer it would have been, ``role`` that buffer's role and ``meta`` the whole
    tensor (shape, torch dtype). ``parts`` are ``(buffer, start, count)``: part buffer ``buffer``
    holds the ``count`` elements of the flattened tensor from element ``start`` on (its own
    ``meta`` is 1-D ``[count]``); the parts follow each other and cover the tensor exactly.
    """

    name: str
    role: str
    meta: TensorMeta
    parts: list[tuple[str, int, int]]

    def to_json(self) -> dict:
        return {"name": self.name, "role": self.role, "meta": self.meta.to_json(),
                "parts": [list(p) for p in self.parts]}

    @classmethod
    def from_json(cls, d: dict) -> "SplitTensor":
        """The split tensor of parsed JSON ``d``, validated against :class:`SplitTensorJSON`."""
        return cls.of(validate(SplitTensorJSON, d, "split tensor"))

    @classmethod
    def of(cls, t: SplitTensorJSON) -> "SplitTensor":
        """The split tensor a validated :class:`SplitTensorJSON` declares."""
        return cls(name=t.name, role=t.role, meta=_meta(t.meta), parts=[tuple(p) for p in t.parts])


@dataclass
class KernelProgram:
    """Plain data that any runtime executes: buffers, kernels in dispatch order, and which
    buffers are the program's inputs and outputs (in order).

    ``kind`` is ``"wgsl"`` for compiled programs; ``"graph"`` programs carry the graph itself
    (``graph`` field) for runtimes that execute ATen directly (the reference platform).

    ``inputs``, ``outputs``, ``input_meta`` and ``output_meta`` are what the device sees: one
    entry per buffer. A tensor over the device's ``max-buffer-size`` is held in several buffers,
    listed in ``parts`` (:class:`SplitTensor`); its part buffers stand in a row in ``inputs`` or
    ``outputs``. :meth:`tensor_inputs` and :meth:`tensor_outputs` give the graph's view (one
    entry per tensor), and :meth:`Platform.run` splits and joins tensors accordingly, so a
    runtime only ever sees :meth:`device_program` (the same program without ``parts``).
    """

    kind: str
    inputs: list[str]
    outputs: list[str]
    buffers: list[BufferSpec] = field(default_factory=list)
    kernels: list[Kernel] = field(default_factory=list)
    graph: dict | None = None
    input_meta: list[TensorMeta] = field(default_factory=list)
    output_meta: list[TensorMeta] = field(default_factory=list)
    parts: list[SplitTensor] = field(default_factory=list)

    def to_json(self) -> dict:
        d = {"kind": self.kind, "inputs": self.inputs, "outputs": self.outputs,
             "buffers": [b.to_json() for b in self.buffers],
             "kernels": [k.to_json() for k in self.kernels], "graph": self.graph,
             "input_meta": [m.to_json() for m in self.input_meta],
             "output_meta": [m.to_json() for m in self.output_meta]}
        if self.parts:
            d["parts"] = [p.to_json() for p in self.parts]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "KernelProgram":
        """The program of parsed JSON ``d``, validated against :class:`ProgramJSON`; a
        :class:`~tapml.schema.SchemaError` (a ValueError) naming the field's path
        (``program.kernels[0].workgroups[1]``) otherwise."""
        p = validate(ProgramJSON, d, "program")
        return cls(kind=p.kind, inputs=list(p.inputs), outputs=list(p.outputs),
                   buffers=[BufferSpec.of(b) for b in p.buffers], kernels=[Kernel.of(k) for k in p.kernels],
                   graph=p.graph, input_meta=[_meta(m) for m in p.input_meta],
                   output_meta=[_meta(m) for m in p.output_meta], parts=[SplitTensor.of(t) for t in p.parts])

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    def key(self) -> str:
        """Content hash: equal programs have equal keys (used for caching on any runtime)."""
        if not hasattr(self, "_key"):
            self._key = hashlib.sha256(self.dumps().encode()).hexdigest()[:32]
        return self._key

    def device_program(self) -> "KernelProgram":
        """What a runtime runs: this program without ``parts`` (itself when nothing is split)."""
        if not self.parts:
            return self
        if not hasattr(self, "_device"):
            self._device = KernelProgram(kind=self.kind, inputs=self.inputs, outputs=self.outputs,
                                         buffers=self.buffers, kernels=self.kernels, graph=self.graph,
                                         input_meta=self.input_meta, output_meta=self.output_meta)
        return self._device

    def tensor_inputs(self) -> list[tuple[TensorMeta, list[int]]]:
        """One ``(meta, positions)`` per graph input: its tensor and the positions in ``inputs``
        of the buffers holding it (one, or its parts in order)."""
        return self._tensors(self.inputs, self.input_meta)

    def tensor_outputs(self) -> list[tuple[TensorMeta, list[int]]]:
        """One ``(meta, positions)`` per graph output, as :meth:`tensor_inputs`."""
        return self._tensors(self.outputs, self.output_meta)

    def _tensors(self, names: list[str], metas: list[TensorMeta]) -> list[tuple[TensorMeta, list[int]]]:
        if not self.parts:  # a hand-made program may give no metas: nothing to check its tensors against
            return [(metas[i] if i < len(metas) else None, [i]) for i in range(len(names))]
        first = {t.parts[0][0]: t for t in self.parts if t.parts}
        out, i = [], 0
        while i < len(names):
            split = first.get(names[i])
            if split is None:
                out.append((metas[i], [i]))
                i += 1
            else:
                out.append((split.meta, list(range(i, i + len(split.parts)))))
                i += len(split.parts)
        return out

    def split_tensors(self, tensors: list, role: str = "input") -> list:
        """The per-buffer tensors of graph-level ``tensors`` (the graph's inputs, or with
        ``role="output"`` its outputs): a split tensor becomes flat views of its parts (no copy
        when it is contiguous); others, None and :class:`ResidentTensor` pass unchanged."""
        if not self.parts:
            return list(tensors)
        views = self.tensor_inputs() if role == "input" else self.tensor_outputs()
        device_metas = self.input_meta if role == "input" else self.output_meta
        # the same tensor, unmodified, gets the same part views as last time: runtimes skip uploading
        # an input they were handed last run (by identity and version), so weights cross once
        made = self.__dict__.setdefault("_part_views", {})
        out = []
        for i, (t, (meta, positions)) in enumerate(zip(tensors, views)):
            if len(positions) == 1:
                out.append(t)
                continue
            if not isinstance(t, torch.Tensor):
                raise Unsupported(f"{role} of shape {list(meta.shape)} is split across {len(positions)} device "
                                  "buffers (over max-buffer-size): pass it as a host tensor, not a resident one")
            last = made.get((role, i))
            if last is not None and last[0]() is t and last[1] == t._version:
                out.extend(last[2])
                continue
            flat, start, parts = t.reshape(-1), 0, []
            for p in positions:
                count = device_metas[p].numel
                parts.append(flat[start:start + count])
                start += count
            made[(role, i)] = (weakref.ref(t), t._version, parts)
            out.extend(parts)
        return out

    def join_outputs(self, outputs: list) -> list:
        """Graph-level outputs from the per-buffer ``outputs`` of a run of :meth:`device_program`:
        the parts of a split tensor concatenated and reshaped to its shape."""
        if not self.parts:
            return list(outputs)
        joined = []
        for meta, positions in self.tensor_outputs():
            if len(positions) == 1:
                joined.append(outputs[positions[0]])
            else:
                joined.append(torch.cat([outputs[p].reshape(-1) for p in positions]).reshape(meta.shape))
        return joined


@dataclass(frozen=True)
class ResidentTensor:
    """A tensor a run left on a platform's device instead of reading it back (``keep`` of
    :meth:`Platform.run`): output ``output`` of the program whose key is ``program``, from that
    program's run number ``serial``. Pass it as an input of a later run on the same platform
    (it is consumed device-side, no host round trip) or download it with :meth:`Platform.read`.
    Only these plain fields cross to a page or a server. It goes stale when its program runs
    again (PlatformError on use)."""

    meta: TensorMeta
    program: str
    output: int
    serial: int
    owner: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.meta.shape)

    @property
    def dtype(self) -> str:
        return self.meta.dtype

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes


class Platform:
    """Base class of targets. Subclasses set ``name`` and implement the ``_`` hooks.

    ``upload_bytes`` counts the bytes the platform has written host -> device so far (inputs,
    constants); a runtime that keeps a tensor resident does not count it again."""

    name = "platform"
    upload_bytes = 0

    def caps(self) -> dict:
        """``{"adapter", "backend", "features", "limits", "dtypes"}`` of the device (a WGSL device adds
        ``cpu_adapter``: whether it runs on the CPU, which picks kernel shapes); limits lowered by
        :meth:`force_limits` are applied, and listed under ``forced_limits``."""
        caps = self._caps()
        forced = self.__dict__.get("forced_limits")
        if not forced:
            return caps
        limits = dict(caps.get("limits") or {})
        for name, value in forced.items():
            have = limits.get(name)
            stricter = max if name.startswith("min-") else min
            limits[name] = value if have is None else stricter(have, value)
        return {**caps, "limits": limits, "forced_limits": dict(forced)}

    def force_limits(self, limits: dict[str, int]) -> None:
        """Compile as if the device had these (stricter) limits, e.g. a phone's 128 MiB
        ``max-storage-buffer-binding-size`` on a desktop GPU: emulates a smaller device. A value
        laxer than the device's own is ignored. ValueError for an unknown name or a value that is
        not a positive integer."""
        for name, value in limits.items():
            if name not in LIMIT_NAMES:
                raise ValueError(f"unknown device limit {name!r}; known: {', '.join(LIMIT_NAMES)}")
            if type(value) is not int or value <= 0:
                raise ValueError(f"device limit {name} must be a positive integer, not {value!r}")
        self.__dict__["forced_limits"] = dict(limits)

    def float_model(self) -> dict:
        """How the device's floats behave where the WGSL spec leaves it free, measured once by
        running a probe: ``{"nan_inf": kept?, "subnormals": kept?}``. The spec lets an
        implementation assume no NaN or Inf and flush subnormals (Chromium's Tint on SwiftShader
        does both; lavapipe keeps them). An empty dict when the probe cannot run."""
        if "_float_model" not in self.__dict__:
            self.__dict__["_float_model"] = self._probe_float_model()
        return self.__dict__["_float_model"]

    def _probe_float_model(self) -> dict:
        from tapml.errors import DeviceLost
        x = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e-40, -3e-39, 1.0])
        one = torch.ones(6)
        graph = Graph(inputs=[("x", TensorMeta.of(x)), ("one", TensorMeta.of(one))],
                      nodes=[Node("product", "aten.mul.Tensor", [{"ref": "x"}, {"ref": "one"}], {},
                                  [TensorMeta.of(x)]),
                             Node("power", "aten.exp.default", [{"ref": "x"}], {}, [TensorMeta.of(x)])],
                      outputs=["product", "power"])
        try:
            product, power = self.run(self.compile(graph), [x, one])
        except DeviceLost:
            raise
        except (PlatformError, Unsupported):
            return {}
        nan_inf = (bool(torch.isnan(product[0]) and torch.isnan(power[0])) and product[1:3].tolist() == [math.inf, -math.inf]
                   and power[1:3].tolist() == [math.inf, 0.0])
        return {"nan_inf": nan_inf, "subnormals": product[3:5].tolist() == x[3:5].tolist()}

    def roofline(self) -> dict:
        """What the device can do at best, measured once by probe kernels
        (:mod:`tapml.platforms.roofline`): ``{"peak_gflops", "storage_gbps", "workgroup_gbps",
        "dispatch_us", "timing"}``; an empty dict when the probes cannot run (a platform that runs
        no kernels)."""
        if "_roofline" not in self.__dict__:
            from tapml.errors import DeviceLost
            from tapml.platforms import roofline
            try:
                self.__dict__["_roofline"] = roofline.probe(self)
            except DeviceLost:
                raise
            except (PlatformError, Unsupported, ValueError, TypeError):
                self.__dict__["_roofline"] = {}
        return self.__dict__["_roofline"]

    def loop_limits(self) -> dict:
        """How many loop iterations the device runs in one invocation, measured once by running a
        probe that asks for :data:`LOOP_PROBE_ITERATIONS`: ``{"loop_cap": N}`` when the device
        stopped the loop after N (lavapipe and llvmpipe end an invocation's loops after 65 535
        iterations, all loops together, without an error), ``{"loop_cap": None}`` when it ran them
        all; an empty dict when the probe cannot run (a platform that runs no kernels)."""
        if "_loop_limits" not in self.__dict__:
            self.__dict__["_loop_limits"] = self._probe_loop_cap()
        return self.__dict__["_loop_limits"]

    def _probe_loop_cap(self) -> dict:
        from tapml.errors import DeviceLost
        i32 = lambda shape: TensorMeta(shape, "int32")  # noqa: E731
        # the bound and the step are data, so no compiler can fold the loop away
        wgsl = ("@group(0) @binding(0) var<storage, read> probe: array<i32>;\n"
                "@group(0) @binding(1) var<storage, read_write> count: array<i32>;\n\n"
                "@compute @workgroup_size(1)\nfn main() {\n  var c: i32 = 0;\n"
                "  for (var i: i32 = 0; i < probe[0]; i = i + 1) { c = c + probe[1]; }\n  count[0] = c;\n}\n")
        program = KernelProgram(
            kind="wgsl", inputs=["probe"], outputs=["count"],
            buffers=[BufferSpec("probe", "i32", 8, "input", i32((2,))),
                     BufferSpec("count", "i32", 4, "output", i32((1,)))],
            kernels=[Kernel("loop_cap", wgsl, [("probe", "read"), ("count", "read_write")], (1, 1, 1),
                            loop_iterations=LOOP_PROBE_ITERATIONS)],
            input_meta=[i32((2,))], output_meta=[i32((1,))])
        try:
            (count,) = self.run(program, [torch.tensor([LOOP_PROBE_ITERATIONS, 1], dtype=torch.int32)])
        except DeviceLost:
            raise
        except (PlatformError, Unsupported, ValueError, TypeError):
            return {}
        ran = int(count.reshape(-1)[0])
        return {"loop_cap": ran if 0 <= ran < LOOP_PROBE_ITERATIONS else None}

    def supports(self, node: Node) -> str | None:
        """None when the platform can run the node, else the reason it cannot."""
        return self._supports(node)

    def compile(self, graph: Graph) -> KernelProgram:
        """Compile a graph. Raises :class:`Unsupported` with a reason, or
        :class:`PlatformError` when compilation fails."""
        if not isinstance(graph, Graph):
            raise TypeError(f"compile() takes a Graph, not {type(graph).__name__}")
        for node in graph.nodes:
            reason = self.supports(node)
            if reason:
                raise Unsupported(f"{node.op}: {reason}")
        return wrap_errors(self._compile, graph)

    def run(self, program: KernelProgram, inputs: list, keep=()) -> list:
        """Run a compiled program on CPU tensors; returns CPU tensors (one per graph output).

        An input may be a :class:`ResidentTensor` from an earlier run on this platform (it stays
        on the device). Output positions in ``keep`` stay on the device too and come back as
        ResidentTensors, not read back. Example, a cache carried across steps::

            logits, cache = platform.run(program, [ids, cache], keep=[1])

        A tensor the program holds in several buffers (``program.parts``: over the device's
        max-buffer-size) is handed to the runtime as flat views of its parts and its outputs are
        joined here; such a tensor cannot be resident (Unsupported).
        """
        tensor_inputs, tensor_outputs = program.tensor_inputs(), program.tensor_outputs()
        if len(inputs) != len(tensor_inputs):
            raise ValueError(f"program takes {len(tensor_inputs)} inputs, got {len(inputs)}")
        keep = sorted(set(keep))
        if any(type(i) is not int or not 0 <= i < len(tensor_outputs) for i in keep):
            raise ValueError(f"keep must name output positions below {len(tensor_outputs)}, not {keep}")
        serials = self.__dict__.setdefault("_serials", {})
        resident = False
        for i, (t, (m, _)) in enumerate(zip(inputs, tensor_inputs)):
            if m is None:
                continue
            if isinstance(t, ResidentTensor):
                self._check_handle(t, f"input {i}")
                if t.dtype != m.dtype:
                    raise ValueError(f"input {i} is a resident {t.dtype} tensor, program expects {m.dtype}")
                resident = True
            if tuple(t.shape) != m.shape:
                raise ValueError(f"input {i} has shape {tuple(t.shape)}, program expects {m.shape}")
        # a runtime sees one tensor per device buffer: split tensors cross as their parts
        device = program.device_program()
        for i in keep:
            if len(tensor_outputs[i][1]) > 1:
                raise Unsupported(f"output {i} of shape {list(tensor_outputs[i][0].shape)} is split across "
                                  f"{len(tensor_outputs[i][1])} device buffers (over max-buffer-size) and cannot "
                                  "stay on the device; read it back instead")
        device_keep = [tensor_outputs[i][1][0] for i in keep]
        device_inputs = program.split_tensors(inputs)
        start = time.perf_counter()
        if keep or resident:
            out = wrap_errors(self._run_resident, device, device_inputs, device_keep)
        else:
            out = wrap_errors(self._run, device, device_inputs)
        self.last_run_ms = (time.perf_counter() - start) * 1e3
        out = wrap_errors(program.join_outputs, out)
        if keep or device.key in serials:  # any run overwrites the outputs earlier handles name
            serials[device.key] = serial = serials.get(device.key, 0) + 1
            out = list(out)
            for i, at in zip(keep, device_keep):
                out[i] = ResidentTensor(tensor_outputs[i][0], device.key, at, serial, id(self))
        return out

    def read(self, handle: ResidentTensor) -> torch.Tensor:
        """Download a :class:`ResidentTensor` (an explicit device -> host crossing)."""
        if not isinstance(handle, ResidentTensor):
            raise TypeError(f"read() takes a ResidentTensor, not {type(handle).__name__}")
        self._check_handle(handle, "read()")
        return wrap_errors(self._read_resident, handle)

    def _check_handle(self, handle: ResidentTensor, what: str) -> None:
        if handle.owner != id(self):
            raise ValueError(f"{what}: the resident tensor belongs to another platform; read() it there first")
        if self.__dict__.get("_serials", {}).get(handle.program) != handle.serial:
            raise PlatformError(f"{what}: stale resident tensor (output {handle.output} of program "
                                f"{handle.program[:12]}): that program ran again since")

    def enable_guards(self) -> bool:
        """Check every later run for out-of-bounds writes: output and scratch buffers get a
        sentinel-filled guard region after their end, inside their binding, and a run that
        changed one raises PlatformError naming the kernel, the buffer and the first bad byte.
        Returns False when the platform cannot (the default; wgpu-native can)."""
        return False

    def reconnect(self) -> None:
        """Re-open a device that was lost (a restarted server, a fresh browser page).

        Raises DeviceLost when it cannot be had; platforms that cannot lose their device do nothing."""

    def close(self) -> None:
        """Release the device. Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # hooks -------------------------------------------------------------------------------
    def _caps(self) -> dict:
        raise NotImplementedError

    def _supports(self, node: Node) -> str | None:
        return None

    def _compile(self, graph: Graph) -> KernelProgram:
        raise NotImplementedError

    def _run(self, program: KernelProgram, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def _run_resident(self, program: KernelProgram, inputs: list, keep: list[int]) -> list:
        """Hook: run with ResidentTensor inputs and outputs kept at ``keep`` (their returned
        values are ignored). By default the kept tensors stay on the host, in the platform."""
        held = self.__dict__.setdefault("_held", {})
        host = [held[(t.program, t.output)] if isinstance(t, ResidentTensor) else t for t in inputs]
        out = self._run(program, host)
        for i in keep:
            held[(program.key, i)] = out[i]
        return out

    def _read_resident(self, handle: ResidentTensor) -> torch.Tensor:
        """Hook: the tensor of a handle (by default the one :meth:`_run_resident` holds)."""
        try:
            return self.__dict__["_held"][(handle.program, handle.output)]
        except KeyError:
            raise PlatformError(f"resident output {handle.output} of program {handle.program[:12]} is gone") from None


class RuntimePlatform(Platform):
    """A platform whose runtime prepares each program once and then runs it many times.

    The base class owns the one :class:`~tapml.platforms.program_cache.ProgramCache` of
    prepared programs (``self.programs``, keyed by :attr:`KernelProgram.key`, limits from
    ``TAPML_PROGRAM_CACHE`` / ``TAPML_PROGRAM_CACHE_MIB``) and calls the hooks:

    - ``_prepare(program) -> (prepared, nbytes)``: make the program ready on the runtime
      (pipelines and buffers, an upload to a page or server); ``nbytes`` is what it holds there.
    - ``_execute(program, prepared, inputs) -> outputs``: run a prepared program.
    - ``_release(key, prepared)``: free what ``_prepare`` made (called when the cache drops it).

    ``program_kinds`` lists the :attr:`KernelProgram.kind` values the runtime executes.
    """

    program_kinds: tuple[str, ...] = ("wgsl",)

    def __init__(self, max_entries: int | None = None, max_bytes: int | None = None):
        from tapml.platforms.program_cache import ProgramCache
        self.programs = ProgramCache(max_entries, max_bytes, on_evict=self._release)

    def prepared(self, program: KernelProgram):
        """The runtime's prepared form of ``program``, made by ``_prepare`` when not cached."""
        if program.kind not in self.program_kinds:
            raise PlatformError(f"{self.name} runs {' or '.join(self.program_kinds)} programs, not {program.kind!r}")
        prepared = self.programs.get(program.key, _MISSING)
        if prepared is _MISSING:
            prepared, nbytes = self._prepare(program)
            self.programs.put(program.key, prepared, nbytes)
        return prepared

    def forget(self, key: str) -> None:
        """Drop the prepared program of ``key`` (releasing it), e.g. after the runtime failed it."""
        prepared = self.programs.pop(key, _MISSING)
        if prepared is not _MISSING:
            self._release(key, prepared)

    def _run(self, program: KernelProgram, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._execute(program, self.prepared(program), inputs)

    def close(self) -> None:
        """Release every prepared program. Safe to call twice."""
        self.programs.clear()

    # hooks -------------------------------------------------------------------------------
    def _prepare(self, program: KernelProgram) -> tuple[object, int]:
        return program, 0

    def _execute(self, program: KernelProgram, prepared, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def _release(self, key: str, prepared) -> None:
        """Nothing to free by default: the runtime forgets the program by itself."""


_MISSING = object()


class PlatformWrapper(Platform):
    """A platform that changes how graphs compile and leaves everything else to ``inner``: caps,
    support checks, runs (resident tensors included: they belong to ``inner``), probes and the
    device's life. Subclasses override ``_compile`` (fault injection, the user's own kernels)."""

    def __init__(self, inner: Platform):
        self.inner = inner
        self.name = inner.name

    def _caps(self) -> dict:
        return self.inner.caps()

    def _supports(self, node: Node) -> str | None:
        return self.inner.supports(node)

    def _compile(self, graph: Graph) -> KernelProgram:
        return self.inner.compile(graph)

    def _run(self, program, inputs):
        return self.inner.run(program, inputs)

    def run(self, program, inputs, keep=()):
        return self.inner.run(program, inputs, keep)

    def read(self, handle):
        return self.inner.read(handle)

    @property
    def upload_bytes(self) -> int:
        return self.inner.upload_bytes

    @property
    def last_run_ms(self):
        return getattr(self.inner, "last_run_ms", None)

    @property
    def last_compile_ms(self):
        return getattr(self.inner, "last_compile_ms", None)

    @property
    def last_compile_cached(self) -> bool:
        return getattr(self.inner, "last_compile_cached", False)

    @property
    def last_artifact(self):
        return getattr(self.inner, "last_artifact", None)

    @property
    def last_wide(self) -> tuple:
        return getattr(self.inner, "last_wide", ())

    def float_model(self) -> dict:
        return self.inner.float_model()

    def loop_limits(self) -> dict:
        return self.inner.loop_limits()

    def enable_guards(self) -> bool:
        return self.inner.enable_guards()

    def reconnect(self) -> None:
        self.inner.reconnect()

    def close(self) -> None:
        self.inner.close()


def graph_program(graph: Graph) -> KernelProgram:
    """A ``graph`` KernelProgram: the graph itself, for runtimes that execute ATen eagerly."""
    return KernelProgram(kind="graph", inputs=[r for r, _ in graph.inputs], outputs=list(graph.outputs),
                         graph=graph.to_json(), input_meta=[m for _, m in graph.inputs],
                         output_meta=[graph.meta[r] for r in graph.outputs])


def check_workgroups(program: KernelProgram, caps: dict) -> None:
    """Raise :class:`Unsupported` when a kernel of ``program`` dispatches more workgroups per
    dimension than a device with ``caps`` allows (``max-compute-workgroups-per-dimension``)."""
    max_groups = (caps.get("limits") or {}).get("max-compute-workgroups-per-dimension", 65535)
    for kern in program.kernels:
        if any(g > max_groups for g in kern.workgroups):
            raise Unsupported(f"kernel {kern.name} dispatches {kern.workgroups} workgroups; "
                              f"the device allows {max_groups} per dimension")


def seconds_or_none(value) -> float | None:
    """``value`` as a duration in seconds when it is one (a finite number above 0), else None: what
    a backend or a worker said a run took is checked before it is reported."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        return None
    return float(value)


def wrap_errors(fn, *args):
    """Call fn, turning unexpected exceptions into PlatformError (keeping Unsupported)."""
    try:
        return fn(*args)
    except (Unsupported, PlatformError):
        raise
    except Exception as e:  # noqa: BLE001 - a failing case is a verdict, not a crash
        raise PlatformError(f"{type(e).__name__}: {e}") from e


__all__ = ["seconds_or_none", "LIMIT_NAMES", "LOOP_PROBE_ITERATIONS", "WGSL_TYPES", "BUFFER_ROLES", "ACCESS", "ProgramJSON", "MAX_OFFSET_ALIGNMENT", "BufferSpec", "Kernel", "KernelProgram", "Platform",
           "PlatformWrapper", "ResidentTensor", "RuntimePlatform",
           "SplitTensor", "check_workgroups", "graph_program", "wrap_errors"]
