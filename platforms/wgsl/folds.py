"""Long reductions and scans, split so that no invocation loops more than LOOP_BUDGET times.

A reduction with one thread per output loops over every reduced element; devices may end an
invocation's loops early (lavapipe and llvmpipe stop after 65 535 iterations, silently), and on
a GPU one thread serializing a long row is slow. So a reduction over more than
:data:`~tapml.platforms.wgsl.codegen.LOOP_BUDGET` elements is *split*:

1. the first pass runs one invocation per (output, chunk): invocation ``c`` folds the elements
   ``c, c + chunks, c + 2·chunks, ...`` of its row (at most :data:`CHUNK` of them; neighbouring
   invocations read neighbouring elements) into a partial *state*, written to temp buffers;
2. further passes fold the partial states, up to :data:`CHUNK` per invocation, until one state
   per output remains; the last pass writes the outputs.

A :class:`Fold` says how: the state variables, an element as a state (``lift``), how one state
absorbs another that follows it (``absorb``; associative, so the split order gives the same
result up to rounding) and the outputs of the final state. No workgroup barriers: they are
expensive on CPU adapters, and passes spread a row over as many invocations as a tree would.

On a device known not to be a CPU adapter (a GPU: ``caps["cpu_adapter"]`` False), a row of at
least :data:`WORKGROUP_FOLD_K` elements is folded by workgroups instead (:func:`workgroup_fold`):
the ``WORKGROUP`` lanes of a workgroup fold interleaved elements of a part of the row, up to
:data:`LANE_FOLD` each, and combine their states in workgroup memory through a barrier tree; the
parts' states of a longer row are folded by the passes above. :func:`forced_fold` picks either
form whatever the device (for tests and probes).

A scan (cumsum, cumprod, cummax, logcumsumexp) over a line longer than the budget runs three
passes: each chunk of :data:`CHUNK` consecutive elements folded to a state, the states of a
line scanned in order, then each chunk scanned again from the state before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from tapml.errors import Unsupported
from tapml.graph import TensorMeta
from tapml.platforms.wgsl.codegen import (CHUNK, I64, LOOP_BUDGET, MAX_GROUPS, WIDE, WORKGROUP, BufferView,
                                         ForcedSetting, Value, contiguous_strides, index_sum, lit)

#: WGSL state type -> the torch dtype of the temp buffer holding partial states.
_STATE_DTYPE = {"f32": "float32", "i32": "int32", "bool": "bool", I64: WIDE}
#: On a GPU a row of at least this many elements is folded by a workgroup: one invocation looping
#: over it leaves the device's other lanes idle (see the module).
WORKGROUP_FOLD_K = 256
#: Elements one lane of a workgroup fold takes at most: a longer row spreads over several
#: workgroups, whose states the merge passes fold.
LANE_FOLD = 64
_FOLD_FORM = ForcedSetting("fold form", ("workgroup", "invocation"))


def workgroup_fold(caps: dict | None, count: int) -> bool:
    """Whether a fold over rows of ``count`` elements runs as a workgroup fold on a device with
    ``caps``: a device known not to be a CPU adapter (whose barriers switch every SIMD group of a
    workgroup) and rows of at least :data:`WORKGROUP_FOLD_K` elements, unless :func:`forced_fold`
    says otherwise."""
    if _FOLD_FORM.value is not None:  # an empty row keeps its reduction's own form (its 0/0, its identity)
        return _FOLD_FORM.value == "workgroup" and count > 0
    return (caps or {}).get("cpu_adapter") is False and count >= WORKGROUP_FOLD_K


def forced_fold(form: str):
    """Compile every fold inside the block as a workgroup fold (``"workgroup"``) or with one
    invocation per row and part (``"invocation"``), whatever the device and the row's length (for
    tests and probes); a reduction short enough for one loop then folds too, unless its rows are empty."""
    return _FOLD_FORM.forced(form)


@dataclass
class Fold:
    """An associative fold: ``state`` lists (name prefix, WGSL type, initial value) of its
    variables; ``lift(k, v, r)`` is the element ``v`` (at linear index ``r`` along the folded
    elements, an i32 expression) as a state (one expression per variable); ``absorb(k, state,
    other, empty)`` emits statements folding ``other`` (expressions), which comes after what
    ``state`` (variable names) holds, into it (``empty``: a WGSL bool, true while ``state``
    holds nothing); ``outputs(k, state)`` are the results, (expression, type) each."""

    state: Sequence[tuple[str, str, str]]
    lift: Callable
    absorb: Callable
    outputs: Callable


def _chunk_kernel(pb, name: str, outer: str, shape, chunks: int, fold):
    """A kernel with one invocation per (``outer`` index into ``shape``, chunk ``c``): returns it,
    the outer index unravelled over ``shape``, the fold's declared state and its ``seen`` flag."""
    k = pb.kernel(name)
    k.emit(f"let {outer}: i32 = n / {chunks};")
    k.emit(f"let c: i32 = n % {chunks};")
    index = k.unravel(outer, shape)
    return k, index, _declare(k, fold), k.var("bool", "false", "seen")


