"""The WGSL compiler: a core-ATen :class:`~tapml.graph.Graph` -> a :class:`KernelProgram`.

Compilation needs no device, only its caps (``{"adapter", "backend", "features", "limits",
"dtypes"}``), so the host compiles for a browser page or a remote server as well as for
wgpu-native in-process. Example::

    from tapml.platforms.wgsl import compile_graph
    program = compile_graph(graph, {"features": ["shader-f16"], "limits": {}})
"""

from __future__ import annotations

from collections import ChainMap, Counter
from typing import Mapping

from tapml.errors import PlatformError, Unsupported
from tapml.graph import Graph, Node, TensorMeta, decode_arg
from tapml.platforms.base import KernelProgram
from tapml.platforms.wgsl.codegen import WIDE, BufferView, Compute, ProgramBuilder, Value, cast, ctype
from tapml.platforms.wgsl.registry import (REGISTRY, Lowering, case_graph, dtype_reason, float64_held_as_float32,
                                          supports_node)

_LOADED = False
# a fused expression larger than this is written to a buffer instead of growing further
MAX_FUSED_COST = 160
# a value of at most this many elements that costs at most this much is recomputed by each reader
# instead of written to a buffer: a dispatch (0.03-0.04 ms on lavapipe) costs more than a few
# operations per read (the cache position's copies, rotary embedding's cos and sin in a decode step)
RECOMPUTED_NUMEL, RECOMPUTED_COST = 64, 8


def load_lowerings() -> dict:
    """Import every op-family module (they register themselves); returns the registry."""
    global _LOADED
    if not _LOADED:
        from tapml.platforms.wgsl import backward, bilinear, complex, elementwise, extra, fractional, index, int64, matmul, nn, nn_more, order, quant, random, reduce, resample, scatter, shape, sort, special, views  # noqa: F401
        _LOADED = True
    return REGISTRY


def supports(node: Node, caps: dict, input_metas=()) -> str | None:
    """None when ``node`` can be compiled for a device with ``caps``, else the reason."""
    load_lowerings()
    return supports_node(node, caps, input_metas)


def _cast_value(v: Value, dtype: str) -> Value:
    src, dst = v.ty, ctype(dtype)
    return Compute(v.shape, dtype, [v], lambda k, e, idx: cast(e[0], src, dst))


