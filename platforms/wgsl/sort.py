"""Sorting on the GPU: sort (values and int64 indices) and topk, by a bitonic sorting network.

Each row (the elements along ``dim``) is padded to a power of two ``P``; padding sorts last.
Elements are compared as (key, original index): the key is an i32 that orders like torch
(floats by their bits with -0.0 made +0.0 so the two zeros tie, every NaN the largest key so
NaN comes after +inf ascending and first descending), ties go to the lower original index, so
the order is total and the indices equal torch's stable sort exactly.

Rows of up to :func:`block_size` elements (2048 with WebGPU's default 16 KiB of workgroup
memory) sort in one dispatch, one workgroup per block of one or more rows held in workgroup
memory. Longer rows sort blockwise first, then each merge stage whose compare distance spans
blocks runs as its own global dispatch (one thread per compared pair) and the distances within
a block finish in workgroup memory again. The sort writes only the sorted indices; the values
output gathers the input at them (a lazy value, fused into whatever reads it).
"""

from __future__ import annotations

import math

import torch

from tapml.errors import Unsupported
from tapml.graph import Node, TensorMeta
from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import (I64, MAX_GROUPS, U64, WIDE, BufferView, Compute, Custom, Value, contiguous_strides,
                                         equal, less)
from tapml.platforms.wgsl.registry import ALL, NUMERIC, randint, register

_KEY_F32 = """
fn sort_key_f32(x: f32) -> i32 {
  var u = bitcast<u32>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) { return 2147483647; }
  if (u == 0x80000000u) { u = 0u; }
  if ((u & 0x80000000u) != 0u) { return bitcast<i32>(u ^ 0x7fffffffu); }
  return bitcast<i32>(u);
}"""


