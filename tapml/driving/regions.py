"""Regions of a model on a target: run part of the model (or all of it) with the reference's
values at its inputs and compare its outputs with the reference's. Shared by migrate's region
and model stages and by the session.

- :class:`RegionChecker` runs a sub-region on a hybrid placement and judges it
  (:meth:`~RegionChecker.compare_region`);
- :func:`run_model_against_reference` runs the whole model and compares end to end;
- :func:`decode_step_inputs` are the inputs a generation's decode graph is checked on;
- :func:`bisect` finds the smallest failing window of nodes;
- :func:`module_regions` lists the regions of the module tree, children before parents;
- :func:`common_module` is the deepest module holding a set of nodes.

A store carved in float16 or bfloat16 (``--dtype``) is judged against *the same model in
float32* (what a port must preserve), with the tolerances of the low dtype: a region's
expected outputs are its subgraph's float32 twin (:func:`tapml.dtypes.as_float32`) run on the
CPU from the region's recorded low-precision inputs, upcast (errors made upstream are not the
region's); the whole model's, the twin of its graph on the upcast program inputs. So a model
that overflows in float16 fails even where the CPU reference overflows the same way.

Example::

    checker = RegionChecker(store, platform)
    verdict = checker.compare_region(names, {n: TARGET for n in names})
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from tapml.judging.compare import (Comparison, Tolerances, agreement_note, anchored_rule, compare_outputs, compare_tensor,
                                   is_random_op, is_uninitialized_op, logits_agreement, merge)
from tapml.dtypes import LOW_FLOATS, as_float32, upcast
from tapml.graph import Graph, dtype_name, run_graph
from tapml.driving.hybrid import HybridResult, HybridRunner, reference_values
from tapml.driving.profile import measured
from tapml.judging.verdict import Verdict, outcome_verdict

#: The step a generation's graph is checked on: the prefill, and the first decode step.
CHECKED_STEP = {"prefill": 0, "decode": 1}
#: Said after a failing comparison of a low-precision store: what it was compared with.
AGAINST_FLOAT32 = "against the model in float32"


def random_nodes(graph: Graph) -> set[str]:
    """Names of the nodes of ``graph`` that draw random values (:func:`tapml.judging.compare.is_random_op`).

    Their values differ from the reference's by design, and so would everything computed from
    them: in a region or whole-model run they are *pinned*, kept on the reference with the
    values of the very reference run the outputs are compared with (they become inputs of the
    run), while each is checked alone, by distribution, in the op stage."""
    return {n.name for n in graph.nodes if is_random_op(n.op)}


def pinned_note(graph: Graph, pinned: Iterable[str]) -> str:
    """What a region or model verdict says about the random nodes it pinned ("" for none)."""
    ops: dict[str, int] = {}
    names = set(pinned)
    for n in graph.nodes:
        if n.name in names:
            ops[n.op] = ops.get(n.op, 0) + 1
    if not ops:
        return ""
    listed = ", ".join(f"{op} x{k}" if k > 1 else op for op, k in ops.items())
    return (f"random ops kept on the reference, their reference values fed in ({listed}): a random op is "
            "compared on shape, dtype and distribution, alone, never by value")


def _with_note(message: str, note: str) -> str:
    return f"{message}; {note}" if message and note else message or note


def low_dtype(store) -> str | None:
    """The low float dtype (``float16``/``bfloat16``) ``store`` was carved in, else None."""
    dtype = getattr(store, "dtype", "float32")
    return dtype if dtype in LOW_FLOATS else None


def float32_twin_values(graph: Graph, inputs: dict, refs: Iterable[str], dtype: str, to: str = "float32") -> dict:
    """The values at ``refs`` of ``graph``'s float32 twin run on the CPU from ``inputs`` (the
    low-precision values at the graph's inputs, upcast here). ``dtype="float32", to="float64"``:
    a float32 graph's float64 anchor (:func:`float64_anchor_values`)."""
    import torch
    twin = as_float32(graph, dtype, to=to)
    wanted = Graph(inputs=twin.inputs, nodes=twin.nodes, outputs=list(dict.fromkeys(refs)))
    with torch.no_grad():
        return run_graph(wanted, upcast({r: inputs[r] for r, _ in graph.inputs}, dtype, to=to))


