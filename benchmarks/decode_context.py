"""Decode step time against the context and the cache size (issue 34): one generation store per
cache size (``tapml carve MODEL --generate 4 --cache C``), its decode steps timed at cache
positions ``t`` on the target and in torch eager (``tapml.bench.decode_step_rows``, the figures of
``tapml bench generation --context``), in the same process.

``after`` is the compiler as it is; ``before`` turns off what issue 34 added (the key/value put
written in place, the fused attention, the lazy cat, the GEMV, the residual add in the product, the
product groups, the RMSNorm kernel and its fold into the GEMV, the lazy row, tiny values recomputed,
merged dispatches; not the grouped reshape), so the compiler emits about the kernels it emitted
before; ``tiled`` turns off only the GEMV (one-row products
through the tiled matmul); ``rows-written`` writes the norm and SiLU x up before the GEMVs;
``computed-head`` lets every GEMV compute its row, an LM head's too; ``ungrouped`` unravels every
dim of a reshape that cannot stay strided (before ``views._reshape_groups``). One process per measurement, so that farm-bench alternates them::

    farm-bench -n 5 --vs "sh -c '.venv/bin/python benchmarks/decode_context.py before STORE 16,256 >>/tmp/b'" \\
        -- sh -c '.venv/bin/python benchmarks/decode_context.py after STORE 16,256 >>/tmp/a'
    .venv/bin/python benchmarks/decode_context.py summary /tmp/a /tmp/b

To compare with an older commit instead, run ``after`` from a worktree of it with its own packages
first on the path (the editable install maps ``tapml.platforms`` and the other top-level folders to
this checkout, so link them inside the worktree's ``tapml/``)::

    git worktree add /tmp/base OLD && (cd /tmp/base/tapml && for d in carving platforms remote reports; do ln -s ../$d $d; done)
    farm-bench -n 5 --vs "sh -c 'cd /tmp/base && PYTHONPATH=/tmp/base $PWD/.venv/bin/python benchmarks/decode_context.py after STORE 16,256 >>/tmp/b'" \\
        -- sh -c '.venv/bin/python benchmarks/decode_context.py after STORE 16,256 >>/tmp/a'

Each run prints one JSON line: per context the median decode step in ms on the target and in
torch (its better thread count of 1 and 2), the kernels per step and the load average.
"""

from __future__ import annotations

import json
import statistics
import sys


def measure(variant: str, store_dir: str, contexts: list[int], backend: str = "vulkan") -> dict:
    from tapml.bench import decode_step_rows
    from tapml.carving.store import CarveStore
    from tapml.platforms.wgpu_native import shared_platform
    import contextlib

    from tapml.platforms.wgsl import matmul
    if variant == "before":
        from tapml.platforms.wgsl import attention, scatter, shape
        attention.find_attention = lambda *a, **k: {}
        scatter.put_in_place = lambda *a, **k: None
        shape.LAZY_CAT_PARTS = 0
        matmul.find_residual_products = lambda *a, **k: {}
        matmul.find_product_groups = lambda *a, **k: {}
        from tapml.platforms.wgsl import codegen, norms
        import tapml.platforms.wgsl as wgsl
        norms.find_rms_norms = lambda *a, **k: {}
        matmul.LAZY_ROW_COST = -1
        wgsl.RECOMPUTED_NUMEL = 0
        codegen.ProgramBuilder.merge_independent = lambda self: None
    if variant == "rows-written":  # the norm and SiLU x up in kernels of their own, not in the GEMV
        matmul.COMPUTED_ROW_BLOCKS = -1
    if variant == "computed-head":  # every GEMV computes its row, an LM head of 4008 blocks too
        matmul.COMPUTED_ROW_BLOCKS = 1 << 30
    if variant == "ungrouped":  # a reshape that cannot stay strided unravels every dim again
        from tapml.platforms.wgsl import views
        views._reshape_groups = lambda src, dst: [(range(len(src)), range(len(dst)))]
    # "tiled": one-row products through the tiled matmul (its small tiles, which M = 1 got before the GEMV)
    tiled = matmul.forced_tiles(matmul.SMALL_TILES) if variant in ("before", "tiled") else contextlib.nullcontext()
    with tiled:
        rows = decode_step_rows(CarveStore(store_dir), shared_platform(backend), contexts, repeat=1)
    return {"variant": variant, "store": store_dir, "contexts": rows}


def summary(after_file: str, before_file: str) -> None:
    def rows(path):  # the first line is farm-bench's warm-up run: not counted
        return [json.loads(line) for line in open(path) if line.startswith("{")][1:]
    a, b = rows(after_file), rows(before_file)
    loads = [x for r in a + b for x in r["contexts"][0]["load_avg"]]
    print(f"runs: {len(a)} after, {len(b)} before; load average {min(loads)}-{max(loads)}")
    for i, ctx in enumerate(a[0]["contexts"]):
        med = {name: statistics.median(r["contexts"][i]["step_ms"] for r in runs) for name, runs in (("after", a), ("before", b))}
        torch_ms = statistics.median(r["contexts"][i]["torch_step_ms"] for r in a + b)
        print(f"cache {ctx['cache']} context {ctx['context']}: step ms after {med['after']:.2f} "
              f"(kernels {ctx['kernels_per_step']}), before {med['before']:.2f} "
              f"(kernels {b[0]['contexts'][i]['kernels_per_step']}), torch {torch_ms:.2f}; "
              f"after/before {med['after'] / med['before']:.2f}, tokens/s vs torch {torch_ms / med['after']:.2f}")


if __name__ == "__main__":
    if sys.argv[1] == "summary":
        summary(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(measure(sys.argv[1], sys.argv[2], [int(c) for c in sys.argv[3].split(",")],
                                 *(sys.argv[4:5] or []))))
