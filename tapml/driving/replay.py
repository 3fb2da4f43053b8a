"""Replay: run every carved case on a platform and compare with the reference's outputs."""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import torch

from tapml.judging.compare import Comparison, Tolerances, compare_anchored, compare_outputs, compare_tensor, float_model_note, merge
from tapml.errors import DeviceLost, PlatformError, Unsupported
from tapml.graph import dtype_name, run_graph
from tapml.driving.profile import measured
from tapml.judging.verdict import STATUSES, CaseVerdict, Verdict, VerdictDocument, outcome_verdict, summary  # noqa: F401 - re-exported


def device_info(platform, probe: bool = True, roofline: bool = False) -> dict:
    """``{adapter, backend, features, limits}`` of a platform, for verdict files (with
    ``error`` when the platform cannot say), and with ``probe`` its measured ``float_model``
    (a run on the device, once per platform) and ``loop_cap``: the loop iterations one invocation
    runs before the device stops it, null when it did not (Platform.loop_limits); with
    ``roofline`` its probed ``roofline`` (Platform.roofline, about a second of probes); DeviceLost
    is raised."""
    try:
        caps = platform.caps()
    except DeviceLost:
        raise
    except PlatformError as e:
        return {"adapter": "unknown", "backend": "unknown", "features": [], "limits": {}, "error": str(e)}
    info = {k: caps.get(k, default) for k, default in
            (("adapter", ""), ("backend", ""), ("features", []), ("limits", {}), ("low_precision", {}))}
    if probe and (model := float_model(platform)):
        info["float_model"] = model
    if probe:
        info.update(loop_limits(platform))
    if roofline:
        from tapml.driving.profile import device_roofline
        if peaks := device_roofline(platform):
            info["roofline"] = peaks
    return info


def loop_limits(platform) -> dict:
    """``{"loop_cap": N or None}`` as the platform measured it (Platform.loop_limits), {} when it cannot."""
    probe = getattr(platform, "loop_limits", None)
    return probe() if callable(probe) else {}


def loop_cap_note(platform, program) -> str:
    """Why a mismatch may be a kernel cut short: its kernels that loop more times per invocation
    than the device's measured loop cap (Platform.loop_limits); empty when none does."""
    cap = loop_limits(platform).get("loop_cap")
    over = [k for k in getattr(program, "kernels", ()) if cap is not None and (k.loop_iterations or 0) > cap]
    if not over:
        return ""
    return (f"kernel {over[0].name} loops {over[0].loop_iterations} times in one invocation and the device stops "
            f"an invocation's loops after {cap} (device loop_cap): its results are cut short")


def float_model(platform) -> dict:
    """The platform's measured float model (NaN/Inf and subnormals kept or not), {} when it has none."""
    probe = getattr(platform, "float_model", None)
    return probe() if callable(probe) else {}


def _reference64(store, case) -> list[torch.Tensor]:
    """The case recomputed in float64: its floating inputs in float64 and, in a float16/bfloat16
    store, every value and ``dtype=`` argument of the store's dtype too (so that a case whose op
    casts to the low dtype is still anchored)."""
    from tapml.dtypes import as_float32
    graph = as_float32(store.case_graph(case), store_dtype(store), to="float64")
    inputs = {r: _in_float64(t) for (r, _), t in zip(graph.inputs, store.case_inputs(case))}
    out = run_graph(graph, inputs)
    return [out[r] for r in graph.outputs]


def _in_float64(t: torch.Tensor) -> torch.Tensor:
    """A floating input in float64, a complex one in complex128 (its float64 pairs), others as they are."""
    return t.to(torch.complex128) if t.is_complex() else t.double() if t.is_floating_point() else t


def store_dtype(store) -> str:
    """The dtype ``store`` was carved in (``float32`` for a store, or a view of one, that does not say)."""
    return getattr(store, "dtype", "float32")


def anchored_by_default(store) -> bool:
    """Whether cases of ``store`` are judged fp64-anchored when nobody says: a float16/bfloat16
    store's are (the reference's own rounding is the yardstick), a float32 store's are not."""
    from tapml.dtypes import LOW_FLOATS
    return store_dtype(store) in LOW_FLOATS