def float64_anchor_values(graph: Graph, inputs: dict, refs: Iterable[str]) -> dict | None:
    """The values at ``refs`` of a float32 ``graph`` recomputed in float64 from ``inputs`` (its
    float32 values, upcast), or None where the CPU cannot run it in float64."""
    try:
        return float32_twin_values(graph, inputs, refs, "float32", to="float64")
    except Exception:  # noqa: BLE001 - an op torch refuses in float64: judged by the tolerances alone
        return None


def judge_anchored(value, expected, anchor, tolerances: Tolerances, op: str | None, worst: int = 5,
                   own=None) -> Comparison:
    """A float32 ``value`` against the reference's ``expected``: within the tolerances, or no
    further from the float64 result ``anchor`` than :data:`~tapml.judging.compare.ANCHOR_FACTOR` times
    the reference's own largest error plus the float32 floor (a target more accurate than the
    reference never fails; :func:`tapml.judging.compare.anchored_rule`), plus ``own``: the arithmetic
    bound of the op that makes the value (:func:`producer_bound`), the rounding a correct kernel
    adds there whatever order it sums in."""
    rtol, atol = tolerances.get(op, dtype_name(expected.dtype))
    rules = []
    if expected.is_floating_point() and anchor is not None and anchor.shape == expected.shape:
        rule = anchored_rule(expected, anchor)
        if own is not None:
            rule.allowed = own + rule.allowed
            rule.why += ", plus the arithmetic bound of the op that makes it"
        rules.append(rule)
    return compare_tensor(value, expected, rtol, atol, worst=worst, rules=rules)


def producer_bound(node, value_of) -> torch.Tensor | None:
    """The arithmetic bound (:func:`tapml.judging.compare.arithmetic_bounds`, float32) of ``node``'s first
    output computed from its reference inputs (``value_of(ref)``) in float64; None where its op
    is not a sum of products (:data:`~tapml.judging.compare.DECIDED_BY_BOUND`) or the bound cannot be had."""
    from tapml.judging.compare import DECIDED_BY_BOUND, arithmetic_bounds
    from tapml.graph import decode_arg, resolve_op
    if node is None or node.op not in DECIDED_BY_BOUND:
        return None

    def wide(ref):
        t = value_of(ref)
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    try:
        args = decode_arg(node.args, wide)
        kwargs = {k: decode_arg(v, wide) for k, v in node.kwargs.items()}
        with torch.no_grad():
            out = resolve_op(node.op)(*args, **kwargs)
            out = [out] if isinstance(out, torch.Tensor) else list(out)
            return arithmetic_bounds(node.op, args, kwargs, out, "float32")[0]
    except Exception:  # noqa: BLE001 - arguments the bound cannot read: the anchored rule alone
        return None


def judge_low(value, expected, dtype: str, tolerances: Tolerances, op: str | None, worst: int = 5) -> Comparison:
    """Compare a target's low-precision ``value`` (upcast) with the float32 twin's ``expected``
    with the tolerances of the low ``dtype`` (integers and bools stay exact)."""
    value = next(iter(upcast({"v": value}, dtype).values()))
    rtol, atol = tolerances.against_float32(op, dtype, expected) if expected.is_floating_point() else \
        tolerances.get(op, dtype_name(expected.dtype))
    c = compare_tensor(value, expected, rtol, atol, worst=worst)
    if c.message:
        c.message = f"{c.message} ({AGAINST_FLOAT32})"
    return c


