"""What choosing int64's representation per run costs a model whose int64 values fit in i32
(issue 36: "no slower figure for models whose int64 values fit"): a whole-model program of each
model run through ``WgslPlatform.run`` (which asks ``wide_refs`` first) against the same program run
through ``Platform.run`` (no choice), alternated in one process, medians of the rounds.

    .venv/bin/python benchmarks/int64_fast_path.py [--rounds 7] [--runs 20] [MODEL ...]
    .venv/bin/python benchmarks/int64_fast_path.py --generate zoo:tiny-llama [--rounds 5]

``--generate``: ``tapml generate`` of the model (32 tokens), its tokens/s with the choice made on every
step against the same with ``WgslPlatform.for_values`` passing the program through, alternated.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["zoo:tiny-llama", "zoo:tiny-vit"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--generate", default=None)
    args = ap.parse_args()
    if args.generate:
        return generation(args.generate, args.rounds)
    from tapml.carving import CarveStore, carve
    from tapml.platforms.base import Platform
    from tapml.platforms.wgpu_native import WgpuPlatform
    platform = WgpuPlatform("vulkan")
    for spec in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            carve(spec, f"{tmp}/store")
            store = CarveStore(f"{tmp}/store")
            graph = store.graph
            inputs = store.program_inputs()
            program = platform.compile(graph)
            ordered = [inputs[r] for r, _ in graph.inputs]
            int64 = sum(m.dtype == "int64" for m in graph.meta.values())
            for _ in range(3):  # warm: pipelines, uploads
                platform.run(program, ordered)
            with_choice, without = [], []
            pair = [("with", platform.run), ("without", lambda p, i: Platform.run(platform, p, i))]
            for r in range(args.rounds):
                for label, run in (pair if r % 2 == 0 else pair[::-1]):  # ABBA: neither always goes first
                    start = time.perf_counter()
                    for _ in range(args.runs):
                        run(program, ordered)
                    (with_choice if label == "with" else without).append((time.perf_counter() - start) / args.runs * 1e3)
            a, b = statistics.median(with_choice), statistics.median(without)
            start = time.perf_counter()
            for _ in range(200):
                platform.for_values(program, ordered)
            choice_us = (time.perf_counter() - start) / 200 * 1e6
            print(f"{spec}: {len(graph.nodes)} nodes, {int64} int64 values; per run {a:.3f} ms with the choice, "
                  f"{b:.3f} ms without: ratio {a / b:.3f} (medians of {args.rounds} alternated rounds of "
                  f"{args.runs} runs; load {os.getloadavg()[0]:.2f}); the choice alone: {choice_us:.1f} us per run; "
                  f"two words: {platform.last_wide or 'none'}")


def generation(model: str, rounds: int) -> None:
    import json
    from typer.testing import CliRunner
    from tapml.cli import app
    from tapml.platforms.wgsl_platform import WgslPlatform
    choosing = WgslPlatform.for_values
    figures = {"with": [], "without": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for label in ("with", "without"):
                WgslPlatform.for_values = choosing if label == "with" else (lambda self, program, inputs: program)
                out = f"{tmp}/g.json"
                r = CliRunner().invoke(app, ["generate", model, "--target", "wgpu:vulkan", "--tokens", "32", "--quiet",
                                             "--json", out])
                assert r.exit_code == 0, r.output
                figures[label].append(json.loads(open(out).read())["tokens_per_s"]["target"])
    WgslPlatform.for_values = choosing
    a, b = statistics.median(figures["with"]), statistics.median(figures["without"])
    print(f"{model} generate: {a:.1f} tokens/s with the choice on every step, {b:.1f} without: ratio {a / b:.3f} "
          f"(medians of {rounds} alternated runs; load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
