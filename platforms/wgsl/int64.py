"""int64 in two 32-bit words, where a tensor's values do not fit in i32.

WGSL has no 64-bit integers. An int64 tensor is held as i32 (one word, the fast path) unless
one of its values does not fit; then it is held as two words: the ``i64`` storage type, read
as the ``tap_i64`` expression type (``vec2<u32>``: low word, high word, two's complement;
the same bytes as torch's little-endian int64, so uploads and read-backs copy bytes).

Which tensors get two words is decided per run from values (:func:`wide_refs`): an int64
graph input whose values do not fit, and every int64 value the graph computes that does not
fit when torch computes it from those inputs (the int64 part of the graph is evaluated on the
host; it is small: positions, buckets, indices). Such a ref is compiled with the dtype
:data:`~tapml.platforms.wgsl.codegen.WIDE` (``int64w``), a name that never leaves the
compiler. For a node that touches one, :func:`wide_lowering` chooses:

- the registry's lowering reading two words through the exact conversion to float32, where torch
  computes in float (:data:`READS_AS_FLOAT`, and a two-word op given a float operand);
- the op's two-word lowering (:data:`WIDE_LOWERINGS`): arithmetic, comparisons, min/max,
  bitwise ops, shifts, division and remainder, pow, products and convolution as torch defines
  them for int64;
- the registry's own lowering where it is correct for two words as it is
  (:data:`TAKES_WIDE`: views, copies, casts, fills, ``where``, gathers, scatters, reductions,
  scans, sorts, pools: they compute in their values' type);
- the registry's lowering on the low words, where no output is wide and the op's result
  depends only on its inputs' low words (:data:`LOW_WORD_EXACT`: ring arithmetic modulo
  2**32, selections, shapes);

and otherwise refuses the node (``unsupported``, with the reason).
"""

from __future__ import annotations

import math

import torch

from tapml.errors import Unsupported
from tapml.platforms.wgsl.codegen import I64, U64, WIDE, Compute, Value, ctype
from tapml.platforms.wgsl.helpers import HELPERS
from tapml.platforms.wgsl.registry import REGISTRY, Lowering, randbool

I32_MIN, I32_MAX = -2**31, 2**31 - 1
I64_MIN, I64_MAX = -2**63, 2**63 - 1

_HELPERS = {
    "tap_i64_of": ((), f"""
fn tap_i64_of(v: i32) -> {I64} {{
  return {I64}(bitcast<u32>(v), select(0u, 0xffffffffu, v < 0));
}}"""),
    "tap_i64_add": ((), f"""
fn tap_i64_add(a: {I64}, b: {I64}) -> {I64} {{
  let lo = a.x + b.x;
  return {I64}(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}}"""),
    "tap_i64_sub": ((), f"""
fn tap_i64_sub(a: {I64}, b: {I64}) -> {I64} {{
  return {I64}(a.x - b.x, a.y - b.y - select(0u, 1u, a.x < b.x));
}}"""),
    "tap_i64_neg": (("tap_i64_sub",), f"""
fn tap_i64_neg(a: {I64}) -> {I64} {{
  return tap_i64_sub({I64}(0u, 0u), a);
}}"""),
    "tap_i64_is_neg": ((), f"""
fn tap_i64_is_neg(a: {I64}) -> bool {{
  return bitcast<i32>(a.y) < 0;
}}"""),
    "tap_i64_abs": (("tap_i64_neg", "tap_i64_is_neg"), f"""
fn tap_i64_abs(a: {I64}) -> {I64} {{
  return select(a, tap_i64_neg(a), tap_i64_is_neg(a));
}}"""),
    "tap_i64_mul": (("tap_u32_mul_wide",), f"""
fn tap_i64_mul(a: {I64}, b: {I64}) -> {I64} {{
  let p = tap_u32_mul_wide(a.x, b.x);
  return {I64}(p.x, p.y + a.x * b.y + a.y * b.x);
}}"""),
    "tap_i64_lt": ((), f"""
fn tap_i64_lt(a: {I64}, b: {I64}) -> bool {{
  let ah = bitcast<i32>(a.y); let bh = bitcast<i32>(b.y);
  return ah < bh || (ah == bh && a.x < b.x);
}}"""),
    "tap_u64_lt": ((), f"""
fn tap_u64_lt(a: {I64}, b: {I64}) -> bool {{
  return a.y < b.y || (a.y == b.y && a.x < b.x);
}}"""),
    # torch: a shift by a negative amount or by 64 or more gives 0 (left) or the sign (right)
    # exponent by squaring over the exponent's bits; torch refuses negative powers of integers
    # other than 1 and -1 (0 here)
    "tap_i64_pow": (("tap_i64_mul", "tap_u64_shr"), f"""
fn tap_i64_pow(a: {I64}, e: {I64}) -> {I64} {{
  let one = {I64}(1u, 0u);
  if (bitcast<i32>(e.y) < 0) {{
    if (all(a == one)) {{ return one; }}
    if (all(a == {I64}(0xffffffffu, 0xffffffffu))) {{ return select(one, a, (e.x & 1u) == 1u); }}
    return {I64}(0u, 0u);
  }}
  var r = one;
  var b = a;
  var n = e;
  for (var i: i32 = 0; i < 64; i = i + 1) {{
    if (n.x == 0u && n.y == 0u) {{ break; }}
    if ((n.x & 1u) == 1u) {{ r = tap_i64_mul(r, b); }}
    b = tap_i64_mul(b, b);
    n = tap_u64_shr(n, 1u);
  }}
  return r;
}}"""),
    "tap_i64_shl": ((), f"""
fn tap_i64_shl(a: {I64}, s: {I64}) -> {I64} {{
  if (s.y != 0u || s.x >= 64u) {{ return {I64}(0u, 0u); }}
  let n = s.x;
  if (n == 0u) {{ return a; }}
  if (n < 32u) {{ return {I64}(a.x << n, (a.y << n) | (a.x >> (32u - n))); }}
  return {I64}(0u, a.x << (n - 32u));
}}"""),
    "tap_i64_shr": ((), f"""
fn tap_i64_shr(a: {I64}, s: {I64}) -> {I64} {{
  let fill = select(0u, 0xffffffffu, bitcast<i32>(a.y) < 0);
  if (s.y != 0u || s.x >= 64u) {{ return {I64}(fill, fill); }}
  let n = s.x;
  if (n == 0u) {{ return a; }}
  if (n < 32u) {{ return {I64}((a.x >> n) | (a.y << (32u - n)), bitcast<u32>(bitcast<i32>(a.y) >> n)); }}
  return {I64}(bitcast<u32>(bitcast<i32>(a.y) >> (n - 32u)), fill);
}}"""),
    "tap_u64_shr": ((), f"""
fn tap_u64_shr(a: {I64}, n: u32) -> {I64} {{
  if (n == 0u) {{ return a; }}
  if (n < 32u) {{ return {I64}((a.x >> n) | (a.y << (32u - n)), a.y >> n); }}
  return {I64}(a.y >> (n - 32u), 0u);
}}"""),
    # unsigned long division, one quotient bit per step: (quotient, remainder)
    "tap_u64_divmod": (("tap_u64_lt", "tap_i64_sub"), f"""
fn tap_u64_divmod(n: {I64}, d: {I64}) -> vec4<u32> {{
  var q = {I64}(0u, 0u);
  var r = {I64}(0u, 0u);
  for (var i: i32 = 63; i >= 0; i = i - 1) {{
    let word = select(n.x, n.y, i >= 32);
    r = {I64}((r.x << 1u) | ((word >> u32(i & 31)) & 1u), (r.y << 1u) | (r.x >> 31u));
    if (!tap_u64_lt(r, d)) {{
      r = tap_i64_sub(r, d);
      if (i >= 32) {{ q.y = q.y | (1u << u32(i - 32)); }} else {{ q.x = q.x | (1u << u32(i)); }}
    }}
  }}
  return vec4<u32>(q, r);
}}"""),
    # truncating division (C's): quotient toward zero, remainder with the dividend's sign
    "tap_i64_divmod_trunc": (("tap_u64_divmod", "tap_i64_abs", "tap_i64_neg", "tap_i64_is_neg"), f"""
fn tap_i64_divmod_trunc(a: {I64}, b: {I64}) -> vec4<u32> {{
  let qr = tap_u64_divmod(tap_i64_abs(a), tap_i64_abs(b));
  var q = qr.xy;
  var r = qr.zw;
  if (tap_i64_is_neg(a) != tap_i64_is_neg(b)) {{ q = tap_i64_neg(q); }}
  if (tap_i64_is_neg(a)) {{ r = tap_i64_neg(r); }}
  return vec4<u32>(q, r);
}}"""),
    # floor division (Python's): quotient toward -inf, remainder with the divisor's sign
    "tap_i64_divmod_floor": (("tap_i64_divmod_trunc", "tap_i64_add", "tap_i64_sub", "tap_i64_is_neg"), f"""
fn tap_i64_divmod_floor(a: {I64}, b: {I64}) -> vec4<u32> {{
  let qr = tap_i64_divmod_trunc(a, b);
  var q = qr.xy;
  var r = qr.zw;
  if (any(r != {I64}(0u, 0u)) && tap_i64_is_neg(r) != tap_i64_is_neg(b)) {{
    q = tap_i64_sub(q, {I64}(1u, 0u));
    r = tap_i64_add(r, b);
  }}
  return vec4<u32>(q, r);
}}"""),
    # int64 -> float32 rounded once, to nearest even, as torch converts
    # an unsigned 64-bit value to the nearest float32 (ties to even)
    "tap_u64_to_f32": (("tap_u64_shr", "tap_u64_lt"), f"""
fn tap_u64_to_f32(m: {I64}) -> f32 {{
  if (m.y == 0u && m.x < 16777216u) {{ return f32(m.x); }}
  let lz = select(countLeadingZeros(m.x) + 32u, countLeadingZeros(m.y), m.y != 0u);
  let s = 40u - lz;
  var q = tap_u64_shr(m, s).x;
  let low = select({I64}(m.x & ((1u << s) - 1u), 0u), {I64}(m.x, m.y & ((1u << (s - 32u)) - 1u)), s >= 32u);
  let half = select({I64}(1u << (s - 1u), 0u), {I64}(0u, 1u << (s - 33u)), s >= 33u);
  if (tap_u64_lt(half, low) || (all(low == half) && (q & 1u) == 1u)) {{ q = q + 1u; }}
  return ldexp(f32(q), i32(s));
}}"""),
    "tap_i64_to_f32": (("tap_u64_to_f32", "tap_i64_neg", "tap_i64_is_neg"), f"""
fn tap_i64_to_f32(a: {I64}) -> f32 {{
  let negative = tap_i64_is_neg(a);
  let f = tap_u64_to_f32(select(a, tap_i64_neg(a), negative));
  return select(f, -f, negative);
}}"""),
    # float32 -> int64 toward zero; NaN, infinities and values outside int64 give -2**63 (x86's
    # conversion, which torch's CPU kernels use)
    "tap_f32_to_i64": (("tap_i64_neg",), f"""
fn tap_f32_to_i64(x: f32) -> {I64} {{
  if (!(x >= -9223372036854775808.0 && x < 9223372036854775808.0)) {{ return {I64}(0u, 0x80000000u); }}
  let t = trunc(x);
  let m = abs(t);
  var r = {I64}(0u, 0u);
  if (m < 4294967296.0) {{
    r = {I64}(u32(m), 0u);
  }} else {{
    let hi = floor(m / 4294967296.0);
    r = {I64}(u32(m - hi * 4294967296.0), u32(hi));
  }}
  return select(r, tap_i64_neg(r), t < 0.0);
}}"""),
    # float32 -> uint64 toward zero for [0, 2**64); below that as the int64 conversion wraps (x86)
    "tap_f32_to_u64": (("tap_f32_to_i64",), f"""
fn tap_f32_to_u64(x: f32) -> {I64} {{
  if (x >= 9223372036854775808.0 && x < 18446744073709551616.0) {{
    let r = tap_f32_to_i64(x - 9223372036854775808.0);
    return {I64}(r.x, r.y | 0x80000000u);
  }}
  return tap_f32_to_i64(x);
}}"""),
}
HELPERS.update(_HELPERS)


