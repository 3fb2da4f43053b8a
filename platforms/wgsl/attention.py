"""Fused attention for decode: one lowering of a pattern, not of an op.

The exported graph of a transformers decoder spells attention as its decomposition::

    scores = bmm(q, k_t)               # [BH, Lq, D] x [BH, D, Lk]
    view(scores) -> [.., Lq, Lk]       # the heads' dims back
    mul(., scale)                      # optional
    add(., mask)                       # optional: the causal/padding mask, -inf-like past the tokens
    _softmax(., -1, False)
    clone / expand / view -> [BH, Lq, Lk]
    out = bmm(probs, v)                # [BH, Lk, Dv]

Compiled op by op, each step is a kernel over the whole static cache: the scores, the
softmax and both products all cost ``Lk`` per query, and ``k_t``/``v`` (the cache read through
the grouped-query expand) are materialized first. :func:`find_attention` finds the pattern
in a graph being compiled (every intermediate used once, inside it, and not an output), and
:func:`fused_attention` writes it as two kernels in the manner of flash-decoding:

1. one invocation per (head, query, chunk of keys): the chunk's scores (float32), their max,
   the sum of exponentials and the weighted sum of the values rows;
2. one invocation per output element: the chunks combined (online softmax).

A key whose mask is ``-inf`` or at or below :data:`MASKED` (transformers fills masked
positions with the dtype's minimum) adds exactly zero to the softmax of a row that has any
other key, so it is skipped without reading the cache: a decode step at position ``t`` of
a 4096-position cache reads ``t + 1`` rows of it, and ``t`` reaches the kernel as data (the
mask computed from the step's ``cache_position``), so one compiled program serves every step.
A row whose every key is masked gets what torch gives it: the mean of the values rows (every
score rounds to the same minimum), or NaN when the mask is ``-inf``.

Before either kernel, one small kernel (:func:`chunk_flags`) says for each chunk of keys of each
row of the mask whether any key of it is unmasked. Both kernels skip a chunk that has none, so the
mask of a long cache is scanned once per step, not once per layer and head, and a chunk past the
tokens costs one load. The flags are computed once per mask per program: the layers of a decoder
share theirs.

Where a row's chunks fit a workgroup (at most ``WORKGROUP``), both kernels are one: its lanes
take a chunk each, a ``storageBarrier()`` makes their partial results visible, and the lanes
combine them. An invocation takes :data:`QUERY_BLOCK` queries of a head (a prefill's), which
share every key and value row it loads.

Only float32, and at most :data:`MAX_QUERIES` queries (past :data:`FEW_QUERIES`, only a masked
prefill into a longer cache, whose chunks past a query's position its flags skip); anything else
compiles as the separate ops. An injected fault sits between two nodes of the pattern and breaks
it, so the fault stays where ``--inject`` put it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tapml.graph import Graph
from tapml.graph import TensorMeta
from tapml.platforms.wgsl.codegen import (LOOP_BUDGET, MAX_GROUPS, WORKGROUP, BufferView, Value, cast, lit,
                                          slow_wide_compiles, vec4_read)

#: Mask values at or below this are "masked" (transformers uses finfo(float32).min).
MASKED = -1.0e38
#: Most queries per head the fused kernel takes (decode steps, speculative decoding, a prefill).
MAX_QUERIES = 1024
#: Most queries the fused kernel takes unless they are a prefill into a longer cache.
FEW_QUERIES = 8
#: Queries one invocation takes (a prefill's): they share each key and value row it loads.
QUERY_BLOCK = 4
#: Most keys: the combine's fallback for a fully masked row loops over every key.
MAX_KEYS = 16384
_RESHAPES = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.clone.default",
             "aten.alias.default", "aten.expand.default")


@dataclass
class AttentionMatch:
    """One attention pattern: the refs its kernel reads, its scale, and its nodes."""

    q: str
    k_t: str
    v: str
    mask: str | float | None
    scale: float | None
    scores_shape: tuple[int, ...]
    nodes: list[str]  # every node of the pattern; the last (the second bmm) carries the result


def find_attention(graph: Graph, uses, wanted: set[str]) -> dict[str, AttentionMatch]:
    """The attention patterns of ``graph``, by the name of each one's last node."""
    producer = {n.name: n for n in graph.nodes}
    found: dict[str, AttentionMatch] = {}
    for node in graph.nodes:
        if node.op == "aten.bmm.default":
            match = _match(node, producer, uses, wanted, graph)
            if match is not None:
                found[node.name] = match
    return found