def repeat_runs(platform, program, inputs: list[torch.Tensor], first: list[torch.Tensor], repeat: int) -> str | None:
    """Run ``program`` ``repeat - 1`` more times after a first run that gave ``first`` and
    compare every run's outputs with the first's bit for bit (:class:`tapml.judging.flaky.RunToRun`).
    Returns None when all were identical, else the ``flaky`` verdict's message (how many runs
    differed, each varied output's pattern and map). A later run that fails raises its
    PlatformError (or Unsupported) prefixed with which run it was.

    Example: ``repeat_runs(platform, program, [x], platform.run(program, [x]), 20)``."""
    from tapml.judging.flaky import RunToRun
    if repeat <= 1:
        return None
    runs = RunToRun(first)
    for k in range(1, repeat):
        try:
            runs.add(platform.run(program, inputs))
        except (Unsupported, PlatformError) as e:
            raise type(e)(f"run {k + 1} of {repeat} (run 1 went through): {e}") from e
    return runs.report()


def flaky_verdict(first: Verdict, report: str) -> Verdict:
    """The ``flaky`` verdict of a case whose runs differed (``report`` from :func:`repeat_runs`),
    keeping the first run's error statistics and saying how it compared with the reference."""
    against = f"run 1 against the reference: {first.status}" + (f" ({first.message})" if first.message else "")
    return Verdict(**{**first.outcome(), "status": "flaky", "message": f"{report}\n{against}"})


def judge_case(store, case: dict, outputs: list[torch.Tensor], expected: list[torch.Tensor],
               tolerances: Tolerances | None = None, anchored: bool | None = None) -> Comparison:
    """Compare a case's target ``outputs`` with the reference's ``expected``. ``anchored=True``:
    every float output fp64-anchored; ``False``: the tolerances; None (default): fp64-anchored
    for float16/bfloat16 outputs of a low-precision store (the reference's own rounding is the
    yardstick) and the tolerances for the rest (a float32 op is judged as in a float32 store).
    A sum of products (:data:`~tapml.judging.compare.DECIDED_BY_BOUND`) is decided by its arithmetic
    bound (:mod:`tapml.judging.compare.bounds`) unless ``--tol`` names its tolerance; any other
    accumulating op passes an element the tolerance misses within its own bound.
    A random op (:data:`~tapml.judging.compare.RANDOM_OPS`) is judged by distribution instead, and one
    that returns uninitialized memory (``torch.empty``) on shapes and dtypes only."""
    from tapml.judging.compare import DECIDED_BY_BOUND, RANDOM_OPS, compare_metadata, is_uninitialized_op
    from tapml.dtypes import LOW_FLOATS
    if case["op"] in RANDOM_OPS:
        return _judge_random(store, case, outputs, expected)
    if is_uninitialized_op(case["op"]):
        return compare_metadata(outputs, expected)
    if anchored is None:
        default = anchored_by_default(store)
        anchor = [default and dtype_name(e.dtype) in LOW_FLOATS for e in expected]
    else:
        anchor = [anchored] * len(expected)
    # a sum of products is decided by its arithmetic bound, unless --tol names its tolerance
    overrides = (tolerances or Tolerances()).overrides
    decided = case["op"] in DECIDED_BY_BOUND and len(outputs) == len(expected) and \
        not any(k in overrides for k in (case["op"], case["op"].rsplit(".", 1)[0], "*"))
    bounded = arithmetic_rules(store, case, expected) if decided else None
    if bounded is None:
        if not any(anchor) or len(outputs) != len(expected):  # a count mismatch is reported as such
            result = compare_outputs(outputs, expected, op=case["op"], tolerances=tolerances)
        else:
            ref64 = _reference64(store, case)
            result = merge([compare_anchored([t], [e], [r]) if a else
                            compare_outputs([t], [e], op=case["op"], tolerances=tolerances)
                            for t, e, r, a in zip(outputs, expected, ref64, anchor)])
        if not result.passed and len(outputs) == len(expected) and not decided:
            bounded = arithmetic_rules(store, case, expected)  # a further way to pass, found only when needed
    if bounded is not None:
        ref64, rules = bounded
        result = merge([compare_anchored([t], [e], [r], rules=[rs]) if a else
                        compare_tensor(t, e, *tolerances_for(tolerances, case["op"], e), rules=rs,
                                       fast=None if decided and rs else "tolerance")
                        for t, e, r, a, rs in zip(outputs, expected, ref64, anchor, rules)])
    return _allow_tie_order(store, case, outputs, expected, result)