def _need(k, *names: str) -> None:
    for name in names:
        k.need(name)


#: (source, destination) expression types -> the conversion; narrowing keeps the low word
#: (torch's int64 -> int32 conversion wraps the same way)
_CASTS = {(I64, "i32"): "bitcast<i32>(({e}).x)", (I64, "u32"): "({e}).x",
          (I64, "bool"): f"any(({{e}}) != {I64}(0u, 0u))", (I64, "f32"): "tap_i64_to_f32({e})",
          ("i32", I64): "tap_i64_of({e})", ("u32", I64): f"{I64}({{e}}, 0u)",
          ("bool", I64): f"{I64}(select(0u, 1u, {{e}}), 0u)", ("f32", I64): "tap_f32_to_i64({e})",
          # uint64: the same two words read as unsigned; to and from int64 the bits are kept (as torch)
          (U64, "i32"): "bitcast<i32>(({e}).x)", (U64, "u32"): "({e}).x", (U64, "bool"): f"any(({{e}}) != {U64}(0u, 0u))",
          (U64, "f32"): "tap_u64_to_f32({e})", (U64, I64): "({e})", (I64, U64): "({e})",
          ("i32", U64): "tap_i64_of({e})", ("u32", U64): f"{U64}({{e}}, 0u)",
          ("bool", U64): f"{U64}(select(0u, 1u, {{e}}), 0u)", ("f32", U64): "tap_f32_to_u64({e})"}


def cast_wide(expr: str, src: str, dst: str) -> str:
    """``expr`` converted between expression types where one of them is ``tap_i64``."""
    template = _CASTS.get((src, dst))
    if template is None:
        raise Unsupported(f"no conversion from {src} to {dst}")
    return template.format(e=expr)


def helpers_called(source: str) -> list[str]:
    """The two-word helpers ``source`` calls: a kernel pulls them in by name, since casts
    (:func:`cast_wide`) are written where no kernel is at hand."""
    return [name for name in _HELPERS if name + "(" in source]


# --- which refs get two words --------------------------------------------------------------

#: Ops whose int64 outputs are indices into their input (or counts of its elements): they fit in
#: i32 whenever the tensor does, so the values they are computed from need not be evaluated.
INDEX_OUTPUTS = frozenset({
    "aten.argmax.default", "aten.argmin.default", "aten.max.dim", "aten.min.dim", "aten.sort.default",
    "aten.sort.stable", "aten.topk.default", "aten.kthvalue.default", "aten.median.dim", "aten.mode.default",
    "aten.nanmedian.dim", "aten.cummax.default", "aten.cummin.default", "aten.max_pool2d_with_indices.default",
    "aten.max_pool3d_with_indices.default", "aten.nonzero.default", "aten.argsort.default",
    "aten.searchsorted.Tensor", "aten.bucketize.Tensor", "aten.multinomial.default"})
#: Those of :data:`INDEX_OUTPUTS` whose first output holds values of their first input (the
#: maximum, the sorted row, the median): held in two words whenever that input is.
SELECTS_VALUES = frozenset(INDEX_OUTPUTS - {
    "aten.argmax.default", "aten.argmin.default", "aten.nonzero.default", "aten.argsort.default",
    "aten.searchsorted.Tensor", "aten.bucketize.Tensor", "aten.multinomial.default"})
#: The most FLOPs of host work :func:`wide_refs` spends on one node: the int64 part of a graph is
#: small; a node past this (a product, a convolution) is not evaluated, and the int64 values
#: computed from it stay in i32, as before two words existed (their outputs are still compared).
EVAL_FLOPS = 1 << 22