class RegionChecker:
    """Runs sub-regions of a store's model on a platform with reference values at their
    inputs and compares their outputs with the reference. Shared by migrate and the session.

    ``graph`` is the store's model graph unless given (a generation's decode graph), and
    ``inputs()`` returns the reference values of its inputs (the store's program inputs unless
    given). In a float16/bfloat16 store, outputs are judged against the float32 twin (see the
    module's docstring); ``ref`` stays the low-precision run whose values feed each region."""

    def __init__(self, store, platform, tolerances: Tolerances | None = None, *, graph: Graph | None = None,
                 inputs: Callable[[], dict] | None = None, clock=None):
        self.store = store
        self.graph: Graph = store.graph if graph is None else graph
        self._inputs = inputs or store.program_inputs
        self.platform = platform
        self.tolerances = tolerances or Tolerances()
        self.producer = self.graph.producer()
        self.order = {n.name: i for i, n in enumerate(self.graph.nodes)}
        self._ref: dict | None = None
        self._ref32: dict | None = None
        self._runners: dict[tuple, HybridRunner] = {}
        #: The store's low float dtype, None for float32 (judged against the reference itself).
        self.low = low_dtype(store)
        #: A :class:`tapml.driving.profile.StageClock` given the seconds of the reference runs and comparisons, or None.
        self.clock = clock
        #: Nodes that draw random values: pinned to the reference's values in every region (:func:`random_nodes`).
        self.random = random_nodes(self.graph)

    @property
    def ref(self) -> dict:
        """Every reference value of the model (computed once)."""
        if self._ref is None:
            with measured(self.clock, "reference"):
                self._ref = reference_values(self.graph, self._inputs())
        return self._ref

    @property
    def ref32(self) -> dict:
        """Every value of the model's float32 twin run from the upcast graph inputs (computed
        once; a float16/bfloat16 store only): what a value in a whole hybrid run is judged by."""
        if self._ref32 is None:
            inputs = {r: self.ref[r] for r, _ in self.graph.inputs}
            self._ref32 = {**upcast(inputs, self.low),
                           **float32_twin_values(self.graph, inputs, [r for n in self.graph.nodes
                                                                      for r in n.output_refs], self.low)}
        return self._ref32

    def input_values(self) -> dict:
        """The reference's values at the graph's inputs: the very tensors of :attr:`ref` once it
        is computed (so a run reuses what the device already holds instead of reading the
        parameters again), else read from the store."""
        values = self._ref if self._ref is not None else self._inputs()
        return {r: values[r] for r, _ in self.graph.inputs}

    def model_io(self) -> tuple[dict, dict]:
        """The reference's values at the graph's inputs and at its outputs: what a whole run of a
        graph other than the store's model (a generation's decode step) is fed and judged by
        (``inputs`` and ``expected`` of :func:`run_model_against_reference`)."""
        return {r: self.ref[r] for r, _ in self.graph.inputs}, {r: self.ref[r] for r in self.graph.outputs}

    def runner(self, names: list[str]) -> HybridRunner:
        """The (cached) runner of the region made of ``names``, in topological order."""
        key = tuple(names)
        if key not in self._runners:
            self._runners[key] = HybridRunner(self.graph.subgraph(names), self.platform)
        return self._runners[key]

    def compare_ref(self, value, ref: str, worst: int = 5, expected=None, anchor=None) -> Comparison:
        """Compare ``value`` with the reference's value at ``ref``, with the tolerance of the op
        that produces it (``worst``: how many of the worst elements to list). In a
        float16/bfloat16 store the reference is the float32 twin's value (``expected``, else
        :attr:`ref32`), with the low dtype's tolerance."""
        op = self.producer[ref].op if ref in self.producer else None
        if self.low is not None:
            return judge_low(value, self.ref32[ref] if expected is None else expected, self.low, self.tolerances,
                             op, worst)
        own = producer_bound(self.producer[ref], self.ref.__getitem__) if anchor is not None and \
            ref in self.producer and ref == self.producer[ref].output_refs[0] else None
        return judge_anchored(value, self.ref[ref], anchor, self.tolerances, op, worst, own)

    def compare(self, values: dict, refs: list[str], expected: dict | None = None,
                anchors: dict | None = None) -> tuple[Comparison, str | None]:
        """Compare values at ``refs`` with the reference (see :meth:`compare_ref`; ``expected``:
        the float32 twin's values by ref, in a low-precision store; ``anchors``: the float64
        values by ref, in a float32 store); returns the merged comparison and the ref of the
        worst failing output."""
        results, worst_ref, worst_err = [], None, -1.0
        for r in refs:
            c = self.compare_ref(values[r], r, expected=None if expected is None else expected[r],
                                 anchor=None if anchors is None else anchors.get(r))
            results.append(c)
            if not c.passed:
                err = float("inf") if c.max_abs_err is None else c.max_abs_err
                if err > worst_err:
                    worst_ref, worst_err = r, err
        return merge(results), worst_ref

    def _reference_note(self, refs: list[str], expected: dict) -> str:
        """Where the CPU reference in the low dtype misses the float32 twin too: a note saying
        so (the dtype's own error, whatever the target does), else nothing."""
        own = merge([judge_low(self.ref[r], expected[r], self.low, self.tolerances, None, worst=0) for r in refs])
        if own.passed:
            return ""
        err = "inf" if own.max_abs_err is None else f"{own.max_abs_err:.3g}"
        return f"; the {self.low} reference itself misses float32 there too (max_abs_err {err}): {self.low}'s own error"

    def compare_region(self, names: list[str], placement: dict[str, str], window: list[str] | None = None) -> Verdict:
        """Run the region made of ``names`` (each placed as ``placement`` says) and return its
        verdict (status, error stats, message, time_ms, worst elements, worst output); a run
        that raises is a verdict too (:func:`~tapml.judging.verdict.outcome_verdict`), DeviceLost is raised.

        The region's outputs are compared with the reference; with ``window`` (a subset of
        ``names``), the values leaving the window are compared too, so an error is pinned
        to the window even where later reference ops would hide it. Random nodes among ``names``
        are pinned to the reference's values (:func:`random_nodes`), and the verdict says so."""
        names = sorted(names, key=self.order.__getitem__)
        pinned = [n for n in names if n in self.random]
        if pinned:
            names = [n for n in names if n not in self.random]
            window = window and [n for n in window if n not in self.random]
            if not names:
                return Verdict(status="pass", message=pinned_note(self.graph, pinned) + "; nothing else to run here")
        verdict = self._compare_region(names, placement, window)
        verdict.message = _with_note(verdict.message, pinned_note(self.graph, pinned))
        return verdict

    def _compare_region(self, names: list[str], placement: dict[str, str], window: list[str] | None) -> Verdict:
        runner = self.runner(names)
        sub = runner.graph
        refs = list(sub.outputs)
        if window:
            known = set(refs)
            refs += [r for r in sub.subgraph(window).outputs if r not in known]
        # uninitialized memory leaving the region (torch.empty for a later random fill): any value is right
        arbitrary = {n.name for n in sub.nodes if is_uninitialized_op(n.op)}
        refs = [r for r in refs if r.split("#")[0] not in arbitrary]
        inputs = {r: self.ref[r] for r, _ in sub.inputs}
        try:
            result = runner.run(inputs, placement, keep=refs)
        except Exception as e:  # noqa: BLE001 - a failing region is a verdict, not a crash
            return outcome_verdict(e)
        # Low precision: the region's own float32 twin from its recorded inputs, not the twin's
        # whole run (errors accumulated upstream are not the region's).
        with measured(self.clock, "reference"):
            expected = None if self.low is None else float32_twin_values(sub, inputs, refs, self.low)
        with measured(self.clock, "compare"):
            comparison, worst_ref = self.compare(result.values, refs, expected)
            if expected is not None and not comparison.passed:
                comparison.message += self._reference_note(refs, expected)
        if expected is None and not comparison.passed:  # float32: judged against float64 too
            with measured(self.clock, "reference"):
                anchors = float64_anchor_values(sub, inputs, refs)
            if anchors is not None:
                with measured(self.clock, "compare"):
                    comparison, worst_ref = self.compare(result.values, refs, anchors=anchors)
        verdict = outcome_verdict(comparison, round(sum(r.run_ms for r in result.regions), 4))
        verdict.worst_output = worst_ref
        return verdict


