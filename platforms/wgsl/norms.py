"""RMSNorm as one kernel: the pattern transformers' Llama-family norms export to.

``mul(w, mul(x, rsqrt(add(mean(pow(x, 2), [-1], keepdim), eps))))`` lowers op by op to a reduction
kernel (the mean) and an elementwise kernel (the rest) wherever its result is read more than once;
in a decode step both are tiny, and on CPU adapters a dispatch costs more than their work
(benchmarks/NOTES.md). :func:`find_rms_norms` finds the pattern, float32 only, every intermediate
used once inside it and not kept (a kept value or an ``--inject`` op between two of its nodes
leaves the ops separate); :func:`rms_norm` writes it with one workgroup per row: its lanes add the
squares (a tree in workgroup memory), then each writes its elements; on a CPU adapter short rows, and
many rows, take one lane each, without barriers.
"""

from __future__ import annotations

from dataclasses import dataclass

from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import (GEMV_ROWS, LANE_GROUP, LANE_ROW_K, LAZY_ROW_COST, MAX_GROUPS, WORKGROUP,
                                          BufferView, Value, cast, combine_lanes, lit, quarter, vec4_read)


@dataclass
class RmsNormMatch:
    """One RMSNorm: the normalized ``x``, the scale ``w`` (a ref of shape ``[K]``), ``eps``, and
    every node of the pattern (the last, the scaling ``mul``, carries the result)."""

    x: str
    w: str
    eps: float
    nodes: list[str]


def _ref(arg) -> str | None:
    return arg.get("ref") if isinstance(arg, dict) else None


def find_rms_norms(graph, uses, wanted: set[str]) -> dict[str, RmsNormMatch]:
    """The RMSNorms of ``graph``, by the name of each one's last node."""
    producer = {n.name: n for n in graph.nodes}

    def inner(ref, op):
        node = producer.get(ref) if ref is not None else None
        if node is None or node.op != op or node.multi or node.kwargs or uses[ref] != 1 or ref in wanted:
            return None
        return node

    found: dict[str, RmsNormMatch] = {}
    for out in graph.nodes:
        if out.op != "aten.mul.Tensor" or out.kwargs or len(out.args) != 2 or out.outputs[0].dtype != "float32":
            continue
        for side in (0, 1):
            w, normed = _ref(out.args[side]), inner(_ref(out.args[1 - side]), "aten.mul.Tensor")
            if w is None or normed is None or len(normed.args) != 2:
                continue
            shape = tuple(out.outputs[0].shape)
            if not shape or tuple(graph.meta[w].shape) != shape[-1:] or graph.meta[w].dtype != "float32":
                continue
            for x_side in (0, 1):
                x, rsqrt = _ref(normed.args[x_side]), inner(_ref(normed.args[1 - x_side]), "aten.rsqrt.default")
                if x is None or rsqrt is None or tuple(graph.meta[x].shape) != shape:
                    continue
                add = inner(_ref(rsqrt.args[0]), "aten.add.Tensor")
                if add is None or len(add.args) != 2 or not isinstance(add.args[1], (int, float)) or \
                        isinstance(add.args[1], bool):
                    continue
                mean = inner(_ref(add.args[0]), "aten.mean.dim")
                if mean is None or len(mean.args) != 3 or mean.args[1] not in ([-1], [len(shape) - 1]) or \
                        mean.args[2] is not True:
                    continue
                square = inner(_ref(mean.args[0]), "aten.pow.Tensor_Scalar")
                if square is None or _ref(square.args[0]) != x or square.args[1] != 2:
                    continue
                found[out.name] = RmsNormMatch(x, w, float(add.args[1]),
                                               [square.name, mean.name, add.name, rsqrt.name, normed.name, out.name])
                break
            if out.name in found:
                break
    return found


