"""Fractional max pooling (2d and 3d): max pools over torch's pseudo-random intervals.

The ``random_samples`` argument is an input tensor (one sample in [0, 1) per batch, plane and
spatial dimension), so the op is deterministic given it and compared by value. The window
starts are torch's CPU ``generate_intervals``: with ``alpha = (in - pool) / (out - 1)``, output
``i`` starts at ``int((i + s) * alpha) - int(s * alpha)`` and the last one at ``in - pool``, every
step rounded to the input's dtype as torch's ``scalar_t`` arithmetic rounds it (float16 and
bfloat16 included), so that a window never shifts by one. The max is torch's: the first largest
value, a NaN always taking the place (the last NaN's index wins); indices count within a plane.
"""

from __future__ import annotations

import math

import torch

from tapml.graph import Node
from tapml.platforms.wgsl.codegen import BufferView, cast, lit, round_low
from tapml.platforms.wgsl.registry import ALL_FLOAT, edge_floats, rand, register


def _dims(node: Node) -> int:
    return 2 if node.op == "aten.fractional_max_pool2d.default" else 3


def _check(node: Node) -> str | None:
    dims = _dims(node)
    kernel, size = node.args[1], node.args[2]
    if not all(isinstance(v, list) and len(v) == dims and all(isinstance(e, int) and not isinstance(e, bool) and e > 0
                                                           for e in v) for v in (kernel, size)):
        return f"{node.op}: kernel_size and output_size must be {dims} sizes > 0"
    return None


def _alpha(size_in: int, size_out: int, pool: int, dtype: str) -> float:
    """torch's ``alpha = scalar_t(in - pool) / scalar_t(out - 1)``, rounded to ``dtype``."""
    a = torch.tensor(float(size_in - pool), dtype=torch.float32) / torch.tensor(float(size_out - 1))
    return float(a.to(getattr(torch, dtype)).float())


def _lower(pb, node, x, kernel_size, output_size, random_samples):
    dims = _dims(node)
    vmeta, imeta = node.outputs
    vb, ib = pb.buffer("temp", vmeta), pb.buffer("temp", imeta)
    res = [BufferView.whole(vb, vmeta), BufferView.whole(ib, imeta)]
    if vmeta.numel == 0:
        return res
    x, samples = pb.fit([x, random_samples], 2)
    sizes = x.shape[-dims:]
    dtype = vmeta.dtype
    k = pb.kernel(f"fractional_max_pool{dims}d")
    idx = k.unravel("n", vmeta.shape)
    lead, outs = idx[:-dims], idx[-dims:]
    batch, plane = (lead[0], lead[1]) if len(lead) == 2 else ("0", lead[0])
    starts = []
    for d in range(dims):
        size_in, size_out, pool = sizes[d], output_size[d], kernel_size[d]
        last = size_in - pool
        if size_out == 1:
            starts.append(k.let(str(last), "i32"))
            continue
        alpha = lit(_alpha(size_in, size_out, pool, dtype), "f32")
        # 2d draws sample 0 for the width and 1 for the height; 3d, 0 for time, 1 height, 2 width
        j = (1 - d) if dims == 2 else d
        s = k.let(cast(samples.read(k, [batch, plane, str(j)]), samples.ty, "f32"), "f32")
        o = outs[d]
        step = k.let(round_low(k, f"{round_low(k, f'f32({o})', dtype)} + {s}", dtype), "f32")
        at = f"i32({round_low(k, f'{step} * {alpha}', dtype)}) - i32({round_low(k, f'{s} * {alpha}', dtype)})"
        starts.append(k.let(f"select({at}, {last}, {o} == {size_out - 1})", "i32"))
    best = k.var("f32", lit(-math.inf, "f32"), "best")
    plane_index = " + ".join(f"({s}) * {math.prod(sizes[d + 1:])}" for d, s in enumerate(starts))
    arg = k.var("i32", plane_index, "arg")
    names = [f"w{d}" for d in range(dims)]
    for d, name in enumerate(names):
        k.open(f"for (var {name}: i32 = {starts[d]}; {name} < {starts[d]} + {kernel_size[d]}; {name} = {name} + 1)")
    v = k.let(cast(x.read(k, list(lead) + names), x.ty, "f32"), "f32")
    at = " + ".join(f"{name} * {math.prod(sizes[d + 1:])}" for d, name in enumerate(names))
    k.emit(f"if ({v} > {best} || {k.need('tap_isnan')}({v})) {{ {best} = {v}; {arg} = {at}; }}")
    for _ in names:
        k.close()
    k.write(vb, "n", best, "f32")
    k.write(ib, "n", arg, "i32")
    pb.add(k.finish(vmeta.numel))
    return res


def _samples(dims: int):
    def samples():
        def u(n, c, dtype=torch.float32):
            return torch.rand(n, c, dims).to(dtype)
        s2 = [((rand(2, 3, 9, 9), [2, 2], [4, 4], u(2, 3)), {}), ((rand(1, 4, 25, 17), [3, 2], [7, 10], u(1, 4)), {}),
              ((rand(3, 12, 12), [2, 3], [5, 3], u(1, 3)), {}), ((edge_floats(2, 2, 8, 8), [2, 2], [5, 6], u(2, 2)), {}),
              ((rand(1, 2, 6, 7), [1, 1], [1, 6], u(1, 2)), {}),
              ((rand(2, 2, 100, 64), [3, 3], [40, 30], u(2, 2)), {})]
        s3 = [((rand(2, 2, 8, 9, 7), [2, 2, 2], [4, 5, 3], u(2, 2)), {}),
              ((rand(3, 7, 7, 7), [3, 1, 2], [3, 6, 1], u(1, 3)), {}),
              ((edge_floats(1, 2, 6, 6, 6), [2, 2, 2], [4, 4, 4], u(1, 2)), {}),
              ((rand(1, 2, 20, 16, 30), [2, 3, 2], [9, 7, 12], u(1, 2)), {})]
        out = s2 if dims == 2 else s3
        lows = [((rand(2, 3, 40, 50).to(d), [2, 3], [17, 21], u(2, 3, d)), {}) for d in (torch.float16, torch.bfloat16)]
        if dims == 3:
            lows = [((rand(1, 3, 12, 20, 9).to(d), [2, 3, 2], [5, 9, 4], u(1, 3, d)), {})
                    for d in (torch.float16, torch.bfloat16)]
        nans = rand(*out[0][0][0].shape)
        nans.view(-1)[::5] = math.nan
        return out + lows + [((nans, *out[0][0][1:]), {})]
    return samples


for _dims_n in (2, 3):
    register(f"aten.fractional_max_pool{_dims_n}d.default", ALL_FLOAT, samples=_samples(_dims_n),
             check=_check)(_lower)

__all__: list[str] = []