class WidePlan:
    """What :func:`wide_refs` needs of one graph, worked out once: the int64 graph inputs to check
    per run, the int64 values that do not depend on any input (evaluated here, once: arange,
    constants, what shapes give), and the nodes whose int64 values do (evaluated per run)."""

    def __init__(self, graph):
        from tapml.platforms.wgsl import load_lowerings
        from tapml.platforms.wgsl.registry import node_flops
        self.int64_inputs = [(i, r) for i, (r, m) in enumerate(graph.inputs) if m.dtype == "int64"]
        self.const_wide: set[str] = set()
        self.dynamic: list = []
        registry = load_lowerings()
        # index outputs fit by construction; an empty tensor's values are whatever memory held
        skip = INDEX_OUTPUTS | {op for op, low in registry.items() if not low.compare_values}
        self.selections = [(n.input_refs[0], n.output_refs[0]) for n in graph.nodes
                           if n.op in SELECTS_VALUES and n.input_refs and n.outputs[0].dtype == "int64"]
        producer = graph.producer()
        needed: set[str] = set()
        stack = [n for n in graph.nodes if n.op not in skip and any(m.dtype == "int64" for m in n.outputs)]
        while stack:
            node = stack.pop()
            if node.name in needed:
                continue
            needed.add(node.name)
            stack.extend(producer[r] for r in node.input_refs if r in producer)
        inputs = {r for r, _ in graph.inputs}
        varying: set[str] = set(inputs)  # refs whose values depend on the graph's inputs
        known: dict[str, torch.Tensor] = {}
        for node in graph.nodes:
            if node.name not in needed or node.op in skip or node_flops(node, graph.meta) > EVAL_FLOPS:
                continue  # its values stay unknown: what is computed from them stays in i32
            if any(r in varying for r in node.input_refs):
                varying.update(node.output_refs)
                self.dynamic.append(node)
            elif all(r in known for r in node.input_refs):
                self._evaluate(node, known, self.const_wide)
        read = {r for n in self.dynamic for r in n.input_refs}
        self.const_values = {r: t for r, t in known.items() if r in read}
        self.const_ranges = {r: _range_of(t) for r, t in self.const_values.items()}
        self.read_inputs = read & inputs

    @staticmethod
    def _evaluate(node, values: dict, wide: set) -> None:
        from tapml.graph import run_node
        from tapml.judging.compare import first_outside_i32
        try:
            outs = run_node(node, values.__getitem__)
        except Exception:  # noqa: BLE001 - a node the host cannot run leaves its values unknown (i32)
            return
        for ref, meta, t in zip(node.output_refs, node.outputs, outs):
            if isinstance(t, torch.Tensor):
                values[ref] = t
                if meta.dtype == "int64" and first_outside_i32(t) is not None:
                    wide.add(ref)

    def wide(self, inputs) -> frozenset[str]:
        """The int64 refs whose values, for these inputs, do not all fit in i32: first by ranges
        (each input's least and greatest value carried through the dynamic nodes, which is cheap
        and, where every range fits, exact enough), else by evaluating those nodes."""
        wide = set(self.const_wide)
        ranges = dict(self.const_ranges)
        for i, ref in self.int64_inputs:
            t = inputs[i] if i < len(inputs) else None
            if isinstance(t, torch.Tensor):
                ranges[ref] = lo_hi = _range_of(t)
                if not I32_MIN <= lo_hi[0] <= lo_hi[1] <= I32_MAX:
                    wide.add(ref)
        if self.dynamic and not wide - self.const_wide and self._ranges_fit(inputs, ranges):
            return self._with_selections(wide)
        if self.dynamic:
            values = dict(self.const_values)
            values.update({ref: t for (ref, _), t in zip(self.graph_inputs, inputs) if isinstance(t, torch.Tensor)})
            for node in self.dynamic:
                if all(r in values for r in node.input_refs):
                    self._evaluate(node, values, wide)
        return self._with_selections(wide)

    def _with_selections(self, wide: set) -> frozenset[str]:
        for source, selected in self.selections:  # in graph order: a selection of a selection follows
            if source in wide:
                wide.add(selected)
        return frozenset(wide)

    def _ranges_fit(self, inputs, ranges: dict) -> bool:
        """Whether every int64 value of the dynamic nodes lies in i32, by interval arithmetic from
        the inputs' ranges (False also where a node's op has no interval rule here)."""
        for (ref, meta), t in zip(self.graph_inputs, inputs):
            if isinstance(t, torch.Tensor) and ref in self.read_inputs and ref not in ranges:
                ranges[ref] = _range_of(t)
        for node in self.dynamic:
            rule = _RANGE_RULES.get(node.op)
            if rule is None:
                return False
            try:
                out = rule(*[_arg_range(a, ranges) for a in node.args],
                           **{k: _arg_range(v, ranges) for k, v in node.kwargs.items()})
            except (KeyError, TypeError, ValueError):
                return False
            if out is None or not I32_MIN <= out[0] <= out[1] <= I32_MAX:
                return False
            for ref in node.output_refs:
                ranges[ref] = out
        return True


def _range_of(t: torch.Tensor) -> tuple:
    if t.numel() == 0:
        return (0, 0)
    if t.dtype == torch.bool:
        return (0, 1)
    if t.is_floating_point():
        return (float(t.min()), float(t.max()))
    if t.dtype == torch.uint64:  # torch has no min/max for it: the whole range, so that nodes are evaluated
        return (0, 2**64 - 1)
    lo, hi = torch.aminmax(t)
    return (int(lo), int(hi))


def _arg_range(a, ranges):
    """``a`` with each tensor ref replaced by its range (None where unknown: a resident tensor; a
    rule that needs it raises TypeError, one that does not, such as copy's destination, goes on)."""
    if isinstance(a, dict) and "ref" in a:
        return ranges.get(a["ref"])
    if isinstance(a, list):
        return [_arg_range(x, ranges) for x in a]
    if isinstance(a, (bool, int, float)) or a is None:
        return a
    raise TypeError("an argument without a range")


def _as_range(a):
    if isinstance(a, tuple):
        return a
    if isinstance(a, bool) or not isinstance(a, (int, float)):
        raise TypeError("no range")
    return (a, a)


def _sum_range(a, b, alpha=1):
    (al, ah), (bl, bh) = _as_range(a), _as_range(b)
    if not isinstance(alpha, (int, float)):
        raise TypeError("alpha")
    return (al + min(alpha * bl, alpha * bh), ah + max(alpha * bl, alpha * bh))


def _product_range(a, b):
    (al, ah), (bl, bh) = _as_range(a), _as_range(b)
    p = [al * bl, al * bh, ah * bl, ah * bh]
    return (min(p), max(p))


def _first_range(x, *args, **kwargs):
    return _as_range(x)


def _union_range(tensors, *args, **kwargs):
    rs = [_as_range(t) for t in tensors]
    return (min(r[0] for r in rs), max(r[1] for r in rs))


#: Interval rules (on ``(least, greatest)``) of the ops int64 positions and lengths go through
#: in a step: arithmetic, and the views and copies that keep their input's values.
_RANGE_RULES = {
    "aten.add.Tensor": _sum_range, "aten.add.Scalar": _sum_range,
    "aten.sub.Tensor": lambda a, b, alpha=1: _sum_range(a, b, -alpha),
    "aten.sub.Scalar": lambda a, b, alpha=1: _sum_range(a, b, -alpha),
    "aten.rsub.Scalar": lambda a, b, alpha=1: _sum_range(b, a, -alpha),
    "aten.mul.Tensor": _product_range, "aten.mul.Scalar": _product_range,
    "aten.neg.default": lambda a: (-_as_range(a)[1], -_as_range(a)[0]),
    "aten.copy.default": lambda dst, src, *args: _as_range(src),
    **dict.fromkeys(("aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default",
                     "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.select.int",
                     "aten.slice.Tensor", "aten.expand.default", "aten.permute.default", "aten.clone.default",
                     "aten.alias.default", "aten.t.default", "aten.transpose.int", "aten.index.Tensor",
                     "aten.index_select.default", "aten.gather.default", "aten._to_copy.default",
                     "aten.lift_fresh_copy.default"), _first_range),
    "aten.cat.default": _union_range,
}


def wide_refs(graph, inputs, plan: WidePlan | None = None) -> frozenset[str]:
    """The int64 refs of ``graph`` whose values, for these ``inputs`` (tensors, or resident
    handles whose values are not known here), do not all fit in i32 (``plan``: the graph's
    :class:`WidePlan`, made here when not given)."""
    if plan is None:
        if not any(m.dtype == "int64" for m in graph.meta.values()):
            return frozenset()
        plan = wide_plan(graph)
    return plan.wide(inputs)


