"""Limits preflight: hold compiled KernelPrograms to a device's limits before anything runs.

:func:`check_program` looks at one :class:`~tapml.platforms.base.KernelProgram`: every buffer
against ``max-buffer-size``, every binding window against ``max-storage-buffer-binding-size``
and ``min-storage-buffer-offset-alignment``, bindings per kernel against
``max-storage-buffers-per-shader-stage``, workgroup counts against
``max-compute-workgroups-per-dimension`` and each entry point's ``@workgroup_size`` against
``max-compute-invocations-per-workgroup``, each kernel's loop iterations per invocation (as the
compiler counted them) against the device's measured ``loop_cap`` (limit ``loop-iterations``;
:meth:`~tapml.platforms.base.Platform.loop_limits` runs one tiny probe); and it lists the buffers the compiler bound through
several windows (a tensor *split* past the binding limit) and the tensors it held in several
buffers (past ``max-buffer-size``: ``KernelProgram.parts``), and why. :func:`preflight_store`
compiles every case of a carve store on a platform (compiles only; the one kernel it runs is the
device's loop-cap probe, once per platform) and sums that up per op. Everything returned is plain data with ``to_json``.

Example::

    with open_target("wgpu:vulkan", limits={"max-storage-buffer-binding-size": 4096}) as p:
        report = preflight_store(store, p)
        print(report.summary_line())   # preflight: 3 ops split across binding windows (largest: ...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tapml.errors import PlatformError, Unsupported

#: The limits the preflight checks, by their WebGPU names (as in ``caps()["limits"]``).
CHECKED_LIMITS = ("max-buffer-size", "max-storage-buffer-binding-size", "min-storage-buffer-offset-alignment",
                  "max-storage-buffers-per-shader-stage", "max-compute-workgroups-per-dimension",
                  "max-compute-invocations-per-workgroup")

_SHORT_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "i64",
                 "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "uint64": "u64",
                 "bool": "bool"}


def format_bytes(n: int) -> str:
    """A size in the binary units device limits are stated in, so that the two compare at a glance:
    ``262144000`` -> ``"250 MiB"``, ``4096`` -> ``"4 KiB"``, ``5000`` -> ``"4.88 KiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 100 or n % scale == 0 else f"{value:.3g} {unit}"
    return f"{n} B"


#: Limits that are byte counts (the others count buffers, workgroups or invocations).
BYTE_LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size",
               "min-storage-buffer-offset-alignment")


