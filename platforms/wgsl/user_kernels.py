"""Your own kernels: a WGSL file that replaces tapml's lowering of one op (``--kernel OP=FILE.wgsl``).

The binding convention (README, "Your own kernels"), for a node with I tensor inputs and O outputs:

- ``@group(0) @binding(i) var<storage, read> ...: array<T>`` for each tensor input, in argument
  order (0 .. I-1); then ``var<storage, read_write>`` for each output (I .. I+O-1); then one
  ``var<storage, read> ...: array<u32>`` of shapes and strides (binding I+O). Non-tensor arguments
  are not passed: a kernel is written for the way its model calls the op.
- ``T`` is how tapml stores the tensor: ``f32`` for float32, ``f16`` for float16 (devices with
  ``shader-f16``; the kernel says ``enable f16;``), ``i32`` for int64/int32 (int64 lowered to i32),
  ``u32`` for bool (0 or 1). bfloat16, and float16 without shader-f16, are packed two per u32:
  no user kernel takes them. Each tensor is contiguous (row-major), bound whole.
- The shapes buffer (u32): ``[0]`` I, ``[1]`` O, ``[2]`` n = elements of output 0, ``[3]`` invocations
  per row of the dispatch grid; then a record of :data:`RECORD` words per tensor, inputs then
  outputs, tensor k at ``4 + 18 * k``: rank, element count, 8 sizes, 8 contiguous strides (in
  elements; unused entries 0). Ranks above :data:`MAX_RANK` are refused.
- The entry point is ``main`` with integer-literal ``@workgroup_size(X[, Y[, Z]])``, W = X*Y*Z
  invocations per workgroup. Dispatch: one invocation per element of output 0, ceil(n / W)
  workgroups split over x and y (x at most the device's max-compute-workgroups-per-dimension).
  Invocation ``i = (workgroup_id.y * num_workgroups.x + workgroup_id.x) * W + local_invocation_index``,
  which for a 1-D workgroup is ``global_invocation_id.y * meta[3] + global_invocation_id.x``;
  invocations with ``i >= meta[2]`` must return.

Several files may be given for one op (say an f32 and an f16 one): each case takes the first whose
bindings fit its tensors; a case none fits is ``unsupported`` with the reason.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Mapping

from tapml.errors import TapmlError, Unsupported
from tapml.graph import Node, TensorMeta
from tapml.platforms.base import BufferSpec, Kernel, KernelProgram
from tapml.platforms.wgsl.codegen import PACKED, BufferView, Value, contiguous_strides
from tapml.platforms.wgsl.registry import ALL, Lowering
from tapml.platforms.wgsl.source import storage_bindings, strip_comments, workgroup_dims

#: Largest kernel file read.
MAX_KERNEL_BYTES = 256 << 10
#: Most dimensions a tensor handed to a user kernel may have (its record holds this many sizes).
MAX_RANK = 8
#: Words before the first tensor record in the shapes buffer.
HEADER = 4
#: Words per tensor in the shapes buffer: rank, element count, MAX_RANK sizes, MAX_RANK strides.
RECORD = 2 + 2 * MAX_RANK
ENTRY = "main"
#: Element types a user kernel's bindings may declare (tapml's unpacked storage types).
ELEMENT_TYPES = ("f32", "f16", "i32", "u32")


@dataclass(frozen=True)
class UserKernel:
    """One ``--kernel OP=FILE`` file, read and checked: ``source`` (the WGSL as written),
    ``workgroup`` (its ``@workgroup_size``) and ``bindings`` (``(access, name, element type)``
    in binding order)."""

    op: str
    path: str
    source: str
    workgroup: tuple[int, ...]
    bindings: tuple[tuple[str, str, str], ...]

    @property
    def invocations(self) -> int:
        """Invocations per workgroup (W)."""
        return math.prod(self.workgroup)

    @property
    def label(self) -> str:
        """How verdicts name the file: its path as given."""
        return self.path

    def option(self) -> str:
        """The ``--kernel`` value that reads this file again."""
        return f"{self.op}={self.path}"

    def declared(self) -> str:
        """Its bindings as a short list, e.g. ``read f32, read_write f32, read u32``."""
        return ", ".join(f"{access} {elem}" for access, _, elem in self.bindings)


def load_user_kernel(op: str, path: str | Path, where: str | None = None) -> UserKernel:
    """Read and check the kernel file ``path`` for ``op``: an op of tapml's vocabulary, a regular
    UTF-8 file of at most :data:`MAX_KERNEL_BYTES`, an entry point ``main`` with an integer
    ``@workgroup_size``, storage bindings of group 0 numbered 0..N-1 holding runtime-sized arrays of
    :data:`ELEMENT_TYPES`, the last one ``read`` u32 (the shapes buffer), no other resources.
    TapmlError (exit 2) saying what to fix. The device's own compiler checks the rest."""
    from tapml.io import read_regular_file
    from tapml.ops import check_op
    where = where or f"--kernel {op}={path}"
    if not isinstance(op, str) or op.count(".") != 2:
        raise TapmlError(f"{where}: expected OP=FILE.wgsl with OP a full aten overload name (aten.gelu.default)")
    try:
        check_op(op)
    except ValueError as e:
        raise TapmlError(f"{where}: {e}; name the op as the store does (`tapml inspect STORE` lists them)") from None
    data = read_regular_file(path, where, hint="give a WGSL file", max_bytes=MAX_KERNEL_BYTES)
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TapmlError(f"{where}: not UTF-8 text (byte {e.start}); a kernel is a WGSL source file") from None
    if "\0" in source:
        raise TapmlError(f"{where}: holds a NUL character; a kernel is a WGSL source file")
    try:
        workgroup = workgroup_dims(source, ENTRY)
        found = storage_bindings(source)
    except ValueError as e:
        raise TapmlError(f"{where}: {e} (see README, \"Your own kernels\")") from None
    if any(d < 1 for d in workgroup):
        raise TapmlError(f"{where}: @workgroup_size{workgroup} must be positive")
    code = strip_comments(source)
    if re.search(r"\bvar\s*<\s*(uniform|workgroup_uniform)\b|\btexture_|\bsampler\b", code):
        raise TapmlError(f"{where}: declares a uniform, texture or sampler; tapml binds storage buffers only "
                         "(inputs, outputs, then the u32 shapes buffer)")
    numbers = sorted(b for _, b, _, _, _ in found)
    if any(g != 0 for g, _, _, _, _ in found) or numbers != list(range(len(found))):
        raise TapmlError(f"{where}: storage bindings must be @group(0) @binding(0) .. @binding(N-1), each once; "
                         f"found {', '.join(f'@group({g}) @binding({b})' for g, b, _, _, _ in found) or 'none'}")
    bindings = tuple((access, name, elem) for _, _, access, name, elem in sorted(found, key=lambda f: f[1]))
    for access, name, elem in bindings:
        if elem not in ELEMENT_TYPES or access not in ("read", "read_write"):
            raise TapmlError(f"{where}: binding {name!r} is var<storage, {access}> array<{elem}>; use read or "
                             f"read_write arrays of {', '.join(ELEMENT_TYPES)}")
    if len(bindings) < 2 or bindings[-1][0] != "read" or bindings[-1][2] != "u32":
        raise TapmlError(f"{where}: the last binding must be the shapes buffer, var<storage, read> array<u32>, after "
                         "at least one output")
    return UserKernel(op, str(path), source, workgroup, bindings)