def tolerances_for(tolerances: Tolerances | None, op: str, expected: torch.Tensor) -> tuple[float, float]:
    """``(rtol, atol)`` for an output of ``op`` shaped as ``expected``."""
    return (tolerances or Tolerances()).get(op, dtype_name(expected.dtype))


def arithmetic_rules(store, case: dict, expected: list[torch.Tensor]) -> tuple[list, list[list]] | None:
    """``(float64 outputs, rules)`` of an accumulating case (:func:`tapml.judging.compare.accumulates`):
    per output, the arithmetic :class:`~tapml.judging.compare.Rule` (the error a correct kernel's
    rounding can make against float64, :mod:`tapml.judging.compare.bounds`), [] for an output with
    none; None for a case with no bound."""
    from tapml.judging.compare import Rule, accumulates, arithmetic_bounds
    from tapml.dtypes import as_float32
    from tapml.graph import decode_arg
    # a complex64 output's parts are float32s
    floats = [dtype_name(e.dtype) if e.is_floating_point() else "float32" for e in expected
              if e.is_floating_point() or e.dtype == torch.complex64]
    if not accumulates(case["op"]) or not floats:
        return None
    graph = as_float32(store.case_graph(case), store_dtype(store), to="float64")
    if len(graph.nodes) != 1:
        return None
    env = {r: _in_float64(t) for (r, _), t in zip(graph.inputs, store.case_inputs(case))}
    node = graph.nodes[0]
    args = decode_arg(node.args, env.__getitem__)
    kwargs = {k: decode_arg(v, env.__getitem__) for k, v in node.kwargs.items()}
    ref64 = _reference64(store, case)
    try:
        bounds = arithmetic_bounds(case["op"], args, kwargs, ref64, floats[0])
    except (RuntimeError, ValueError, TypeError, IndexError):  # arguments the bound cannot read: no bound
        return None
    if bounds is None:
        return None
    rules = [[Rule("arithmetic", r, b, f"c(n) u sum|terms| in {floats[0]}")] if b is not None
             and (e.is_floating_point() or e.is_complex()) else [] for r, b, e in zip(ref64, bounds, expected)]
    return (ref64, rules) if any(rules) else None


def _judge_random(store, case: dict, outputs, expected) -> Comparison:
    """A random op's outputs judged on shape, dtype and distribution, never on values
    (:func:`tapml.judging.compare.compare_distribution`, with the case's decoded arguments)."""
    from tapml.judging.compare import compare_distribution
    from tapml.graph import decode_arg
    graph = store.case_graph(case)
    env = dict(zip([r for r, _ in graph.inputs], store.case_inputs(case)))
    node = graph.nodes[0]
    args = decode_arg(node.args, env.__getitem__)
    kwargs = {k: decode_arg(v, env.__getitem__) for k, v in node.kwargs.items()}
    return compare_distribution(case["op"], outputs, expected, args, kwargs)


def _allow_tie_order(store, case: dict, outputs, expected, result: Comparison) -> Comparison:
    """A sort's or topk's result whose values match and whose indices differ only in the order
    of equal values passes (torch leaves that order unspecified), with a note saying so."""
    from tapml.judging.compare import indices_pick_equal_values, tie_dim
    dim = tie_dim(case["op"], case["args"], case["kwargs"])
    if result.passed or dim is None or len(outputs) != 2 or len(expected) != 2:
        return result
    values_ok = compare_outputs([outputs[0]], [expected[0]], op=case["op"]).passed
    if not values_ok or not indices_pick_equal_values(store.case_inputs(case)[0], dim, outputs[1], expected[0]):
        return result
    return Comparison(True, 0.0, 0.0, 0.0, message="indices differ from the reference only in the order of equal "
                      "values (torch leaves the order of ties unspecified)")


