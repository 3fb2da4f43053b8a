"""RMSNorm as one kernel: the pattern transformers' Llama-family norms export to.

``mul(w, mul(x, rsqrt(add(mean(pow(x, 2), [-1], keepdim), eps))))`` lowers op by op to a reduction
kernel (the mean) and an elementwise kernel (the rest) wherever its result is read more than once;
in a decode step both are tiny, and on CPU adapters a dispatch costs more than their work
(benchmarks/NOTES.md). :func:`find_rms_norms` finds the pattern, float32 only, every intermediate
used once inside it and not kept (a kept value or an ``--inject`` op between two of its nodes
leaves the ops separate); :func:`rms_norm` writes it with one workgroup per row: its lanes add the
squares (a tree in workgroup memory), then each writes its elements.
"""

from __future__ import annotations

from dataclasses import dataclass

from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import MAX_GROUPS, WORKGROUP, BufferView, cast, combine_lanes, lit


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


def rms_norm(pb, match: RmsNormMatch, env: dict, meta) -> BufferView:
    """The pattern's value (``meta``: the last ``mul``'s) in one kernel."""
    shape = tuple(meta.shape)
    K = shape[-1]
    rows = meta.numel // K if K else 0
    out = pb.buffer("temp", meta)
    result = BufferView.whole(out, meta)
    if rows == 0:
        return result
    x = views.reshape(env[match.x], (rows, K))
    x, w = pb.fit([x, env[match.w]], 1)
    k = pb.kernel("rms_norm")
    gx = min(rows, MAX_GROUPS)
    per_lane = -(-K // WORKGROUP)
    k.emit("let lane: i32 = i32(lid.x);")
    k.emit(f"let row: i32 = min(i32(wid.y) * {gx} + i32(wid.x), {rows - 1});")
    k.emit("var squares: f32 = 0.0;")
    k.loop("i", per_lane)
    idx = k.let(f"lane + i * {WORKGROUP}", "i32")
    k.open(f"if ({idx} < {K})")
    v = k.let(cast(x.read(k, ["row", idx]), x.ty, "f32"), "f32")
    k.emit(f"squares = squares + {v} * {v};")
    k.close()
    k.close()
    combine_lanes(k, WORKGROUP, "lane", "lane", ["squares"])  # the row's sum ends in lane 0's slot
    k.emit(f"let scale: f32 = inverseSqrt(partial[0] / {lit(float(K), 'f32')} + {lit(match.eps, 'f32')});")
    k.open(f"if (i32(wid.y) * {gx} + i32(wid.x) < {rows})")  # past the last row: computed, written nowhere
    k.loop("i", per_lane)
    idx = k.let(f"lane + i * {WORKGROUP}", "i32")
    k.open(f"if ({idx} < {K})")
    xv = cast(x.read(k, ["row", idx]), x.ty, "f32")
    wv = cast(w.read(k, [idx]), w.ty, "f32")
    k.write(out, f"row * {K} + {idx}", f"{wv} * ({xv} * scale)", "f32")
    k.close()
    k.close()
    k.close()
    pb.add(k.finish(0, workgroup=(WORKGROUP, 1, 1), groups=(gx, -(-rows // gx), 1), group_ids=True))
    return result