def interleave_index(nd: int, kept: Sequence[int], kept_index: Sequence[str], dims: Sequence[int],
                     reduced_index: Sequence[str]) -> list[str]:
    """The index of an element of an ``nd``-dimensional tensor from the indices of its kept
    dimensions and of its reduced ones (each list in the order of its dimensions)."""
    idx = [None] * nd
    for d, i in zip(kept, kept_index):
        idx[d] = i
    for d, i in zip(dims, reduced_index):
        idx[d] = i
    return idx


def moments_fold(value: Callable, outputs: Callable) -> Fold:
    """Count, mean and sum of squared deviations from it (``M2``) of ``value(k, v)`` (an f32
    expression of the element), merged as Chan et al. do (Welford's update when one side is one
    element): one pass, stable where a sum of squares is not. ``outputs(k, (n, mean, m2))``."""
    def absorb(k, st, o, empty):
        n, mu, m2 = st
        k.emit(f"let nn: f32 = {n} + {o[0]};")
        k.emit(f"let d: f32 = {o[1]} - {mu};")
        k.emit(f"{mu} = {mu} + d * ({o[0]} / nn);")
        k.emit(f"{m2} = {m2} + {o[2]} + d * d * ({n} * {o[0]} / nn);")
        k.emit(f"{n} = nn;")
        # an Inf or NaN element makes torch's deviations, and so M2, NaN; merged in some orders
        # (+Inf and -Inf each in a part) the update above leaves M2 at +Inf
        k.emit(f"if ((bitcast<u32>({mu}) & 0x7fffffffu) >= 0x7f800000u) {{ {m2} = {lit(math.nan, 'f32')}; }}")
    return Fold([("n", "f32", "0.0"), ("mu", "f32", "0.0"), ("m2", "f32", "0.0")],
                lambda k, v, r: ["1.0", value(k, v), "0.0"], absorb, outputs)


def softmax_fold(outputs: Callable) -> Fold:
    """The largest element ``m`` and the sum of ``exp(v - m)`` in one pass ("online softmax"): a
    state absorbing a larger maximum rescales its sum. A NaN makes ``m`` NaN; -inf elements while
    the maximum is -inf count ``exp(0)`` and vanish once a finite maximum comes, so a row of -inf
    gives NaN and +inf gives NaN, as torch's softmax does. ``outputs(k, (m, s))``."""
    def absorb(k, st, o, empty):
        m, s = st
        nan = "((bitcast<u32>({}) & 0x7fffffffu) > 0x7f800000u)"
        k.emit(f"let mn: f32 = select(select(max({m}, {o[0]}), {o[0]}, {nan.format(o[0])}), {m}, {nan.format(m)});")
        # exp(a - mn) with a == mn == -inf is 1 (not NaN): such terms vanish once a finite maximum
        # comes; +inf - +inf stays NaN, as in torch
        k.emit(f"{s} = select({s} * select(exp({m} - mn), 1.0, {m} == mn && mn < 0.0) + {o[1]} * "
               f"select(exp({o[0]} - mn), 1.0, {o[0]} == mn && mn < 0.0), {o[1]}, {empty});")
        k.emit(f"{m} = select(mn, {o[0]}, {empty});")
    return Fold([("m", "f32", "0.0"), ("s", "f32", "0.0")], lambda k, v, r: [v, "1.0"], absorb, outputs)


