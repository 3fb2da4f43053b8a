"""float16/bfloat16 against float32 on the same device, in the same run: a 512x512x512 ``mm``
kernel (device time) and one whole tiny-llama forward compiled as one program (device time),
per wgpu backend. Rounds alternate the dtype order; the median of the rounds is reported with
the load average beside it. Run: ``.venv/bin/python benchmarks/low_precision.py [ROUNDS]``."""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from tapml.bench import alternated, device_seconds, matmul_graph, wgpu_backends
from tapml.graph import torch_dtype

DTYPES = ("float32", "float16", "bfloat16")


def model_program(platform, dtype: str):
    """The whole zoo:tiny-llama forward in ``dtype`` as one program, and its inputs."""
    import tempfile

    from tapml.carving import CarveStore, carve
    out = os.path.join(tempfile.mkdtemp(), "store")
    carve("zoo:tiny-llama", out, dtype=dtype)
    store = CarveStore(out)
    inputs = store.program_inputs()
    return platform.compile(store.graph), [inputs[r] for r, _ in store.graph.inputs]


def main(rounds: int = 5) -> dict:
    results = {}
    for backend, platform in wgpu_backends():
        gen = torch.Generator().manual_seed(0)
        a, b = torch.rand(512, 512, generator=gen), torch.rand(512, 512, generator=gen)
        mm = {d: (platform.compile(matmul_graph(512, 0, d)), [a.to(torch_dtype(d)), b.to(torch_dtype(d))])
              for d in DTYPES}
        model = {d: model_program(platform, d) for d in DTYPES}
        programs = {("mm512", d): mm[d] for d in DTYPES} | {("tiny-llama", d): model[d] for d in DTYPES}
        times, loads = alternated({key: (lambda p=p: device_seconds(platform, *p, repeat=3)[0])
                                   for key, p in programs.items()}, rounds)
        row = {"load_avg": loads, "low_precision": platform.caps()["low_precision"]}
        for (what, d), ts in times.items():
            row[f"{what} {d} ms"] = round(statistics.median(ts) * 1e3, 3)
        for what in ("mm512", "tiny-llama"):
            for d in DTYPES[1:]:
                ratios = [t32 / t for t32, t in zip(times[what, "float32"], times[what, d])]
                row[f"{what} {d} speed vs float32"] = round(statistics.median(ratios), 3)
        results[backend] = row
    return results


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5), indent=2))