def run_model_against_reference(store, runner: HybridRunner, placement: dict[str, str], tolerances: Tolerances,
                keep: Iterable[str] = (), *, inputs: dict | None = None,
                expected: dict | None = None, clock=None) -> tuple[Verdict, HybridResult | None]:
    """Run the whole model of ``store`` with ``runner`` on ``placement`` and compare its outputs
    with the reference's. Shared by migrate's model stage and :meth:`tapml.driving.session.Session.compare_model`.
    ``inputs`` and ``expected`` (reference outputs by ref) replace the store's program inputs and
    model outputs (a generation's decode step). In a float16/bfloat16 store the outputs (those
    ``expected`` names) are judged against the float32 twin of the graph run on the upcast inputs,
    with the low dtype's tolerances. ``clock``: a :class:`tapml.driving.profile.StageClock` given the
    comparison's seconds.

    Returns the verdict and the run, which is None when the run raised: a failing run is a
    verdict (:func:`~tapml.judging.verdict.outcome_verdict`), except DeviceLost, which is raised.

    Example::

        verdict, result = run_model_against_reference(store, HybridRunner(store.graph, platform), placement, Tolerances())
        verdict.status  # 'pass'
    """
    inputs = store.program_inputs() if inputs is None else inputs
    pinned = random_nodes(runner.graph)
    if pinned:
        # values drawn at random can be compared only with the run that drew them: one reference
        # run gives the random nodes' values (fed in) and the outputs they are judged by
        graph = runner.graph
        try:
            with measured(clock, "reference"):
                ref = reference_values(graph, inputs)
        except Exception as e:  # noqa: BLE001 - a model the reference cannot run is a verdict, not a crash
            return outcome_verdict(e), None
        wanted = list(expected) if expected is not None else list(store.model_outputs())
        runner = HybridRunner(graph.subgraph([n.name for n in graph.nodes if n.name not in pinned]), runner.platform)
        inputs = {r: ref[r] for r, _ in runner.graph.inputs}
        expected = {r: ref[r] for r in wanted if r in set(runner.graph.outputs)}
    verdict, result = _run_and_compare(store, runner, placement, tolerances, keep, inputs, expected, clock)
    if pinned:
        verdict.message = _with_note(verdict.message, pinned_note(graph, pinned))
    return verdict, result