def replay_case(platform, store, case: dict, tolerances: Tolerances | None = None,
               anchored: bool | None = None, profile: int = 0, repeat: int = 1, clock=None) -> CaseVerdict:
    """Run one case on ``platform`` and judge it against the reference's outputs. A platform
    failure is a verdict (see :func:`~tapml.judging.verdict.outcome_verdict`); DeviceLost is raised.
    ``anchored``: judge floats fp64-anchored (:func:`~tapml.judging.compare.compare_anchored`); None
    (default) means so for a float16/bfloat16 store (:func:`anchored_by_default`).
    ``profile``: time that many more runs of a case that ran and record their median device
    time, GFLOP/s and GB/s on the verdict (:func:`tapml.driving.profile.profile_program`).
    ``repeat``: run the case that many times; outputs that differ from run to run make it
    ``flaky`` (:func:`repeat_runs`), whatever the first run's comparison says.
    ``clock``: a :class:`tapml.driving.profile.StageClock` that the comparison's seconds are added to."""
    start = time.perf_counter()
    speed, timing, first_ms, two_words = {}, {}, None, None
    try:
        graph = store.case_graph(case)
        try:
            program = platform.compile(graph)
        finally:
            timing = backend_timing(platform)
        inputs = store.case_inputs(case)
        outputs = platform.run(program, inputs)
        first_ms = getattr(platform, "last_run_ms", None)
        two_words = list(getattr(platform, "last_wide", ()) or ()) or None
        varied = repeat_runs(platform, program, inputs, outputs, repeat)
    except (Unsupported, PlatformError) as e:
        outcome = outcome_verdict(e)
    else:
        time_ms = round(first_ms if first_ms is not None else (time.perf_counter() - start) * 1e3, 4)
        expected = store.case_outputs(case)
        with measured(clock, "compare"):
            result = judge_case(store, case, outputs, expected, tolerances, anchored)
        outcome = outcome_verdict(result, time_ms)
        if outcome.status == "mismatch":
            note = float_model_note(float_model(platform), inputs + expected)
            outcome.message = "; ".join(m for m in (outcome.message, note, loop_cap_note(platform, program)) if m)
        if varied:
            outcome = flaky_verdict(outcome, varied)
        if two_words:
            note = f"int64 past i32 held in two 32-bit words: {', '.join(two_words[:6])}" + \
                (f" (+{len(two_words) - 6})" if len(two_words) > 6 else "")
            outcome.message = "; ".join(m for m in (outcome.message, note) if m)
        if profile:
            from tapml.driving.profile import profile_program
            try:
                speed = profile_program(platform, program, inputs, graph, runs=profile)
            except (Unsupported, PlatformError) as e:
                outcome.message = (outcome.message + "; " if outcome.message else "") + f"not profiled: {e}"
    if timing and first_ms is not None:
        timing["run_s"] = round(first_ms / 1e3, 6)
    return CaseVerdict(id=case["id"], op=case["op"], node=case["node"], module=case["module"],
                       instances=case.get("instances", 1), **outcome.outcome(), **speed, **timing,
                       int64_two_words=two_words)


def backend_timing(platform) -> dict:
    """``{"compile_s", "compile_cached"}`` of the last compile on an external backend's target (which
    reports ``last_compile_ms``: :class:`~tapml.remote.device_worker.WorkerPlatform`); {} elsewhere."""
    ms = getattr(platform, "last_compile_ms", None)
    if ms is None:
        return {}
    return {"compile_s": round(ms / 1e3, 6), "compile_cached": bool(getattr(platform, "last_compile_cached", False))}


