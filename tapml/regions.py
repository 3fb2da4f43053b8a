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

Example::

    checker = RegionChecker(store, platform)
    verdict = checker.compare_region(names, {n: TARGET for n in names})
"""

from __future__ import annotations

from typing import Callable, Iterable

from tapml.compare import Comparison, Tolerances, compare_outputs, compare_tensor, merge
from tapml.graph import Graph, dtype_name
from tapml.hybrid import HybridResult, HybridRunner, reference_values
from tapml.verdict import Verdict, outcome_verdict

#: The step a generation's graph is checked on: the prefill, and the first decode step.
CHECKED_STEP = {"prefill": 0, "decode": 1}


class RegionChecker:
    """Runs sub-regions of a store's model on a platform with reference values at their
    inputs and compares their outputs with the reference. Shared by migrate and the session.

    ``graph`` is the store's model graph unless given (a generation's decode graph), and
    ``inputs()`` returns the reference values of its inputs (the store's program inputs unless
    given)."""

    def __init__(self, store, platform, tolerances: Tolerances | None = None, *, graph: Graph | None = None,
                 inputs: Callable[[], dict] | None = None):
        self.store = store
        self.graph: Graph = store.graph if graph is None else graph
        self._inputs = inputs or store.program_inputs
        self.platform = platform
        self.tolerances = tolerances or Tolerances()
        self.producer = self.graph.producer()
        self.order = {n.name: i for i, n in enumerate(self.graph.nodes)}
        self._ref: dict | None = None
        self._runners: dict[tuple, HybridRunner] = {}

    @property
    def ref(self) -> dict:
        """Every reference value of the model (computed once)."""
        if self._ref is None:
            self._ref = reference_values(self.graph, self._inputs())
        return self._ref

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

    def compare_ref(self, value, ref: str, worst: int = 5) -> Comparison:
        """Compare ``value`` with the reference's value at ``ref``, with the tolerance of the op
        that produces it (``worst``: how many of the worst elements to list)."""
        expected = self.ref[ref]
        op = self.producer[ref].op if ref in self.producer else None
        rtol, atol = self.tolerances.get(op, dtype_name(expected.dtype))
        return compare_tensor(value, expected, rtol, atol, worst=worst)

    def compare(self, values: dict, refs: list[str]) -> tuple[Comparison, str | None]:
        """Compare values at ``refs`` with the reference (see :meth:`compare_ref`); returns the
        merged comparison and the ref of the worst failing output."""
        results, worst_ref, worst_err = [], None, -1.0
        for r in refs:
            c = self.compare_ref(values[r], r)
            results.append(c)
            if not c.passed:
                err = float("inf") if c.max_abs_err is None else c.max_abs_err
                if err > worst_err:
                    worst_ref, worst_err = r, err
        return merge(results), worst_ref

    def compare_region(self, names: list[str], placement: dict[str, str], window: list[str] | None = None) -> Verdict:
        """Run the region made of ``names`` (each placed as ``placement`` says) and return its
        verdict (status, error stats, message, time_ms, worst elements, worst output); a run
        that raises is a verdict too (:func:`~tapml.verdict.outcome_verdict`), DeviceLost is raised.

        The region's outputs are compared with the reference; with ``window`` (a subset of
        ``names``), the values leaving the window are compared too, so an error is pinned
        to the window even where later reference ops would hide it."""
        names = sorted(names, key=self.order.__getitem__)
        runner = self.runner(names)
        sub = runner.graph
        refs = list(sub.outputs)
        if window:
            known = set(refs)
            refs += [r for r in sub.subgraph(window).outputs if r not in known]
        inputs = {r: self.ref[r] for r, _ in sub.inputs}
        try:
            result = runner.run(inputs, placement, keep=refs)
        except Exception as e:  # noqa: BLE001 - a failing region is a verdict, not a crash
            return outcome_verdict(e)
        comparison, worst_ref = self.compare(result.values, refs)
        verdict = outcome_verdict(comparison, round(sum(r.run_ms for r in result.regions), 4))
        verdict.worst_output = worst_ref
        return verdict


def run_model_against_reference(store, runner: HybridRunner, placement: dict[str, str], tolerances: Tolerances,
                keep: Iterable[str] = (), *, inputs: dict | None = None,
                expected: dict | None = None) -> tuple[Verdict, HybridResult | None]:
    """Run the whole model of ``store`` with ``runner`` on ``placement`` and compare its outputs
    with the reference's. Shared by migrate's model stage and :meth:`tapml.session.Session.compare_model`.
    ``inputs`` and ``expected`` (reference outputs by ref) replace the store's program inputs and
    model outputs (a generation's decode step).

    Returns the verdict and the run, which is None when the run raised: a failing run is a
    verdict (:func:`~tapml.verdict.outcome_verdict`), except DeviceLost, which is raised.

    Example::

        verdict, result = run_model_against_reference(store, HybridRunner(store.graph, platform), placement, Tolerances())
        verdict.status  # 'pass'
    """
    try:
        result = runner.run(store.program_inputs() if inputs is None else inputs, placement, keep=keep)
    except Exception as e:  # noqa: BLE001 - a failing model is a verdict, not a crash
        return outcome_verdict(e), None
    expected = store.model_outputs() if expected is None else expected
    c = compare_outputs([result.values[r] for r in expected], list(expected.values()), tolerances=tolerances)
    return outcome_verdict(c, round(sum(r.run_ms for r in result.regions) + result.reference_ms, 4)), result


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
           "common_module", "CHECKED_STEP"]
