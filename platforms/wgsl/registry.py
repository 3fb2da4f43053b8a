"""The lowering registry: one entry per full aten overload name.

Each :class:`Lowering` says which tensor dtypes the op takes, how to emit it (``fn``), and
how to make sample inputs for its test (``samples``), so that the device tests are generated
from this table: adding an op touches one place.

``fn(pb, node, *args, **kwargs)`` receives the node's decoded arguments with every tensor
replaced by a :class:`~tapml.platforms.wgsl.codegen.Value` and returns one Value per output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from tapml.graph import Graph, Node, TensorMeta, encode_arg

ALL_FLOAT = ("float32", "float16", "bfloat16")
ALL_INT = ("int64", "int32", "int16", "int8", "uint8")
ALL = ALL_FLOAT + ALL_INT + ("bool",)
NUMERIC = ALL_FLOAT + ALL_INT


def _elements(node: Node, ins: list[TensorMeta]) -> int:
    return sum(m.numel for m in node.outputs)


def _matmul(node: Node, ins: list[TensorMeta]) -> int:
    if len(ins) < 2:
        raise IndexError("a matrix product has two operands")
    return 2 * _elements(node, ins) * ins[0].shape[-1]


def _addmm(node: Node, ins: list[TensorMeta]) -> int:
    if len(ins) < 3:
        raise IndexError("addmm has three operands")
    out = _elements(node, ins)
    return 2 * out * ins[1].shape[-1] + out


def _conv(node: Node, ins: list[TensorMeta]) -> int:
    weight = ins[1].shape  # (Cout, Cin/groups, *kernel); transposed: (Cin, Cout/groups, *kernel)
    if len(node.args) > 6 and node.args[6] is True:  # each input element meets Cout/groups·kernel weights
        return 2 * ins[0].numel * math.prod(weight[1:])
    return 2 * node.outputs[0].numel * math.prod(weight[1:])


def _reduce(node: Node, ins: list[TensorMeta]) -> int:
    if not ins:
        raise IndexError("a reduction has an input")
    return ins[0].numel


#: FLOP counts by kind, from a node and the metas of its tensor inputs. Rough on purpose: they
#: weigh how much of a model's work a placement puts on the target.
FLOPS: dict[str, Callable[[Node, list[TensorMeta]], int]] = {
    "elementwise": _elements,  # one per output element
    "view": lambda node, ins: 0,  # a reinterpretation (strides), no work
    "matmul": _matmul,  # 2·M·N·K
    "addmm": _addmm,  # 2·M·N·K + M·N
    "conv": _conv,  # 2·outputs·(Cin/groups)·kernel
    "softmax": lambda node, ins: 5 * _elements(node, ins),
    "norm": lambda node, ins: 8 * node.outputs[0].numel,
    "reduce": _reduce,  # one per input element
}


@dataclass
class Lowering:
    """A registry entry: ``fn`` emits ``op``, which takes tensors of ``dtypes``; ``samples()``
    returns ``[(args, kwargs)]`` for its tests, ``check(node)`` a reason it cannot run a node
    (or None), ``family`` is the module that registered it.

    Facts about the op itself: ``view`` (it only reinterprets its input: zero FLOPs),
    ``flops`` (a kind of :data:`FLOPS`), ``compare_values`` (False when any values are right,
    e.g. ``empty``: its tests compare only shapes and dtypes)."""

    op: str
    fn: Callable
    dtypes: tuple[str, ...]
    samples: Callable[[], list] | None = None
    check: Callable[[Node], str | None] | None = None
    family: str = ""
    view: bool = False
    flops: str = "elementwise"
    compare_values: bool = True

    def count_flops(self, node: Node, meta: dict[str, TensorMeta]) -> int:
        """A rough FLOP count of ``node`` (``meta``: the graph's tensor metas by ref)."""
        return node_flops(node, meta, self)


REGISTRY: dict[str, Lowering] = {}


def register(ops: str | Sequence[str], dtypes: Sequence[str] = ALL, samples=None, check=None, *,
             view: bool = False, flops: str | None = None, compare_values: bool = True):
    """Decorator: register ``fn`` as the lowering of each op in ``ops``.

    ``view``: the ops only reinterpret their input (zero FLOPs); ``flops``: a kind of
    :data:`FLOPS` (default ``"elementwise"``, ``"view"`` for views); ``compare_values=False``:
    tests compare only shapes and dtypes. Example::

        @register("aten.neg.default", NUMERIC, samples=lambda: [((rand(3, 5),), {})])
        def neg(pb, node, x):
            return [elementwise(pb, node, [x], lambda k, a: f"(-{a})")]
    """
    names = [ops] if isinstance(ops, str) else list(ops)
    kind = flops or ("view" if view else "elementwise")
    if kind not in FLOPS:
        raise ValueError(f"unknown flops kind {kind!r}; use one of {', '.join(FLOPS)}")

    def deco(fn):
        family = fn.__module__.rsplit(".", 1)[-1]
        for name in names:
            if name in REGISTRY:
                raise ValueError(f"{name} is registered twice")
            REGISTRY[name] = Lowering(name, fn, tuple(dtypes), samples, check, family, view=view, flops=kind,
                                      compare_values=compare_values)
        return fn
    return deco


def node_flops(node: Node, meta: dict[str, TensorMeta], lowering: Lowering | None = None) -> int:
    """A rough FLOP count of one node by its registry entry's ``flops`` kind: 2·M·N·K for matrix
    products and convolutions, a few per element for normalizations and softmax, one per input
    element for reductions, zero for views, and one per output element for everything else
    (ops without a lowering included)."""
    if lowering is None:
        from tapml.platforms.wgsl import load_lowerings
        lowering = load_lowerings().get(node.op)
    kind = lowering.flops if lowering is not None else "elementwise"
    ins = [meta[r] for r in node.input_refs if r in meta]
    try:
        return FLOPS[kind](node, ins)
    except (IndexError, TypeError):
        return _elements(node, ins)


def dtype_reason(dtype: str, caps: dict) -> str | None:
    """Why a tensor of ``dtype`` cannot live on a device with ``caps`` (None when it can)."""
    if dtype == "float64":
        return "float64: WGSL has no 64-bit floats"
    if dtype.startswith("complex") and dtype not in ("complex64", "complex32"):
        return (f"{dtype}: WGSL has no complex types (complex64 and complex32 are held as pairs of float32 and "
                f"float16; {dtype} is not)")
    if dtype not in ALL and dtype not in ("int64w", "complex64", "uint64", "complex32"):  # two words, pairs
        return f"dtype {dtype} has no WGSL lowering"
    return None


def float64_held_as_float32(graph: Graph) -> bool:
    """Whether ``graph``'s float64 tensors can be held as float32: they are all graph inputs (the
    constants a model keeps in float64), no node computes a float64 value and no output is one. Each
    such input is converted when a program runs, and refused there unless float32 holds its values
    exactly (:func:`exact_float32`); the nodes reading them compute in their own output's dtype,
    which torch does too (or compare, which exact values do alike in either)."""
    return any(m.dtype == "float64" for _, m in graph.inputs) and \
        not any(m.dtype == "float64" for n in graph.nodes for m in n.outputs) and \
        not any(graph.meta[r].dtype == "float64" for r in graph.outputs)


def exact_float32(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` (float64) as float32, which must hold every value exactly (NaN and infinities included)."""
    from tapml.errors import Unsupported
    held = t.to(torch.float32)
    back = held.to(torch.float64)
    if not bool(((back == t) | (back.isnan() & t.isnan())).all()):
        raise Unsupported(f"{where}: float64 values that float32 does not hold exactly (WGSL has no 64-bit "
                          "floats; float64 constants that float32 holds exactly run as float32)")
    return held


def low_precision_paths(features) -> dict[str, str]:
    """How float16 and bfloat16 are held and computed on a device with ``features``: the
    ``low_precision`` entry of its caps (shown in verdicts' device info)."""
    f16 = ("native f16 (shader-f16), f32 arithmetic rounded per op" if "shader-f16" in (features or []) else
           "packed two per u32 (no shader-f16): unpack2x16float to f32, rounded to nearest even on store")
    return {"float16": f16, "bfloat16": "packed two per u32 as the high half of an f32: f32 arithmetic, "
                                        "rounded to nearest even on store"}


#: Ops whose input or output is always complex (the FFTs): lowered for complex64 held as pairs
#: of float32 (platforms/wgsl/complex.py).
COMPLEX_OPS = frozenset({"aten._fft_r2c.default", "aten._fft_c2r.default", "aten._fft_c2c.default"})


def supports_node(node: Node, caps: dict, input_metas: Sequence[TensorMeta] = (),
                  registry: Mapping[str, Lowering] | None = None) -> str | None:
    """None when the registry (or ``registry``, one laid over it) can lower ``node`` for a device
    with ``caps``, else the reason. A refusal by design (float64, complex) is said before a
    missing lowering."""
    if not any(m.dtype == "float64" for m in node.outputs):  # float64 inputs: constants held as float32
        input_metas = [TensorMeta(m.shape, "float32") if m.dtype == "float64" else m for m in input_metas]
    for m in list(input_metas) + list(node.outputs):
        reason = dtype_reason(m.dtype, caps)
        if reason:
            return reason
    if any(m.dtype == "uint64" for m in list(input_metas) + list(node.outputs)):
        from tapml.platforms.wgsl.int64 import uint64_lowering
        from tapml.errors import Unsupported
        try:
            low = uint64_lowering(node, input_metas, REGISTRY if registry is None else registry)
        except Unsupported as e:
            return str(e)
        return low.check(node) if low.check is not None else None
    if any(m.dtype in ("complex64", "complex32") for m in list(input_metas) + list(node.outputs)):
        from tapml.platforms.wgsl.complex import complex_lowering
        from tapml.errors import Unsupported
        try:
            low = complex_lowering(node, input_metas, REGISTRY if registry is None else registry)
        except Unsupported as e:
            return str(e)
        return low.check(node) if low.check is not None else None
    low = (REGISTRY if registry is None else registry).get(node.op)
    if low is None:
        return f"no WGSL lowering for {node.op}{_packed_type_note(node.op)}"
    for m in input_metas:
        if m.dtype not in low.dtypes:
            return f"{node.op} takes {', '.join(low.dtypes)} tensors, not {m.dtype}"
    if low.check is not None:
        return low.check(node)
    return None


def _packed_type_note(op: str) -> str:
    """For a packed-weight op of a format tapml only reads (:data:`tapml.quant.FORMATS`), which
    block type it has no kernel for; empty for any other op."""
    from tapml.quant import FORMATS, packed_op_format
    fmt = packed_op_format(op)
    if fmt is None or fmt.quantizable:
        return ""
    return (f" (no WGSL kernel reads ggml's {fmt.name.upper()} blocks, {fmt.block_bytes} bytes per {fmt.block_elems} "
            "weights; kernels exist for " + ", ".join(n.upper() for n, f in FORMATS.items() if f.quantizable) + ")")


# --- samples for tests -------------------------------------------------------------------

def rand(*shape, lo: float = -2.0, hi: float = 2.0, dtype=torch.float32) -> torch.Tensor:
    """Uniform in [lo, hi), never exactly zero (so wrong zeros show)."""
    t = torch.rand(*shape) * (hi - lo) + lo
    t = torch.where(t == 0, torch.full_like(t, 0.125), t)
    return t.to(dtype)


def randint(*shape, lo: int = 0, hi: int = 10, dtype=torch.int64) -> torch.Tensor:
    return torch.randint(lo, hi, shape, dtype=dtype)


def randbool(*shape) -> torch.Tensor:
    return torch.rand(*shape) > 0.5


def edge_floats(*shape, dtype=torch.float32) -> torch.Tensor:
    """:func:`rand` with the float edge values +0, -0, +inf, -inf and NaN in its first elements
    (as many as fit), for samples of lowerings that claim float dtypes."""
    t = rand(*shape).reshape(-1)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])[:t.numel()]
    t[:len(specials)] = specials
    return t.reshape(shape).to(dtype)


def edge_ints(*shape, dtype=torch.int64) -> torch.Tensor:
    """:func:`randint` in [-5, 5) with the i32 boundaries (INT32_MIN, INT32_MAX, -1, 0, 1) in its
    first elements, for samples of lowerings that claim integer dtypes."""
    t = randint(*shape, lo=-5, hi=5, dtype=dtype).reshape(-1)
    bounds = torch.tensor([-2**31, 2**31 - 1, -1, 0, 1], dtype=torch.int64)[:t.numel()]
    t[:len(bounds)] = bounds.to(dtype)
    return t.reshape(shape)


def case_graph(op: str, args: Sequence[Any], kwargs: dict | None = None) -> tuple[Graph, list[torch.Tensor]]:
    """A one-node Graph calling ``op`` on sample arguments (tensors become graph inputs),
    with output metadata taken from running it in torch; returns the graph and its inputs."""
    from tapml.graph import resolve_op
    kwargs = kwargs or {}
    tensors: list[torch.Tensor] = []

    def lift(a):
        if isinstance(a, torch.Tensor):
            tensors.append(a)
            return _Ref(f"x{len(tensors) - 1}")
        if isinstance(a, (list, tuple)):
            return [lift(x) for x in a]
        return a

    largs, lkwargs = lift(list(args)), {k: lift(v) for k, v in kwargs.items()}
    out = resolve_op(op)(*args, **kwargs)
    multi = isinstance(out, (tuple, list))
    outs = list(out) if multi else [out]
    node = Node(name="n0", op=op, args=_enc(largs), kwargs={k: _enc(v) for k, v in lkwargs.items()},
                outputs=[TensorMeta.of(o) for o in outs], multi=multi)
    graph = Graph(inputs=[(f"x{i}", TensorMeta.of(t)) for i, t in enumerate(tensors)], nodes=[node],
                  outputs=node.output_refs)
    return graph, tensors


class _Ref(str):
    pass


def _enc(a):
    if isinstance(a, _Ref):
        return {"ref": str(a)}
    if isinstance(a, list):
        return [_enc(x) for x in a]
    return encode_arg(a, None)


def sample_cases(op: str) -> list[tuple[Graph, list[torch.Tensor]]]:
    """The registry's samples that fit ``op``'s schema, as one-node graphs with inputs.
    An entry's samples may be shared by several overloads; each keeps the ones it accepts."""
    low = REGISTRY[op]
    out = []
    for args, kwargs in (low.samples() if low.samples else []):
        try:
            out.append(case_graph(op, args, kwargs))
        except (RuntimeError, TypeError, IndexError, ValueError, NotImplementedError):
            continue
    return out


__all__ = ["Lowering", "REGISTRY", "FLOPS", "register", "node_flops", "supports_node", "dtype_reason", "case_graph", "rand", "randint",
           "randbool", "edge_floats", "edge_ints", "sample_cases", "low_precision_paths", "ALL", "ALL_FLOAT", "ALL_INT", "NUMERIC"]


# --- coverage, for the README ----------------------------------------------------------------

def core_aten_ops() -> list[str]:
    """Every functional overload torch tags ``core`` that the op vocabulary accepts (sorted).
    From the dispatcher's full list: ``dir(torch.ops.aten)`` lists only the ops resolved so far."""
    from tapml.ops import check_op
    names = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        attr, _, overload = qualified[len("aten::"):].partition(".")
        overload = overload or "default"
        packet = getattr(torch.ops.aten, attr, None)
        op = getattr(packet, overload, None) if packet is not None else None
        if op is None or torch.Tag.core not in op.tags:
            continue
        name = f"aten.{attr}.{overload}"
        try:
            check_op(name)
        except ValueError:
            continue
        names.append(name)
    return sorted(set(names))


def coverage_markdown() -> str:
    """The README's table of lowerings: per family, how many ops take each dtype; then how many
    core ATen overloads are lowered, which are refused by design and which are not lowered yet."""
    from tapml.platforms.wgsl import load_lowerings
    registry = load_lowerings()
    dtypes = ALL_FLOAT + ALL_INT + ("bool", "complex64")
    families: dict[str, list[Lowering]] = {}
    for low in registry.values():
        families.setdefault(low.family.rsplit(".", 1)[-1], []).append(low)
    lines = ["| family | lowerings | " + " | ".join(dtypes) + " |", "|---|---|" + "---|" * len(dtypes)]
    for family, lows in sorted(families.items()) + [("**all**", list(registry.values()))]:
        counts = " | ".join(str(sum(d in low.dtypes for low in lows)) for d in dtypes)
        lines.append(f"| {family} | {len(lows)} | {counts} |")
    core = core_aten_ops()
    by_design = [op for op in core if op not in registry and op in COMPLEX_OPS]
    missing = [op for op in core if op not in registry and op not in COMPLEX_OPS]
    lines += ["", f"{sum(op in registry for op in core)} of the {len(core)} functional core ATen overloads are lowered; "
              f"refused by design: {', '.join(f'`{op}`' for op in by_design) or 'none'}, every "
              "float64 tensor but the constants float32 holds exactly, and complex128; not lowered yet: " + (", ".join(f"`{op}`" for op in missing) or "none") + "."]
    return "\n".join(lines)