def wide_plan(graph) -> WidePlan:
    """The :class:`WidePlan` of ``graph``."""
    plan = WidePlan(graph)
    plan.graph_inputs = list(graph.inputs)
    return plan


def widen(graph, wide):
    """``graph`` with the int64 refs in ``wide`` typed :data:`WIDE` (two words)."""
    from tapml.graph import Graph, Node, TensorMeta

    def meta(ref, m):
        return TensorMeta(m.shape, WIDE) if ref in wide and m.dtype == "int64" else m
    nodes = [Node(n.name, n.op, n.args, n.kwargs, [meta(r, m) for r, m in zip(n.output_refs, n.outputs)],
                  multi=n.multi, module=n.module, module_type=n.module_type, case=n.case) for n in graph.nodes]
    return Graph(inputs=[(r, meta(r, m)) for r, m in graph.inputs], nodes=nodes, outputs=list(graph.outputs),
                 state=dict(graph.state))


# --- lowerings ------------------------------------------------------------------------------

#: Registry lowerings that are right for two-word values as they are: they move, select, fill or
#: convert elements through the generic read, write, literal and cast of the value's type.
TAKES_WIDE = frozenset({
    "aten._to_copy.default", "aten.to.dtype", "aten.clone.default", "aten.copy.default", "aten.alias.default",
    "aten.lift_fresh_copy.default", "aten.full.default", "aten.full_like.default", "aten.new_full.default",
    "aten.scalar_tensor.default", "aten.zeros_like.default", "aten.new_zeros.default", "aten.zeros.default",
    "aten.ones_like.default", "aten.new_ones.default", "aten.ones.default", "aten.where.self",
    "aten.where.ScalarSelf", "aten.where.ScalarOther", "aten.where.Scalar", "aten.cat.default",
    "aten.index.Tensor", "aten.index_select.default", "aten.gather.default", "aten.expand_copy.default",
    "aten.permute_copy.default", "aten.view_copy.default", "aten.slice_copy.Tensor", "aten.unsqueeze_copy.default",
    "aten.squeeze_copy.dims", "aten.t_copy.default", "aten.select_copy.int", "aten.flip.default",
    "aten.roll.default", "aten.repeat.default", "aten.stack.default", "aten.contiguous.default",
    "aten.tril.default", "aten.triu.default", "aten.fill.Scalar", "aten.narrow_copy.default", "aten.unbind_copy.int",
    "aten.as_strided_copy.default", "aten.masked_select.default", "aten.masked_fill.Tensor", "aten.nonzero.default",
    "aten.nonzero_static.default", "aten._pad_circular.default",
    *(f"aten.{kind}_pad{n}d.default" for kind in ("reflection", "replication") for n in (1, 2, 3)),
    # truth tests (a cast to bool: either word nonzero)
    "aten.any.default", "aten.any.dim", "aten.any.dims", "aten.all.default", "aten.all.dim", "aten.all.dims",
    "aten.logical_not.default", "aten.logical_and.default", "aten.logical_or.default", "aten.logical_xor.default",
    # reductions and scans whose arithmetic and comparisons follow the value's type (codegen.arith, less)
    "aten.sum.default", "aten.sum.dim_IntList", "aten.prod.default", "aten.prod.dim_int", "aten.cumsum.default",
    "aten.cumprod.default", "aten.amax.default", "aten.amin.default", "aten.max.default", "aten.min.default",
    "aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.argmin.default",
    # sorts (keys of two words, compared as signed) and what is built on them; binary searches
    "aten.sort.default", "aten.sort.stable", "aten.topk.default", "aten.kthvalue.default", "aten.median.default",
    "aten.median.dim", "aten.nanmedian.default", "aten.nanmedian.dim", "aten.mode.default", "aten._unique2.default",
    "aten.unique_consecutive.default", "aten.cummax.default", "aten.cummin.default", "aten.searchsorted.Tensor",
    "aten.searchsorted.Scalar", "aten.bucketize.Tensor", "aten.bucketize.Scalar",
    # gathers; random draws and uninitialized tensors, whose values do not depend on their input's
    "aten.embedding.default", "aten.bernoulli.p", "aten.bernoulli.Tensor", "aten.geometric.default",
    "aten.randint_like.default", "aten.randint_like.low_dtype", "aten.new_empty_strided.default",
    # scatters (gather-formulated: each output element combines the entries aimed at it, in the output's type)
    "aten.index_copy.default", "aten.index_put.default", "aten.put.default", "aten.scatter.src", "aten.scatter.value",
    "aten.scatter.reduce", "aten.scatter.value_reduce", "aten.scatter_add.default", "aten.scatter_reduce.two",
    "aten.index_reduce.default", "aten.slice_scatter.default", "aten.select_scatter.default",
    "aten.diagonal_scatter.default", "aten.as_strided_scatter.default", "aten.masked_scatter.default",
    # pools and their gradients: comparisons, sums and truncating divisions in the values' type
    "aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default", "aten.avg_pool1d.default",
    "aten.avg_pool2d.default", "aten.avg_pool3d.default", "aten.avg_pool2d_backward.default",
    "aten.embedding_dense_backward.default",
    # creation: ranges and draws past i32 in two words
    "aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.randint.default", "aten.randint.low",
})
#: Ops whose floating result torch computes from their integer operands converted to float32 (the
#: default dtype): the registry's lowering reads a two-word operand through the exact conversion
#: (``tap_i64_to_f32``, round to nearest even), so it is right as it is whenever no output is an integer.
READS_AS_FLOAT = frozenset({
    *(f"aten.{name}.default" for name in (
        "sin", "cos", "tan", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid",
        "erf", "erfc", "erfinv", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "atan2",
        "lgamma", "digamma", "polygamma", "i0", "angle", "special_erfcx", "special_ndtri", "special_i0e",
        "special_i1", "special_i1e", "special_modified_bessel_i0", "special_modified_bessel_i1",
        "special_hermite_polynomial_h", "special_hermite_polynomial_he", "special_laguerre_polynomial_l",
        "special_legendre_polynomial_p", "isnan", "isinf")),
    "aten.div.Tensor", "aten.div.Scalar", "aten.copysign.Tensor", "aten.copysign.Scalar",
    "aten.pow.Tensor_Tensor", "aten.pow.Tensor_Scalar", "aten.pow.Scalar",
})
#: Ops whose result, where it fits in i32, depends only on the low words of their int64 inputs
#: (ring arithmetic modulo 2**32, selection, shape): run on the low words when no output is wide.
LOW_WORD_EXACT = frozenset({
    "aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor", "aten.sub.Scalar", "aten.rsub.Scalar",
    "aten.rsub.Tensor", "aten.mul.Tensor", "aten.mul.Scalar", "aten.neg.default", "aten.bitwise_and.Tensor",
    "aten.bitwise_and.Scalar", "aten.bitwise_or.Tensor", "aten.bitwise_or.Scalar", "aten.bitwise_xor.Tensor",
    "aten.bitwise_xor.Scalar", "aten.bitwise_not.default", "aten.sum.default", "aten.sum.dim_IntList",
    "aten.cumsum.default", "aten.empty_like.default", "aten.new_empty.default",
    *(op for op in TAKES_WIDE if op not in ("aten._to_copy.default", "aten.to.dtype")),
})


def _wide_type(v) -> bool:
    return isinstance(v, Value) and v.dtype == WIDE


def _scalar(v) -> bool:
    return isinstance(v, (int, float, bool)) and not isinstance(v, Value)


def _int_args(node, args):
    """Refuse float operands: an int64 op with a float operand computes in float (not here)."""
    for a in args:
        if isinstance(a, float) or isinstance(a, Value) and ctype(a.dtype) == "f32":
            raise Unsupported(f"{node.op} with a float operand and int64 values held in two 32-bit words is not "
                              "lowered")


def _binary(helper, result=None, swap=False, negate=False):
    """A two-word lowering ``helper(a, b)`` (``swap``: ``helper(b, a)``; ``negate``: ``!``)."""
    from tapml.platforms.wgsl.elementwise import elementwise

    def lower(pb, node, a, b, alpha=1):
        _int_args(node, [a, b, alpha])

        def fn(k, x, y, *al):
            k.need(helper)
            if al:
                k.need("tap_i64_mul")
                y = f"tap_i64_mul({y}, {al[0]})"
            e = f"{helper}({y}, {x})" if swap else f"{helper}({x}, {y})"
            return f"!{e}" if negate else e
        args = [a, b] + ([alpha] if alpha != 1 else [])
        return [elementwise(pb, node, args, fn, compute=I64, result=result)]
    return lower