def _ref(arg) -> str | None:
    return arg.get("ref") if isinstance(arg, dict) else None


def _match(out, producer, uses, wanted, graph) -> AttentionMatch | None:
    nodes = [out.name]

    def inner(ref):
        """The node making ``ref`` when it may be folded into the pattern (used once, not kept)."""
        node = producer.get(ref) if ref is not None else None
        if node is None or node.multi or uses[ref] != 1 or ref in wanted:
            return None
        return node

    def through_reshapes(ref):
        node = inner(ref)
        while node is not None and node.op in _RESHAPES:
            meta_in = graph.meta.get(_ref(node.args[0]))
            if meta_in is None or meta_in.numel != node.outputs[0].numel:  # an expand that broadcasts
                return None
            nodes.append(node.name)
            node = inner(_ref(node.args[0]))
        return node

    probs, v = _ref(out.args[0]), _ref(out.args[1])
    softmax = through_reshapes(probs)
    if softmax is None or softmax.op != "aten._softmax.default" or v is None:
        return None
    shape = softmax.outputs[0].shape
    if len(shape) < 3 or softmax.args[1] not in (-1, len(shape) - 1) or softmax.args[2]:
        return None
    nodes.append(softmax.name)
    node, mask, scale = inner(_ref(softmax.args[0])), None, None
    if node is not None and node.op == "aten.add.Tensor" and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        first = inner(_ref(a))
        if first is not None and first.op in ("aten.mul.Tensor", "aten.bmm.default", *_RESHAPES):
            mask = b
        else:
            first, mask = inner(_ref(b)), a
        nodes.append(node.name)
        node = first
    if node is not None and node.op in ("aten.mul.Tensor", "aten.div.Tensor") and len(node.args) == 2 and \
            not node.kwargs and isinstance(node.args[1], (int, float)) and not isinstance(node.args[1], bool):
        scale = float(node.args[1]) if node.op == "aten.mul.Tensor" else 1.0 / float(node.args[1])
        nodes.append(node.name)
        node = inner(_ref(node.args[0]))
    if node is not None and node.op in _RESHAPES:
        node = through_reshapes(node.name)
    if node is None or node.op != "aten.bmm.default":
        return None
    nodes.append(node.name)
    q, k_t = _ref(node.args[0]), _ref(node.args[1])
    metas = [graph.meta.get(r) for r in (q, k_t, v)]
    mask_meta = graph.meta.get(_ref(mask)) if isinstance(mask, dict) else None
    if q is None or k_t is None or None in metas or (isinstance(mask, dict) and mask_meta is None):
        return None
    if isinstance(mask, (int, float)) and not isinstance(mask, bool):
        mask = float(mask)
    elif mask is not None and not isinstance(mask, dict):
        return None
    (bh, lq, d), (bh_k, d_k, lk), (bh_v, lk_v, dv) = (m.shape if len(m.shape) == 3 else (0, 0, 0) for m in metas)
    floats = all(m.dtype == "float32" for m in [*metas, mask_meta, softmax.outputs[0]] if m is not None)
    if not (floats and bh == bh_k == bh_v and d == d_k and lk == lk_v and 1 <= lq <= MAX_QUERIES
            and 1 <= lk <= MAX_KEYS and d >= 1 and dv >= 1 and tuple(shape[-2:]) == (lq, lk)
            and math.prod(shape[:-2]) == bh and tuple(out.outputs[0].shape) == (bh, lq, dv)):
        return None
    if mask_meta is not None and len(mask_meta.shape) > len(shape):
        return None
    # past a few queries, only a prefill into a longer cache (whose masked chunks are skipped) is
    # fused; self-attention over the queries themselves (an encoder, a forward without a cache) keeps
    # the tiled products, which share their loads across queries and keys alike and were faster there
    if lq > FEW_QUERIES and (mask_meta is None or lk <= lq):
        return None
    return AttentionMatch(q=q, k_t=k_t, v=v, mask=_ref(mask) if isinstance(mask, dict) else mask, scale=scale,
                          scores_shape=tuple(shape), nodes=list(reversed(nodes)))