def _declare(k, fold: Fold) -> list[str]:
    return [k.var(ty, init, prefix) for prefix, ty, init in fold.state]


def _absorb(k, fold: Fold, state: list[str], other: list[str], seen: str) -> None:
    k.open("")  # its own scope: absorb may declare names
    fold.absorb(k, state, other, f"!{seen}")
    k.emit(f"{seen} = true;")
    k.close()


def _partials(pb, fold: Fold, count: int) -> list:
    return [pb.buffer("temp", TensorMeta((count,), _STATE_DTYPE[ty])) for _, ty, _ in fold.state]


def fold_rows(pb, name: str, x: Value, dims: Sequence[int], outs: Sequence[TensorMeta], fold: Fold) -> list[BufferView]:
    """Fold ``x`` over ``dims`` (one output element per element of the other dims, row-major)
    into buffers of ``outs`` (metas of as many elements each), in as many passes as keep every
    invocation within LOOP_BUDGET iterations. Returns views of the outputs."""
    nd = len(x.shape)
    kept = [d for d in range(nd) if d not in dims]
    kept_shape = [x.shape[d] for d in kept]
    red_shape = [x.shape[d] for d in dims]
    count, rows = math.prod(red_shape), math.prod(kept_shape)
    bufs = [pb.buffer("temp", m) for m in outs]
    views = [BufferView.whole(b, m) for b, m in zip(bufs, outs)]
    if rows == 0:
        return views
    if workgroup_fold(pb.caps, count):
        _workgroup_fold(pb, name, x, dims, kept_shape, count, bufs, fold)
        return views
    chunks = 1 if count <= LOOP_BUDGET else -(-count // CHUNK)
    (x,) = pb.fit([x], len(outs) if chunks == 1 else len(fold.state))
    k, kidx, state, seen = _chunk_kernel(pb, name, "row", kept_shape, chunks, fold)
    _fold_elements(k, fold, state, seen, x, dims, kidx, -(-count // chunks), f"c + j * {chunks}")
    if chunks == 1:
        for b, (e, ty) in zip(bufs, fold.outputs(k, state)):
            k.write(b, "row", e, ty)
        pb.add(k.finish(rows))
        return views
    partial = _partials(pb, fold, rows * chunks)
    for b, s, (_, ty, _) in zip(partial, state, fold.state):
        k.write(b, "n", s, ty)
    pb.add(k.finish(rows * chunks))
    _merge_parts(pb, name, fold, partial, rows, chunks, bufs)
    return views


def _fold_elements(k, fold: Fold, state: list[str], seen: str, x: Value, dims: Sequence[int], kidx: list[str],
                   trips: int, position: str) -> None:
    """Emit the loop of ``trips`` iterations folding into ``state`` element ``position`` (an i32
    expression of the loop's ``j``) of the reduced elements of the row at kept index ``kidx``,
    where it is inside the row."""
    nd = len(x.shape)
    kept = [d for d in range(nd) if d not in dims]
    red_shape = [x.shape[d] for d in dims]
    k.loop("j", trips)
    k.emit(f"let r: i32 = {position};")
    k.open(f"if (r < {math.prod(red_shape)})")
    ridx = k.unravel("r", red_shape)
    _absorb(k, fold, state, fold.lift(k, x.read(k, interleave_index(nd, kept, kidx, dims, ridx)), "r"), seen)
    k.close()
    k.close()


def _merge_parts(pb, name: str, fold: Fold, partial: list, rows: int, parts: int, bufs: list) -> None:
    """Fold ``parts`` partial states a row (in ``partial``, row-major) into the outputs ``bufs``, in
    as many passes as keep every invocation within LOOP_BUDGET iterations."""
    while True:
        chunks = 1 if parts <= LOOP_BUDGET else -(-parts // CHUNK)
        k = pb.kernel(f"{name}_merge")
        k.emit(f"let row: i32 = n / {chunks};")
        k.emit(f"let c: i32 = n % {chunks};")
        state = _declare(k, fold)
        seen = k.var("bool", "false", "seen")
        k.loop("j", -(-parts // chunks))
        k.emit(f"let p: i32 = c + j * {chunks};")
        k.open(f"if (p < {parts})")
        other = [BufferView.whole(b, b.meta).read(k, [f"(row * {parts} + p)"]) for b in partial]
        _absorb(k, fold, state, other, seen)
        k.close()
        k.close()
        if chunks == 1:
            for b, (e, ty) in zip(bufs, fold.outputs(k, state)):
                k.write(b, "row", e, ty)
            pb.add(k.finish(rows))
            return
        partial = _partials(pb, fold, rows * chunks)
        for b, s, (_, ty, _) in zip(partial, state, fold.state):
            k.write(b, "n", s, ty)
        pb.add(k.finish(rows * chunks))
        parts = chunks


def _workgroup_fold(pb, name: str, x: Value, dims: Sequence[int], kept_shape: list[int], count: int, bufs: list,
                    fold: Fold) -> None:
    """:func:`fold_rows` as workgroups: one a part of a row, its lanes folding interleaved elements
    (neighbouring lanes read neighbouring elements) and then each other's states in workgroup
    memory; lane 0 writes the row's outputs, or its part's state for
    :func:`_merge_parts`. Lanes whose elements ran out hold no state and are skipped. ``kept_shape``
    and ``count``: the shape of the rows and the elements of each, as :func:`fold_rows` found them."""
    rows = math.prod(kept_shape)
    lanes = WORKGROUP
    parts = max(1, -(-count // (lanes * LANE_FOLD)))
    total = rows * parts
    gx = min(total, MAX_GROUPS)
    (x,) = pb.fit([x], len(bufs) if parts == 1 else len(fold.state))
    k = pb.kernel(name)
    k.emit("let lane: i32 = i32(lid.x);")
    k.emit(f"let part: i32 = i32(wid.y) * {gx} + i32(wid.x);")
    # a dispatch rounded up past the last part runs along on it (barriers need every lane) and writes nothing
    k.emit(f"let at: i32 = min(part, {total - 1});")
    k.emit(f"let row: i32 = at / {parts};")
    k.emit(f"let c: i32 = at % {parts};")
    kidx = k.unravel("row", kept_shape)
    state = _declare(k, fold)
    seen = k.var("bool", "false", "seen")
    _fold_elements(k, fold, state, seen, x, dims, kidx, -(-count // (lanes * parts)), f"(j * {parts} + c) * {lanes} + lane")
    # workgroup memory holds no bool: a bool state (and whether a lane holds one) as a u32
    shared = [(f"fold_lanes{i}", "u32" if ty == "bool" else ty) for i, (_, ty, _) in enumerate(fold.state)]
    for (arr, wty), (_, ty, _) in zip(shared, fold.state):
        k.helpers[arr] = f"var<workgroup> {arr}: array<{wty}, {lanes}>;"
    k.helpers["fold_seen"] = f"var<workgroup> fold_seen: array<u32, {lanes}>;"

    def put(slot: str) -> None:
        for (arr, wty), s, (_, ty, _) in zip(shared, state, fold.state):
            k.emit(f"{arr}[{slot}] = {'select(0u, 1u, ' + s + ')' if ty == 'bool' else s};")
        k.emit(f"fold_seen[{slot}] = select(0u, 1u, {seen});")
    put("lane")
    step = lanes // 2
    while step:
        k.emit("workgroupBarrier();")
        k.open(f"if (lane < {step} && fold_seen[lane + {step}] != 0u)")
        other = [k.let(f"({arr}[lane + {step}] != 0u)" if ty == "bool" else f"{arr}[lane + {step}]", ty)
                 for (arr, _), (_, ty, _) in zip(shared, fold.state)]
        _absorb(k, fold, state, other, seen)
        if step > 1:
            put("lane")
        k.close()
        step //= 2
    k.open(f"if (part < {total} && lane == 0)")
    if parts == 1:
        for b, (e, ty) in zip(bufs, fold.outputs(k, state)):
            k.write(b, "row", e, ty)
    else:
        partial = _partials(pb, fold, total)
        for b, s, (_, ty, _) in zip(partial, state, fold.state):
            k.write(b, "at", s, ty)
    k.close()
    pb.add(k.finish(0, workgroup=(lanes, 1, 1), groups=(gx, -(-total // gx), 1), group_ids=True))
    if parts > 1:
        _merge_parts(pb, name, fold, partial, rows, parts, bufs)


def scan_lines(pb, name: str, x: Value, dim: int, outs: Sequence[TensorMeta], fold: Fold) -> list[BufferView]:
    """Inclusive scan of ``x`` along ``dim``: element ``j`` of each output is ``fold.outputs``
    of the state of elements ``0..j`` of its line. One pass when a line fits LOOP_BUDGET,
    else three (see the module). Returns views of buffers of ``outs`` (``x``'s shape)."""
    nd = len(x.shape)
    lines = [x.shape[d] for d in range(nd) if d != dim]
    L = x.shape[dim]
    bufs = [pb.buffer("temp", m) for m in outs]
    views = [BufferView.whole(b, m) for b, m in zip(bufs, outs)]
    if math.prod(lines) * L == 0:
        return views
    chunks = -(-L // CHUNK) if L > LOOP_BUDGET else 1
    if chunks > LOOP_BUDGET:
        raise Unsupported(f"a scan over {L} elements needs {chunks} chunks of {CHUNK}; more than {LOOP_BUDGET} "
                          "are not split further")
    size = -(-L // chunks)
    nlines = math.prod(lines)
    ostrides = contiguous_strides(outs[0].shape)
    (x,) = pb.fit([x], max(len(outs), len(fold.state)) + (len(fold.state) if chunks > 1 else 0))

    def chunk_kernel(kname: str, prefix: list | None, write: bool):
        """One invocation per (line, chunk): the chunk's elements folded onto the state before
        it (``prefix``: scanned states of the chunks, None for none), each position written to
        the outputs when ``write``, else the chunk's state returned to be written."""
        k, lidx, state, seen = _chunk_kernel(pb, kname, "line", lines, chunks, fold)
        if prefix is not None:
            k.open("if (c > 0)")
            _absorb(k, fold, state, [BufferView.whole(b, b.meta).read(k, [f"(line * {chunks} + c - 1)"])
                                     for b in prefix], seen)
            k.close()
        k.loop("q", size)
        k.emit(f"let j: i32 = c * {size} + q;")
        k.open(f"if (j < {L})")
        idx = list(lidx[:dim]) + ["j"] + list(lidx[dim:])
        _absorb(k, fold, state, fold.lift(k, x.read(k, idx), "j"), seen)
        if write:
            flat = k.let(index_sum(idx, ostrides), "i32")
            for b, (e, ty) in zip(bufs, fold.outputs(k, state)):
                k.write(b, flat, e, ty)
        k.close()
        k.close()
        return k, state

    if chunks == 1:
        k, _ = chunk_kernel(name, None, True)
        pb.add(k.finish(nlines))
        return views
    k, state = chunk_kernel(f"{name}_chunks", None, False)
    totals = _partials(pb, fold, nlines * chunks)
    for b, s, (_, ty, _) in zip(totals, state, fold.state):
        k.write(b, "n", s, ty)
    pb.add(k.finish(nlines * chunks))
    # the chunks' states scanned along each line, one invocation per line
    k = pb.kernel(f"{name}_offsets")
    state = _declare(k, fold)
    seen = k.var("bool", "false", "seen")
    scanned = _partials(pb, fold, nlines * chunks)
    k.loop("c", chunks)
    _absorb(k, fold, state, [BufferView.whole(b, b.meta).read(k, [f"(n * {chunks} + c)"]) for b in totals], seen)
    for b, s, (_, ty, _) in zip(scanned, state, fold.state):
        k.write(b, f"n * {chunks} + c", s, ty)
    k.close()
    pb.add(k.finish(nlines))
    k, _ = chunk_kernel(name, scanned, True)
    pb.add(k.finish(nlines * chunks))
    return views