def _expr(template, *helpers, result=None):
    from tapml.platforms.wgsl.elementwise import elementwise

    def lower(pb, node, *args):
        _int_args(node, args)

        def fn(k, *xs):
            _need(k, *helpers)
            return template.format(*xs)
        return [elementwise(pb, node, list(args), fn, compute=I64, result=result)]
    return lower


def _clamp(pb, node, x, min=None, max=None):
    from tapml.platforms.wgsl.elementwise import elementwise
    _int_args(node, [x, min, max])
    bounds = [b for b in (min, max) if b is not None]

    def fn(k, e, *bs):
        k.need("tap_i64_lt")
        bs = list(bs)
        if min is not None:
            lo = bs.pop(0)
            e = f"select({e}, {lo}, tap_i64_lt({e}, {lo}))"
        if max is not None:
            hi = bs.pop(0)
            e = f"select({e}, {hi}, tap_i64_lt({hi}, {e}))"
        return e
    return [elementwise(pb, node, [x, *bounds], fn, compute=I64)]


def _division(mode, part):
    from tapml.platforms.wgsl.elementwise import elementwise

    def lower(pb, node, a, b, rounding_mode=None):
        _int_args(node, [a, b])
        m = rounding_mode if mode == "given" else mode
        if m is None:
            raise Unsupported(f"{node.op}: true division of two-word int64 values is not lowered")
        helper = f"tap_i64_divmod_{m}"

        def fn(k, x, y):
            k.need(helper)
            return f"{helper}({x}, {y}).{part}"
        c = elementwise(pb, node, [a, b], fn, compute=I64, cost=64)
        return [pb.materialize(c)]  # 64 steps per element: never fused into another kernel's loop
    return lower


def _truncated(v):
    """A float scalar given to an op on integers, converted as torch converts it (toward zero)."""
    return int(v) if isinstance(v, float) and not isinstance(v, bool) and math.isfinite(v) else v


def _hardtanh(pb, node, x, min_val=-1.0, max_val=1.0):
    return _clamp(pb, node, x, min=_truncated(min_val), max=_truncated(max_val))


def _ldexp(pb, node, x, e):
    """torch scales a float by ``std::ldexp``, converting an int64 exponent to a C int (the low word);
    an integer ``x`` it multiplies by ``pow(2.0, e)`` in float32 (an exponent past 127 gives inf)."""
    return REGISTRY["aten.ldexp.Tensor"].fn(pb, node, x, narrowed(e) if x.ty == "f32" else e)


def _masked_fill(pb, node, x, mask, value):
    return REGISTRY["aten.masked_fill.Scalar"].fn(pb, node, x, mask, _truncated(value))


def _constant_pad(pb, node, x, pad, value=0):
    return REGISTRY["aten.constant_pad_nd.default"].fn(pb, node, x, pad, _truncated(value))


def _addcmul(pb, node, x, a, b, value=1):
    from tapml.platforms.wgsl.elementwise import elementwise
    _int_args(node, [x, a, b, value])

    def fn(k, e, p, q, *v):
        _need(k, "tap_i64_add", "tap_i64_mul")
        product = f"tap_i64_mul({p}, {q})"
        return f"tap_i64_add({e}, {f'tap_i64_mul({product}, {v[0]})' if v else product})"
    return [elementwise(pb, node, [x, a, b] + ([value] if value != 1 else []), fn, compute=I64)]


def _summed(pb, node, inputs, term, shape, reduced: int, meta):
    """The sum over the last ``reduced`` dims of the index space ``shape`` (the output's dims, then
    the summed ones) of ``term(k, idx)``, a two-word product, as torch sums int64: in two words (in
    the low words when ``meta``'s values fit in i32), by the reduction kernel (split across
    invocations when long)."""
    from tapml.graph import Node, TensorMeta
    from tapml.platforms.wgsl.codegen import Custom, cast
    t = ctype(meta.dtype)
    terms = Custom(tuple(shape), meta.dtype, inputs, lambda k, idx: cast(term(k, list(idx)), I64, t))
    out = TensorMeta(tuple(shape[:len(shape) - reduced]), meta.dtype)
    total = Node(node.name, "aten.sum.dim_IntList", (), {}, [out])
    return REGISTRY["aten.sum.dim_IntList"].fn(pb, total, terms, list(range(len(shape) - reduced, len(shape))))[0]


def _contraction(pb, node, a, b, a_at, b_at, shape, reduced: int, meta):
    """``sum of a[a_at(idx)] * b[b_at(idx)]`` over the last ``reduced`` dims of ``shape`` (:func:`_summed`)."""
    from tapml.platforms.wgsl.codegen import cast

    def term(k, idx):
        k.need("tap_i64_mul")
        return f"tap_i64_mul({cast(a.read(k, a_at(idx)), a.ty, I64)}, {cast(b.read(k, b_at(idx)), b.ty, I64)})"
    return _summed(pb, node, [a, b], term, shape, reduced, meta)


