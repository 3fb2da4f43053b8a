"""Time to a verdict and peak memory of a sized hf:llama as it grows in layers (issue #16).

Carves and migrates ``hf:llama`` at hidden 2048 (16 heads of 128), intermediate 5632, a 128 000-token
vocabulary and 2, 4, 8, 16 layers (16: ~1.35B parameters, 5.4 GB in float32) on ``wgpu:vulkan``, each step
in its own fresh process (:func:`tapml.bench.scale_figure`), and prints a markdown table: wall
time split into export, carving and the migration's op, region and model stages; the shares of
compilation, device execution and comparison; peak RSS per process against the parameter bytes;
the 1-minute load average around each run. A run is stopped when the machine has less than
``--min-free-gib`` of memory available (it would swap, or take the others' processes with it).

    .venv/bin/python benchmarks/scale.py --layers 2 4 8 16 --json benchmarks/scale-run.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: hf: models get small attention by default (4 heads of 16): full-width attention (q, k, v, o all
#: 2048x2048) makes 16 layers the 1.35B parameters of a 1B-class model.
CONFIG = {"hidden_size": 2048, "intermediate_size": 5632, "vocab_size": 128000, "num_attention_heads": 16,
          "num_key_value_heads": 16, "head_dim": 128}


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    return float("inf")


def row_of(layers: int, r: dict) -> str:
    gib = 1 << 30
    if r.get("error"):
        return f"| {layers} | failed: {r['error'][:120]} |"
    st = r["stages"]
    sh = r["shares"]
    carve = r["carve"]
    return (f"| {layers} | {r['param_bytes'] / gib:.2f} | {r['store_bytes'] / gib:.2f} | {carve['export_s']:.0f} | "
            f"{carve['carve_s']:.0f} | {st['op']['s']:.0f} | {st['region']['s']:.0f} | {st['model']['s']:.0f} | "
            f"{r['wall_s']:.0f} | {sh['compile']:.0%} / {sh['device']:.0%} / {sh['compare']:.0%} | "
            f"{carve['peak_rss_bytes'] / gib:.2f} | {r['migrate']['peak_rss_bytes'] / gib:.2f} | "
            f"{r['peak_rss_vs_params']:.2f} | {r['ops_share']:.0%} / {r['flops_share']:.0%} | "
            f"{' → '.join(f'{x:.1f}' for x in r['load_avg'])} |")


HEADER = ("| layers | params GiB | store GiB | export s | carve s | op stage s | region stage s | model stage s | "
          "total s | compile / device / compare | carve peak RSS GiB | migrate peak RSS GiB | peak / params | "
          "ops / FLOPs on target | load avg (before → after carve → after migrate) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> int:
    from tapml.bench import scale_figure
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--target", default="wgpu:vulkan")
    ap.add_argument("--workdir", default="/tmp/tapml-scale")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    ap.add_argument("--min-free-gib", type=float, default=4.0)
    args = ap.parse_args()

    def guard() -> str | None:
        free = mem_available_gib()
        return f"stopped: {free:.1f} GiB available, under {args.min_free_gib:g}" if free < args.min_free_gib else None
    rows, figures = [], {}
    for layers in args.layers:
        r = scale_figure("hf:llama", args.target, Path(args.workdir) / f"l{layers}",
                         hf_config={**CONFIG, "num_hidden_layers": layers}, timeout=args.timeout, guard=guard)
        figures[str(layers)] = r
        rows.append(row_of(layers, r))
        print(rows[-1], file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
    print(HEADER)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