def rms_norm(pb, match: RmsNormMatch, env: dict, meta) -> Value:
    """The pattern's value (``meta``: the last ``mul``'s): rows few enough for a GEMV
    (``gemv_rows``) are a :class:`NormedRow` (a GEMV that reads them computes the norm itself);
    more rows are written by one kernel."""
    shape = tuple(meta.shape)
    K = shape[-1]
    rows = meta.numel // K if K else 0
    x, w = env[match.x], env[match.w]
    if 1 <= rows <= GEMV_ROWS and isinstance(w, BufferView) and \
            (isinstance(x, BufferView) or (rows == 1 and x.cost <= LAZY_ROW_COST)):
        return NormedRow(views.reshape(x, (rows, K)), w, match.eps, meta, shape, {})
    out = pb.buffer("temp", meta)
    result = BufferView.whole(out, meta)
    if rows:
        _write(pb, views.reshape(x, (rows, K)), w, match.eps, out, rows, K)
    return result


#: On a CPU adapter a norm of at least this many rows (a prefill) takes one lane a row, as a row of
#: at most ``LANE_ROW_K`` elements always does (codegen.LANE_GROUP).
LANE_ROWS = 64


def _write(pb, x: Value, w: Value, eps: float, out, rows: int, K: int) -> None:
    """The kernel: one workgroup a row, whose lanes add the squares and then each write their
    elements; on a CPU adapter, for short rows or many of them, one lane a row."""
    x, w = pb.fit([x, w], 1)
    k = pb.kernel("rms_norm")
    four = K % 4 == 0 and out.dtype == "f32"  # four elements a load and a store (Value.read4)
    one_lane = (pb.caps or {}).get("cpu_adapter") and (K <= LANE_ROW_K or rows >= LANE_ROWS)
    lanes = 1 if one_lane else WORKGROUP
    groups = -(-rows // LANE_GROUP) if one_lane else rows
    gx = min(groups, MAX_GROUPS)
    group = f"(i32(wid.y) * {gx} + i32(wid.x))"
    if one_lane:
        k.emit(f"let row: i32 = {group} * {LANE_GROUP} + i32(lid.x);")
        k.emit("let lane: i32 = 0;")
        k.open(f"if (row < {rows})")  # no barrier follows: a lane past the last row does nothing
    else:
        k.emit("let lane: i32 = i32(lid.x);")
        k.emit(f"let row: i32 = min({group}, {rows - 1});")
    scale = row_scale(k, lambda i: x.read(k, ["row", i]), x.ty, K, eps, "lane", lanes,
                      (lambda i: vec4_read(k, x, ["row", i], 1)) if four else None)
    if not one_lane:
        k.open(f"if ({group} < {rows})")  # past the last row: computed, written nowhere
    step = 4 if four else 1
    k.loop("i", -(-K // (step * lanes)))
    idx = k.let(f"(lane + i * {lanes}) * {step}" if lanes > 1 else f"i * {step}", "i32")
    ragged = K % (step * lanes) != 0
    if ragged:
        k.open(f"if ({idx} < {K})")
    if four:
        o = k.bind(out, "read_write", elem="vec4<f32>")
        value = f"{vec4_read(k, w, [idx], 0)} * ({vec4_read(k, x, ['row', idx], 1)} * {scale})"
        at = quarter(f"row * {K} + {idx}")
        k.emit(f"{o.name}_set({at}, {value});" if o.split else f"{o[at]} = {value};")
    else:
        xv = cast(x.read(k, ["row", idx]), x.ty, "f32")
        wv = cast(w.read(k, [idx]), w.ty, "f32")
        k.write(out, f"row * {K} + {idx}", f"{wv} * ({xv} * {scale})", "f32")
    if ragged:
        k.close()
    k.close()
    k.close()
    pb.add(k.finish(0, workgroup=(LANE_GROUP if one_lane else WORKGROUP, 1, 1), groups=(gx, -(-groups // gx), 1),
                    group_ids=True))


def row_scale(k, element, ty: str, K: int, eps: float, lane: str, lanes: int, element4=None, tag: str = "") -> str:
    """Emit, at the kernel's top level, ``1 / sqrt(mean(x * x) + eps)`` of one row of ``K``
    elements (``element(i)``: element ``i`` as an expression of type ``ty``; ``element4(i)``, where
    given, elements ``i .. i + 3`` as one ``vec4<f32>``), its squares added by the ``lanes`` lanes of
    the workgroup (``lane``: this lane's index); returns its name. Ends with a barrier, so the
    workgroup memory may be used again."""
    k.emit(f"var squares{tag}: f32 = 0.0;")
    step = 4 if element4 is not None else 1
    k.loop("i", -(-K // (lanes * step)))
    idx = k.let(f"{lane} + i * {lanes}", "i32")
    k.open(f"if ({idx} < {K // step})")
    if element4 is not None:
        v = k.let(element4(f"{idx} * 4"), "vec4<f32>")
        k.emit(f"squares{tag} = squares{tag} + dot({v}, {v});")
    else:
        v = k.let(cast(element(idx), ty, "f32"), "f32")
        k.emit(f"squares{tag} = squares{tag} + {v} * {v};")
    k.close()
    k.close()
    if lanes == 1:
        k.emit(f"let scale{tag}: f32 = inverseSqrt(squares{tag} / {lit(float(K), 'f32')} + {lit(eps, 'f32')});")
        return f"scale{tag}"
    combine_lanes(k, lanes, lane, lane, [f"squares{tag}"])  # the row's sum ends in lane 0's slot, partial[0]
    k.emit(f"let scale{tag}: f32 = inverseSqrt(partial[0] / {lit(float(K), 'f32')} + {lit(eps, 'f32')});")
    k.emit("workgroupBarrier();")  # every lane has read the sum before the memory is reused
    return f"scale{tag}"


class NormedRow(Value):
    """A few rows' RMSNorm, not written yet: ``w * (x * scale)`` with ``scale`` each row's
    ``1 / sqrt(mean(x * x) + eps)``. A GEMV reading it (``matmul.gemv_kernel``) computes a row's
    ``scale`` in each workgroup that reads the row (:meth:`prologue`), so the norm needs no kernel
    of its own; any other reader reads the rows as :func:`rms_norm` writes them, written once at
    the first such read. Reshapes that keep the rows' length keep it a NormedRow (the elements stay
    in order, row ``r`` of the flattened rows is ``x[r]``). ``x`` (rows by ``K``) is a buffer, or
    rows cheap enough to compute where they are read (``LAZY_ROW_COST``: a decode step's embedding row)."""

    def __init__(self, x: Value, w: BufferView, eps: float, meta, shape, state: dict):
        self.x, self.w, self.eps, self.meta, self.state = x, w, eps, meta, state
        self.shape, self.dtype, self.cost = tuple(shape), "float32", 0

    @property
    def K(self) -> int:
        return self.x.shape[1]

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    def reshaped(self, shape):
        if not shape or shape[-1] != self.K:  # a row split or merged: read as written
            return None
        return NormedRow(self.x, self.w, self.eps, self.meta, shape, self.state)

    def written(self, pb) -> BufferView:
        if "row" not in self.state:  # shared by every reshape of these rows
            out = pb.buffer("temp", self.meta)
            _write(pb, self.x, self.w, self.eps, out, self.rows, self.K)
            self.state["row"] = BufferView.whole(out, self.meta)
        return views.reshape(self.state["row"], self.shape)

    def read(self, k, idx):
        return self.written(k.program).read(k, idx)

    def bufs(self):
        return self.x.bufs() | self.w.bufs() | (self.state["row"].bufs() if "row" in self.state else frozenset())

    def same_row(self, other) -> bool:
        return isinstance(other, NormedRow) and other.state is self.state

    def prologue(self, k, lane: str, lanes: int, row: str = "0", tag: str = "") -> str:
        """Emit the scale of row ``row`` into a kernel whose ``lanes`` lanes all run this (top
        level), named with ``tag`` (one per row of the kernel)."""
        four = (lambda i: vec4_read(k, self.x, [row, i], 1)) if self.K % 4 == 0 else None
        return row_scale(k, lambda i: self.x.read(k, [row, i]), self.x.ty, self.K, self.eps, lane, lanes, four, tag)

    def read4(self, k, i: str, scale: str, row: str = "0", w: str | None = None) -> str:
        """Elements ``i .. i + 3`` of row ``row`` as a ``vec4<f32>`` expression, rounded as torch
        rounds them (``w``: the scale's elements ``i .. i + 3`` where already read, see :meth:`weight4`)."""
        return f"({w or self.weight4(k, i)} * ({vec4_read(k, self.x, [row, i], 1)} * {scale}))"

    def weight4(self, k, i: str) -> str:
        """The norm's weight at ``i .. i + 3`` (the same for every row) as a ``vec4<f32>``."""
        return vec4_read(k, self.w, [i], 0)
