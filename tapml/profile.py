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
than 25% on a loaded machine), and still does when measured again (``remeasure``): a real
slowdown persists, a burst of load on a shared machine does not.

Example::

    speed = profile_program(platform, program, inputs, graph)   # {"device_ms", "gflops", ...}
    slower = slower_cases(new_doc, VerdictDocument.read("old.json", what="--baseline"))
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager, nullcontext
from typing import Callable

from tapml.errors import TapmlError

#: Runs per measurement (their median is the case's device time).
RUNS = 5
#: Default threshold of ``--slower-than``, percent.
SLOWER_THAN = 25.0
#: A case must be at least this much slower (ms) to count: below it, timer and load noise rule.
MIN_DIFF_MS = 0.05
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
    return {"float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "bool": 1, "uint8": 1, "int8": 1,
            "int16": 2}.get(dtype, 4)


def graph_flops(graph) -> int:
    """Rough FLOPs of a graph: the registry's count of each node."""
    from tapml.platforms.wgsl.registry import node_flops
    return sum(node_flops(n, graph.meta) for n in graph.nodes)


def shapes_text(graph) -> str:
    """The input shapes of a case, as ``tapml inspect`` writes them (``16x64,64x128``): with the
    op, what identifies a case across stores."""
    return ",".join("x".join(map(str, m.shape)) or "()" for _, m in graph.inputs)


def profile_program(platform, program, inputs: list, graph, runs: int = RUNS) -> dict:
    """``{"device_ms", "gflops", "gbps", "timing", "shapes"}`` of one compiled case: the median
    of ``runs`` device times, and FLOPs and bytes per that time (None for a zero time)."""
    from tapml.platforms.base import wrap_errors
    times, timing = wrap_errors(device_times, platform, program, inputs, runs)
    ms = statistics.median(times)
    flops, nbytes = graph_flops(graph), program_bytes(program)
    per_s = 1e3 / ms if ms > 0 else None
    return {"device_ms": round(ms, 6), "timing": timing, "shapes": shapes_text(graph),
            "gflops": None if per_s is None else round(flops * per_s / 1e9, 6),
            "gbps": None if per_s is None else round(nbytes * per_s / 1e9, 6)}


def read_baseline(path: str):
    """The VerdictDocument of ``--baseline OLD.json``, read with the strict reader; TapmlError
    (exit 2) when it is malformed or holds no device times."""
    from tapml.verdict import VerdictDocument
    doc = VerdictDocument.read(path, what="--baseline", hint=BASELINE_HINT)
    if not any(c.device_ms is not None for c in doc.cases):
        raise TapmlError(f"--baseline {path} holds no device times; {BASELINE_HINT}")
    return doc


def _key(v) -> tuple:
    get = v.get if isinstance(v, dict) else lambda k: getattr(v, k)
    return get("id"), get("op"), get("shapes")


def slower_cases(result: dict, baseline, slower_than: float = SLOWER_THAN, min_diff_ms: float = MIN_DIFF_MS,
                 remeasure: Callable[[dict], float | None] | None = None, attempts: int = 2) -> list[dict]:
    """The cases of ``result`` (a profiled Verdict JSON) more than ``slower_than`` percent and
    ``min_diff_ms`` slower than the same case (id, op and input shapes) of ``baseline`` (a
    VerdictDocument). ``result`` is changed in place: each case found in the baseline gets its
    ``baseline_ms``, and ``result["drift"]`` is the median ratio of device time to baseline
    over all those cases (at least 1).

    Two guards keep a loaded machine from flagging: the baseline is scaled by the drift when at
    least three cases are compared (load slows every case alike, a slowed kernel stands out;
    a change that slows every case alike shows as drift instead), and ``remeasure(case_json)``
    (device ms, or None) measures a case that looks slower up to ``attempts`` more times,
    keeping its fastest median: a real slowdown persists, a burst of load does not.
    Returns ``[{"id", "op", "baseline_ms", "device_ms", "ratio"}]``, the largest ratio first."""
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

    def is_slower(ms: float, base: float) -> bool:
        return ms > base * limit and ms > base * drift * limit and ms - base * drift >= min_diff_ms

    found = []
    for v in compared:
        base = v["baseline_ms"]
        for _ in range(attempts if remeasure is not None else 0):
            if not is_slower(v["device_ms"], base):
                break
            again = remeasure(v)
            if again is not None and 0 < again < v["device_ms"]:
                for k in ("gflops", "gbps"):
                    if v.get(k) is not None:
                        v[k] = round(v[k] * v["device_ms"] / again, 6)
                v["device_ms"] = round(again, 6)
        if is_slower(v["device_ms"], base):
            found.append({"id": v["id"], "op": v["op"], "baseline_ms": base, "device_ms": v["device_ms"],
                          "ratio": round(v["device_ms"] / base, 4)})
    found.sort(key=lambda s: -s["ratio"])
    return found


def compare_with_baseline(store, platform, result: dict, baseline, slower_than: float = SLOWER_THAN,
                          min_diff_ms: float = MIN_DIFF_MS) -> list[dict]:
    """:func:`slower_cases` of a profiled ``result`` of ``store`` on ``platform`` (still open:
    a case that looks slower is measured again on it)."""
    def remeasure(verdict: dict):
        case = store.case(verdict["id"])
        graph = store.case_graph(case)
        return profile_program(platform, platform.compile(graph), store.case_inputs(case), graph)["device_ms"]

    return slower_cases(result, baseline, slower_than, min_diff_ms, remeasure=remeasure)


def unmatched_cases(result: dict, baseline) -> int:
    """How many profiled cases of ``result`` have no case in ``baseline`` to compare with."""
    old = {_key(c) for c in baseline.cases if c.device_ms is not None}
    return sum(1 for v in result["cases"] if v.get("device_ms") is not None and _key(v) not in old)


__all__ = ["StageClock", "measured", "RUNS", "SLOWER_THAN", "MIN_DIFF_MS", "device_times", "program_bytes", "graph_flops", "shapes_text",
           "profile_program", "read_baseline", "slower_cases", "compare_with_baseline", "unmatched_cases", "runtime_of"]


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