def parse_kernel_options(items: list[str] | None) -> dict[str, tuple[UserKernel, ...]]:
    """``--kernel OP=FILE`` values, each file read and checked (:func:`load_user_kernel`), grouped
    by op in the order given. TapmlError for a bad item."""
    kernels: dict[str, list[UserKernel]] = {}
    for item in items or []:
        op, sep, path = str(item).partition("=")
        if not sep or not op or not path:
            raise TapmlError(f"--kernel {item!r}: expected OP=FILE.wgsl, e.g. aten.gelu.default=my_gelu.wgsl")
        kernels.setdefault(op, []).append(load_user_kernel(op, path, f"--kernel {item}"))
    return {op: tuple(ks) for op, ks in kernels.items()}


def user_lowerings(kernels: Mapping[str, tuple[UserKernel, ...]]) -> dict[str, Lowering]:
    """Registry entries that lower each op of ``kernels`` with the user's files, to lay over the
    registry (``compile_graph(graph, caps, lowerings=...)``)."""
    return {op: Lowering(op, partial(lower_user_kernel, files), ALL, family="user_kernels", flops="elementwise")
            for op, files in kernels.items()}


def _tensors(a) -> list[Value]:
    if isinstance(a, Value):
        return [a]
    if isinstance(a, (list, tuple)):
        return [v for x in a for v in _tensors(x)]
    return []


