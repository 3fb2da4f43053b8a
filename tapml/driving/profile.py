"""Per-op speed on real shapes: device time, GFLOP/s and GB/s of each carved case, and the
cases that got slower than a baseline (``tapml replay --profile [--baseline OLD.json]``).

A case's device time is the median of several runs of its compiled program: GPU timestamps
around the program's compute pass where the device has ``timestamp-query`` (``timing``
``"timestamp"``), else the host clock around the kernels with the inputs resident
(``benchmark``), else around whole runs, transfers included (``timing`` ``"wall"``). FLOPs come
from the lowering registry's per-op facts (:func:`tapml.platforms.wgsl.registry.node_flops`);
bytes are what the program's kernels bind: each kernel reads or writes every buffer it binds
once.

A case is ``slower`` than its baseline when its device time exceeds the baseline's by more
than ``slower_than`` percent *and* by at least ``min_diff_ms`` (tiny kernels jitter by more
than 100% on a loaded machine), and still does in repeated timings beside control cases, with
a sign test saying it is not luck (:func:`slower_cases`): a real slowdown persists, a burst of
load on a shared machine does not.

Example::

    speed = profile_program(platform, program, inputs, graph)   # {"device_ms", "gflops", ...}
    slower = slower_cases(new_doc, VerdictDocument.read("old.json", what="--baseline"))
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager, nullcontext
from typing import Callable

from tapml.errors import TapmlError

#: Runs per measurement (their median is the case's device time).
RUNS = 5
#: Default threshold of ``--slower-than``, percent.
SLOWER_THAN = 25.0
#: A case must be at least this much slower (ms) to count: below it, timer and load noise rule
#: (on a shared 2-core machine a 0.14 ms kernel was measured at 0.30 ms with nothing changed).
MIN_DIFF_MS = 0.5
#: Rounds of timings of a case that looks slower (each ``RUNS`` runs, beside the control cases).
ROUNDS = 4
#: Control cases timed in each round: their ratio to their baseline is the machine's load then.
CONTROLS = 3
#: A case is slower only when the sign test's chance of its timings by luck is at most this.
MAX_P = 0.01
BASELINE_HINT = "pass a file written by `tapml replay --profile --json`"


def runtime_of(platform):
    """The platform that runs programs under wrappers such as fault injection (``inner``)."""
    seen = 0
    while getattr(platform, "inner", None) is not None and seen < 8:
        platform, seen = platform.inner, seen + 1
    return platform


def device_times(platform, program, inputs: list, runs: int = RUNS) -> tuple[list[float], str]:
    """Milliseconds of ``runs`` runs of a compiled ``program`` and how they were taken
    (``"timestamp"`` or ``"wall"``); see the module's docstring for which clock is used."""
    runtime = runtime_of(platform)
    if callable(getattr(runtime, "device_times", None)):
        return runtime.device_times(program, inputs, runs)
    platform.run(program, inputs)  # warm-up: compile, upload
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        platform.run(program, inputs)
        times.append((time.perf_counter() - start) * 1e3)
    return times, "wall"


def program_bytes(program) -> int:
    """Bytes a program's kernels move: the size of every buffer each kernel binds (read or written)."""
    sizes = {b.name: b.size for b in getattr(program, "buffers", [])}
    kernels = getattr(program, "kernels", [])
    if not kernels:  # a graph program (the reference): its inputs are read and outputs written once
        meta = list(getattr(program, "input_meta", [])) + list(getattr(program, "output_meta", []))
        return sum(m.numel * _itemsize(m.dtype) for m in meta)
    return sum(window[1] if window else sizes.get(name, 0) for k in kernels for name, _access, *window in k.bindings)


def _itemsize(dtype: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "uint64": 8, "bool": 1, "uint8": 1, "int8": 1,
            "int16": 2}.get(dtype, 4)


