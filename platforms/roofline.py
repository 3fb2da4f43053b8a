"""A roofline per device: what the device can do at best, measured by probe kernels, and how far
a measured kernel is from it.

Four probes, each a hand-written WGSL program run on the device like any other
(:meth:`tapml.platforms.base.Platform.roofline` runs them once per platform):

- ``peak_gflops``: eight independent chains of vec4 multiply-adds per lane, no memory traffic;
- ``storage_gbps``: every lane sums vec4 loads of a 32 MiB storage buffer, grid-strided so that
  neighbouring lanes read neighbouring vec4s (the buffer never leaves the device);
- ``workgroup_gbps``: every lane sums vec4 loads from a 4 KiB ``var<workgroup>`` array;
- ``dispatch_us``: one more empty kernel in the same submission.

Each probe's result reaches memory only through a condition no value meets, so no compiler can
drop the work, and each grows its work until one run lasts :data:`MIN_SECONDS` (a GPU finishes a
CPU adapter's probe in microseconds). Runs are timed with the runtime's ``benchmark`` (inputs
resident; GPU timestamps where the device has them, as ``replay --profile`` times a case) where it
has one, else as whole runs less the round trip of a program that does nothing (the browser,
remote devices). Figures are the best of three timings:
a shared machine's load only ever slows a probe down.

:func:`attained` places a measured kernel on the roofline: the least time its FLOPs, its bytes and
its dispatches can take on the device, which of the three bounds it, and the fraction of that
bound reached (1.0 is the device's limit).
"""

from __future__ import annotations

import time

from tapml.graph import TensorMeta
from tapml.platforms.base import BufferSpec, Kernel, KernelProgram

#: A probe's work grows until one run lasts this long (seconds), or its size limit is reached.
MIN_SECONDS = 0.002
LANES = 64
#: Bytes of the storage buffer the bandwidth probe reads (under every device's 128 MiB binding limit).
STORAGE_BYTES = 32 << 20
#: Empty kernels in the dispatch probe's longer program.
DISPATCHES = 64
_SINK = ("@group(0) @binding(0) var<storage, read> probe: array<f32>;\n"
         "@group(0) @binding(1) var<storage, read_write> sink: array<f32>;\n")
# the result is kept alive by a store that no probe value reaches (sums of small positive numbers)
_KEEP = "  if (s.x + s.y + s.z + s.w == -1.5) { sink[0] = s.x; }\n"