def chunk_keys(d: int, dv: int) -> int:
    """Keys one invocation of the first kernel takes: its loops stay within LOOP_BUDGET."""
    return max(1, (LOOP_BUDGET - d - dv) // (d + dv + 2))


def chunk_flags(pb, ref: str, mask: Value, lk: int, chunk: int) -> BufferView:
    """For each row of ``mask`` (its shape but the last dim) and each chunk of ``chunk`` keys of
    ``lk``: 1 where a key of the chunk is unmasked (above :data:`MASKED`, or NaN), else 0. One
    kernel per mask ``ref`` per program; later attentions reading the same mask reuse it."""
    from tapml.platforms.wgsl import views
    chunks = -(-lk // chunk)
    key = ("attention chunk flags", ref, lk, chunk)
    if key in pb.memo:
        return pb.memo[key]
    lead = tuple(mask.shape[:-1])
    (mask,) = pb.fit([views.expand_to(mask, lead + (lk,))], 1)
    meta = TensorMeta(lead + (chunks,), "int32")
    out = pb.buffer("temp", meta)
    k = pb.kernel("attention_flags")
    row, c = k.let(f"n / {chunks}", "i32"), k.let(f"n % {chunks}", "i32")
    idx = k.unravel(row, lead)
    found = k.var("i32", "0", "any")
    k.loop("jj", chunk)
    at = k.let(f"{c} * {chunk} + jj", "i32")
    k.open(f"if ({at} >= {lk})")
    k.emit("break;")
    k.close()
    k.open(f"if (!({cast(mask.read(k, [*idx, at]), mask.ty, 'f32')} <= {lit(MASKED, 'f32')}))")
    k.emit(f"{found} = 1;")
    k.emit("break;")
    k.close()
    k.close()
    k.write(out, "n", found, "i32")
    pb.add(k.finish(math.prod(lead) * chunks))
    pb.memo[key] = BufferView.whole(out, meta)
    return pb.memo[key]


def fused_attention(pb, match: AttentionMatch, env: dict, meta: TensorMeta) -> BufferView:
    """The pattern's output (``meta``: the second bmm's ``[BH, Lq, Dv]``) by the kernels of the
    module docstring: one where a row's chunks fit a workgroup, else the partial results and
    their combination."""
    from tapml.platforms.wgsl import views
    q, k_t, v = env[match.q], env[match.k_t], env[match.v]
    (bh, lq, d), lk, dv = q.shape, k_t.shape[2], v.shape[2]
    shape = match.scores_shape
    mask = views.expand_to(env[match.mask], shape) if isinstance(match.mask, str) else None
    NEG_INF, NAN = lit(-math.inf, "f32"), lit(math.nan, "f32")
    chunk = chunk_keys(d, dv)
    chunks = -(-lk // chunk)
    rows = bh * lq
    QB = min(QUERY_BLOCK, lq)  # queries of a head one invocation takes: they share the key and value loads
    blocks_per_head = -(-lq // QB)
    blocks = bh * blocks_per_head
    # besides these, a kernel binds the partial results, the output and the chunk flags
    q, k_t, v, *rest = pb.fit([q, k_t, v] + ([mask] if mask is not None else []), 2 + (mask is not None))
    mask = rest[0] if rest else None
    width = dv + 2  # a chunk's partial result: its max, its sum of exponentials, its weighted values
    parts_meta = TensorMeta((rows * chunks * width,), "float32")
    parts = pb.buffer("temp", parts_meta)

    flags = chunk_flags(pb, match.mask, env[match.mask], lk, chunk) if mask is not None else None
    # where the widths allow, rows, keys, values and sums go four at a time (a vec4 load of the
    # cache), except where wide loops compile slowly (vec4 loads inside the key loop)
    vec4_rows = not slow_wide_compiles(pb.caps)
    d4, dv4 = vec4_rows and d % 4 == 0, vec4_rows and dv % 4 == 0
    if flags is not None:
        flags = views.expand_to(flags, tuple(shape[:-1]) + (chunks,))

    def live_chunk(k, head, queries, c) -> str:
        """A WGSL bool: some query of ``queries`` ((index, valid) pairs) has an unmasked key in chunk ``c``."""
        if flags is None:
            return "true"
        lead = k.unravel(head, shape[:-2]) if len(shape) > 2 else []
        return " || ".join(f"({ok} && {flags.read(k, [*lead, qi, c])} != 0)" for qi, ok in queries)

    def mask_at(k, head, query, key):
        """The mask's value (float32) at this head, query and key; a constant when there is none."""
        if mask is None:
            return "0.0" if match.mask is None else lit(float(match.mask), "f32")
        lead = k.unravel(head, shape[:-2]) if len(shape) > 2 else []
        return cast(mask.read(k, [*lead, query, key]), mask.ty, "f32")

    def part(k, head, queries, c):
        """Chunk ``c``'s partial results (max, sum of exponentials, weighted values) for each valid
        query of ``queries`` ((index, valid) pairs, the index clamped into range): the queries of a
        block share every key and value load."""
        nq = len(queries)
        if d4:
            k.emit(f"var qrow: array<vec4<f32>, {nq * d // 4}>;")
            k.loop("i", d // 4)
            for j, (qi, _) in enumerate(queries):
                k.emit(f"qrow[{j * d // 4} + i] = {vec4_read(k, q, [head, qi, 'i * 4'], 2)};")
        else:
            k.emit(f"var qrow: array<f32, {nq * d}>;")
            k.loop("i", d)
            for j, (qi, _) in enumerate(queries):
                k.emit(f"qrow[{j * d} + i] = {cast(q.read(k, [head, qi, 'i']), q.ty, 'f32')};")
        k.close()
        k.emit(f"var score: array<f32, {nq * chunk}>;")
        mx = [k.var("f32", f"{NEG_INF}", "mx") for _ in queries]
        k.loop("jj", chunk)
        key = k.let(f"{c} * {chunk} + jj", "i32")
        k.open(f"if ({key} >= {lk})")
        k.emit("break;")
        k.close()
        mv = [k.let(mask_at(k, head, qi, key), "f32") for qi, _ in queries]
        # a key is live for a valid query whose mask is above MASKED (so not -inf; NaN is not masked)
        live = [k.let(f"{ok} && !({m} <= {lit(MASKED, 'f32')})", "bool") for (_, ok), m in zip(queries, mv)]
        k.open(f"if (!({' || '.join(live)}))")
        for j in range(nq):
            k.emit(f"score[{j * chunk} + jj] = {NEG_INF};")
        k.emit("continue;")
        k.close()
        dots = [k.var("f32", "0.0", "dot") for _ in queries]
        if d4:  # four dims a load
            k.loop("i", d // 4)
            kv = k.let(vec4_read(k, k_t, [head, "i * 4", key], 1), "vec4<f32>")
            for j, dot in enumerate(dots):
                k.emit(f"{dot} = {dot} + dot(qrow[{j * d // 4} + i], {kv});")
        else:
            k.loop("i", d)
            kv = k.let(cast(k_t.read(k, [head, "i", key]), k_t.ty, "f32"), "f32")
            for j, dot in enumerate(dots):
                k.emit(f"{dot} = {dot} + qrow[{j * d} + i] * {kv};")
        k.close()
        for j, (dot, m, ok) in enumerate(zip(dots, mv, live)):
            scaled = dot if match.scale is None else f"({dot} * {lit(match.scale, 'f32')})"
            k.emit(f"score[{j * chunk} + jj] = select({NEG_INF}, {scaled} + {m}, {ok});")
            k.emit(f"{mx[j]} = max({mx[j]}, score[{j * chunk} + jj]);")
        k.close()
        totals = [k.var("f32", "0.0", "l") for _ in queries]
        k.emit(f"var acc: array<{'vec4<f32>' if dv4 else 'f32'}, {nq * dv // 4 if dv4 else nq * dv}>;")
        k.open(f"if ({' || '.join(f'{m} > {NEG_INF}' for m in mx)})")
        k.loop("jj", chunk)
        key = k.let(f"{c} * {chunk} + jj", "i32")
        k.open(f"if ({key} >= {lk})")
        k.emit("break;")
        k.close()
        seen = [k.let(f"score[{j * chunk} + jj] != {NEG_INF}", "bool") for j in range(nq)]
        k.open(f"if (!({' || '.join(seen)}))")
        k.emit("continue;")
        k.close()
        ps = [k.let(f"select(0.0, exp(score[{j * chunk} + jj] - {mx[j]}), {ok})", "f32") for j, ok in enumerate(seen)]
        for total, p_ in zip(totals, ps):
            k.emit(f"{total} = {total} + {p_};")
        if dv4:
            k.loop("e", dv // 4)
            vv = k.let(vec4_read(k, v, [head, key, "e * 4"], 2), "vec4<f32>")
            for j, p_ in enumerate(ps):
                k.emit(f"acc[{j * dv // 4} + e] = acc[{j * dv // 4} + e] + {p_} * {vv};")
        else:
            k.loop("e", dv)
            vv = k.let(cast(v.read(k, [head, key, "e"]), v.ty, "f32"), "f32")
            for j, p_ in enumerate(ps):
                k.emit(f"acc[{j * dv} + e] = acc[{j * dv} + e] + {p_} * {vv};")
        k.close()
        k.close()
        k.close()
        for j, (qi, ok) in enumerate(queries):
            k.open(f"if ({ok})")
            at = k.let(f"(({head} * {lq} + {qi}) * {chunks} + {c}) * {width}", "i32")
            k.write(parts, at, mx[j], "f32")
            k.write(parts, f"{at} + 1", totals[j], "f32")
            if dv4:
                k.loop("e", dv // 4)
                for x in range(4):
                    k.write(parts, f"{at} + 2 + e * 4 + {x}", f"acc[{j * dv // 4} + e].{'xyzw'[x]}", "f32")
            else:
                k.loop("e", dv)
                k.write(parts, f"{at} + 2 + e", f"acc[{j * dv} + e]", "f32")
            k.close()
            k.close()

    def block_queries(k, block) -> tuple[str, list[tuple[str, str]]]:
        """The head of query block ``block`` and its queries ((index, valid) pairs)."""
        head = k.let(f"{block} / {blocks_per_head}", "i32")
        first = k.let(f"({block} % {blocks_per_head}) * {QB}", "i32")
        queries = []
        for j in range(QB):
            qi = k.let(f"{first} + {j}", "i32") if j else first
            queries.append((k.let(f"min({qi}, {lq - 1})", "i32") if lq % QB else qi,
                            k.let(f"{qi} < {lq}", "bool") if lq % QB else "true"))
        return head, queries

    out = pb.buffer("temp", meta)
    partial = BufferView.whole(parts, parts_meta)

    def combine(k, row, e):
        """Output element ``e`` of ``row`` from the row's partial results."""
        head, query = k.let(f"{row} / {lq}", "i32"), k.let(f"{row} % {lq}", "i32")
        big = k.var("f32", f"{NEG_INF}", "big")
        k.loop("c", chunks)
        k.open(f"if (!({live_chunk(k, head, [(query, 'true')], 'c')}))")
        k.emit("continue;")
        k.close()
        k.emit(f"{big} = max({big}, {partial.read(k, [f'({row} * {chunks} + c) * {width}'])});")
        k.close()
        result = k.var("f32", "0.0", "o")
        k.open(f"if ({big} > {NEG_INF})")
        num, den = k.var("f32", "0.0", "num"), k.var("f32", "0.0", "den")
        k.loop("c", chunks)
        k.open(f"if (!({live_chunk(k, head, [(query, 'true')], 'c')}))")
        k.emit("continue;")
        k.close()
        at = k.let(f"{row} * {chunks} + c", "i32")
        w = k.let(f"exp({partial.read(k, [f'{at} * {width}'])} - {big})", "f32")
        k.emit(f"{den} = {den} + {partial.read(k, [f'{at} * {width} + 1'])} * {w};")
        k.emit(f"{num} = {num} + {partial.read(k, [f'{at} * {width} + 2 + {e}'])} * {w};")
        k.close()
        k.emit(f"{result} = {num} / {den};")
        k.close()
        k.open("else")  # every key masked: torch's softmax of equal minima is uniform; of -inf, NaN
        first = k.let(mask_at(k, head, query, "0"), "f32")
        k.open(f"if ({first} == {NEG_INF})")
        k.emit(f"{result} = {NAN};")
        k.close()
        k.open("else")
        total = k.var("f32", "0.0", "sum")
        k.loop("j", lk)
        if dv4:  # as the values are read above (one binding of them, not two)
            four = vec4_read(k, v, [head, "j", f"({e} / 4) * 4"], 2)
            k.emit(f"{total} = {total} + {four}[{e} % 4];")
        else:
            k.emit(f"{total} = {total} + {cast(v.read(k, [head, 'j', e]), v.ty, 'f32')};")
        k.close()
        k.emit(f"{result} = {total} / {lit(float(lk), 'f32')};")
        k.close()
        k.close()
        k.write(out, f"{row} * {dv} + {e}", result, "f32")

    if chunks <= WORKGROUP:  # a workgroup takes whole query blocks: its lanes a chunk each, then combine them
        per = WORKGROUP // chunks  # blocks per workgroup: short rows share one, so their lanes stay busy
        groups = -(-blocks // per)
        k = pb.kernel("attention")
        gx = min(groups, MAX_GROUPS)
        k.emit(f"let first: i32 = (i32(wid.y) * {gx} + i32(wid.x)) * {per};")
        k.emit("let lane: i32 = i32(lid.x);")
        block, c = k.let(f"first + lane / {chunks}", "i32"), k.let(f"lane % {chunks}", "i32")
        k.open(f"if (lane < {per * chunks} && {block} < {blocks})")
        head, queries = block_queries(k, block)
        k.open(f"if ({live_chunk(k, head, queries, c)})")  # a chunk with every key masked is not read
        part(k, head, queries, c)
        k.close()
        k.close()
        k.emit("storageBarrier();")  # the blocks' partial results, written by their lanes, are visible
        k.open(f"for (var at: i32 = lane; at < {per * QB * dv}; at = at + {WORKGROUP})", -(-per * QB * dv // WORKGROUP))
        out_block = k.let(f"first + at / {QB * dv}", "i32")
        out_query = k.let(f"({out_block} % {blocks_per_head}) * {QB} + (at / {dv}) % {QB}", "i32")
        k.open(f"if ({out_block} < {blocks} && {out_query} < {lq})")
        combine(k, k.let(f"({out_block} / {blocks_per_head}) * {lq} + {out_query}", "i32"), k.let(f"at % {dv}", "i32"))
        k.close()
        k.close()
        pb.add(k.finish(0, workgroup=(WORKGROUP, 1, 1), groups=(gx, -(-groups // gx), 1), group_ids=True))
        return BufferView.whole(out, meta)

    k = pb.kernel("attention_part")
    block, c = k.let(f"n / {chunks}", "i32"), k.let(f"n % {chunks}", "i32")
    head, queries = block_queries(k, block)
    k.open(f"if ({live_chunk(k, head, queries, c)})")  # else its partial results are not read
    part(k, head, queries, c)
    k.close()
    pb.add(k.finish(blocks * chunks))

    k = pb.kernel("attention_combine")
    combine(k, k.let(f"n / {dv}", "i32"), k.let(f"n % {dv}", "i32"))
    pb.add(k.finish(rows * dv))
    return BufferView.whole(out, meta)


__all__ = ["AttentionMatch", "chunk_flags", "find_attention", "fused_attention", "MASKED", "MAX_QUERIES"]
