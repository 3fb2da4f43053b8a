"""Peers in the same run: the same workloads on several targets side by side (``tapml bench
--target wgpu:vulkan --target iree:vulkan``), each next to torch eager on the CPU.

Workloads (:data:`PEER_WORKLOADS`): ``mm`` at 512 and 1024, the MLP 1024 -> 4096 -> 1024 on a
batch of 64 (``linear``, GELU, ``linear``), a 1024-channel convolution, and zoo:tiny-llama's
forward; ``quick`` runs small ones. Every target compiles each workload's graph through its own
route (tapml's WGSL compiler, an external backend through the seam), its outputs are checked
against torch, and then targets and torch are timed in alternated rounds, the order rotating
each round, so a burst of load on a shared machine hits them alike.

A target's time is its ``run``'s own (``Platform.last_run_ms``): host tensors in, host tensors out,
the device's transfers included, the hop to a backend's worker process not; the same for every
target. ``resident_ms`` is the other figure every compiler can give: one run with its inputs already
in device buffers and its outputs left there, launched and waited for alone (``time_resident``: tapml's
own platforms, and backends that implement :meth:`~tapml.platforms.backend.Backend.time_resident`, as
IREE and tinygrad do), so the compilers compare without the host transfers. Where a platform can also
time its kernels alone (``benchmark``: several runs in one submission, GPU timestamps), that
``device_ms`` is reported too, with its place on the device's roofline. Figures are
medians over rounds of each round's best of :data:`RUNS_PER_ROUND` runs; ratios are of medians.
Only the target being timed is open (see :func:`run_peers`). A target of tapml's own compiler whose
device has no tuned matmul tiles yet is tuned first, as `tapml bench` does (``--quick`` keeps what
is cached); its ``devices`` entry names the tiles (``matmul_tiles``).

Example::

    doc = run_peers(["wgpu:vulkan", "iree:vulkan"], rounds=5)
    doc["workloads"][0]["ratios"]["iree:vulkan"]  # its time over wgpu:vulkan's
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from tapml.bench import LONG_ROW_CASES, device_seconds, matmul_graph, roofline_figure, tuned_tiles

#: name -> what it is, in the order `tapml bench` prints them.
PEER_WORKLOADS = {
    "mm_512": "mm 512 x 512 x 512",
    "mm_1024": "mm 1024 x 1024 x 1024",
    "mlp_1024": "MLP 1024 -> 4096 -> 1024, batch 64",
    "conv_1024": "convolution, 1024 channels, 64 taps",
    "tiny_llama": "zoo:tiny-llama forward",
}
#: ``--quick``: small shapes, a smoke run (figures not to be quoted).
QUICK_WORKLOADS = {"mm_128": "mm 128 x 128 x 128", "mlp_64": "MLP 64 -> 256 -> 64, batch 8"}
RUNS_PER_ROUND = 3


def _exported_graph(fn, inputs: list):
    import torch

    from tapml.graph import graph_from_fx

    class Program(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)
    ep = torch.export.export(Program(), tuple(inputs), strict=False).run_decompositions()
    return graph_from_fx(ep.graph, ep.graph_signature)


def _mlp(width: int, hidden: int, batch: int):
    import torch
    gen = torch.Generator().manual_seed(width)
    inputs = [torch.randn(batch, width, generator=gen), torch.randn(hidden, width, generator=gen) / width ** 0.5,
              torch.randn(hidden, generator=gen), torch.randn(width, hidden, generator=gen) / hidden ** 0.5,
              torch.randn(width, generator=gen)]

    def fn(x, w1, b1, w2, b2):
        return (torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1)), w2, b2),)
    return _exported_graph(fn, inputs), inputs, lambda: fn(*inputs), list(fn(*inputs))


def _mm(n: int):
    import torch
    gen = torch.Generator().manual_seed(n)
    a, b = torch.rand(n, n, generator=gen), torch.rand(n, n, generator=gen)
    return matmul_graph(n), [a, b], lambda: a @ b, [a @ b]


def _conv():
    import torch

    from tapml.graph import run_node
    from tapml.platforms.wgsl.registry import case_graph
    op, make = LONG_ROW_CASES["conv_1024x64"]
    graph, inputs = case_graph(op, make(torch.Generator().manual_seed(0)))
    env = dict(zip([r for r, _ in graph.inputs], inputs))
    return graph, inputs, lambda: run_node(graph.nodes[0], env.__getitem__), [run_node(graph.nodes[0], env.__getitem__)]


def _tiny_llama(workdir: Path):
    import torch

    from tapml.carving import CarveStore, carve
    from tapml.frontends.capture import split_inputs
    from tapml.frontends.models import load_model
    out = workdir / "tiny-llama"
    if not (out / "manifest.json").is_file():
        carve("zoo:tiny-llama", out)
    store = CarveStore(out)
    values, expected = store.program_inputs(), store.model_outputs()
    model, example = load_model("zoo:tiny-llama")
    args, kwargs = split_inputs(example)

    def forward():
        with torch.no_grad():
            return model(*args, **kwargs)
    return (store.graph, [values[ref] for ref, _ in store.graph.inputs], forward,
            [expected[ref] for ref in store.graph.outputs])


def workloads(names, workdir: Path) -> dict:
    """name -> ``(graph, inputs, torch_fn, expected outputs of the graph)`` of each workload in ``names``."""
    makers: dict[str, Callable] = {"mm_512": lambda: _mm(512), "mm_1024": lambda: _mm(1024),
                                   "mlp_1024": lambda: _mlp(1024, 4096, 64), "conv_1024": _conv,
                                   "tiny_llama": lambda: _tiny_llama(workdir), "mm_128": lambda: _mm(128),
                                   "mlp_64": lambda: _mlp(64, 256, 8)}
    return {name: makers[name]() for name in names}


def _flat(values) -> list:
    return [t for v in values for t in (_flat(v) if isinstance(v, (list, tuple)) else [v])]


def _matches(got: list, want: list) -> bool:
    from tapml.judging.compare import compare_tensor
    return all(compare_tensor(g, w).passed for g, w in zip(_flat(got), _flat(want)))


def _largest_error(got: list, want: list) -> float:
    got, want = _flat(got), _flat(want)
    if len(got) != len(want):
        raise ValueError(f"{len(got)} outputs; torch gives {len(want)}")
    return max((float((g.double() - w.double()).abs().max()) for g, w in zip(got, want) if w.numel()), default=0.0)


def _run_ms(platform, program, inputs) -> float:
    """The best of :data:`RUNS_PER_ROUND` runs, each as the platform timed its own ``run``."""
    best = float("inf")
    for _ in range(RUNS_PER_ROUND):
        start = time.perf_counter()
        platform.run(program, inputs)
        ms = getattr(platform, "last_run_ms", None)
        best = min(best, ms if ms is not None else (time.perf_counter() - start) * 1e3)
    return best


def _resident_ms(platform, program, inputs) -> float | None:
    """Milliseconds per run with the inputs already on the target's device, each run launched and
    waited for alone (``time_resident``, best of its batches of :data:`RUNS_PER_ROUND`); None
    where the target cannot tell (the reference, a browser, a remote device, a backend without it)."""
    timer = getattr(platform, "time_resident", None)
    seconds = timer(program, inputs, RUNS_PER_ROUND) if callable(timer) else None
    return None if seconds is None else seconds * 1e3


def _ratios(entries: dict, key: str, base: float | None) -> dict:
    """spec -> its ``key`` figure over ``base`` (None where either is missing)."""
    return {spec: round(e[key] / base, 4) if base and key in e else None for spec, e in entries.items()}


def _torch_ms(fn) -> float:
    import torch
    best = float("inf")
    with torch.no_grad():
        for _ in range(RUNS_PER_ROUND):
            start = time.perf_counter()
            fn()
            best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def run_peers(targets: list[str], *, rounds: int = 5, quick: bool = False, token: str | None = None,
              workdir: str | Path | None = None, on_step: Callable[[str], None] | None = None) -> dict:
    """Time every workload on every target and torch eager, alternated over ``rounds``; returns
    ``{"targets", "devices", "rounds", "load_avg", "workloads": [{"name", "what", "torch_ms",
    "targets": {spec: {"ms", "max_abs_err", "matches_torch", "resident_ms"? or "resident_error"?, "device_ms"?,
    "roofline_*"?} or {"error"}}, "ratios": {spec: ms over the first target's ms}, "resident_ratios": {spec: resident_ms over
    the first target's, or None}, "vs_torch": {spec: ms over torch's}}]}``. A
    workload a target cannot compile or run is an ``error`` there, not the end of the run.

    Each target is open only while it is timed (a round opens it again: compiled programs come
    from the compile caches), and torch is timed with none open: a runtime's threads that stay
    busy between runs (IREE's on lavapipe wait on the device by spinning, both cores) would
    otherwise be timed as the others' slowness. Scratch files (a carved store) go under ``workdir``,
    a temporary folder removed at the end by default."""
    from tapml.driving.profile import device_roofline, graph_flops
    from tapml.driving.replay import device_info
    from tapml.driving.targets import check_target, open_target
    for spec in targets:
        check_target(spec)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="tapml-peers-") as scratch:
            return run_peers(targets, rounds=rounds, quick=quick, token=token, workdir=scratch, on_step=on_step)
    step = on_step or (lambda _msg: None)
    names = QUICK_WORKLOADS if quick else PEER_WORKLOADS
    root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    step("building the workloads")
    loads = workloads(names, root)
    rows = {name: {"name": name, "what": names[name], "targets": {}} for name in loads}
    times = {name: {who: [] for who in [*targets, "torch"]} for name in loads}
    resident = {name: {who: [] for who in targets} for name in loads}
    doc = {"targets": list(targets), "rounds": rounds, "quick": quick, "devices": {}, "load_avg": []}
    order = [*targets, "torch"]
    for r in range(rounds):
        doc["load_avg"].append(round(os.getloadavg()[0], 2))
        for who in order[r % len(order):] + order[:r % len(order)]:
            step(f"round {r + 1} of {rounds}: {who}")
            if who == "torch":
                for name, (_graph, _inputs, torch_fn, _want) in loads.items():
                    times[name]["torch"].append(_torch_ms(torch_fn))
                continue
            with open_target(who, token=token) as platform:
                if r == 0:
                    doc["devices"][who] = device_info(platform, probe=False)
                    if not quick and (tiles := tuned_tiles(platform, step)) is not None:
                        doc["devices"][who]["matmul_tiles"] = tiles
                for name, (graph, inputs, _torch_fn, want) in loads.items():
                    entry = rows[name]["targets"].setdefault(who, {})
                    if "error" in entry:
                        continue
                    try:
                        program = platform.compile(graph)
                        got = platform.run(program, inputs)
                        if r == 0:
                            entry.update(max_abs_err=_largest_error(got, want), matches_torch=_matches(got, want))
                        times[name][who].append(_run_ms(platform, program, inputs))
                        if "resident_error" not in entry:
                            try:
                                if (ms := _resident_ms(platform, program, inputs)) is not None:
                                    resident[name][who].append(ms)
                            except Exception as e:  # noqa: BLE001 - the run is timed; only this figure is missing
                                entry["resident_error"] = f"{type(e).__name__}: {e}"[:500]
                        if r == rounds - 1 and callable(getattr(platform, "benchmark", None)):
                            s, timing = device_seconds(platform, program, inputs, 3)
                            entry["device_ms"] = round(s * 1e3, 4)
                            entry.update(roofline_figure(platform, program, graph_flops(graph), s, timing))
                    except Exception as e:  # noqa: BLE001 - a workload a target fails is a figure, not a crash
                        entry.clear()
                        entry["error"] = f"{type(e).__name__}: {e}"[:500]
                if r == rounds - 1 and (peaks := device_roofline(platform)):
                    doc["devices"][who]["roofline"] = peaks
    doc["workloads"] = []
    for name, row in rows.items():
        ts = times[name]
        row["torch_ms"] = round(statistics.median(ts["torch"]), 4)
        for spec, entry in row["targets"].items():
            if "error" not in entry and ts[spec]:
                entry["ms"] = round(statistics.median(ts[spec]), 4)
            if "error" not in entry and resident[name][spec]:
                entry["resident_ms"] = round(statistics.median(resident[name][spec]), 4)
        row["ratios"] = _ratios(row["targets"], "ms", row["targets"].get(targets[0], {}).get("ms"))
        row["resident_ratios"] = _ratios(row["targets"], "resident_ms",
                                         row["targets"].get(targets[0], {}).get("resident_ms"))
        row["vs_torch"] = _ratios(row["targets"], "ms", row["torch_ms"])
        doc["workloads"].append(row)
    doc["load_avg_median"] = statistics.median(doc["load_avg"])
    return doc


__all__ = ["run_peers", "workloads", "PEER_WORKLOADS", "QUICK_WORKLOADS", "RUNS_PER_ROUND"]