class ControlTarget:
    """The control of an external backend's target: the same route on a mature device (its
    ``Backend.control``, reported in the platform's caps as ``control``), opened once, lazily, in a
    worker of its own (:func:`tapml.driving.targets.open_target`, no fault injection) when a case first fails.

    :meth:`blame` re-runs a failed case there: ``route`` when it fails there too (the export route
    or the front end is at fault), ``device compiler`` when it passes. A target without a control
    blames nothing. Example::

        with ControlTarget.of(platform) as control:
            verdict = control.blame(store, case, replay_case(platform, store, case))
    """

    def __init__(self, spec: str | None):
        self.spec = spec
        self._platform = None
        self._failed: str | None = None

    @classmethod
    def of(cls, platform, target: str = "") -> "ControlTarget":
        """The control a platform's caps name (none when it names none or cannot say). A backend behind
        ``remote://`` or ``registry://`` names its control on the server's machine, so none runs here."""
        if target.startswith(("remote://", "registry://")):
            return cls(None)
        try:
            control = platform.caps().get("control")
        except (PlatformError, Unsupported):
            control = None
        return cls(control if isinstance(control, str) and control else None)

    def blame(self, store, case: dict, verdict: CaseVerdict, tolerances: Tolerances | None = None,
              anchored: bool | None = None) -> CaseVerdict:
        """``verdict`` with ``blame``, ``control`` and ``control_status`` set when it failed and
        the control could run the case (the control's own failure to open is said in the message)."""
        if self.spec is None or verdict.status in ("pass", "flaky"):
            return verdict
        platform = self._open()
        if platform is None:
            verdict.message = "; ".join(m for m in (verdict.message, f"control {self.spec} not run: {self._failed}") if m)
            return verdict
        try:
            there = replay_case(platform, store, case, tolerances, anchored)
        except DeviceLost as e:
            there = CaseVerdict(status="error", message=str(e))
        verdict.control, verdict.control_status = self.spec, there.status
        verdict.blame = "device compiler" if there.status == "pass" else "route"
        said = (f"control {self.spec} passes: blame the device compiler" if there.status == "pass" else
                f"control {self.spec} fails too ({there.status}): blame the route (export, front end)")
        verdict.message = "; ".join(m for m in (verdict.message, said) if m)
        return verdict

    def _open(self):
        if self._platform is None and self._failed is None:
            from tapml.errors import TapmlError
            from tapml.driving.targets import open_target
            try:
                self._platform = open_target(self.spec)
            except TapmlError as e:
                self._failed = str(e)
        return self._platform

    def close(self) -> None:
        if self._platform is not None:
            self._platform.close()
            self._platform = None

    def __enter__(self) -> "ControlTarget":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_case(platform, store, case: dict, tolerances: Tolerances | None = None, anchored: bool | None = None) -> dict:
    """:func:`replay_case` as the case's Verdict JSON; DeviceLost is raised, never a verdict."""
    return replay_case(platform, store, case, tolerances, anchored).to_json()


def first_cases(cases: list[dict], per_op: int) -> list[dict]:
    """The first ``per_op`` of ``cases`` of each op, in their order (``replay --per-op``: a quick
    pass over every op of a store whose ops each have many cases)."""
    if per_op < 1:
        raise ValueError(f"per_op must be at least 1, not {per_op}")
    seen: Counter[str] = Counter()
    kept = []
    for case in cases:
        seen[case["op"]] += 1
        if seen[case["op"]] <= per_op:
            kept.append(case)
    return kept


def replay(store, platform, target: str, tolerances: Tolerances | None = None, anchored: bool | None = None,
           cases: list[dict] | None = None, on_case: Callable[[dict], None] | None = None, profile: int = 0,
           repeat: int = 1, guards: bool = False, preflight: Callable | None = None) -> dict:
    """Replay ``cases`` (default: all) of ``store`` on ``platform``; returns the Verdict JSON.
    ``anchored``: fp64-anchored judging, None for the store's default (see :func:`replay_case`).
    ``profile``: record each case's device time, the median of that many runs (see :func:`replay_case`).
    ``repeat``: run each case that many times, ``flaky`` when its outputs vary. ``guards``: check
    every run for writes past the end of a buffer (:meth:`Platform.enable_guards`; TapmlError
    when the platform cannot), which are ``error`` verdicts naming the kernel and buffer.
    ``preflight``: first hold the cases to the device's limits, compiling only
    (:func:`tapml.driving.preflight.preflight_before_run`); ``preflight(report)`` is called with the
    :class:`~tapml.driving.preflight.StorePreflight` and its JSON is the document's ``preflight``.

    A case that finds the device gone is an ``error`` verdict saying so, and the replay goes
    on: the next case may find it back (a remote platform reconnects by itself).

    On an external backend that names a control (:class:`ControlTarget`), a case that fails is
    run on the control too and its verdict says which layer to ``blame``.

    On a pool (``registry://``) the cases spread over its devices (:func:`tapml.driving.targets.spread`):
    a case whose device is lost runs again on another, each verdict says the ``device`` that
    ran it, the document lists the pool's ``devices`` (what each served, why one left), and
    only a case no device is left for is an ``error`` verdict."""
    from tapml.errors import TapmlError
    if not (isinstance(repeat, int) and repeat >= 1):
        raise TapmlError(f"--repeat {repeat}: give a number of runs of 1 or more (2 or more to check for flaky kernels)")
    if guards and not platform.enable_guards():
        raise TapmlError(f"--guards: {target} cannot check for out-of-bounds writes; wgpu targets "
                         "(wgpu, wgpu:vulkan, wgpu:gl, ...) and browser can")
    from tapml.driving.targets import spread
    verdicts = []
    try:
        device = device_info(platform, roofline=bool(profile))
    except DeviceLost as e:
        device = {"adapter": "unknown", "backend": "unknown", "features": [], "limits": {}, "error": str(e)}
    todo = store.cases if cases is None else cases
    checked = None
    if preflight is not None:
        from tapml.driving.preflight import preflight_before_run
        checked = preflight_before_run(store, platform, target, todo)
        if checked is not None:
            preflight(checked)

    def lost(case: dict, e: DeviceLost) -> CaseVerdict:
        return CaseVerdict(id=case["id"], op=case["op"], node=case["node"], module=case["module"],
                           instances=case.get("instances", 1), status="error", message=f"error: {e}")

    # A pool (registry://): the cases spread over its devices, each case's verdict made once,
    # on the device that ran it (recorded per case), reported back in the store's order.
    pooled = spread(platform, todo, lambda device, case: replay_case(device, store, case, tolerances, anchored,
                                                                     profile, repeat),
                    on_result=(lambda i, v, ran_on: on_case({**v.to_json(), "device": ran_on})) if on_case else None,
                    on_lost=lost)
    if pooled is not None:
        for v, ran_on in pooled:
            v.device = ran_on or None
            verdicts.append(v)
    with ControlTarget.of(platform, target) if pooled is None else ControlTarget(None) as control:
        for case in todo if pooled is None else ():
            try:
                v = control.blame(store, case, replay_case(platform, store, case, tolerances, anchored, profile, repeat),
                                  tolerances, anchored)
            except DeviceLost as e:
                v = lost(case, e)
            verdicts.append(v)
            if on_case:
                on_case(v.to_json())
    doc = VerdictDocument(target=target, device=device, model=store.model, tolerances=(tolerances or Tolerances()).to_json(),
                          dtype=store_dtype(store), anchored=anchored_by_default(store) if anchored is None else anchored,
                          cases=verdicts).to_json()
    if pooled is not None:
        doc["devices"] = _pool_of(platform).pool.describe()
    if checked is not None:
        doc["preflight"] = checked.to_json()
    return doc