def compile_graph(graph: Graph, caps: dict, lowerings: Mapping[str, Lowering] | None = None) -> KernelProgram:
    """Compile ``graph`` into one KernelProgram for a device with ``caps``.

    ``lowerings`` lay over the registry for this compile only (an op's entry there replaces the
    registry's): the user's own kernels, :func:`tapml.platforms.wgsl.user_kernels.user_lowerings`.

    Elementwise chains fuse into the kernel that reads them, views are strides, values used
    more than once and graph outputs are written to buffers. Raises :class:`Unsupported`
    (with the reason) for what the device or WGSL cannot do, :class:`PlatformError` when a
    lowering fails.
    """
    load_lowerings()
    from tapml.platforms.wgsl.attention import find_attention, fused_attention
    from tapml.platforms.wgsl.matmul import find_product_groups, find_residual_products, product_group, residual_product
    from tapml.platforms.wgsl.norms import find_rms_norms, rms_norm
    from tapml.platforms.wgsl.complex import complex_lowering, touches_complex
    from tapml.platforms.wgsl.int64 import (WIDE_LOWERINGS, narrowed, touches_uint64, uint64_lowering, wide_lowering,
                                            wide_scalar)
    from tapml.platforms.wgsl.scatter import put_in_place
    registry = REGISTRY if not lowerings else ChainMap(dict(lowerings), REGISTRY)
    caps = caps or {}
    pb = ProgramBuilder(caps)
    env: dict[str, Value] = {}
    inputs = []
    held32 = float64_held_as_float32(graph)
    input_metas = []  # as the program takes them: float64 constants as float32
    for ref, meta in graph.inputs:
        if held32 and meta.dtype == "float64":
            meta = TensorMeta(meta.shape, "float32")
        input_metas.append(meta)
        reason = dtype_reason(meta.dtype, caps)
        if reason:
            raise Unsupported(f"input {ref}: {reason}")
        buf = pb.buffer("input", meta, "in")
        inputs.append(buf.name)
        env[ref] = BufferView.whole(buf, meta)
    uses = Counter(r for n in graph.nodes for r in set(n.input_refs))
    wanted = set(graph.outputs)
    in_place: set[str] = set()  # input buffers written in place, listed as outputs too

    attention = {} if lowerings else find_attention(graph, uses, wanted)
    residuals = {} if lowerings else find_residual_products(graph, uses, wanted)
    folded = {name for match in attention.values() for name in match.nodes[:-1]}
    folded |= {name for match in residuals.values() for name in match.nodes}
    norms = {} if lowerings else find_rms_norms(graph, uses, wanted)
    folded |= {name for match in norms.values() for name in match.nodes[:-1]}

    groups = {} if lowerings else find_product_groups(graph, folded)
    by_name = {n.name: n for n in graph.nodes}
    done: set[str] = set()

    def lower(node, values: list | None = None) -> None:
        """Lower ``node`` (or take its ``values``, computed with others) into ``env``."""
        in_metas = [graph.meta[r] for r in node.input_refs]
        value_of = env.__getitem__
        if touches_complex(node, in_metas):  # complex64: pairs of float32
            low = complex_lowering(node, in_metas, registry)
            reason = low.check(node) if low.check is not None else None
        elif touches_uint64(node, in_metas):  # uint64: two words read as unsigned
            low = uint64_lowering(node, in_metas, registry)
            reason = low.check(node) if low.check is not None else None
        elif any(m.dtype == WIDE for m in in_metas + list(node.outputs)) or \
                (node.op in WIDE_LOWERINGS and wide_scalar(node) and
                 any(m.dtype == "int64" for m in in_metas + list(node.outputs))):  # int64 in two words
            low, low_words = wide_lowering(node, in_metas, registry)
            reason = low.check(node) if low.check is not None else None
            if low_words:
                value_of = lambda ref: narrowed(env[ref])  # noqa: E731
        else:
            reason = supports_node(node, caps, in_metas, registry)
            low = registry.get(node.op)
        if reason:
            raise Unsupported(f"{node.op}: {reason}")
        try:
            if values is not None:
                pass
            elif node.name in attention:
                values = [fused_attention(pb, attention[node.name], env, node.outputs[0])]
            elif node.name in residuals:
                values = [residual_product(pb, residuals[node.name], env, node.outputs[0])]
            elif node.name in norms:
                values = [rms_norm(pb, norms[node.name], env, node.outputs[0])]
            else:
                args = decode_arg(node.args, value_of)
                kwargs = {k: decode_arg(v, value_of) for k, v in node.kwargs.items()}
                if node.op == "aten.index_put.default" and node.op not in (lowerings or {}) and \
                        _sole_reader_of_input(node, graph, uses, env):
                    put = put_in_place(pb, node, *args, **kwargs)
                    if put is not None:
                        in_place.add(put.buf.name)
                        values = [put]
                if values is None:
                    values = low.fn(pb, node, *args, **kwargs)
        except (Unsupported, PlatformError):
            raise
        except Exception as e:  # a lowering bug is a verdict on this op, not a crash
            raise PlatformError(f"lowering {node.op} ({node.name}) failed: {type(e).__name__}: {e}") from e
        if len(values) != len(node.outputs):
            raise PlatformError(f"lowering {node.op} returned {len(values)} values for {len(node.outputs)} outputs")
        for ref, v, meta in zip(node.output_refs, values, node.outputs):
            if tuple(v.shape) != tuple(meta.shape):
                raise PlatformError(f"lowering {node.op} ({node.name}) produced shape {list(v.shape)}, "
                                    f"torch says {list(meta.shape)}")
            if v.dtype != meta.dtype:
                v = _cast_value(v, meta.dtype)
            if ref in wanted and not (isinstance(v, BufferView) and v.buf.name in in_place):
                v = _output(pb, v, meta)
            elif v.cost > MAX_FUSED_COST or (v.cost > 0 and uses[ref] > 1 and not _recomputed(v)):
                v = pb.materialize(v)
            env[ref] = v
        done.add(node.name)

    for node in graph.nodes:
        if node.name in folded or node.name in done:  # folded: inside a fused pattern, written by its last node
            continue
        group = groups.get(node.name)
        if group is not None:  # products sharing their row: their views first, then one kernel
            for name in group.early:
                if name not in done:
                    lower(by_name[name])
            try:
                members = product_group(pb, group, graph, env)
            except (Unsupported, PlatformError):
                raise
            except Exception as e:  # noqa: BLE001 - as a lowering bug above
                raise PlatformError(f"lowering the products of {', '.join(group.members)} failed: "
                                    f"{type(e).__name__}: {e}") from e
            for name, value in members.items():
                lower(by_name[name], [value])
            if node.name in done:
                continue
        lower(node)

    outputs, claimed = [], set()
    for ref in graph.outputs:
        v, meta = env[ref], graph.meta[ref]
        owned = isinstance(v, BufferView) and (v.buf.role == "output" or v.buf.name in in_place)
        if not (owned and v.buf.name not in claimed and v.is_whole):
            v = _output(pb, v, meta, force=True)
        claimed.add(v.buf.name)
        outputs.append(v.buf.name)
    pb.merge_independent()
    used = {binding[0] for kern in pb.kernels for binding in kern.bindings}
    # a temp no kernel touches (an unused multi-output element) needs no device memory
    pb.buffers = [b for b in pb.buffers if b.role != "temp" or b.name in used]
    for b in pb.buffers:  # programs and buffers say int64; the storage type says how it is held
        b.meta = _torch_meta(b.meta)
    program = KernelProgram(kind="wgsl", inputs=inputs, outputs=outputs, buffers=pb.buffers, kernels=pb.kernels,
                            input_meta=[_torch_meta(m) for m in input_metas],
                            output_meta=[_torch_meta(graph.meta[r]) for r in graph.outputs])
    return pb.into_parts(program)  # tensors over max-buffer-size: held in several buffers