def block_size(caps_limits: dict, key_bytes: int = 4) -> int:
    """Elements one workgroup sorts in workgroup memory (a key of ``key_bytes`` and an index of 4
    bytes each): the largest power of two that fits ``max-compute-workgroup-storage-size``, at most 2048."""
    storage = int(caps_limits.get("max-compute-workgroup-storage-size", 16384))
    return max(2, min(2048, 1 << int(math.log2(max(storage // (key_bytes + 4), 2)))))


def _key_type(ty: str) -> str:
    """The WGSL type of a sort key of expression type ``ty``: i32 (floats and bools mapped to
    ordered i32), or the two-word int64 or uint64 itself."""
    return ty if ty in (I64, U64) else "i32"


def _before(count: int, descending: bool, key_type: str = "i32") -> str:
    """WGSL ``sort_before(a, ai, b, bi)``: element (key a, index ai) goes before (b, bi) in the
    sorted row; indices >= ``count`` are padding and go last."""
    first = less("b", "a", key_type) if descending else less("a", "b", key_type)
    return f"""
fn sort_before(a: {key_type}, ai: i32, b: {key_type}, bi: i32) -> bool {{
  let pad_a = ai >= {count};
  let pad_b = bi >= {count};
  if (pad_a || pad_b) {{ return select(!pad_a, ai < bi, pad_a && pad_b); }}
  if (!{equal("a", "b", key_type)}) {{ return {first}; }}
  return ai < bi;
}}"""


def _key(k, expr: str, ty: str) -> str:
    if ty == "f32":
        k.helpers.setdefault("sort_key_f32", _KEY_F32)
        return f"sort_key_f32({expr})"
    if ty == "bool":
        return f"select(0, 1, {expr})"
    return expr


def _compare_exchange(k, keys: str, idxs: str, i: str, j: str, kk: str, P: int, base: str, key_type: str) -> None:
    """Compare and maybe swap elements ``i`` and ``i + j`` of the arrays named ``keys``/``idxs``
    (WGSL accessors: ``keys[i]``), for bitonic stage ``kk``; ``base`` is the flat position of
    element 0 of the arrays, so the direction follows the element's position in its row."""
    k.emit(f"let l: i32 = {i} + {j};")
    k.emit(f"let up: bool = ((({base} + {i}) & {P - 1}) & {kk}) == 0;")
    if key_type in (I64, U64):
        k.need("tap_i64_lt" if key_type == I64 else "tap_u64_lt")  # sort_before's, which the body scan does not see
    k.emit(f"let a: {key_type} = {keys.format(i)};")
    k.emit(f"let ai: i32 = {idxs.format(i)};")
    k.emit(f"let b: {key_type} = {keys.format('l')};")
    k.emit(f"let bi: i32 = {idxs.format('l')};")
    k.open("if (select(sort_before(a, ai, b, bi), sort_before(b, bi, a, ai), up))")


class _Plan:
    """Sizes of one sort: ``rows`` rows of ``count`` elements padded to ``P``; workgroups of
    ``W`` threads each sort a block of ``Bl`` elements (``R`` whole rows, or a part of one)."""

    def __init__(self, pb, rows: int, count: int, key_type: str = "i32"):
        limits = pb.caps.get("limits") or {}
        self.key_type = key_type
        bmax = block_size(limits, 8 if key_type in (I64, U64) else 4)
        threads = int(min(limits.get("max-compute-invocations-per-workgroup", 256),
                          limits.get("max-compute-workgroup-size-x", 256)))
        self.rows, self.count = rows, count
        self.P = max(2, 1 << (count - 1).bit_length())
        if self.P <= bmax:
            self.R = min(bmax // self.P, 1 << (rows - 1).bit_length())
            self.Bl = self.R * self.P
            self.blocks = -(-rows // self.R)
        else:
            self.R, self.Bl = 1, bmax
            self.blocks = rows * self.P // bmax
        self.W = min(1 << int(math.log2(max(threads, 1))), self.Bl // 2)
        self.gx = min(self.blocks, MAX_GROUPS)
        self.gy = -(-self.blocks // self.gx)


def _block_kernel(pb, plan: _Plan, name: str, kfrom: int, kto: int, before: str, load, store):
    """One workgroup per block: ``load(k, i, g)`` emits the statements that fill workgroup slot
    ``i`` with flat element ``g``; then bitonic stages ``kfrom..kto`` (distances below the block
    size) run in workgroup memory; ``store(k, i, g)`` writes slot ``i`` back."""
    k = pb.kernel(name)
    Bl, W = plan.Bl, plan.W
    k.helpers["sort_shared"] = (f"var<workgroup> sort_keys: array<{plan.key_type}, {Bl}>;\n"
                                f"var<workgroup> sort_idx: array<i32, {Bl}>;")
    k.helpers["sort_before"] = before
    # the workgroup's linear id; the dispatch may round up past the last block, and barriers
    # need uniform control flow, so such workgroups run along on the last block and store nothing
    k.emit(f"let lid: i32 = i32(gid.x) % {W};")
    k.emit(f"let wid: i32 = i32(gid.y) * {plan.gx} + i32(gid.x) / {W};")
    k.emit(f"let live: bool = wid < {plan.blocks};")
    k.emit(f"let blk: i32 = min(wid, {plan.blocks - 1});")
    k.emit(f"let base: i32 = blk * {Bl};")
    k.loop("q", Bl // W)
    k.emit(f"let i: i32 = q * {W} + lid;")
    load(k, "i", "base + i")
    k.close()
    k.open(f"for (var kk: i32 = {kfrom}; kk <= {kto}; kk = kk << 1u)")
    k.open(f"for (var jj: i32 = min(kk >> 1u, {Bl // 2}); jj > 0; jj = jj >> 1u)")
    k.emit("workgroupBarrier();")
    k.loop("q", Bl // 2 // W)
    k.emit(f"let p: i32 = q * {W} + lid;")
    k.emit("let i: i32 = (p / jj) * 2 * jj + (p & (jj - 1));")
    _compare_exchange(k, "sort_keys[{}]", "sort_idx[{}]", "i", "jj", "kk", plan.P, "base", plan.key_type)
    k.emit("sort_keys[i] = b; sort_idx[i] = bi; sort_keys[l] = a; sort_idx[l] = ai;")
    k.close()
    k.close()
    k.close()
    k.close()
    k.emit("workgroupBarrier();")
    k.loop("q", Bl // W)
    k.emit(f"let i: i32 = q * {W} + lid;")
    k.open("if (live)")
    store(k, "i", "base + i")
    k.close()
    k.close()
    pb.add(k.finish(0, workgroup=(W, 1, 1), groups=(plan.gx, plan.gy, 1)))


def _global_step(pb, plan: _Plan, keys_buf, idx_buf, kk: int, jj: int, before: str) -> None:
    """One bitonic stage whose compare distance ``jj`` spans blocks: a thread per compared pair."""
    k = pb.kernel("sort_merge")
    k.helpers["sort_before"] = before
    kb, ib = k.bind(keys_buf, "read_write"), k.bind(idx_buf, "read_write")
    k.emit(f"let i: i32 = (n / {jj}) * {2 * jj} + (n & {jj - 1});")
    _compare_exchange(k, kb["{}"], ib["{}"], "i", str(jj), str(kk), plan.P, "0", plan.key_type)
    for buf, pos, v in ((keys_buf, "i", "b"), (idx_buf, "i", "bi"), (keys_buf, "l", "a"), (idx_buf, "l", "ai")):
        k.write(buf, pos, v, plan.key_type if buf is keys_buf else "i32")
    k.close()
    pb.add(k.finish(plan.rows * plan.P // 2))


def sorted_indices(pb, x: Value, dim: int, descending: bool, keep: int) -> BufferView:
    """Emit the sort of ``x`` along ``dim`` (rows of ``n = x.shape[dim]`` elements) and return the
    int64 indices of the first ``keep`` elements of each sorted row, as ``x``'s shape with
    ``keep`` along ``dim``. Ties keep their input order (a stable sort)."""
    nd = len(x.shape)
    count = x.shape[dim]
    kept_shape = [x.shape[e] for e in range(nd) if e != dim]
    rows = math.prod(kept_shape)
    out_shape = list(x.shape)
    out_shape[dim] = keep
    meta = TensorMeta(tuple(out_shape), "int64")
    out = pb.buffer("temp", meta, "t")
    row_strides = contiguous_strides(kept_shape)
    strides = [0] * nd
    for e, st in zip([e for e in range(nd) if e != dim], row_strides):
        strides[e] = st * keep
    strides[dim] = 1
    view = BufferView(out, out_shape, strides, 0, "int64")
    if rows == 0 or keep == 0:
        return view
    key_type = _key_type(x.ty)
    plan = _Plan(pb, rows, count, key_type)
    P = plan.P
    if rows * P >= 2 ** 31:  # kernels index elements with i32
        raise Unsupported(f"sorting {rows} rows of {count} elements pads them to {rows} x {P}, past the 2**31 "
                          "elements WGSL kernels can index with i32")
    before = _before(count, descending, key_type)
    multi = P > plan.Bl

    def load_input(k, i, g):
        row = k.let(f"min(({g}) / {P}, {rows - 1})", "i32")
        pos = k.let(f"({g}) & {P - 1}", "i32")
        idx = list(k.unravel(row, kept_shape))
        idx.insert(dim, k.let(f"min({pos}, {count - 1})", "i32"))
        k.emit(f"sort_keys[{i}] = {_key(k, x.read(k, idx), x.ty)};")
        k.emit(f"sort_idx[{i}] = {pos};")

    def store_out(k, i, g):
        row = k.let(f"({g}) / {P}", "i32")
        pos = k.let(f"({g}) & {P - 1}", "i32")
        k.open(f"if ({row} < {rows} && {pos} < {keep})")
        k.write(out, f"{row} * {keep} + {pos}", f"sort_idx[{i}]", "i32")
        k.close()

    (x,) = pb.fit([x], pb.bindings_of([out.name]) + (0 if not multi else 2))
    if not multi:
        _block_kernel(pb, plan, "sort_rows", 2, P, before, load_input, store_out)
        return view
    work = TensorMeta((rows, P), "int32")
    keys_buf = pb.buffer("temp", TensorMeta((rows, P), {I64: WIDE, U64: "uint64"}.get(key_type, "int32")), "t")
    idx_buf = pb.buffer("temp", work, "t")

    def load_work(k, i, g):
        k.emit(f"sort_keys[{i}] = {k.bind(keys_buf)[g]};")
        k.emit(f"sort_idx[{i}] = {k.bind(idx_buf)[g]};")

    def store_work(k, i, g):
        k.write(keys_buf, g, f"sort_keys[{i}]", key_type)
        k.write(idx_buf, g, f"sort_idx[{i}]", "i32")

    _block_kernel(pb, plan, "sort_blocks", 2, plan.Bl, before, load_input, store_work)
    kk = 2 * plan.Bl
    while kk <= P:
        jj = kk // 2
        while jj >= plan.Bl:
            _global_step(pb, plan, keys_buf, idx_buf, kk, jj, before)
            jj //= 2
        last = kk == P
        _block_kernel(pb, plan, "sort_finish" if last else "sort_blocks", kk, kk, before, load_work,
                      store_out if last else store_work)
        kk *= 2
    return view


def gathered(pb, meta: TensorMeta, x: Value, dim: int, indices: BufferView) -> Value:
    """``x`` gathered along ``dim`` at ``indices`` (a lazy value of ``meta``'s shape)."""
    x, indices = pb.fit([x, indices], 1)
    size = x.shape[dim]

    def fn(k, idx):
        src = list(idx)
        src[dim] = k.let(f"clamp({indices.read(k, list(idx))}, 0, {size - 1})", "i32")
        return x.read(k, src)
    return Custom(meta.shape, meta.dtype, [x, indices], fn)


def _sort_like(pb, node: Node, x: Value, dim: int, descending: bool, keep: int) -> list[Value]:
    values_meta = node.outputs[0]
    if not x.shape:  # a 0-d tensor sorts as itself, at index 0
        return [x, Compute((), "int64", [], lambda k, exprs, idx: "i32(0)")]
    dim = views.norm_dim(dim, len(x.shape))
    idx = sorted_indices(pb, x, dim, descending, keep)
    if idx.numel == 0:
        return [BufferView.whole(pb.buffer("temp", values_meta), values_meta), idx]
    return [gathered(pb, values_meta, x, dim, idx), idx]


# --- samples -------------------------------------------------------------------------------
# torch's default (unstable) CPU sort orders ties arbitrarily in rows longer than 16, and its
# topk always does, so their samples past that are tie-free in every dtype they are cast to.

def distinct(*shape, dtype=torch.float32) -> torch.Tensor:
    """A random arrangement of distinct values, exact in float16 and bfloat16 (8 significant
    bits, magnitudes in [2**-14, 2**16)), for up to 7680 elements."""
    count = math.prod(shape)
    if count > 7680:
        raise ValueError("distinct() makes at most 7680 values")
    j = torch.randperm(count)
    mag = (128 + j % 128).double() * torch.pow(2.0, ((j // 128) % 30 - 21).double())
    return torch.where(j >= 3840, -mag, mag).to(dtype).reshape(shape)


def distinct_ints(*shape, dtype=torch.int64) -> torch.Tensor:
    """Distinct integers of ``dtype`` with the i32 (or the dtype's) boundaries among them."""
    count = math.prod(shape)
    info = torch.iinfo(dtype) if dtype != torch.int64 else torch.iinfo(torch.int32)
    span = info.max - info.min + 1
    if count > span:
        raise ValueError(f"{count} distinct {dtype} values do not exist")
    if span <= 65536:
        vals = torch.randperm(span)[:count] + info.min
    else:
        vals = torch.randperm(4 * count)[:count] - 2 * count
    flat = vals.reshape(-1)
    for pos, bound in enumerate((info.min, info.max)[:count]):
        hit = (flat == bound).nonzero()
        if len(hit):  # the bound is there already: swap it to its place
            flat[hit[0, 0]] = flat[pos]
        flat[pos] = bound
    return flat.reshape(shape).to(dtype)


def _edges_distinct(rows: int, cols: int) -> torch.Tensor:
    """:func:`distinct` rows, with the float edge values spread so that no row ties, even in
    float16 (where float32 denormals become zeros): NaN, ±inf, ±0 and denormals, at most one
    zero or denormal per row."""
    t = distinct(rows, cols)
    specials = [[math.nan, math.inf, -math.inf, 0.0], [-0.0, math.nan], [1e-40, -math.inf], [-1e-39, math.inf]]
    for r, row in enumerate(specials[:rows]):
        for c, v in enumerate(row[:cols]):
            t[r, (c * 7 + r) % cols] = v
    return t


def _ties(*shape, dtype=torch.float32) -> torch.Tensor:
    """Values with many ties and every float edge value (for the stable sort)."""
    t = randint(*shape, lo=-3, hi=3).to(torch.float32).reshape(-1) * 0.5
    edges = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40, math.nan, -0.0, math.inf])
    t[:min(len(edges), t.numel())] = edges[:t.numel()]
    t = t[torch.randperm(t.numel())]
    return t.reshape(shape).to(dtype)


def _sort_samples():
    return [
        ((_edges_distinct(4, 1000),), {}),
        ((_edges_distinct(3, 37).reshape(3, 37, 1).expand(3, 37, 2).contiguous() *
          torch.tensor([1.0, -1.0]), 1, True), {}),
        ((distinct(50, 3), 0), {}),
        ((_ties(6, 16), -1, True), {}),  # rows of at most 16: torch's unstable sort is stable there
        ((_ties(300, 7), 1), {}),
        ((distinct(2100), 0, True), {}),  # longer than a block: the multi-pass path
        ((distinct(5, 1),), {}),
        ((torch.tensor(2.5),), {}),
        ((distinct(0, 5), 1), {}),
        ((distinct_ints(3, 40), 1), {}),
        ((distinct_ints(2, 200, dtype=torch.int32), -1, True), {}),
        ((distinct_ints(1, 256, dtype=torch.uint8).reshape(4, 64), 1), {}),
        ((distinct_ints(3, 50, dtype=torch.int8), 0, True), {}),
        ((distinct_ints(4, 30, dtype=torch.int16), 1), {}),
        ((torch.rand(5, 16) > 0.5, 1), {}),
        ((torch.rand(3, 9) > 0.5, -1, True), {}),
    ]


def _stable_samples():
    return [
        ((_ties(4, 1000),), {"stable": True}),
        ((_ties(3, 37, 4),), {"stable": True, "dim": 1, "descending": True}),
        ((_ties(50, 3),), {"stable": True, "dim": 0}),
        ((_ties(5000),), {"stable": True}),  # multi-pass with ties across blocks
        ((_ties(3000),), {"stable": True, "descending": True}),
        ((_ties(5, 1),), {"stable": True}),
        ((_edges_distinct(3, 100),), {"stable": None}),
        ((_edges_distinct(2, 60),), {"stable": False, "descending": True}),
        ((randint(3, 500, lo=-3, hi=3),), {"stable": True, "descending": True}),
        ((torch.cat([randint(50, lo=-3, hi=3, dtype=torch.int32),
                     torch.tensor([-2**31, 2**31 - 1, -2**31, 2**31 - 1], dtype=torch.int32)]),), {"stable": True}),
        ((randint(4, 300, lo=0, hi=256, dtype=torch.uint8),), {"stable": True, "dim": 0}),
        ((randint(2, 80, lo=-128, hi=128, dtype=torch.int8),), {"stable": True, "descending": True}),
        ((randint(2, 80, lo=-5, hi=5, dtype=torch.int16),), {"stable": True}),
        ((torch.rand(3, 1500) > 0.5,), {"stable": True}),
        ((torch.rand(4, 33) > 0.5,), {"stable": True, "descending": True}),
    ]


def _topk_samples():
    return [
        ((_edges_distinct(1, 1000).reshape(1000), 10), {}),
        ((_edges_distinct(4, 50), 50, -1, False), {}),
        ((distinct(3, 37, 4), 5, 1), {}),
        ((distinct(7, 3), 2, 0, False), {}),
        ((_edges_distinct(2, 3000), 7), {}),  # longer than a block: the multi-pass path
        ((distinct(5, 1), 1), {}),
        ((distinct(3, 20), 0), {}),
        ((torch.tensor(1.5), 1), {}),
        ((distinct_ints(3, 40), 4), {}),
        ((distinct_ints(2, 100, dtype=torch.int32), 100, 1, False), {}),
        ((distinct_ints(1, 256, dtype=torch.uint8).reshape(2, 128), 9), {}),
        ((distinct_ints(3, 60, dtype=torch.int8), 3, -1, False), {}),
        ((distinct_ints(4, 30, dtype=torch.int16), 6), {}),
    ]


# --- lowerings -----------------------------------------------------------------------------

@register(["aten.sort.default"], ALL, samples=_sort_samples, flops="reduce")
def sort(pb, node, x, dim=-1, descending=False):
    """Sort along ``dim``: values and int64 indices, ties in input order (torch's stable sort,
    which its default sort equals for rows of up to 16 and for rows without ties)."""
    return _sort_like(pb, node, x, dim, bool(descending), x.shape[views.norm_dim(dim, len(x.shape))]
                      if x.shape else 1)


@register(["aten.sort.stable"], ALL, samples=_stable_samples, flops="reduce")
def sort_stable(pb, node, x, *, stable=None, dim=-1, descending=False):
    """``sort.stable``: always stable here, whatever ``stable`` says (see :func:`sort`)."""
    return sort(pb, node, x, dim, descending)


def _topk_check(node: Node) -> str | None:
    sorted_ = node.args[4] if len(node.args) > 4 else node.kwargs.get("sorted", True)
    if sorted_ is False:
        return ("topk with sorted=False: torch leaves the order of the k results unspecified (on CPU it is "
                "its selection algorithm's), so no order a target returns can be checked against it")
    return None


@register(["aten.topk.default"], NUMERIC, samples=_topk_samples, check=_topk_check, flops="reduce")
def topk(pb, node, x, k, dim=-1, largest=True, sorted=True):
    """The ``k`` largest (or smallest) elements along ``dim``, sorted, with their int64 indices:
    the first ``k`` of a stable sort, NaN counting as the largest value. For equal values torch's
    CPU topk returns an arbitrary order of their indices, so this matches it exactly only where
    the k results hold no ties (its samples are tie-free); ``sorted=False`` is refused
    (:func:`_topk_check`)."""
    size = x.shape[views.norm_dim(dim, len(x.shape))] if x.shape else 1
    if not 0 <= int(k) <= size:
        raise Unsupported(f"topk of k={k} elements from rows of {size}: k must be in [0, {size}]")
    return _sort_like(pb, node, x, dim, bool(largest), int(k))


__all__ = ["sort", "sort_stable", "topk", "sorted_indices", "gathered", "block_size", "distinct", "distinct_ints"]