def graph_flops(graph) -> int:
    """Rough FLOPs of a graph: the registry's count of each node."""
    from tapml.platforms.wgsl.registry import node_flops
    return sum(node_flops(n, graph.meta) for n in graph.nodes)


def shapes_text(graph) -> str:
    """The input shapes of a case, as ``tapml inspect`` writes them (``16x64,64x128``): with the
    op, what identifies a case across stores."""
    return ",".join("x".join(map(str, m.shape)) or "()" for _, m in graph.inputs)


def device_roofline(platform) -> dict:
    """The roofline of the device under ``platform``'s wrappers (Platform.roofline: probed once
    per platform), {} where it has none."""
    probe = getattr(runtime_of(platform), "roofline", None)
    return probe() if callable(probe) else {}


def roofline_place(roofline: dict, flops: float, nbytes: float, ms: float, kernels: int = 1) -> dict:
    """``{"roofline_bound", "roofline_ms", "roofline_fraction"}`` of a program that did ``flops`` and moved
    ``nbytes`` in ``ms`` over ``kernels`` dispatches (tapml.platforms.roofline.attained); {}
    without a roofline or a time."""
    from tapml.platforms.roofline import attained
    place = attained(roofline, flops, nbytes, ms / 1e3, kernels)
    return {"roofline_bound": place["bound"], "roofline_ms": place["bound_ms"],
            "roofline_fraction": place["fraction"]} if place else {}


def profile_program(platform, program, inputs: list, graph, runs: int = RUNS) -> dict:
    """``{"device_ms", "gflops", "gbps", "timing", "shapes"}`` of one compiled case: the median
    of ``runs`` device times, and FLOPs and bytes per that time (None for a zero time); where
    the device's roofline is known, also what bounds the case there and the fraction of that
    bound it reached (:func:`roofline_place`)."""
    from tapml.platforms.base import wrap_errors
    times, timing = wrap_errors(device_times, platform, program, inputs, runs)
    ms = statistics.median(times)
    flops, nbytes = graph_flops(graph), program_bytes(program)
    per_s = 1e3 / ms if ms > 0 else None
    place = roofline_place(device_roofline(platform), flops, nbytes, ms, max(1, len(getattr(program, "kernels", []))))
    return {"device_ms": round(ms, 6), "timing": timing, "shapes": shapes_text(graph),
            "gflops": None if per_s is None else round(flops * per_s / 1e9, 6),
            "gbps": None if per_s is None else round(nbytes * per_s / 1e9, 6), **place}


def read_baseline(path: str):
    """The VerdictDocument of ``--baseline OLD.json``, read with the strict reader; TapmlError
    (exit 2) when it is malformed or holds no device times."""
    from tapml.judging.verdict import VerdictDocument
    doc = VerdictDocument.read(path, what="--baseline", hint=BASELINE_HINT)
    if not any(c.device_ms is not None for c in doc.cases):
        raise TapmlError(f"--baseline {path} holds no device times; {BASELINE_HINT}")
    return doc


def _key(v) -> tuple:
    get = v.get if isinstance(v, dict) else lambda k: getattr(v, k)
    return get("id"), get("op"), get("shapes")


def sign_test_p(above: int, samples: int) -> float:
    """One-sided sign test: the chance that ``above`` or more of ``samples`` timings fall above a
    line that is (at least) their median, i.e. of seeing this many above by luck alone."""
    return sum(math.comb(samples, k) for k in range(above, samples + 1)) / 2 ** samples if samples else 1.0


def control_cases(suspect: dict, pool: list[dict], count: int = CONTROLS) -> list[dict]:
    """The ``count`` cases of ``pool`` that a neighbour's load slows as it slows ``suspect``: those
    bound by the same resource on the device's roofline (``roofline_bound``: a memory-heavy
    neighbour slows the memory-bound kernels, not the compute-bound ones), the nearest in baseline
    time first (a kernel of a few dispatches and a long one feel load differently: wake-ups against
    arithmetic); the rest, where too few share its bound, the nearest in time of the others."""
    def distance(c: dict) -> tuple[bool, float]:
        same = suspect.get("roofline_bound") is not None and c.get("roofline_bound") == suspect.get("roofline_bound")
        return not same, abs(math.log(c["baseline_ms"] / suspect["baseline_ms"]))
    return sorted(pool, key=distance)[:count]


