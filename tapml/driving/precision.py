"""Where float16/bfloat16 precision runs out: per-op range and error analysis of a low-precision
store on a target, the ops that must stay in float32, and the end-to-end effect of keeping them.

:func:`analyze` runs the store's low-precision graph on the target with every intermediate
kept, and on the CPU three times on the same program inputs: in the low dtype (the reference),
in float32 (the *twin*, :func:`tapml.dtypes.as_float32`: the model's true activations) and in
float64 (the *anchor*). Per node with floating outputs it reports (the Precision JSON,
ARCHITECTURE.md):

- ``max_abs``: the largest finite ``|x|`` of the float32 twin's outputs (the true activation);
- ``headroom``: ``FINITE_MAX[dtype] / max_abs`` (above 1 the activation fits the dtype's finite
  range, below 1 it cannot be held); null when ``max_abs`` is 0;
- ``overflow``: the target's low-precision output is non-finite where the twin's is finite;
- ``absorbed``: the node overflowed but every output of its module (the values the module
  region hands on, :meth:`tapml.graph.Graph.subgraph`) is finite on the target: an Inf that
  vanished (``rsqrt(Inf) = 0``), leaving a finite and wrong result;
- ``err_vs_fp64`` / ``ref_err_vs_fp64``: the largest ``|x - anchor|`` of the target's / the CPU
  low-precision reference's outputs over the elements where both are finite; null when the
  value is non-finite where the anchor is finite (the error is unbounded);
- ``err_vs_fp32``: the same for the target against the twin.

``keep_float32`` lists the nodes whose twin inputs or outputs cannot be held in the dtype (they
round to Inf), then, after running the model with them in float32
(:func:`tapml.dtypes.keep_float32`), the nodes that still overflow, until none does;
``keep_float32_modules`` the modules all of whose floating nodes are kept. ``end_to_end``
compares the model's outputs on the target with the twin's, with the dtype's tolerances,
``before`` and ``after`` keeping that list in float32. When ``after`` fails although no op
needed float32 (every op fits the dtype), ``cause`` names the op whose error against float64
first exceeds the reference's own 4 times (:func:`cause`) and says it is not a precision matter.

Example::

    doc = analyze(CarveStore("stores/llama-fp16"), platform, "wgpu:vulkan")
    doc["keep_float32"], doc["end_to_end"]["after"]["status"]     # ['pow', 'mean', ...], 'pass'
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from tapml.judging.compare import Tolerances, compare_tensor, merge
from tapml.dtypes import FINITE_MAX, LOW_FLOATS, as_float32, graph_dtype, keep_float32, upcast
from tapml.errors import DeviceLost, TapmlError
from tapml.graph import Graph, Node
from tapml.driving.hybrid import TARGET, HybridRunner, reference_values
from tapml.judging.verdict import PRECISION_FORMAT_VERSION
#: Most runs with a growing keep_float32 list (each adds the nodes that still overflow).
MAX_ROUNDS = 4

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def floating_nodes(graph: Graph) -> list[Node]:
    """The nodes with at least one floating output, in topological order: the ones analyzed."""
    return [n for n in graph.nodes if any(m.dtype in _FLOATS for m in n.outputs)]


def _float_refs(node: Node) -> list[str]:
    return [r for r, m in zip(node.output_refs, node.outputs) if m.dtype in _FLOATS]


def _overflowed(value, twin) -> bool:
    """Whether ``value`` is non-finite where ``twin`` is finite."""
    import torch
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point or value.shape != twin.shape:
        return False
    return bool((~torch.isfinite(value) & torch.isfinite(twin)).any())


def _unholdable(twin, dtype: str) -> bool:
    """Whether a finite value of ``twin`` rounds to Inf in ``dtype``."""
    import torch

    from tapml.graph import torch_dtype
    if not isinstance(twin, torch.Tensor) or not twin.dtype.is_floating_point:
        return False
    finite = torch.isfinite(twin)
    return bool((finite & ~torch.isfinite(twin.to(torch_dtype(dtype)))).any())


def _max_abs(twin) -> float | None:
    import torch
    if not isinstance(twin, torch.Tensor) or not twin.dtype.is_floating_point or twin.numel() == 0:
        return None
    finite = twin[torch.isfinite(twin)]
    return float(finite.abs().max()) if finite.numel() else None


def _error(value, anchor) -> tuple[float | None, bool]:
    """(largest |value - anchor| over elements finite in both, whether it is unbounded: ``value``
    non-finite where ``anchor`` is finite)."""
    import torch
    if not isinstance(value, torch.Tensor) or value.shape != anchor.shape or not value.dtype.is_floating_point:
        return None, False
    v, a = value.double(), anchor.double()
    if bool((~torch.isfinite(v) & torch.isfinite(a)).any()):
        return None, True
    both = torch.isfinite(v) & torch.isfinite(a)
    if not bool(both.any()):
        return (0.0 if v.numel() == 0 else None), False
    return float((v - a).abs()[both].max()), False


def _worst(errors: list[tuple[float | None, bool]]) -> float | None:
    if any(unbounded for _, unbounded in errors):
        return None
    found = [e for e, _ in errors if e is not None]
    return max(found) if found else None


def module_members(graph: Graph) -> dict[str, list[str]]:
    """Module path -> names of the nodes it holds (its own and its sub-modules'), for every
    module of the graph including the root ``""`` (the whole model)."""
    members: dict[str, list[str]] = {}
    for n in graph.nodes:
        path = n.module
        while True:
            members.setdefault(path, []).append(n.name)
            if not path:
                break
            path = path.rpartition(".")[0]
    return members


def kept_modules(graph: Graph, keep: Iterable[str]) -> list[str]:
    """The outermost modules all of whose floating nodes are in ``keep``, in execution order."""
    keep = set(keep)
    floating = {n.name for n in floating_nodes(graph)}
    full = [path for path, names in module_members(graph).items()
            if (own := [x for x in names if x in floating]) and set(own) <= keep]
    full_set = set(full)
    return [p for p in full if not p or not any(q in full_set for q in _ancestors(p))]


def _ancestors(path: str) -> list[str]:
    out = []
    while path:
        path = path.rpartition(".")[0]
        out.append(path)
    return out


def resolve_keep(graph: Graph, items: Iterable[str], *, unknown: str = "raise") -> list[str]:
    """Node names for a keep_float32 list, in graph order. An item is a node name, a module path
    (its floating nodes) or an op overload name ``aten.x.y`` (every node of that op), tried in that
    order. ``unknown="raise"``: TapmlError naming an item that is none of these; ``"skip"``: such
    an item is left out (a generation's other graph may have it)."""
    names = {n.name for n in graph.nodes}
    members = module_members(graph)
    floating = {n.name for n in floating_nodes(graph)}
    by_op: dict[str, list[str]] = {}
    for n in graph.nodes:
        by_op.setdefault(n.op, []).append(n.name)
    chosen: set[str] = set()
    for item in items:
        if item in names:
            chosen.add(item)
        elif item in members:
            chosen.update(x for x in members[item] if x in floating)
        elif item in by_op:
            chosen.update(by_op[item])
        elif unknown == "raise":
            raise TapmlError(f"keep_float32 names {item[:80]!r}, which is neither a node, a module nor an op "
                             "(aten.x.y) of the model; `tapml inspect STORE` lists them")
    return [n.name for n in graph.nodes if n.name in chosen]


def read_keep_items(items: Iterable[str]) -> list[str]:
    """``--keep-float32`` items with each path to a Precision JSON (an item ending in ``.json``, or
    naming an existing file) replaced by its ``keep_float32`` and ``keep_float32_modules``, read with
    :func:`tapml.judging.verdict.read_precision_document` (the file may come from anyone). TapmlError
    (exit 2) when such a file cannot be read or is not a precision document."""
    from pathlib import Path

    from tapml.io import read_json_file
    from tapml.judging.verdict import read_precision_document
    out: list[str] = []
    for item in items:
        if item.endswith(".json") or ("/" in item and Path(item).is_file()):
            where = f"--keep-float32 {item}"
            hint = "expected the JSON of `tapml precision --json`"
            doc = read_precision_document(read_json_file(item, where, hint), where, hint)
            out += doc["keep_float32"] + [m for m in doc["keep_float32_modules"] if m]
        else:
            out.append(item)
    return out


def resolve_keep_float32(graphs: dict[str, Graph], items: Iterable[str]) -> dict[str, list[str]]:
    """``--keep-float32`` items (node names, module paths, op names; precision JSON already read
    with :func:`read_keep_items`) resolved in each of ``graphs`` (``{"prefill": g, "decode": g}``
    for a generation, else one graph): ``{kind: node names}``. TapmlError (exit 2) when the graphs
    compute in float32 (nothing to keep) or an item names nothing in any of them."""
    items = list(items)
    if not items:
        return {kind: [] for kind in graphs}
    if all(graph_dtype(g) not in LOW_FLOATS for g in graphs.values()):
        raise TapmlError("--keep-float32 needs a float16/bfloat16 carve: add --dtype float16 (or carve the store "
                         "with it)")
    for item in items:
        if not any(resolve_keep(g, [item], unknown="skip") for g in graphs.values()):
            resolve_keep(next(iter(graphs.values())), [item])  # raises, naming the item
    return {kind: resolve_keep(g, items, unknown="skip") for kind, g in graphs.items()}


def _run_all(graph: Graph, platform, inputs: dict, refs: list[str]) -> dict:
    """Every value in ``refs`` of ``graph`` run wholly on ``platform``."""
    runner = HybridRunner(graph, platform)
    return runner.run(inputs, {n.name: TARGET for n in graph.nodes}, keep=refs).values


def end_to_end(graph: Graph, platform, inputs: dict, twin_outputs: dict, dtype: str,
               tolerances: Tolerances | None = None, values: dict | None = None) -> dict:
    """Run ``graph`` wholly on ``platform`` and compare its outputs with the float32 twin's
    (``twin_outputs``, by ref) with ``dtype``'s tolerances: ``{"status": pass|mismatch|error,
    "max_abs_err", "max_rel_err", "message"}``. ``values``: the outputs of a run already made
    (by ref), compared instead of running again. DeviceLost is raised."""
    tolerances = tolerances or Tolerances()
    try:
        values = _run_all(graph, platform, inputs, []) if values is None else values
    except DeviceLost:
        raise
    except Exception as e:  # noqa: BLE001 - a run that fails is the result, not a crash
        return {"status": "error", "max_abs_err": None, "max_rel_err": None,
                "message": f"{type(e).__name__}: {str(e).strip()[:500]}"}
    results = []
    for ref, expected in twin_outputs.items():
        got = upcast({ref: values[ref]})[ref]
        rtol, atol = tolerances.against_float32(None, dtype, expected) if expected.dtype.is_floating_point \
            else (None, None)
        results.append(compare_tensor(got, expected, rtol, atol))
    c = merge(results)
    return {"status": "pass" if c.passed else "mismatch", "max_abs_err": _finite(c.max_abs_err),
            "max_rel_err": _finite(c.max_rel_err), "message": c.message}


def _finite(x):
    return x if x is None or math.isfinite(x) else None


def analyze(store, platform, target_name: str, *, dtype: str | None = None, tolerances: Tolerances | None = None,
            device: dict | None = None, on_round: Callable[[int, int], None] | None = None) -> dict:
    """The precision analysis of ``store`` (carved in float16 or bfloat16) on ``platform``: the
    Precision JSON (module docstring; ARCHITECTURE.md). ``dtype`` is checked against the store's;
    ``device`` (the platform's caps) goes into the document as it is; ``on_round(round, kept)``
    is called before each run with a keep_float32 list. TapmlError (exit 2) when the store is not
    low precision or the target cannot run its graph; DeviceLost is raised."""
    graph: Graph = store.graph
    low = graph_dtype(graph)
    if low not in LOW_FLOATS:
        raise TapmlError(f"{store.model} was carved in float32: precision analysis needs a float16/bfloat16 carve "
                         f"(tapml carve MODEL --dtype float16)")
    if dtype is not None and dtype != low:
        raise TapmlError(f"the store holds a {low} model, not {dtype}; pass --dtype {low} or carve it in {dtype}")
    inputs = store.program_inputs()
    twin = reference_values(as_float32(graph, low), upcast(inputs, low))
    anchor = reference_values(as_float32(graph, low, to="float64"), upcast(inputs, low, to="float64"))
    ref_low = reference_values(graph, inputs)
    nodes = floating_nodes(graph)
    refs = [r for n in nodes for r in _float_refs(n)]
    try:
        values = _run_all(graph, platform, inputs, refs)
    except DeviceLost:
        raise
    except Exception as e:  # noqa: BLE001 - the target cannot run the model: nothing to measure
        raise TapmlError(f"{target_name} cannot run the {low} model of {store.model}: {type(e).__name__}: "
                         f"{str(e).strip()[:300]}; `tapml replay STORE --target {target_name}` shows which op "
                         "fails") from None

    overflow = {n.name for n in nodes if any(_overflowed(values[r], twin[r]) for r in _float_refs(n))}
    module_outputs = _module_outputs(graph)
    ops = []
    for n in nodes:
        rs = _float_refs(n)
        maxima = [m for m in (_max_abs(twin[r]) for r in rs) if m is not None]
        max_abs = max(maxima) if maxima else None
        absorbed = n.name in overflow and not any(
            _overflowed(values[r], twin[r]) for r in module_outputs[n.module] if r in values)
        ops.append({"op": n.op, "node": n.name, "module": n.module, "max_abs": max_abs,
                    "headroom": FINITE_MAX[low] / max_abs if max_abs else None,
                    "overflow": n.name in overflow, "absorbed": absorbed,
                    "err_vs_fp64": _worst([_error(values[r], anchor[r]) for r in rs]),
                    "ref_err_vs_fp64": _worst([_error(ref_low[r], anchor[r]) for r in rs]),
                    "err_vs_fp32": _worst([_error(values[r], twin[r]) for r in rs])})

    keep = {n.name for n in nodes
            if any(_unholdable(twin[r], low) for r in _float_refs(n) + [x for x in n.input_refs if x in twin])}
    rounds = 0
    last_run: tuple[frozenset, dict] | None = None  # the keep list of the last mixed run, and its values
    while keep and rounds < MAX_ROUNDS:
        rounds += 1
        if on_round:
            on_round(rounds, len(keep))
        mixed = keep_float32(graph, keep, low)
        try:
            kept_values = _run_all(mixed, platform, inputs, refs)
        except DeviceLost:
            raise
        except Exception:  # noqa: BLE001 - the mixed model fails to run: end_to_end "after" says how
            break
        last_run = (frozenset(keep), kept_values)
        still = {n.name for n in nodes if n.name not in keep
                 and any(_overflowed(kept_values[r], twin[r]) for r in _float_refs(n))}
        if not still:
            break
        keep |= still
    keep_list = [n.name for n in graph.nodes if n.name in keep]
    twin_outputs = {r: twin[r] for r in graph.outputs}
    # the run that measured every op is the model's own run: its outputs are "before"
    before = end_to_end(graph, platform, inputs, twin_outputs, low, tolerances, values=values)
    reuse = last_run[1] if last_run is not None and last_run[0] == keep else None
    after = end_to_end(keep_float32(graph, keep, low), platform, inputs, twin_outputs, low, tolerances, values=reuse) \
        if keep else dict(before)
    doc = {"format_version": PRECISION_FORMAT_VERSION, "kind": "precision", "model": store.model, "dtype": low,
           "target": target_name, "device": device, "ops": ops, "keep_float32": keep_list,
           "keep_float32_modules": kept_modules(graph, keep), "rounds": rounds,
           "end_to_end": {"before": before, "after": after}}
    if after["status"] == "mismatch" and not keep and (found := cause(ops, low)):
        doc["cause"] = {**found, "message": cause_message(found, low, target_name)}
    return doc


#: An op stands out as the cause when its error against float64 exceeds this many times the
#: low-precision reference's own (fp64-anchored judging's factor, tapml.judging.compare.ANCHOR_FACTOR).
CAUSE_FACTOR = 4.0


def cause(ops: list[dict], dtype: str) -> dict | None:
    """The op where the target's error against float64 first exceeds the low-precision
    reference's own :data:`CAUSE_FACTOR` times (``ops``: the Precision JSON's entries, in graph
    order), as ``{"op", "node", "module", "err_vs_fp64", "ref_err_vs_fp64", "ratio"}``; None when
    no op does. The first, not the largest: the target runs the whole model, so a wrong op's
    error flows into every op after it, where it may grow. The reference's error counts as at
    least one rounding of the op's largest value (``u max|x|``), so an op the reference gets
    exactly is not blamed for its own rounding."""
    from tapml.judging.compare import UNIT_ROUNDOFF
    u = UNIT_ROUNDOFF[dtype]
    for entry in ops:
        err, ref = entry["err_vs_fp64"], entry["ref_err_vs_fp64"]
        if err is None or ref is None:
            continue
        ratio = err / max(ref, u * (entry["max_abs"] or 0.0), 1e-30)
        if ratio > CAUSE_FACTOR:
            return {**{k: entry[k] for k in ("op", "node", "module", "err_vs_fp64", "ref_err_vs_fp64")},
                    "ratio": ratio}
    return None


def cause_message(found: dict, dtype: str, target: str) -> str:
    """What :func:`cause` found, said to the user: not a precision matter, and what to run."""
    return (f"every op fits {dtype}, yet the model fails end to end: {found['op']} ({found['node']}) errs "
            f"{found['err_vs_fp64']:.3g} against float64, {found['ratio']:.3g}x the {dtype} reference's own error "
            f"({found['ref_err_vs_fp64']:.3g}). This is not a precision matter but a wrong result on {target}: run "
            f"`tapml migrate STORE --target {target}` to find the op that is wrong")


def _module_outputs(graph: Graph) -> dict[str, list[str]]:
    """Module path -> the refs its region hands on (read outside it, or model outputs)."""
    out = {}
    for path, names in module_members(graph).items():
        out[path] = graph.subgraph(names).outputs
    return out


def passed(doc: dict) -> bool:
    """Whether the model passes end to end with the document's keep_float32 list applied."""
    return doc["end_to_end"]["after"]["status"] == "pass"


__all__ = ["analyze", "cause", "cause_message", "CAUSE_FACTOR", "end_to_end", "floating_nodes", "kept_modules", "module_members", "resolve_keep",
           "read_keep_items", "resolve_keep_float32", "passed",
           "PRECISION_FORMAT_VERSION", "MAX_ROUNDS"]