def _torch_meta(meta: TensorMeta | None) -> TensorMeta | None:
    """``meta`` as torch names its dtype (a two-word int64 is an int64)."""
    return TensorMeta(meta.shape, "int64") if meta is not None and meta.dtype == WIDE else meta


def _recomputed(v: Value) -> bool:
    """Whether a value read by several nodes is cheap enough to recompute in each of them."""
    return v.numel <= RECOMPUTED_NUMEL and v.cost <= RECOMPUTED_COST


def _sole_reader_of_input(node, graph: Graph, uses: Counter, env: dict) -> bool:
    """Whether ``node``'s first argument is a whole graph input that no other node and no graph
    output reads, so that ``node`` may write into its buffer."""
    ref = node.input_refs[0] if node.input_refs else None
    if ref is None or not (isinstance(node.args[0], dict) and node.args[0].get("ref") == ref):
        return False
    v = env.get(ref)
    return (uses[ref] == 1 and ref not in graph.outputs and isinstance(v, BufferView) and v.buf.role == "input"
            and v.is_whole and any(r == ref for r, _ in graph.inputs))


def _output(pb: ProgramBuilder, v: Value, meta: TensorMeta, force: bool = False) -> BufferView:
    """``v`` in an output buffer: a temp buffer holding exactly ``v`` becomes the output."""
    if not isinstance(v, BufferView):
        v = v.written(pb) or v  # a value with a kernel of its own writes itself, not a copy
    if isinstance(v, BufferView) and v.buf.role == "temp" and v.is_whole and not force:
        v.buf.role = "output"
        v.buf.meta = meta
        return v
    out = pb.buffer("output", meta, "out")
    return pb.materialize(v, out)


__all__ = ["compile_graph", "supports", "load_lowerings", "REGISTRY", "case_graph"]