def _convolution(pb, node, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A direct convolution (or transposed convolution) in two words: each output element sums
    input times weight over its group's channels and the kernel window (padding reads as 0)."""
    from tapml.platforms.wgsl import views
    from tapml.platforms.wgsl.codegen import cast
    meta = node.outputs[0]
    nsp = len(x.shape) - 2
    ksize = list(w.shape[2:])
    # weights: (out, in / groups, k...), transposed (in, out / groups, k...)
    cin_g = x.shape[1] // groups if transposed else w.shape[1]
    cout_g = w.shape[1] if transposed else w.shape[0] // groups
    stride, padding, dilation = ([int(v) for v in (p if len(p) == nsp else list(p) * nsp)]
                                 for p in (stride, padding, dilation))

    def term(k, idx):
        n, co, out, ci, kk = idx[0], idx[1], idx[2:2 + nsp], idx[2 + nsp], idx[3 + nsp:]
        channel = k.let(f"({co} / {cout_g}) * {cin_g} + {ci}", "i32")
        if transposed:  # input position i feeds output i * stride - padding + k * dilation
            num = [k.let(f"{o} + {p} - {q} * {d}", "i32") for o, p, q, d in zip(out, padding, kk, dilation)]
            pos = [k.let(f"{m} / {s}", "i32") for m, s in zip(num, stride)]
            conds = [f"{m} >= 0 && {m} % {s} == 0" for m, s in zip(num, stride)]
            wv = cast(w.read(k, [channel, f"{co} % {cout_g}"] + list(kk)), w.ty, I64)
        else:
            pos = [k.let(f"{o} * {s} - {p} + {q} * {d}", "i32") for o, s, p, q, d in zip(out, stride, padding, kk, dilation)]
            conds = [f"{p} >= 0" for p in pos]
            wv = cast(w.read(k, [co, ci] + list(kk)), w.ty, I64)
        inside = " && ".join(conds + [f"{p} < {size}" for p, size in zip(pos, x.shape[2:])]) or "true"
        at = [k.let(f"clamp({p}, 0, {size - 1})", "i32") for p, size in zip(pos, x.shape[2:])]
        xv = cast(x.read(k, [n, channel] + at), x.ty, I64)
        k.need("tap_i64_mul")
        return f"select({I64}(0u, 0u), tap_i64_mul({xv}, {wv}), {inside})"
    product = _summed(pb, node, [x, w], term, tuple(meta.shape) + (cin_g, *ksize), 1 + nsp, meta)
    if bias is not None:
        bias = views.reshape(bias, [bias.shape[0]] + [1] * nsp)
    return _scaled_sum(pb, node, product, bias)


def _scaled_sum(pb, node, product, bias=None, beta=1, alpha=1):
    """``beta * bias + alpha * product`` in two words (torch skips the bias when ``beta`` is 0)."""
    from tapml.platforms.wgsl.elementwise import elementwise
    _int_args(node, [bias, beta, alpha])
    if bias is None or beta == 0:
        if alpha == 1:
            return [product]
        return [elementwise(pb, node, [product, alpha], lambda k, p, al: f"tap_i64_mul({p}, {al})", compute=I64)]
    return [elementwise(pb, node, [product, bias, alpha, beta],
                        lambda k, p, c, al, be: f"tap_i64_add(tap_i64_mul({p}, {al}), tap_i64_mul({c}, {be}))",
                        compute=I64)]


def _mm(pb, node, a, b):
    (m, kk), n = a.shape, b.shape[1]
    return [_contraction(pb, node, a, b, lambda i: [i[0], i[2]], lambda i: [i[2], i[1]], (m, n, kk), 1,
                         node.outputs[0])]


def _bmm(pb, node, a, b):
    (batch, m, kk), n = a.shape, b.shape[2]
    return [_contraction(pb, node, a, b, lambda i: [i[0], i[1], i[3]], lambda i: [i[0], i[3], i[2]],
                         (batch, m, n, kk), 1, node.outputs[0])]


def _addmm(pb, node, bias, a, b, *, beta=1, alpha=1):
    return _scaled_sum(pb, node, _mm(pb, node, a, b)[0], bias, beta, alpha)


def _baddbmm(pb, node, bias, a, b, *, beta=1, alpha=1):
    return _scaled_sum(pb, node, _bmm(pb, node, a, b)[0], bias, beta, alpha)


def _addmv(pb, node, bias, mat, vec, *, beta=1, alpha=1):
    m, kk = mat.shape
    product = _contraction(pb, node, mat, vec, lambda i: [i[0], i[1]], lambda i: [i[1]], (m, kk), 1,
                           node.outputs[0])
    return _scaled_sum(pb, node, product, bias, beta, alpha)


def _addbmm(pb, node, bias, a, b, *, beta=1, alpha=1):
    (batch, m, kk), n = a.shape, b.shape[2]
    product = _contraction(pb, node, a, b, lambda i: [i[2], i[0], i[3]], lambda i: [i[2], i[3], i[1]],
                           (m, n, batch, kk), 2, node.outputs[0])
    return _scaled_sum(pb, node, product, bias, beta, alpha)


#: int64 shifts: also the registry's lowering of int64 held in i32 (the two-word arithmetic, whose
#: result is narrowed), so that a shift by 32 or more behaves as torch's on int64
SHIFTS = {"left": ["aten.bitwise_left_shift.Tensor", "aten.bitwise_left_shift.Tensor_Scalar"],
          "right": ["aten.bitwise_right_shift.Tensor", "aten.bitwise_right_shift.Tensor_Scalar"]}

_CMP = {"lt": ("tap_i64_lt", False, False), "gt": ("tap_i64_lt", True, False), "ge": ("tap_i64_lt", False, True),
        "le": ("tap_i64_lt", True, True)}


def _lowerings() -> dict[str, Lowering]:
    out: dict[str, Lowering] = {}

    def add(ops, fn, samples):
        for op in [ops] if isinstance(ops, str) else ops:
            out[op] = Lowering(op, fn, (WIDE,), samples, family="int64")

    add(["aten.add.Tensor", "aten.add.Scalar"], _binary("tap_i64_add"), _binary_samples("add"))
    add(["aten.sub.Tensor", "aten.sub.Scalar"], _binary("tap_i64_sub"), _binary_samples("sub"))
    add("aten.rsub.Scalar", _binary("tap_i64_sub", swap=True), _binary_samples("rsub"))
    add(["aten.mul.Tensor", "aten.mul.Scalar"], _binary("tap_i64_mul"), _binary_samples("mul"))
    add("aten.neg.default", _expr("tap_i64_neg({0})", "tap_i64_neg"), _unary_samples)
    add("aten.abs.default", _expr("tap_i64_abs({0})", "tap_i64_abs"), _unary_samples)
    add("aten.sign.default", _expr(f"select(select({I64}(0u, 0u), {I64}(1u, 0u), any({{0}} != {I64}(0u, 0u))), "
                                   f"{I64}(0xffffffffu, 0xffffffffu), tap_i64_is_neg({{0}}))", "tap_i64_is_neg"),
        _unary_samples)
    for name, (helper, swap, negate) in _CMP.items():
        add([f"aten.{name}.Tensor", f"aten.{name}.Scalar"], _binary(helper, "bool", swap, negate), _binary_samples(name))
    add(["aten.eq.Tensor", "aten.eq.Scalar"], _expr("all({0} == {1})", result="bool"), _binary_samples("eq"))
    add(["aten.ne.Tensor", "aten.ne.Scalar"], _expr("any({0} != {1})", result="bool"), _binary_samples("ne"))
    add("aten.minimum.default", _expr("select({1}, {0}, tap_i64_lt({0}, {1}))", "tap_i64_lt"), _binary_samples("min"))
    add("aten.maximum.default", _expr("select({1}, {0}, tap_i64_lt({1}, {0}))", "tap_i64_lt"), _binary_samples("max"))
    add(["aten.clamp.default", "aten.clamp.Tensor"], _clamp, _clamp_samples)
    add("aten.clamp_min.default", lambda pb, node, x, m: _clamp(pb, node, x, min=m), _unary_scalar_samples)
    add("aten.clamp_max.default", lambda pb, node, x, m: _clamp(pb, node, x, max=m), _unary_scalar_samples)
    for name, sym in (("and", "&"), ("or", "|"), ("xor", "^")):
        add([f"aten.bitwise_{name}.Tensor", f"aten.bitwise_{name}.Scalar"], _expr(f"({{0}} {sym} {{1}})"),
            _binary_samples(name))
    add("aten.bitwise_not.default", _expr("(~{0})"), _unary_samples)
    add(SHIFTS["left"], _expr("tap_i64_shl({0}, {1})", "tap_i64_shl"), _shift_samples)
    add(SHIFTS["right"], _expr("tap_i64_shr({0}, {1})", "tap_i64_shr"), _shift_samples)
    add(["aten.div.Tensor_mode", "aten.div.Scalar_mode"], _division("given", "xy"), _divmode_samples)
    add(["aten.floor_divide.default", "aten.floor_divide.Scalar"], _division("floor", "xy"), _division_samples)
    add(["aten.remainder.Tensor", "aten.remainder.Scalar"], _division("floor", "zw"), _division_samples)
    add(["aten.fmod.Tensor", "aten.fmod.Scalar"], _division("trunc", "zw"), _division_samples)
    # on integers torch's rounding ops are the identity, relu and hardtanh clamp, fmax/fmin are max/min
    add([f"aten.{name}.default" for name in ("floor", "ceil", "trunc", "round")], _expr("{0}"), _unary_samples)
    add("aten.relu.default", _expr(f"select({{0}}, {I64}(0u, 0u), tap_i64_is_neg({{0}}))", "tap_i64_is_neg"),
        _unary_samples)
    add("aten.hardtanh.default", _hardtanh, _hardtanh_samples)
    add("aten.signbit.default", _expr("tap_i64_is_neg({0})", "tap_i64_is_neg", result="bool"), _unary_samples)
    add("aten.fmin.default", _expr("select({1}, {0}, tap_i64_lt({0}, {1}))", "tap_i64_lt"), _binary_samples("min"))
    add("aten.fmax.default", _expr("select({1}, {0}, tap_i64_lt({1}, {0}))", "tap_i64_lt"), _binary_samples("max"))
    add(["aten.pow.Tensor_Tensor", "aten.pow.Tensor_Scalar", "aten.pow.Scalar"],
        _expr("tap_i64_pow({0}, {1})", "tap_i64_pow"), _pow_samples)
    add("aten.masked_fill.Scalar", _masked_fill, _masked_fill_samples)
    add("aten.constant_pad_nd.default", _constant_pad, _pad_samples)
    add("aten.addcmul.default", _addcmul, _addcmul_samples)
    add("aten.ldexp.Tensor", _ldexp,
        lambda: [((torch.tensor([1.5, -2.0, 0.0, 3.0, 1.0, 1.0, 1.0]),
                   torch.tensor([2**40, 2**40 + 3, 2**40, -(2**40), 2**32 + 1, -(2**32) + 3, 100])), {}),
                 ((wide_ints(2, 4), torch.tensor([1, -3, 0, 2**35 + 2])), {})])
    add("aten.mm.default", _mm, lambda: [((wide_ints(3, 5), wide_ints(5, 4, limits=(3, -1, 2**33))), {}),
                                         ((wide_ints(2, 5000, lo=-2**20, hi=2**20), wide_ints(5000, 3, lo=-2**20, hi=2**20)), {})])
    add("aten.bmm.default", _bmm, lambda: [((wide_ints(2, 3, 5), wide_ints(2, 5, 4, limits=(7, -(2**35)))), {})])
    add("aten.addmm.default", _addmm, lambda: [((wide_ints(4), wide_ints(3, 5), wide_ints(5, 4)), {}),
                                               ((wide_ints(3, 4), wide_ints(3, 5), wide_ints(5, 4)),
                                                {"beta": 3, "alpha": -(2**33)}),
                                               ((wide_ints(3, 4), wide_ints(3, 5), wide_ints(5, 4)), {"beta": 0})])
    add("aten.baddbmm.default", _baddbmm, lambda: [((wide_ints(2, 3, 4), wide_ints(2, 3, 5), wide_ints(2, 5, 4)),
                                                    {"beta": -2, "alpha": 5})])
    add("aten.addmv.default", _addmv, lambda: [((wide_ints(3), wide_ints(3, 6), wide_ints(6)), {"alpha": 2})])
    add("aten.convolution.default", _convolution, lambda: [
        ((wide_ints(2, 4, 7, 6), wide_ints(6, 2, 3, 2, lo=-2**20, hi=2**20), wide_ints(6), [2, 1], [1, 0], [1, 2],
          False, [0, 0], 2), {}),
        ((wide_ints(1, 3, 9), wide_ints(4, 3, 3), None, [1], [2], [1], False, [0], 1), {}),
        ((wide_ints(2, 4, 5, 4), wide_ints(4, 3, 3, 2), wide_ints(6), [2, 1], [1, 0], [1, 2], True, [1, 0], 2), {}),
        ((wide_ints(1, 2, 6), wide_ints(2, 3, 4), None, [3], [1], [2], True, [2], 1), {})])
    add("aten.addbmm.default", _addbmm, lambda: [((wide_ints(3, 4), wide_ints(2, 3, 5), wide_ints(2, 5, 4)), {})])
    return out


def wide_scalar(node) -> bool:
    """Whether ``node`` takes a Python int outside the i32 range (a literal i32 cannot hold)."""
    def walk(a):
        if isinstance(a, bool):
            return False
        if isinstance(a, int):
            return not I32_MIN <= a <= I32_MAX
        if isinstance(a, list):
            return any(walk(x) for x in a)
        return False
    return any(walk(a) for a in node.args) or any(walk(v) for v in node.kwargs.values())


def static_wide_refs(graph) -> frozenset[str]:
    """The int64 outputs of nodes that take an int outside i32 (``x * 2**40``, ``full(.., -2**63)``):
    held in two words whatever the inputs, since no i32 literal holds that int."""
    return frozenset(r for n in graph.nodes if (n.op in WIDE_LOWERINGS or n.op in TAKES_WIDE) and wide_scalar(n)
                     for r, m in zip(n.output_refs, n.outputs) if m.dtype == "int64")


def wide_lowering(node, input_metas, registry) -> tuple[Lowering, bool]:
    """The lowering of ``node``, which has a two-word input or output, and whether its wide
    inputs are to be read as their low words (i32); :class:`Unsupported` when there is none."""
    outputs_wide = any(m.dtype == WIDE for m in node.outputs)
    low = registry.get(node.op)
    if low is not None and _computes_in_float(node, input_metas, WIDE_LOWERINGS):
        return low, False
    if node.op in WIDE_LOWERINGS and (outputs_wide or node.op not in LOW_WORD_EXACT):
        return WIDE_LOWERINGS[node.op], False
    if low is not None and (low.view or node.op in TAKES_WIDE):
        return low, False
    if low is not None and not outputs_wide and node.op in LOW_WORD_EXACT and \
            all(ctype(m.dtype) in ("i32", "bool") for m in node.outputs):
        return low, True
    raise Unsupported(f"{node.op} has no lowering for int64 values outside the i32 range (held in two 32-bit "
                      "words on WGSL targets)")


#: Two-word lowerings whose float operand is not a promotion to float: a fill value or bound
#: torch converts to the tensor's integer dtype.
_NO_FLOAT_PATH = frozenset({"aten.masked_fill.Scalar", "aten.constant_pad_nd.default", "aten.hardtanh.default",
                            "aten.ldexp.Tensor"})


def _computes_in_float(node, input_metas, two_word_ops) -> bool:
    """Whether torch computes ``node`` in float from its 64-bit integer operands, so that the
    registry's lowering, reading them through the exact conversion to float32, is right: a
    :data:`READS_AS_FLOAT` op with no integer output, or one of ``two_word_ops`` given a float operand."""
    if node.op in READS_AS_FLOAT and not any(ctype(m.dtype) in ("i32", I64, U64) for m in node.outputs):
        return True
    return node.op in two_word_ops and node.op not in _NO_FLOAT_PATH and _float_operand(node, input_metas)


def _float_operand(node, input_metas) -> bool:
    """Whether ``node`` has a floating operand: torch then computes in float, from its int64
    operands converted to float32, as the registry's lowerings read two words."""
    def walk(a):
        return isinstance(a, float) or isinstance(a, (list, tuple)) and any(walk(x) for x in a)
    return any(walk(a) for a in node.args) or any(walk(v) for v in node.kwargs.values()) or \
        any(ctype(m.dtype) == "f32" for m in input_metas)


#: Ops torch's CPU kernels compute on uint64 whose two-word lowering is the same on the unsigned
#: reading of the words (products and sums wrap alike; equality and bitwise ops see bits).
UINT64_SAME_BITS = frozenset({
    "aten.mul.Tensor", "aten.mul.Scalar", "aten.eq.Tensor", "aten.eq.Scalar", "aten.ne.Tensor", "aten.ne.Scalar",
    "aten.constant_pad_nd.default",  # its fill value converted as torch converts it
    *(f"aten.bitwise_{name}.{kind}" for name in ("and", "or", "xor") for kind in ("Tensor", "Scalar"))})
#: The other ops torch computes on uint64: the registry's lowering, right for any element type (their
#: comparisons go through ``codegen.less``, unsigned for ``tap_u64``: sorts, unique).
UINT64_AS_ANY = frozenset({
    "aten._to_copy.default", "aten.to.dtype", "aten.clone.default", "aten.copy.default", "aten.alias.default",
    "aten.lift_fresh_copy.default", "aten.full.default", "aten.full_like.default", "aten.new_full.default",
    "aten.scalar_tensor.default", "aten.zeros_like.default", "aten.zeros.default", "aten.ones_like.default",
    "aten.ones.default", "aten.new_zeros.default", "aten.new_ones.default", "aten.empty_like.default",
    "aten.new_empty.default", "aten.where.self", "aten.where.ScalarSelf", "aten.where.ScalarOther", "aten.cat.default",
    "aten.index.Tensor", "aten.index_select.default", "aten.embedding.default", "aten.permute_copy.default",
    "aten.view_copy.default", "aten.flip.default", "aten.repeat.default", "aten.contiguous.default", "aten.sum.default", "aten.sum.dim_IntList", "aten.prod.default", "aten.prod.dim_int",
    "aten.cumsum.default", "aten.cumprod.default", "aten.sort.default", "aten.sort.stable", "aten._unique2.default",
    "aten.unique_consecutive.default"})


def touches_uint64(node, input_metas) -> bool:
    """Whether ``node`` reads or makes a uint64 tensor (held in two words, read as unsigned)."""
    return any(m.dtype == "uint64" for m in list(input_metas) + list(node.outputs))


def uint64_lowering(node, input_metas, registry) -> Lowering:
    """The lowering of ``node``, which touches uint64: :data:`UINT64_SAME_BITS` two-word ones, the
    registry's own for :data:`UINT64_AS_ANY` (and views), the registry's reading the exact unsigned
    conversion to float32 where torch computes in float; :class:`Unsupported` otherwise."""
    low = registry.get(node.op)
    if low is not None and _computes_in_float(node, input_metas, UINT64_SAME_BITS):
        return low
    if node.op in UINT64_SAME_BITS:
        return WIDE_LOWERINGS[node.op]
    if low is not None and (low.view or node.op in UINT64_AS_ANY):
        return low
    raise Unsupported(f"{node.op} has no lowering for uint64 (held in two 32-bit words on WGSL targets)")


def narrowed(v: Value) -> Value:
    """A two-word value read as its low word (an int64 held in i32)."""
    if not _wide_type(v):
        return v
    return Compute(v.shape, "int64", [v], lambda k, e, idx: f"bitcast<i32>(({e[0]}).x)", cost=0)


# --- samples: values at and past the i32 limits and at the int64 limits ---------------------

LIMITS = (I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1, I32_MIN - 1, I32_MAX + 1, I32_MIN, I32_MAX, -2**32,
          2**32, 2**32 - 1, -(2**32 - 1), 2**53 + 1, -(2**40) - 7, 0, 1, -1)


def wide_ints(*shape, lo: int = -2**62, hi: int = 2**62, limits=LIMITS) -> torch.Tensor:
    """Seeded int64 values spread over ``[lo, hi)`` with :data:`LIMITS` in the first elements."""
    n = math.prod(shape)
    g = torch.Generator().manual_seed(n * 31 + len(shape))
    t = torch.randint(lo, hi, (n,), dtype=torch.int64, generator=g)
    lim = torch.tensor(limits, dtype=torch.int64)[:n]
    t[:len(lim)] = lim
    return t.reshape(shape)


def _binary_samples(kind):
    def samples():
        a = wide_ints(6, 7)
        b = wide_ints(6, 7, limits=tuple(reversed(LIMITS)))
        out = [((a, b), {}), ((a, wide_ints(7, limits=(5, -3, 2**33))), {}), ((a, 5), {}), ((a, -(2**40)), {}),
               ((wide_ints(3, 1, 4), torch.randint(-50, 50, (5, 1), dtype=torch.int64)), {})]
        if kind in ("add", "sub"):
            out.append(((a, b), {"alpha": 3}))
        if kind in ("min", "max"):
            out = [s for s in out if all(isinstance(x, torch.Tensor) for x in s[0])]
        return out
    return samples


def _unary_samples():
    return [((wide_ints(5, 6),), {}), ((wide_ints(17),), {})]


def _unary_scalar_samples():
    return [((wide_ints(5, 6), -(2**33)), {}), ((wide_ints(17), 7), {})]


def _clamp_samples():
    return [((wide_ints(5, 6), -(2**33), 2**40), {}), ((wide_ints(17), None, 7), {}),
            ((wide_ints(4, 5), wide_ints(5, limits=()), wide_ints(4, 1, limits=(I64_MAX,))), {})]


def _shift_samples():
    amounts = torch.tensor([0, 1, 31, 32, 33, 63, 64, 70, -1, 5], dtype=torch.int64)
    return [((wide_ints(7, 10), amounts), {}), ((wide_ints(13), 3), {}), ((wide_ints(13), 40), {})]


def _nonzero(*shape, limits=LIMITS):
    t = wide_ints(*shape, limits=tuple(v for v in limits if v != 0))
    return torch.where(t == 0, torch.ones_like(t), t)


def _division_samples():
    a = wide_ints(6, 7, limits=tuple(v for v in LIMITS if v != I64_MIN))
    b = _nonzero(6, 7, limits=tuple(reversed(LIMITS)))
    return [((a, b), {}), ((a, torch.tensor([3, -3, 7, 2**33, -(2**35), 1, -1], dtype=torch.int64)), {}),
            ((a, 10), {}), ((a, -(2**33)), {})]


def _divmode_samples():
    a, b = _division_samples()[0][0]
    return [((a, b), {"rounding_mode": "trunc"}), ((a, b), {"rounding_mode": "floor"}),
            ((a, 9), {"rounding_mode": "floor"}), ((a, -(2**34)), {"rounding_mode": "trunc"})]


def _hardtanh_samples():
    return [((wide_ints(5, 6), -(2**33), 2**40), {}), ((wide_ints(17), -2.5, 3.7), {})]


def _pow_samples():
    exps = torch.tensor([0, 1, 2, 3, 31, 32, 33, 62, 63, 64, 5, 7], dtype=torch.int64)
    bases = torch.tensor([3, -3, 2, -2, 1, -1, 0, 2**32 + 1, -(2**40), I64_MIN, 7, 2**31], dtype=torch.int64)
    return [((bases, exps), {}), ((wide_ints(3, 12), exps), {}), ((bases, 3), {}), ((bases, 40), {}),
            ((3, exps), {}), ((-(2**33), exps), {}), ((torch.tensor([1, -1, -1, 1, 2**40, 0, 5]), torch.tensor([-3, -3, -4, -9, -1, -2, -1])), {})]


def _masked_fill_samples():
    return [((wide_ints(4, 5), randbool(4, 5), -(2**40)), {}), ((wide_ints(4, 5), randbool(5), -1.5), {}),
            ((wide_ints(6), randbool(6), I64_MAX), {})]


def _pad_samples():
    return [((wide_ints(3, 4), [1, 2]), {}), ((wide_ints(3, 4), [2, 0, 1, 1], -(2**45)), {}),
            ((wide_ints(2, 3, 4), [1, 1], 7.9), {})]


def _addcmul_samples():
    a, b, c = wide_ints(4, 5), wide_ints(4, 5, limits=(3, -1, 2**31, I64_MAX)), wide_ints(5, limits=(-(2**33), 5))
    return [((a, b, c), {}), ((a, b, c), {"value": 3}), ((a, b, c), {"value": -(2**40)})]


def cast_samples() -> list:
    """``_to_copy`` from and to two words: every dtype from int64 limits, int64 from float32
    values past i32, infinities and NaN."""
    floats = torch.tensor([-math.inf, math.inf, math.nan, 3e19, -3e19, 9.2e18, -9.2e18, 1.5e10, -2.7, 0.5,
                           -9.223372036854775808e18, 4294967296.0, -4294967295.0, 2.0**40 + 2**17], dtype=torch.float32)
    a = wide_ints(4, 5)
    return [((floats,), {"dtype": torch.int64}), ((floats.to(torch.float16)[:9],), {"dtype": torch.int64}),
            ((a,), {"dtype": torch.float32}), ((a,), {"dtype": torch.int32}), ((a,), {"dtype": torch.int16}),
            ((a,), {"dtype": torch.int8}), ((a,), {"dtype": torch.uint8}), ((a,), {"dtype": torch.bool}),
            ((a,), {"dtype": torch.float16}), ((a,), {"dtype": torch.bfloat16}),
            ((wide_ints(40, limits=(2**40 + 1, -(2**53 + 1), I64_MAX, 2**24 + 1, 2**25 + 3, 2**25 + 1, -(2**63))),),
             {"dtype": torch.float32})]


def where_samples() -> list:
    return [((randbool(4, 5), wide_ints(4, 5), wide_ints(5, limits=(3, -(2**40)))), {}),
            ((randbool(6), wide_ints(6), torch.tensor(7)), {})]


WIDE_LOWERINGS: dict[str, Lowering] = _lowerings()


def _register_shifts() -> None:
    from tapml.platforms.wgsl.registry import register
    for op in SHIFTS["left"] + SHIFTS["right"]:
        low = WIDE_LOWERINGS[op]
        register(op, ("int64",), samples=_i32_shift_samples)(low.fn)


def _i32_shift_samples():
    x = torch.randint(-1000, 1000, (6, 10), dtype=torch.int64)
    amounts = torch.tensor([0, 1, 3, 7, 2, 64, 70, -1, 5, 33], dtype=torch.int64)
    return [((x, amounts), {}), ((x, 3), {}), ((x >> 40, 40), {})]


_register_shifts()

__all__ = ["WidePlan", "wide_plan", "WIDE_LOWERINGS", "SHIFTS", "wide_scalar", "static_wide_refs", "TAKES_WIDE",
           "READS_AS_FLOAT", "LOW_WORD_EXACT", "wide_refs", "widen", "wide_lowering", "narrowed",
           "cast_wide", "wide_ints", "LIMITS", "helpers_called"]
