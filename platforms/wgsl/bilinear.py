"""``aten._trilinear``, what ``nn.Bilinear`` exports as: three tensors, each unsqueezed at its
``expand`` dims and broadcast together, multiplied and summed over ``sumdim``."""

from __future__ import annotations

import math

from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import Custom, cast, round_low
from tapml.platforms.wgsl.registry import ALL_FLOAT, FLOPS, edge_floats, rand, register


def _samples():
    return [((rand(4, 5), rand(3, 5, 7), rand(4, 7), [1, 3], [0], [1, 2], [2, 3]), {}),  # nn.Bilinear(5, 7, 3)
            ((rand(1, 2), rand(6, 2, 1), rand(1, 1), [1, 3], [0], [1, 2], [2, 3]), {}),
            ((rand(3, 4), rand(4, 5), rand(3, 5), [2], [0], [1], []), {}),  # no sum: a broadcast product
            ((rand(3, 4), rand(4, 5), rand(3, 5), [2], [0], [1], [0, 2]), {}),
            ((rand(2, 3, 4), rand(3, 4), rand(2, 4), [], [0], [1], [1, 2], 2), {}),
            ((edge_floats(4, 5), rand(2, 5, 3), rand(4, 3), [1, 3], [0], [1, 2], [2, 3]), {})]


def trilinear_flops(node, ins) -> int:
    """Two per product term: each output element sums the product over the summed dims."""
    total = len(ins[0].shape) + len(node.args[3])
    sizes = [1] * total
    for meta, expand in zip(ins, node.args[3:6]):
        shape = list(meta.shape)
        for d in sorted(e % total for e in expand):
            shape.insert(d, 1)
        sizes = [max(a, b) for a, b in zip(sizes, shape)]
    summed = math.prod(sizes[d % total] for d in set(node.args[6]))
    return 2 * node.outputs[0].numel * summed


FLOPS["trilinear"] = trilinear_flops


@register("aten._trilinear.default", ALL_FLOAT, samples=_samples, flops="trilinear")
def trilinear(pb, node, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """Sums in f32 in the order of the summed dims (torch contracts pairwise through bmm, so
    the rounding differs within float32's tolerance)."""
    meta = node.outputs[0]
    total = len(i1.shape) + len(expand1)
    ins = []
    for v, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        for d in sorted(e % total for e in expand):
            v = views.unsqueeze(v, d)
        ins.append(v)
    sizes = [max(v.shape[d] for v in ins) for d in range(total)]
    ins = pb.fit([views.expand_to(v, sizes) for v in ins], 1)
    summed = sorted({d % total for d in sumdim})
    kept = [d for d in range(total) if d not in summed]

    def fn(k, idx):
        acc = k.var("f32", "0.0", "acc")
        index = dict(zip(kept, idx))
        for j, d in enumerate(summed):
            k.loop(f"s{j}", sizes[d])
            index[d] = f"s{j}"
        terms = [cast(v.read(k, [index[d] for d in range(total)]), v.ty, "f32") for v in ins]
        k.emit(f"{acc} = {acc} + {' * '.join(terms)};")
        for _ in summed:
            k.close()
        return round_low(k, acc, meta.dtype)
    return [Custom(meta.shape, meta.dtype, ins, fn, cost=9)]


__all__ = ["trilinear", "trilinear_flops"]
