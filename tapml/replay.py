"""Replay: run every carved case on a platform and compare with the reference's outputs."""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from tapml.compare import Tolerances, compare_anchored, compare_outputs
from tapml.errors import DeviceLost, PlatformError, Unsupported
from tapml.graph import run_graph

STATUSES = ("pass", "mismatch", "unsupported", "error")


def device_info(platform) -> dict:
    """``{adapter, backend, features, limits}`` of a platform, for verdict files."""
    try:
        caps = platform.caps()
    except PlatformError as e:
        return {"adapter": "unknown", "backend": "unknown", "features": [], "limits": {}, "error": str(e)}
    return {k: caps.get(k, default) for k, default in
            (("adapter", ""), ("backend", ""), ("features", []), ("limits", {}))}


def _reference64(store, case) -> list[torch.Tensor]:
    graph = store.case_graph(case)
    inputs = {r: (t.double() if t.is_floating_point() else t) for (r, _), t in zip(graph.inputs, store.case_inputs(case))}
    out = run_graph(graph, inputs)
    return [out[r] for r in graph.outputs]


def run_case(platform, store, case: dict, tolerances: Tolerances | None = None, anchored: bool = False) -> dict:
    """Run one case on ``platform``; returns its verdict (never raises for a platform failure)."""
    verdict = {"id": case["id"], "op": case["op"], "node": case["node"], "module": case["module"],
               "instances": case.get("instances", 1), "status": "error", "max_abs_err": None,
               "max_rel_err": None, "mismatch_fraction": None, "message": "", "time_ms": None}
    start = time.perf_counter()
    try:
        program = platform.compile(store.case_graph(case))
        outputs = platform.run(program, store.case_inputs(case))
    except Unsupported as e:
        verdict.update(status="unsupported", message=str(e))
        return verdict
    except DeviceLost as e:
        verdict.update(status="error", message=f"error: {e}")
        return verdict
    except PlatformError as e:
        verdict.update(status="error", message=str(e))
        return verdict
    verdict["time_ms"] = round(getattr(platform, "last_run_ms", (time.perf_counter() - start) * 1e3), 4)
    expected = store.case_outputs(case)
    if anchored:
        result = compare_anchored(outputs, expected, _reference64(store, case))
    else:
        result = compare_outputs(outputs, expected, op=case["op"], tolerances=tolerances)
    verdict.update(status="pass" if result.passed else "mismatch", message=result.message, **result.stats())
    if result.worst:
        verdict["worst"] = result.worst
    return verdict


def summarize(verdicts: Iterable[dict]) -> dict:
    """``{"pass": n, "mismatch": n, "unsupported": n, "error": n}`` over ``verdicts``."""
    summary = dict.fromkeys(STATUSES, 0)
    for v in verdicts:
        summary[v["status"]] += 1
    return summary


def replay(store, platform, target: str, tolerances: Tolerances | None = None, anchored: bool = False,
           cases: list[dict] | None = None, on_case: Callable[[dict], None] | None = None) -> dict:
    """Replay ``cases`` (default: all) of ``store`` on ``platform``; returns the Verdict JSON."""
    verdicts = []
    for case in store.cases if cases is None else cases:
        v = run_case(platform, store, case, tolerances, anchored)
        verdicts.append(v)
        if on_case:
            on_case(v)
    return {"target": target, "device": device_info(platform), "model": store.model,
            "tolerances": (tolerances or Tolerances()).to_json(), "cases": verdicts, "summary": summarize(verdicts)}
