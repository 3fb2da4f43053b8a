#!/usr/bin/env python3
"""Reproduce one tapml case on an external backend without tapml's checking: run the backend's own
input (the artifact plan.json names: MLIR, ONNX, ...) through ``runner.py`` with the recorded inputs,
and compare the outputs with the reference's (dtype and shape first, then values).

    python run.py [--json]

Needs numpy and what runner.py says it needs (the backend's own package). Prints PASS or FAIL with
the error stats and exits 0 (pass), 1 (fail: wrong dtype, shape or values, or the backend refused or
failed the program) or 2 (cannot run here). plan.json is data and names only files in this folder.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,120}")


def _file(name: str) -> Path:
    if not isinstance(name, str) or not FILE_NAME.fullmatch(name):
        raise SystemExit(f"cannot run: plan.json names {name!r}, not a file of this folder")
    return HERE / name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args()
    try:
        import numpy as np
    except ImportError:
        print(f"cannot run: numpy is not importable by {sys.executable}", file=sys.stderr)
        return 2
    plan = json.loads((HERE / "plan.json").read_text())
    sys.path.insert(0, str(HERE))
    try:
        import runner
    except ImportError as e:
        print(f"cannot run: runner.py needs {e.name or e} ({plan['runner_needs']})", file=sys.stderr)
        return 2
    inputs = [np.load(_file(i["file"]), allow_pickle=False) for i in plan["inputs"]]
    artifact = _file(plan["artifact"]).read_bytes() if plan.get("artifact") else b""
    result = {"status": "pass", "message": "", "outputs": []}
    try:
        outputs = list(runner.run(artifact, inputs, [i["dtype"] for i in plan["inputs"]]))
    except Exception as e:  # noqa: BLE001 - the backend failing is the finding
        result.update(status="fail", message=f"the backend failed: {type(e).__name__}: {e}",
                      traceback=traceback.format_exc())
        outputs = None
    if outputs is not None and len(outputs) != len(plan["outputs"]):
        result.update(status="fail", message=f"{len(outputs)} outputs, the reference has {len(plan['outputs'])}")
    elif outputs is not None:
        for o, got in zip(plan["outputs"], outputs):
            got = np.asarray(got)
            want = np.load(_file(o["expected"]), allow_pickle=False)
            entry = {"name": o["expected"], "dtype": str(got.dtype), "shape": list(got.shape)}
            host = "float32" if o["dtype"] == "bfloat16" else o["dtype"]
            if list(got.shape) != o["shape"] or (str(got.dtype) != host and o["dtype"] != "bfloat16"):
                entry["problem"] = f"{got.dtype}{list(got.shape)}, the reference's is {o['dtype']}{o['shape']}"
            else:
                g, w = got.astype(np.float64), want.astype(np.float64)
                err = np.abs(g - w)
                bad = ~(np.isclose(g, w, rtol=o["rtol"], atol=o["atol"], equal_nan=True))
                entry.update(max_abs_err=float(np.nanmax(err)) if err.size else 0.0,
                             mismatch_fraction=float(bad.mean()) if bad.size else 0.0)
                if bad.any():
                    entry["problem"] = f"{int(bad.sum())}/{bad.size} elements beyond rtol {o['rtol']} atol {o['atol']}"
            result["outputs"].append(entry)
            if "problem" in entry:
                result["status"] = "fail"
                result["message"] = "; ".join(m for m in (result["message"], f"{o['expected']}: {entry['problem']}") if m)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['status'].upper()}: {plan['title']} on {plan['target']}" +
              (f": {result['message']}" if result["message"] else ""))
    return 0 if result["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