def format_limit(n: int, name: str | None = None) -> str:
    """A limit as devices state it: bytes in binary units (``134217728`` -> ``"128 MiB"``,
    ``4096`` -> ``"4 KiB"``) unless ``name`` names a limit that is a count (not in :data:`BYTE_LIMITS`)."""
    if name is not None and name not in BYTE_LIMITS:
        return str(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def tensor_label(shape, dtype: str) -> str:
    """``"f32 [64000,1024]"`` (just the dtype when the shape is unknown)."""
    return _SHORT_DTYPES.get(dtype, dtype) + ("" if shape is None else " [" + ",".join(map(str, shape)) + "]")


@dataclass(frozen=True)
class SplitBuffer:
    """A buffer bound through several windows: its tensor's ``shape`` (None when the program
    does not say) and ``dtype``, its ``bytes``, how many distinct ``windows`` the kernels bind,
    the largest window's bytes, and the ``limit`` that forced the split with its value (None
    when the buffer would fit one binding: the compiler tiled it for another reason). A tensor
    over ``max-buffer-size`` is held in several device ``buffers`` (its parts; 1 otherwise), and
    its ``limit`` is ``max-buffer-size``."""

    buffer: str
    shape: tuple[int, ...] | None
    dtype: str
    bytes: int
    windows: int
    window_bytes: int
    limit: str | None
    limit_value: int | None
    buffers: int = 1

    def tensor(self) -> str:
        """``"f32 [64000,1024]"``."""
        return tensor_label(self.shape, self.dtype)

    def describe(self) -> str:
        """``"f32 [64000,1024] 250 MiB -> 2 windows over max-storage-buffer-binding-size 128 MiB"``, or
        for a tensor held in several buffers ``"f32 [128256,4096] 2.1 GB -> 2 buffers over
        max-buffer-size 2 GiB, 17 windows of <= 128 MiB"``."""
        if self.buffers > 1:
            over = f" over {self.limit} {format_limit(self.limit_value)}" if self.limit else ""
            return (f"{self.tensor()} {format_bytes(self.bytes)} -> {self.buffers} buffers{over}, {self.windows} "
                    f"windows of <= {format_limit(self.window_bytes)}")
        why = (f" over {self.limit} {format_limit(self.limit_value)}" if self.limit else
               f" of <= {format_limit(self.window_bytes)}")
        return f"{self.tensor()} {format_bytes(self.bytes)} -> {self.windows} windows{why}"

    def to_json(self) -> dict:
        return {"buffer": self.buffer, "shape": None if self.shape is None else list(self.shape), "dtype": self.dtype,
                "bytes": self.bytes, "buffers": self.buffers, "windows": self.windows, "window_bytes": self.window_bytes,
                "limit": self.limit, "limit_value": self.limit_value}


@dataclass(frozen=True)
class LimitViolation:
    """Something a program asks for that the device does not allow: the ``limit`` by name,
    the ``value`` asked for and what is ``allowed``, in ``kernel`` and/or on ``buffer``.
    ``limit`` is ``"buffer-bounds"`` for a window past its buffer's end and ``"workgroup-size"``
    for an entry point whose ``@workgroup_size`` cannot be read (malformed programs)."""

    limit: str
    value: int
    allowed: int
    kernel: str | None = None
    buffer: str | None = None
    detail: str = ""

    def describe(self) -> str:
        """``"kernel k0: buffer w window of 191 MiB over max-storage-buffer-binding-size 128 MiB"``."""
        where = ": ".join(p for p in (self.kernel and f"kernel {self.kernel}", self.buffer and f"buffer {self.buffer}") if p)
        text = self.detail or f"{self.value} over {self.limit} {self.allowed}"
        return f"{where}: {text}" if where else text

    def to_json(self) -> dict:
        return {"limit": self.limit, "value": self.value, "allowed": self.allowed, "kernel": self.kernel,
                "buffer": self.buffer, "message": self.describe()}


@dataclass
class ProgramPreflight:
    """What :func:`check_program` found in one program: its ``kernels``, the largest binding
    window in bytes, the buffers it split and every limit it goes over."""

    kernels: int
    largest_binding: int
    splits: list[SplitBuffer] = field(default_factory=list)
    violations: list[LimitViolation] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.violations

    def to_json(self) -> dict:
        return {"kernels": self.kernels, "largest_binding": self.largest_binding,
                "splits": [s.to_json() for s in self.splits], "violations": [v.to_json() for v in self.violations]}


def _binding_window(binding, size: int) -> tuple[int, int]:
    """``(offset, size)`` of a kernel binding: the whole buffer, or the window of a 4-tuple."""
    if len(binding) >= 4:
        return int(binding[2]), int(binding[3])
    return 0, size


def check_program(program, caps: dict, loop_cap: int | None = None) -> ProgramPreflight:
    """Hold ``program`` (a KernelProgram) to the limits in ``caps["limits"]`` and, when the device
    stops loops (``loop_cap``, from its probe), each kernel's loop iterations to it; see the module.

    A limit the device does not report is not checked, except the offset alignment (256, the
    largest any device may ask). ``graph`` programs (no kernels) have nothing to check.

    Example: ``check_program(platform.compile(graph), platform.caps()).violations``.
    """
    from tapml.platforms.base import MAX_OFFSET_ALIGNMENT
    from tapml.remote.limits import workgroup_size
    limits = caps.get("limits") or {}
    binding_limit = limits.get("max-storage-buffer-binding-size")
    buffer_limit = limits.get("max-buffer-size")
    alignment = limits.get("min-storage-buffer-offset-alignment") or MAX_OFFSET_ALIGNMENT
    per_stage = limits.get("max-storage-buffers-per-shader-stage")
    max_groups = limits.get("max-compute-workgroups-per-dimension")
    max_invocations = limits.get("max-compute-invocations-per-workgroup")
    buffers = {b.name: b for b in program.buffers}
    violations: list[LimitViolation] = []
    for b in program.buffers:
        if buffer_limit is not None and b.size > buffer_limit:
            violations.append(LimitViolation("max-buffer-size", b.size, buffer_limit, buffer=b.name,
                                             detail=f"{format_bytes(b.size)} over max-buffer-size {format_limit(buffer_limit)}"))
    windows: dict[str, set[tuple[int, int]]] = {}
    largest = 0
    for kern in program.kernels:
        if per_stage is not None and len(kern.bindings) > per_stage:
            violations.append(LimitViolation("max-storage-buffers-per-shader-stage", len(kern.bindings), per_stage,
                                             kernel=kern.name, detail=f"binds {len(kern.bindings)} storage buffers, "
                                             f"over max-storage-buffers-per-shader-stage {per_stage}"))
        for binding in kern.bindings:
            buf = buffers.get(binding[0])
            if buf is None:
                continue  # a program naming a buffer it lacks fails validation where it is loaded
            offset, size = _binding_window(binding, buf.size)
            largest = max(largest, size)
            if len(binding) >= 4 and (offset, size) != (0, buf.size):
                windows.setdefault(buf.name, set()).add((offset, size))
            if binding_limit is not None and size > binding_limit:
                violations.append(LimitViolation(
                    "max-storage-buffer-binding-size", size, binding_limit, kern.name, buf.name,
                    f"binds {format_bytes(size)} over max-storage-buffer-binding-size {format_limit(binding_limit)}"))
            if offset % alignment:
                violations.append(LimitViolation(
                    "min-storage-buffer-offset-alignment", offset, alignment, kern.name, buf.name,
                    f"window at offset {offset}, not a multiple of min-storage-buffer-offset-alignment {alignment}"))
            if offset < 0 or size < 0 or offset + size > buf.size:
                violations.append(LimitViolation(
                    "buffer-bounds", offset + size, buf.size, kern.name, buf.name,
                    f"window [{offset}, {offset + size}) outside the buffer's {buf.size} bytes"))
        iterations = getattr(kern, "loop_iterations", None)
        if loop_cap is not None and iterations is not None and iterations > loop_cap:
            violations.append(LimitViolation(
                "loop-iterations", iterations, loop_cap, kern.name,
                detail=f"loops {iterations} times in one invocation; the device stops an invocation's loops after "
                       f"{loop_cap} (its measured loop_cap), so the result would be cut short"))
        if max_groups is not None and any(g > max_groups for g in kern.workgroups):
            violations.append(LimitViolation(
                "max-compute-workgroups-per-dimension", max(kern.workgroups), max_groups, kern.name,
                detail=f"dispatches {tuple(kern.workgroups)} workgroups, over "
                       f"max-compute-workgroups-per-dimension {max_groups}"))
        if max_invocations is not None:
            try:
                per_group = workgroup_size(kern.wgsl, kern.entry)
            except ValueError as e:
                violations.append(LimitViolation("workgroup-size", 0, max_invocations, kern.name, detail=str(e)))
            else:
                if per_group > max_invocations:
                    violations.append(LimitViolation(
                        "max-compute-invocations-per-workgroup", per_group, max_invocations, kern.name,
                        detail=f"@workgroup_size of {per_group} invocations, over "
                               f"max-compute-invocations-per-workgroup {max_invocations}"))
    splits = []
    part_of = {name: t for t in getattr(program, "parts", None) or [] for name, _, _ in t.parts}
    for t in getattr(program, "parts", None) or []:
        spans = [(name, span) for name, _, _ in t.parts for span in windows.get(name, ())]
        splits.append(SplitBuffer(
            buffer=t.name, shape=tuple(t.meta.shape), dtype=t.meta.dtype,
            bytes=sum(buffers[name].size for name, _, _ in t.parts if name in buffers), windows=len(spans),
            window_bytes=max((size for _, (_, size) in spans), default=0), limit="max-buffer-size",
            limit_value=buffer_limit, buffers=len(t.parts)))
    for name, spans in windows.items():
        if name in part_of:
            continue
        buf = buffers[name]
        forced = binding_limit is not None and buf.size > binding_limit
        splits.append(SplitBuffer(
            buffer=name, shape=tuple(buf.meta.shape) if buf.meta is not None else None,
            dtype=buf.meta.dtype if buf.meta is not None else buf.dtype, bytes=buf.size, windows=len(spans),
            window_bytes=max(size for _, size in spans), limit="max-storage-buffer-binding-size" if forced else None,
            limit_value=binding_limit if forced else None))
    return ProgramPreflight(kernels=len(program.kernels), largest_binding=largest, splits=splits, violations=violations)


@dataclass
class OpPreflight:
    """One op of a store on one device: its ``cases`` and their ``kernels``, the largest binding
    window, the buffers split (one entry per distinct tensor, with how many cases split it),
    limits gone over, and why cases were unsupported or failed to compile (reason -> cases)."""

    op: str
    cases: int = 0
    kernels: int = 0
    largest_binding: int = 0
    splits: dict[tuple, dict] = field(default_factory=dict)
    violations: dict[str, dict] = field(default_factory=dict)
    unsupported: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    #: cases whose int64 values, past i32, the target holds in two 32-bit words (64-bit emulation)
    int64_two_words: int = 0

    @property
    def fits(self) -> bool:
        """Whether every case of the op compiled within the device's limits."""
        return not (self.violations or self.unsupported or self.errors)

    def add(self, found: ProgramPreflight) -> None:
        self.kernels += found.kernels
        self.largest_binding = max(self.largest_binding, found.largest_binding)
        for s in found.splits:
            key = (s.shape, s.dtype, s.bytes, s.buffers, s.windows, s.limit)
            entry = self.splits.setdefault(key, {**s.to_json(), "cases": 0, "message": s.describe()})
            entry["cases"] += 1
        for v in found.violations:
            entry = self.violations.setdefault(f"{v.limit}: {v.detail or v.value}", {**v.to_json(), "cases": 0})
            entry["cases"] += 1

    def to_json(self) -> dict:
        return {"op": self.op, "cases": self.cases, "kernels": self.kernels, "largest_binding": self.largest_binding,
                "splits": sorted(self.splits.values(), key=lambda s: -s["bytes"]),
                "violations": list(self.violations.values()),
                "unsupported": [{"reason": r, "cases": n} for r, n in self.unsupported.items()],
                "errors": [{"reason": r, "cases": n} for r, n in self.errors.items()], "fits": self.fits,
                "int64_two_words": self.int64_two_words}


@dataclass
class StorePreflight:
    """:func:`preflight_store`'s result: the device's ``limits`` (as the compiler saw them, with
    the ``forced_limits`` that lowered them), its measured ``loop_cap`` (None: no cap found, or
    not measured) and one :class:`OpPreflight` per op, in store order."""

    target: str
    limits: dict
    forced_limits: dict
    ops: list[OpPreflight]
    loop_cap: int | None = None

    @property
    def fits(self) -> bool:
        """Whether every case compiled within the device's limits (nothing unsupported or over a limit)."""
        return all(o.fits for o in self.ops)

    def largest_split(self) -> dict | None:
        splits = [s for o in self.ops for s in o.splits.values()]
        return max(splits, key=lambda s: s["bytes"]) if splits else None

    def summary_line(self) -> str:
        """One line for before a run: ``"preflight: 3 ops split across binding windows (largest:
        f32 [64000,1024] 250 MiB in 2 windows of <= 128 MiB)"`` (``"split across buffers and binding
        windows"`` when a tensor is over max-buffer-size, ``"in 2 buffers and 17 windows"``), plus
        ops over a limit; empty when nothing was split or over a limit."""
        parts = []
        split_ops = [o for o in self.ops if o.splits]
        if split_ops:
            big = self.largest_split()
            tensor = tensor_label(big["shape"], big["dtype"])
            held = any(s.get("buffers", 1) > 1 for o in split_ops for s in o.splits.values())
            many = f"{big['buffers']} buffers and " if big.get("buffers", 1) > 1 else ""
            parts.append(f"{len(split_ops)} op{'s' * (len(split_ops) != 1)} split across "
                         f"{'buffers and ' if held else ''}binding windows (largest: {tensor} "
                         f"{format_bytes(big['bytes'])} in {many}{big['windows']} windows of <= "
                         f"{format_limit(big['window_bytes'])})")
        over = [o for o in self.ops if o.violations]
        if over:
            names = sorted({v["limit"] for o in over for v in o.violations.values()})
            parts.append(f"{len(over)} op{'s' * (len(over) != 1)} over a device limit ({', '.join(names)})")
        if not parts:
            return ""
        forced = ", ".join(f"{k}={format_limit(v, k)}" for k, v in sorted(self.forced_limits.items()))
        return "preflight: " + "; ".join(parts) + (f" [--device-limit {forced}]" if forced else "")

    def summary(self) -> dict:
        return {"ops": len(self.ops), "cases": sum(o.cases for o in self.ops),
                "ops_split": sum(bool(o.splits) for o in self.ops),
                "ops_over_limit": sum(bool(o.violations) for o in self.ops),
                "ops_unsupported": sum(bool(o.unsupported) for o in self.ops),
                "ops_error": sum(bool(o.errors) for o in self.ops), "largest_split": self.largest_split(),
                "fits": self.fits}

    def to_json(self) -> dict:
        return {"target": self.target, "limits": self.limits, "forced_limits": self.forced_limits,
                "loop_cap": self.loop_cap, "ops": [o.to_json() for o in self.ops], "summary": self.summary()}


def checks_limits(platform) -> bool:
    """Whether ``platform`` reports limits to hold programs to (the reference does not)."""
    return bool((platform.caps().get("limits") or {}))


def preflight_before_run(store, platform, target: str, cases: list[dict] | None = None) -> StorePreflight | None:
    """:func:`preflight_store` for a run about to start (replay, migrate): None when the platform
    has no limits to check (the reference) or its device is lost (the run reports that itself)."""
    from tapml.errors import DeviceLost
    try:
        return preflight_store(store, platform, target, cases) if checks_limits(platform) else None
    except DeviceLost:
        return None


def preflight_store(store, platform, target: str = "", cases: list[dict] | None = None,
                    on_case: Callable[[dict], None] | None = None) -> StorePreflight:
    """Compile each of ``cases`` (default: every case of ``store``) on ``platform`` and check
    each program with :func:`check_program`; no case runs (the device's loop-cap probe does, once). DeviceLost is raised; Unsupported
    and compile failures are recorded per op. ``on_case(case)`` is called after each."""
    caps = platform.caps()
    # the one thing run: the loop-cap probe (a tiny kernel, once per platform), on a device that has limits
    probe = getattr(platform, "loop_limits", None)
    loop_cap = (probe() if callable(probe) and caps.get("limits") else {}).get("loop_cap")
    ops: dict[str, OpPreflight] = {}
    for case in store.cases if cases is None else cases:
        row = ops.setdefault(case["op"], OpPreflight(case["op"]))
        row.cases += 1
        try:
            graph = store.case_graph(case)
            program = platform.compile(graph)
            if hasattr(platform, "for_values") and any(m.dtype == "int64" for m in graph.meta.values()):
                # the program a run would use: int64 values past i32 in two words
                program = platform.for_values(program, store.case_inputs(case))
                row.int64_two_words += bool(platform.last_wide)
            if hasattr(platform, "for_values") and any(m.dtype == "float64" for _, m in graph.inputs):
                # float64 constants run as float32 only where float32 holds their values exactly
                import torch

                from tapml.platforms.wgsl.registry import exact_float32
                for i, t in enumerate(store.case_inputs(case)):
                    if getattr(t, "dtype", None) is torch.float64:
                        exact_float32(t, f"input {i}")
        except Unsupported as e:
            reason = str(e).splitlines()[0][:300]
            row.unsupported[reason] = row.unsupported.get(reason, 0) + 1
        except PlatformError as e:
            reason = str(e).splitlines()[0][:300]
            row.errors[reason] = row.errors.get(reason, 0) + 1
        else:
            row.add(check_program(program, caps, loop_cap))
        if on_case:
            on_case(case)
    return StorePreflight(target=target or getattr(platform, "name", ""), limits=dict(caps.get("limits") or {}),
                          forced_limits=dict(caps.get("forced_limits") or {}), ops=list(ops.values()), loop_cap=loop_cap)


__all__ = ["BYTE_LIMITS", "CHECKED_LIMITS", "LimitViolation", "OpPreflight", "ProgramPreflight", "SplitBuffer",
           "StorePreflight", "check_program", "checks_limits", "preflight_before_run", "format_bytes", "format_limit", "preflight_store"]