def slower_cases(result: dict, baseline, slower_than: float = SLOWER_THAN, min_diff_ms: float = MIN_DIFF_MS,
                 remeasure: Callable[[dict], list[float]] | None = None, rounds: int = ROUNDS,
                 max_p: float = MAX_P) -> list[dict]:
    """The cases of ``result`` (a profiled Verdict JSON) that are slower than the same case (id, op
    and input shapes) of ``baseline`` (a VerdictDocument) by more than ``slower_than`` percent and
    ``min_diff_ms``, with confidence. ``result`` is changed in place: each case found in the
    baseline gets its ``baseline_ms``, ``result["drift"]`` is the median ratio of device time to
    baseline over all those cases (at least 1), and ``result["speed_check"]`` says how many cases
    looked slower, were timed again and cleared.

    A timing on a shared machine is noisy, so a case that looks slower is not yet a finding:
    ``remeasure(case_json)`` (its device times in ms) times it ``rounds`` more times, each round
    beside up to three *control* cases that did not look slower, the nearest to it in baseline
    time among those bound by the same resource (:func:`control_cases`), whose ratio to their own
    baseline is the load of that moment (a loaded machine slows every case alike; a slowed kernel
    stands out). Each timing is above the line when it exceeds the baseline times that load by
    more than ``slower_than`` percent and ``min_diff_ms``; the case is slower when so many are
    above that a one-sided sign test puts the chance of it by luck at ``max_p`` or less (and their
    median is above too). Without ``remeasure``, the first timing is judged by the thresholds alone.
    Returns ``[{"id", "op", "baseline_ms", "device_ms", "ratio", "p_value", "timings"}]``, the
    largest ratio first."""
    if not slower_than >= 0:
        raise TapmlError(f"--slower-than {slower_than}: give a percentage of 0 or more (25 flags cases 25% slower)")
    old = {_key(c): c.device_ms for c in baseline.cases if c.device_ms is not None and c.device_ms > 0}
    compared = []
    for v in result["cases"]:
        base = old.get(_key(v))
        if base is not None and v.get("device_ms") is not None:
            v["baseline_ms"] = base
            compared.append(v)
    ratios = [v["device_ms"] / v["baseline_ms"] for v in compared]
    drift = max(1.0, statistics.median(ratios)) if len(ratios) >= 3 else 1.0
    result["drift"] = round(drift, 4)
    limit = 1 + slower_than / 100

    def above(ms: float, base: float, load: float) -> bool:
        return ms > base * limit and ms > base * load * limit and ms - base * load >= min_diff_ms

    suspects = [v for v in compared if above(v["device_ms"], v["baseline_ms"], drift)]
    result["speed_check"] = {"suspects": len(suspects), "rounds": rounds if remeasure is not None else 0,
                             "min_diff_ms": min_diff_ms, "max_p": max_p}
    if remeasure is None:
        found = [{"id": v["id"], "op": v["op"], "baseline_ms": v["baseline_ms"], "device_ms": v["device_ms"],
                  "ratio": round(v["device_ms"] / v["baseline_ms"], 4), "p_value": None, "timings": 1}
                 for v in suspects]
        return sorted(found, key=lambda s: -s["ratio"])
    suspected = {id(v) for v in suspects}
    pool = [v for v in compared if id(v) not in suspected]
    controls = {id(v): control_cases(v, pool) for v in suspects}
    timings: dict[int, list[tuple[float, float]]] = {id(v): [] for v in suspects}  # (ms, load of its round)
    live = list(suspects)
    for done in range(1, rounds + 1):
        if not live:
            break
        ratios: dict[int, float] = {}  # each control timed once a round
        for v in live:
            for c in controls[id(v)]:
                if id(c) not in ratios:
                    ratios[id(c)] = statistics.median(remeasure(c)) / c["baseline_ms"]
            loads = [ratios[id(c)] for c in controls[id(v)]]
            load = max(1.0, statistics.median(loads)) if loads else drift
            timings[id(v)] += [(ms, load) for ms in remeasure(v) if ms > 0]
        # a suspect that cannot reach max_p even if every timing left is above is cleared now
        left = (rounds - done) * RUNS
        live = [v for v in live if sign_test_p(sum(above(ms, v["baseline_ms"], ld) for ms, ld in timings[id(v)]) + left,
                                               len(timings[id(v)]) + left) <= max_p]
    found = []
    for v in suspects:
        times = timings[id(v)]
        if not times:
            continue
        base = v["baseline_ms"]
        p = sign_test_p(sum(above(ms, base, ld) for ms, ld in times), len(times))
        ms = statistics.median(t for t, _ in times)
        load = statistics.median(ld for _, ld in times)
        if p <= max_p and above(ms, base, load):
            for k in ("gflops", "gbps"):
                if v.get(k) is not None:
                    v[k] = round(v[k] * v["device_ms"] / ms, 6)
            v["device_ms"] = round(ms, 6)
            found.append({"id": v["id"], "op": v["op"], "baseline_ms": base, "device_ms": v["device_ms"],
                          "ratio": round(ms / base, 4), "p_value": float(f"{p:.3g}"), "timings": len(times)})
    found.sort(key=lambda s: -s["ratio"])
    return found