def _program(name: str, wgsl: str, groups: int, copies: int = 1, loops: int = 0, temp: int = 0) -> KernelProgram:
    f32 = lambda n: TensorMeta((n,), "float32")  # noqa: E731
    buffers = [BufferSpec("probe", "f32", 16, "input", f32(4)), BufferSpec("sink", "f32", 4, "output", f32(1))]
    bindings = [("probe", "read"), ("sink", "read_write")]
    if temp:
        buffers.append(BufferSpec("data", "f32", temp, "temp", f32(temp // 4)))
        bindings.append(("data", "read"))
    kernels = [Kernel(f"{name}{i}", wgsl, list(bindings), (groups, 1, 1), loop_iterations=loops) for i in range(copies)]
    return KernelProgram(kind="wgsl", inputs=["probe"], outputs=["sink"], buffers=buffers, kernels=kernels,
                         input_meta=[f32(4)], output_meta=[f32(1)])


#: Independent multiply-add chains per lane in the peak probe, and steps of each per loop iteration
#: (fewer leave lavapipe bound by its loop's own overhead: 55 GFLOP/s with one step, 105 with four).
CHAINS, UNROLL = 8, 4
PEAK_ITERATIONS = 256


def _peak(iterations: int) -> str:
    chains = "\n".join(f"  var a{i}: vec4<f32> = vec4<f32>(f32(gid.x % 7u) * 1e-3 + {i + 1}.0);" for i in range(CHAINS))
    steps = " ".join(f"a{i} = a{i} * m + c;" for _ in range(UNROLL) for i in range(CHAINS))
    return (_SINK + f"\n@compute @workgroup_size({LANES})\nfn main(@builtin(global_invocation_id) gid: vec3<u32>) {{\n"
            "  let m = vec4<f32>(probe[0]);\n  let c = vec4<f32>(probe[1]);\n" + chains + "\n"
            f"  for (var i: i32 = 0; i < {iterations}; i = i + 1) {{ {steps} }}\n"
            f"  let s = {' + '.join(f'a{i}' for i in range(CHAINS))};\n" + _KEEP + "}\n")


def _storage(lanes: int, passes: int) -> str:
    per_lane = STORAGE_BYTES // 16 // lanes
    return ("@group(0) @binding(0) var<storage, read> probe: array<f32>;\n"
            "@group(0) @binding(1) var<storage, read_write> sink: array<f32>;\n"
            "@group(0) @binding(2) var<storage, read> data: array<vec4<f32>>;\n"
            f"\n@compute @workgroup_size({LANES})\nfn main(@builtin(global_invocation_id) gid: vec3<u32>) {{\n"
            "  let g = i32(gid.x);\n  var s0 = vec4<f32>(probe[1]);\n  var s1 = s0;\n  var s2 = s0;\n  var s3 = s0;\n"
            f"  for (var p: i32 = 0; p < {passes}; p = p + 1) {{\n"
            f"    for (var j: i32 = 0; j < {per_lane}; j = j + 4) {{\n"
            + "".join(f"      s{u} = s{u} + data[g + (j + {u}) * {lanes}];\n" for u in range(4)) +
            "    }\n  }\n  let s = s0 + s1 + s2 + s3;\n" + _KEEP + "}\n")


def _workgroup(iterations: int) -> str:
    return (_SINK + f"var<workgroup> tile: array<vec4<f32>, {4 * LANES}>;\n"
            f"\n@compute @workgroup_size({LANES})\n"
            "fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {\n"
            "  let l = i32(lid.x);\n"
            f"  for (var j: i32 = 0; j < 4; j = j + 1) {{ tile[l + {LANES} * j] = vec4<f32>(probe[1] * f32(l + j)); }}\n"
            "  workgroupBarrier();\n  var s0 = vec4<f32>(0.0);\n  var s1 = s0;\n  var s2 = s0;\n  var s3 = s0;\n"
            f"  for (var i: i32 = 0; i < {iterations}; i = i + 1) {{\n"
            f"    let b = (l + i) & {4 * LANES - 1};\n"
            f"    s0 = s0 + tile[b];\n    s1 = s1 + tile[(b + {LANES}) & {4 * LANES - 1}];\n"
            f"    s2 = s2 + tile[(b + {2 * LANES}) & {4 * LANES - 1}];\n"
            f"    s3 = s3 + tile[(b + {3 * LANES}) & {4 * LANES - 1}];\n  }}\n"
            "  let s = s0 + s1 + s2 + s3;\n" + _KEEP + "}\n")


_EMPTY = (_SINK + f"\n@compute @workgroup_size({LANES})\nfn main(@builtin(global_invocation_id) gid: vec3<u32>) {{\n"
          "  if (gid.x == 4294967295u) { sink[0] = probe[0]; }\n}\n")


class _Clock:
    """Seconds per run of a probe program on ``platform``, taken as ``replay --profile`` takes a
    case's (so that the two compare): the runtime's ``device_times`` (GPU timestamps where the
    device has them) or ``benchmark``, else whole runs less the round trip of a program that does
    nothing."""

    def __init__(self, platform):
        import torch
        self.platform = platform
        self.inputs = [torch.tensor([0.999, 0.001, 0.0, 0.0])]
        times, bench = getattr(platform, "device_times", None), getattr(platform, "benchmark", None)
        self.times = times if callable(times) else None
        self.bench = bench if callable(bench) else None
        self.floor = 0.0
        if self.times is None and self.bench is None:
            self.floor = self._runs(_program("empty", _EMPTY, 1))
        self.how = "device" if self.times or self.bench else "round trip"

    def _runs(self, program) -> float:
        self.platform.run(program, self.inputs)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            self.platform.run(program, self.inputs)
            best = min(best, time.perf_counter() - start)
        return best

    def __call__(self, program) -> float:
        if self.times is not None:
            return min(self.times(program, self.inputs, 5)[0]) / 1e3
        if self.bench is not None:
            self.platform.run(program, self.inputs)
            return min(self.bench(program, self.inputs, repeat=3) for _ in range(3))
        return max(self._runs(program) - self.floor, 1e-9)


def _grown(clock: _Clock, make, size: int, limit: int) -> tuple[float, int]:
    """Time ``make(size)`` (a program), growing ``size`` 4x at a time until a run lasts
    :data:`MIN_SECONDS` or ``size`` would pass ``limit``; returns (seconds, size)."""
    while True:
        seconds = clock(make(size))
        if seconds >= MIN_SECONDS or size * 4 > limit:
            return seconds, size
        size *= 4


def probe(platform) -> dict:
    """Run the four probes on ``platform``: ``{"peak_gflops", "storage_gbps", "workgroup_gbps",
    "dispatch_us", "timing"}`` (``timing``: ``"device"`` or ``"round trip"``). Raises what the
    platform raises for a program it cannot run."""
    clock = _Clock(platform)
    iterations = PEAK_ITERATIONS
    s, groups = _grown(clock, lambda g: _program("peak", _peak(iterations), g, loops=iterations), 16, 65535)
    peak = LANES * groups * iterations * CHAINS * UNROLL * 4 * 2 / s

    lanes = LANES * 256
    per_lane = STORAGE_BYTES // 16 // lanes
    s, passes = _grown(clock, lambda p: _program("loads", _storage(lanes, p), 256, loops=p * per_lane // 4,
                                                   temp=STORAGE_BYTES), 1, 16)
    storage = STORAGE_BYTES * passes / s

    iterations = 1024
    s, groups = _grown(clock, lambda g: _program("shared", _workgroup(iterations), g, loops=iterations + 4), 16, 65535)
    shared = LANES * groups * iterations * 4 * 16 / s

    one = clock(_program("empty", _EMPTY, 1))
    many = clock(_program("empty", _EMPTY, 1, copies=DISPATCHES))
    dispatch = max(many - one, 0.0) / (DISPATCHES - 1)
    return {"peak_gflops": round(peak / 1e9, 3), "storage_gbps": round(storage / 1e9, 3),
            "workgroup_gbps": round(shared / 1e9, 3), "dispatch_us": round(dispatch * 1e6, 3), "timing": clock.how}


def attained(roofline: dict, flops: float, nbytes: float, seconds: float, kernels: int = 1) -> dict:
    """Where a kernel that did ``flops`` and moved ``nbytes`` in ``seconds`` (``kernels``
    dispatches) stands on ``roofline`` (a :func:`probe` result): ``{"bound": "compute" | "memory"
    | "dispatch", "bound_ms", "fraction"}``, the least time the device needs for it, what bounds
    that time, and ``bound_ms`` over the measured time. Empty when the roofline or the time is
    missing."""
    peak, bandwidth = roofline.get("peak_gflops"), roofline.get("storage_gbps")
    if not peak or not bandwidth or not seconds or seconds <= 0:
        return {}
    floors = {"compute": flops / (peak * 1e9), "memory": nbytes / (bandwidth * 1e9),
              "dispatch": kernels * (roofline.get("dispatch_us") or 0.0) * 1e-6}
    bound = max(floors, key=floors.get)
    return {"bound": bound, "bound_ms": round(floors[bound] * 1e3, 6), "fraction": round(floors[bound] / seconds, 4)}


__all__ = ["probe", "attained", "MIN_SECONDS", "STORAGE_BYTES"]