def _run_and_compare(store, runner: HybridRunner, placement: dict[str, str], tolerances: Tolerances,
                     keep: Iterable[str], inputs: dict, expected: dict | None,
                     clock) -> tuple[Verdict, HybridResult | None]:
    try:
        result = runner.run(inputs, placement, keep=keep)
    except Exception as e:  # noqa: BLE001 - a failing model is a verdict, not a crash
        return outcome_verdict(e), None
    expected = store.model_outputs() if expected is None else expected
    low = low_dtype(store)
    twin = None
    with measured(clock, "compare"):
        if low is None:
            c = compare_outputs([result.values[r] for r in expected], list(expected.values()), tolerances=tolerances)
            if not c.passed:
                c = _judge_model_anchored(runner.graph, inputs, result.values, expected, tolerances, c)
        else:
            twin = float32_twin_values(runner.graph, inputs, expected, low)
            c = merge([judge_low(result.values[r], twin[r], low, tolerances, None) for r in expected])
        agreement = _logits_agreement(store, runner.graph, result.values, twin or expected, tolerances)
    verdict = outcome_verdict(c, round(sum(r.run_ms for r in result.regions) + result.reference_ms, 4))
    if agreement is not None:
        verdict.distribution = agreement
        if agreement["status"] != "pass" and verdict.status == "pass":
            verdict.status = "mismatch"
        if agreement["status"] != "pass" or verdict.status != "pass":
            verdict.message = _with_note(verdict.message, agreement_note(agreement))
    return verdict, result


def is_quantized(store, graph: Graph) -> bool:
    """Whether the model is a quantized one: carved with ``--quantize``, or holding packed-weight
    ops (a GGUF file's blocks)."""
    from tapml.quant import packed_op_name
    return getattr(store, "quantize", None) is not None or any(packed_op_name(n.op) for n in graph.nodes)


def logits_output(graph: Graph, refs: Iterable[str]) -> str | None:
    """The output of ``refs`` a model's logits are: the first floating one with a last dimension of
    more than one that is no state of the graph (a generation's cache); None when there is none."""
    meta, state = graph.meta, set(graph.state.values())
    for ref in refs:
        m = meta.get(ref)
        if m is not None and ref not in state and m.dtype in ("float32", "float16", "bfloat16") \
                and len(m.shape) >= 1 and m.shape[-1] > 1:
            return ref
    return None


def _logits_agreement(store, graph: Graph, values: dict, expected: dict, tolerances: Tolerances) -> dict | None:
    """A quantized model's logits (:func:`logits_output`) judged as distributions against ``expected``
    (:func:`tapml.judging.compare.logits_agreement`); None for a model that is not quantized or has none."""
    if not is_quantized(store, graph):
        return None
    ref = logits_output(graph, expected)
    if ref is None or ref not in values or tuple(values[ref].shape) != tuple(expected[ref].shape):
        return None  # no logits, or of another shape (the comparison has said so)
    rtol, atol = tolerances.get(None, dtype_name(expected[ref].dtype))
    return logits_agreement(values[ref].to(expected[ref].dtype), expected[ref], rtol, atol)