def _fits(kernel: UserKernel, ins: list[str], outs: list[str]) -> str | None:
    """Why ``kernel`` does not fit tensors stored as ``ins`` and ``outs`` (None when it does)."""
    want = [("read", t) for t in ins] + [("read_write", t) for t in outs] + [("read", "u32")]
    have = [(access, elem) for access, _, elem in kernel.bindings]
    if have == want:
        return None
    return (f"{kernel.label} declares {kernel.declared()}; this case needs "
            f"{', '.join(f'{a} {t}' for a, t in want)} ({len(ins)} input(s), {len(outs)} output(s), then the shapes)")


def lower_user_kernel(kernels: tuple[UserKernel, ...], pb, node: Node, *args, **kwargs) -> list[Value]:
    """The registry ``fn`` of a user kernel: binds the node's tensor inputs (each made contiguous),
    its outputs and the shapes buffer as the convention says, dispatches one invocation per
    element of output 0 and returns the outputs. Unsupported when no file fits the case."""
    values = _tensors(list(args)) + _tensors(list(kwargs.values()))
    metas = [TensorMeta(tuple(v.shape), v.dtype) for v in values] + list(node.outputs)
    storage = [pb.storage(m.dtype) for m in metas]
    packed = next((m for m, s in zip(metas, storage) if s in PACKED), None)
    if packed is not None:
        why = "bfloat16 is" if packed.dtype == "bfloat16" else "float16 without shader-f16 is"
        raise Unsupported(f"{node.op}: {why} held packed two per u32 on this device; a --kernel takes "
                          f"{', '.join(ELEMENT_TYPES)} tensors")
    ins, outs = storage[:len(values)], storage[len(values):]
    reasons = []
    for kernel in kernels:
        reason = _fits(kernel, ins, outs)
        if reason is None:
            break
        reasons.append(reason)
    else:
        raise Unsupported(f"{node.op}: no --kernel file fits this case: " + "; ".join(reasons))
    if any(len(m.shape) > MAX_RANK for m in metas):
        raise Unsupported(f"{node.op}: a tensor of rank over {MAX_RANK}; the shapes buffer of a --kernel holds "
                          f"{MAX_RANK} dimensions")
    buffers = []
    for i, v in enumerate(values):
        if v.numel == 0:
            raise Unsupported(f"{node.op}: input {i} is empty, and WebGPU cannot bind an empty buffer")
        if not (isinstance(v, BufferView) and v.is_whole and v.buf.meta.dtype == v.dtype):
            v = pb.materialize(v)
        buffers.append(v.buf)
    outputs = [pb.buffer("temp", meta) for meta in node.outputs]
    buffers += outputs
    for b in buffers:
        if b.size > pb.max_binding_size:
            raise Unsupported(f"{node.op}: a tensor of {b.size} bytes is over the device's "
                              f"max-storage-buffer-binding-size ({pb.max_binding_size}); a --kernel binds each tensor whole")
    if len(buffers) + 1 > pb.max_bindings:
        raise Unsupported(f"{node.op}: {kernel.label} binds {len(buffers) + 1} storage buffers; the device allows "
                          f"{pb.max_bindings} (max-storage-buffers-per-shader-stage)")
    n = node.outputs[0].numel if node.outputs else 0
    if n == 0 or any(o.numel == 0 for o in node.outputs):
        return [BufferView.whole(o, meta) for o, meta in zip(outputs, node.outputs)]
    limit = int((pb.caps.get("limits") or {}).get("max-compute-workgroups-per-dimension", 65535))
    total = -(-n // kernel.invocations)
    gx = min(total, limit)
    gy = -(-total // gx)
    if gy > limit:
        raise Unsupported(f"{node.op}: {n} invocations need more than {limit}x{limit} workgroups of {kernel.invocations}")
    words = [len(values), len(node.outputs), n, gx * kernel.invocations]
    for m in metas:
        shape = [int(s) for s in m.shape]
        pad = [0] * (MAX_RANK - len(shape))
        words += [len(shape), m.numel] + shape + pad + list(contiguous_strides(shape)) + pad
    data = struct.pack(f"<{len(words)}I", *words)
    shapes = BufferSpec(name=f"k{len(pb.buffers)}", dtype="u32", size=len(data), role="const",
                        meta=TensorMeta((len(words),), "int32"), data=data)
    pb.buffers.append(shapes)
    pb.sizes[shapes.name] = shapes.size
    name = pb.kernel("user_" + re.sub(r"[^A-Za-z0-9_]", "_", Path(kernel.path).stem)[:40]).name
    bindings = [(b.name, "read") for b in buffers[:len(values)]] + [(b.name, "read_write") for b in outputs] + \
        [(shapes.name, "read")]
    pb.add(Kernel(name=name, wgsl=kernel.source, bindings=bindings, workgroups=(gx, gy, 1), entry=ENTRY))
    return [BufferView.whole(o, meta) for o, meta in zip(outputs, node.outputs)]


def probe_program(kernel: UserKernel) -> KernelProgram:
    """A program that only builds ``kernel``'s pipeline on a device: a 16-byte buffer per binding
    and no workgroups dispatched, so that the device's compiler judges the file once per device,
    whatever the cases. Run it with no inputs; it has no outputs."""
    buffers, bindings = [], []
    for i, (access, _, _) in enumerate(kernel.bindings):
        name = f"probe{i}"
        role, data = ("const", bytes(16)) if access == "read" else ("temp", None)
        buffers.append(BufferSpec(name=name, dtype="u32", size=16, role=role, data=data))
        bindings.append((name, access))
    return KernelProgram(kind="wgsl", inputs=[], outputs=[], buffers=buffers,
                         kernels=[Kernel("user_kernel_probe", kernel.source, bindings, (0, 0, 0), entry=ENTRY)])


def kernel_fingerprints(items: list[str] | None) -> list[str]:
    """``OP=FILE sha256:DIGEST`` of each ``--kernel`` value (the file read and checked again): what a
    migration's journal records, so that a resume with other kernel files, or changed ones, is refused."""
    return [f"{k.option()} sha256:{hashlib.sha256(k.source.encode()).hexdigest()}"
            for files in parse_kernel_options(items).values() for k in files]


def source_digest(kernel: UserKernel) -> str:
    """A short content hash of the kernel's source (what a device's verdict on it is cached by)."""
    return hashlib.sha256(kernel.source.encode()).hexdigest()[:16]


__all__ = ["UserKernel", "load_user_kernel", "parse_kernel_options", "user_lowerings", "lower_user_kernel",
           "probe_program", "source_digest", "kernel_fingerprints", "MAX_KERNEL_BYTES", "MAX_RANK", "HEADER", "RECORD", "ELEMENT_TYPES"]