def _pool_of(platform):
    """The PoolPlatform under a (possibly fault-injected) pool platform."""
    return getattr(platform, "inner", platform)


def injects_into(target: str) -> bool:
    """Whether ``--inject`` faults go into ``target`` when several targets run side by side:
    every target but ``reference`` (the column the others are read against)."""
    return not (target == "reference" or target.startswith("reference:"))


def replay_targets(store, targets: list[str], *, token: str | None = None, inject: list[str] | None = None,
                   on_target: Callable[[str, int], None] | None = None, limits: dict[str, int] | None = None,
                   kernels: list[str] | None = None, **options) -> dict[str, dict]:
    """Replay ``store`` on each of ``targets`` in turn; returns ``{target: Verdict JSON}`` in
    their order, each exactly what :func:`replay` returns for that target alone.

    Each platform is closed before the next opens, so a browser and a wgpu device never compete
    for the machine. ``inject`` goes into every target but ``reference`` (:func:`injects_into`).
    ``limits`` (``--device-limit``) are lowered on every target but ``reference`` too.
    ``kernels`` (``--kernel OP=FILE.wgsl``) go into the WGSL targets (:func:`tapml.driving.targets.takes_kernels`).
    ``on_target(target, index)`` is called before each opens; ``options`` go to :func:`replay`
    (``tolerances``, ``anchored``, ``cases``, ``on_case``...).

    Example: ``replay_targets(store, ["reference", "wgpu:vulkan"])["wgpu:vulkan"]["summary"]``.
    """
    from tapml.errors import TapmlError
    from tapml.driving.targets import check_target, open_target, takes_kernels
    for t in targets:
        check_target(t)
    if kernels and not any(takes_kernels(t) for t in targets):
        raise TapmlError(f"--kernel replaces a lowering of tapml's WGSL compiler, and none of {', '.join(targets)} "
                         "runs it: add a wgpu, browser or remote:// target")
    repeated = sorted({t for t in targets if targets.count(t) > 1})
    if repeated:
        raise TapmlError(f"--target {repeated[0]} is given twice; name each target once")
    results = {}
    for i, target in enumerate(targets):
        if on_target:
            on_target(target, i)
        with open_target(target, token=token, inject=inject if injects_into(target) else None,
                         limits=limits if injects_into(target) else None,
                         kernels=kernels if takes_kernels(target) else None) as platform:
            results[target] = replay(store, platform, target, **options)
    return results