def _judge_model_anchored(graph: Graph, inputs: dict, values: dict, expected: dict, tolerances: Tolerances,
                          plain: Comparison) -> Comparison:
    """A float32 model's outputs judged against float64 too (:func:`judge_anchored`, with the
    arithmetic bound of the op that makes each output); ``plain`` where float64 cannot be had."""
    producer = graph.producer()
    makers = {r: producer[r] for r in expected if r in producer and producer[r].output_refs[0] == r}
    needed = [i for n in makers.values() for i in n.input_refs]
    anchors = float64_anchor_values(graph, inputs, list(expected) + needed)
    if anchors is None:
        return plain
    value_of = {**inputs, **anchors}.__getitem__
    return merge([judge_anchored(values[r], e, anchors[r], tolerances, None, own=producer_bound(makers.get(r), value_of))
                  for r, e in expected.items()])


def decode_step_inputs(store, prefill_ref: dict | None = None) -> dict:
    """The inputs a generation's decode graph is checked on (by migrate and the session): its
    parameters, the token and position of the first decode step, and the reference's cache after
    the prefill. ``prefill_ref`` is the prefill graph's reference values (computed when not given)."""
    prefill = store.step_graph("prefill")
    if prefill_ref is None:
        prefill_ref = reference_values(prefill, store.program_inputs("prefill"))
    cache = {name: prefill_ref[ref] for name, ref in prefill.state.items()}
    return {**store.program_inputs("decode"), **store.step_inputs(CHECKED_STEP["decode"]), **cache}


def bisect(names: list[str], fails: Callable[[list[str]], bool]) -> list[str]:
    """The smallest failing window of ``names`` (a failing sequence in topological order).

    Halves while one half fails on its own; when neither half does (the failure needs both,
    as accumulated error does), shrinks the window from each end by binary search. Each step
    costs one ``fails`` call: O(log n) in all.
    """
    while len(names) > 1:
        mid = len(names) // 2
        left, right = names[:mid], names[mid:]
        if fails(left):
            names = left
        elif fails(right):
            names = right
        else:
            lo, hi = 0, mid  # names[lo:] fails, names[hi:] does not
            while hi - lo > 1:
                m = (lo + hi) // 2
                lo, hi = (m, hi) if fails(names[m:]) else (lo, m)
            names = names[lo:]
            lo, hi = mid - lo, len(names)  # names[:lo] does not fail, names[:hi] does
            while hi - lo > 1:
                m = (lo + hi) // 2
                lo, hi = (lo, m) if fails(names[:m]) else (m, hi)
            return names[:hi]
    return names


def module_regions(graph: Graph) -> list[tuple[str, list[str]]]:
    """(module path, node names) for every module of the model, children before their parent
    (post-order, siblings in execution order); a module with the same nodes as one already
    listed is left out. The root module (path ``""``) comes last: the whole model."""
    members: dict[str, list[str]] = {}
    first: dict[str, int] = {}
    children: dict[str, set[str]] = {}
    for i, n in enumerate(graph.nodes):
        path = n.module
        while True:
            members.setdefault(path, []).append(n.name)
            first.setdefault(path, i)
            if not path:
                break
            parent = path.rpartition(".")[0]
            children.setdefault(parent, set()).add(path)
            path = parent
    out, seen = [], set()

    def visit(path: str) -> None:
        for child in sorted(children.get(path, ()), key=first.__getitem__):
            visit(child)
        key = tuple(members[path])
        if key not in seen:
            seen.add(key)
            out.append((path, members[path]))

    visit("")
    return out


def common_module(paths: list[str]) -> str:
    """The deepest module path that contains every one of ``paths``: ``["a.b.c", "a.b.d"]`` -> ``"a.b"``."""
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


__all__ = ["RegionChecker", "run_model_against_reference", "decode_step_inputs", "bisect", "module_regions",
           "random_nodes", "pinned_note",
           "common_module", "low_dtype", "float32_twin_values", "judge_low", "CHECKED_STEP", "AGAINST_FLOAT32"]
