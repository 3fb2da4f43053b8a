"""Long rows before and after splitting them across invocations (issue 27): ``tapml bench``'s
long-row figures (softmax and layer_norm over a 131 072-element row, a 1024-channel 64-tap
convolution; :data:`tapml.bench.LONG_ROW_CASES`) on one backend, with the split (``after``) or
with it turned off (``before``: LOOP_BUDGET raised past every row, so each row or output is one
invocation again, the kernels tapml emitted before the split; on lavapipe they are cut short
after 65 535 iterations, so they are timed doing less than the whole work).

One process per measurement, so that farm-bench alternates them and times whole processes::

    farm-bench -n 5 --timeout 1500 --vs "sh -c 'exec .venv/bin/python benchmarks/long_rows.py before vulkan >>/tmp/b 2>&1'" \\
        -- sh -c 'exec .venv/bin/python benchmarks/long_rows.py after vulkan >>/tmp/a 2>&1'
    .venv/bin/python benchmarks/long_rows.py summary /tmp/a /tmp/b

Each run prints one JSON line (its figures and the load average); ``summary`` gives the medians.
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def measure(variant: str, backend: str) -> dict:
    from tapml.bench import LONG_ROW_CASES, long_row_figure
    from tapml.platforms.wgpu_native import shared_platform
    if variant == "before":
        from tapml.platforms.wgsl import codegen, folds, nn, reduce
        for module in (codegen, folds, nn, reduce):
            module.LOOP_BUDGET = 1 << 40
    platform = shared_platform(backend)
    figures = [long_row_figure(platform, name, repeat=3) for name in LONG_ROW_CASES]
    return {"variant": variant, "backend": backend, "figures": figures, "load_avg": round(os.getloadavg()[0], 2)}


def summary(paths: list[str]) -> dict:
    # each file's first run is farm-bench's warm-up, not counted
    runs = [run for p in paths for run in [json.loads(line) for line in open(p) if line.startswith("{")][1:]]
    out = {}
    for run in runs:
        for f in run["figures"]:
            row = out.setdefault(f"{run['backend']} {f['case']} {run['variant']}",
                                 {"ours_ms": [], "torch_ms": [], "ratio": [], "matches_torch": set(),
                                  "kernels": f.get("kernels"), "load_avg": []})
            for k in ("ours_ms", "torch_ms", "ratio"):
                row[k].append(f[k])
            row["matches_torch"].add(f.get("matches_torch"))
            row["load_avg"].append(run["load_avg"])
    figures = ("ours_ms", "torch_ms", "ratio", "load_avg")
    return {k: {"runs": len(v["ours_ms"]), **{m: statistics.median(v[m]) for m in figures},
                "matches_torch": sorted(v["matches_torch"], key=str), "kernels": v["kernels"]} for k, v in out.items()}


if __name__ == "__main__":
    if sys.argv[1] == "summary":
        print(json.dumps(summary(sys.argv[2:]), indent=1))
    else:
        print(json.dumps(measure(sys.argv[1], sys.argv[2])))