def compare_with_baseline(store, platform, result: dict, baseline, slower_than: float = SLOWER_THAN,
                          min_diff_ms: float = MIN_DIFF_MS) -> list[dict]:
    """:func:`slower_cases` of a profiled ``result`` of ``store`` on ``platform`` (still open:
    a case that looks slower is timed again on it)."""
    return slower_cases(result, baseline, slower_than, min_diff_ms,
                        remeasure=lambda verdict: case_times(platform, store, store.case(verdict["id"])))


def case_times(platform, store, case: dict, runs: int = RUNS) -> list[float]:
    """Device times (ms) of ``runs`` runs of one carved case of ``store``, compiled for ``platform``."""
    from tapml.platforms.base import wrap_errors
    graph = store.case_graph(case)
    return wrap_errors(device_times, platform, platform.compile(graph), store.case_inputs(case), runs)[0]


def unmatched_cases(result: dict, baseline) -> int:
    """How many profiled cases of ``result`` have no case in ``baseline`` to compare with."""
    old = {_key(c) for c in baseline.cases if c.device_ms is not None}
    return sum(1 for v in result["cases"] if v.get("device_ms") is not None and _key(v) not in old)


__all__ = ["StageClock", "measured", "RUNS", "SLOWER_THAN", "MIN_DIFF_MS", "device_times", "program_bytes", "graph_flops", "shapes_text",
           "profile_program", "read_baseline", "control_cases", "slower_cases", "compare_with_baseline", "case_times", "sign_test_p",
           "ROUNDS", "CONTROLS", "MAX_P", "unmatched_cases", "runtime_of"]


class StageClock:
    """Seconds per kind of work, added up over a run by the code doing it: ``compile`` and
    ``device`` (:class:`tapml.bench.TimedPlatform`), ``compare`` and ``reference`` (replay,
    regions, migrate take a ``clock=``; see :func:`measured`). Example::

        clock = StageClock()
        with clock.measure("compare"):
            ...
        clock.seconds  # {"compare": 0.012}
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def measure(self, kind: str):
        """Add the seconds of the ``with`` block to ``kind``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start


def measured(clock: StageClock | None, kind: str):
    """``clock.measure(kind)``, or a context that measures nothing when there is no clock."""
    return nullcontext() if clock is None else clock.measure(kind)
