"""The tapml pytest plugin: run carved cases as pytest tests, in generated or hand-written suites.

Loaded into every pytest run through the ``pytest11`` entry point, so it imports nothing heavy
until a tapml test actually runs. It adds these options (and ini keys of the same name without
the dashes, e.g. ``tapml_target = wgpu:vulkan``):

``--tapml-target SPEC``      the target to check (any TARGET spec; default ``reference``); a
                             ``registry://HOST:PORT[?platform=P]`` pool gives each pytest-xdist
                             worker its own device (``-n auto``: one worker per live device)
``--tapml-tol OP=RTOL,ATOL`` tolerance override, as ``tapml replay --tol`` (repeatable)
``--tapml-inject OP=KIND``   fault injection, as ``tapml replay --inject`` (repeatable)
``--tapml-kernel OP=FILE``   your own WGSL kernel for OP, as ``tapml replay --kernel`` (repeatable; replaces
                             the kernels a generated suite carries)
``--tapml-token-file FILE``  device server token for ``remote://`` targets (else $TAPML_TOKEN)
``--tapml-token-map FILE``   JSON ``{"HOST:PORT": token, "*": fallback}``: a token per server of a pool
``--tapml-store DIR``        the carve store of hand-written suites
``--tapml-repeat K``         run each case K times; outputs that differ run to run fail it as flaky
``--tapml-baseline OLD.json`` a ``tapml replay --profile --json`` file: each case is also timed,
                             and fails when it is more than 25% (and 0.5 ms) slower than there, with confidence

and these fixtures:

``tapml_target``  the opened target platform (session scope, closed at the end)
``tapml_store``   the :class:`~tapml.carving.store.CarveStore` (a generated conftest overrides it)
``tapml_case``    one carved case, ready to run: ``tapml_case.check()`` runs it on the target
                  and fails with op, node, module and error statistics when it does not pass.

A hand-written test that asks for ``tapml_case`` without parametrizing it runs once per case
of the store; ``@pytest.mark.tapml(op="aten.mm.default")`` narrows it to one op::

    @pytest.mark.tapml(op="aten.mm.default")
    def test_matmuls(tapml_case):
        tapml_case.check()

Cases are judged by :func:`tapml.driving.replay.run_case`, exactly like ``tapml replay``. Each test records
the device it ran on as the JUnit properties ``tapml_device`` (the target, ``remote://HOST:PORT``
for a pool's device) and ``tapml_adapter``.

Over a device pool (``--tapml-target registry://...``), worker ``gwN`` of ``pytest -n K`` takes
device ``N`` (modulo the pool's size) of the pool's live devices sorted by target; without xdist
the run takes the first. When that device goes away during a test, the test runs again on the
next live device of the pool, which the worker keeps from then on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

_OPTIONS = (
    ("--tapml-target", "tapml_target", "store", "Target to check: reference, wgpu[:vulkan|gl|metal|dx12], "
     "browser, remote://HOST:PORT, registry://HOST:PORT[?platform=P] (a device per xdist worker; "
     "-n auto: one worker per device) (default: the suite's target, else reference)"),
    ("--tapml-tol", "tapml_tol", "append", "Tolerance override OP=RTOL,ATOL or RTOL,ATOL (repeatable); "
     "takes precedence over the tolerances a generated suite recorded"),
    ("--tapml-inject", "tapml_inject", "append", "Fault OP[@NODE]=scale:F|offset:F|nan|compile-error "
     "(repeatable): proves the suite catches a broken kernel"),
    ("--tapml-kernel", "tapml_kernel", "append", "OP=FILE.wgsl: your own WGSL kernel in place of tapml's "
     "lowering of OP on WGSL targets (repeatable; replaces the kernels a generated suite carries)"),
    ("--tapml-token-file", "tapml_token_file", "store", "File holding the device server token "
     "for remote:// targets (else $TAPML_TOKEN)"),
    ("--tapml-token-map", "tapml_token_map", "store", "JSON file mapping HOST:PORT (or \"*\") to the token "
     "of each device server of a registry:// pool"),
    ("--tapml-store", "tapml_store", "store", "Carve store whose cases hand-written tests that use "
     "the tapml_case fixture run"),
    ("--tapml-repeat", "tapml_repeat", "store", "Run each case K times (default 1); a case whose outputs "
     "are not bit-identical run to run fails as flaky, with a map of the elements that varied"),
    ("--tapml-baseline", "tapml_baseline", "store", "A `tapml replay --profile --json` file: time each case "
     "and fail it when it is more than 25% slower than the same case there"),
)


class CaseFailure(AssertionError):
    """A carved case did not pass on the target (mismatch, unsupported or error)."""


@dataclass(frozen=True)
class CaseSpec:
    """What a generated test records about its case: the case id in the store and the
    tolerances it was generated with (None: the dtype's default)."""

    case_id: str
    rtol: float | None = None
    atol: float | None = None


def case(case_id: str, test_id: str, tol: tuple[float, float] | None = None, known=None):
    """One parameter of a generated test: ``case("c12", "model.mlp::aten.mm.default[16x64-64x128]",
    tol=(1e-3, 1e-4), known=xfail("mismatch: ..."))``."""
    rtol, atol = tol if tol is not None else (None, None)
    marks = [] if known is None else [known]
    return pytest.param(CaseSpec(case_id, rtol, atol), id=test_id, marks=marks)


def xfail(reason: str):
    """A known failure that must keep failing: strict, so an unexpected pass fails the run."""
    return pytest.mark.xfail(reason=reason, strict=True, raises=CaseFailure)


def skip(reason: str):
    """A known failure that is not run."""
    return pytest.mark.skip(reason=reason)


def failing(reason: str):
    """A known failure that is run and fails; the recorded reason is added to its message."""
    return pytest.mark.tapml_known_failure(reason=reason)


def pytest_addoption(parser):
    group = parser.getgroup("tapml", "tapml: check carved cases on a target")
    for flag, dest, action, help_text in _OPTIONS:
        group.addoption(flag, dest=dest, action=action, default=None, help=help_text)
        parser.addini(dest, help=help_text.split(" (")[0], type="linelist" if action == "append" else "string",
                      default=[] if action == "append" else "")


def _opt(config, dest: str):
    value = config.getoption(dest, default=None)
    if value:
        return value
    try:
        return config.getini(dest) or None
    except ValueError:
        return None


def pytest_configure(config):
    config.addinivalue_line("markers", "tapml(op=None, store=None): select the carved cases a tapml_case "
                            "test runs (by op; from another store)")
    config.addinivalue_line("markers", "tapml_known_failure(reason): a case recorded as failing during "
                            "migration; it is expected to fail and its message carries the reason")
    from tapml.errors import TapmlError
    try:
        target = _opt(config, "tapml_target")
        if target:
            from tapml.driving.targets import check_target
            check_target(target)
        inject = _opt(config, "tapml_inject")
        if inject:
            from tapml.driving.inject import parse_faults
            parse_faults(inject)
        kernels = _opt(config, "tapml_kernel")
        if kernels:
            from tapml.platforms.wgsl.user_kernels import parse_kernel_options
            parse_kernel_options(kernels)
        tol = _opt(config, "tapml_tol")
        if tol:
            _cli_tolerances(tol)
        repeat_option(config)
        baseline_option(config)
    except TapmlError as e:
        raise pytest.UsageError(f"tapml: {e}") from None


_BASELINES: dict[str, object] = {}


def baseline_option(config):
    """The VerdictDocument of ``--tapml-baseline`` (read once per process), or None.
    Raises TapmlError when the file is malformed or holds no device times."""
    path = _opt(config, "tapml_baseline")
    if not path:
        return None
    if path not in _BASELINES:
        from tapml.driving.profile import read_baseline
        _BASELINES[path] = read_baseline(path)
    return _BASELINES[path]


def repeat_option(config) -> int:
    """``--tapml-repeat`` (or the ini key) as a number of runs, 1 when not given; TapmlError
    when it is not a whole number of 1 or more."""
    from tapml.errors import TapmlError
    value = _opt(config, "tapml_repeat")
    if value is None:
        return 1
    try:
        runs = int(value)
    except ValueError:
        runs = 0
    if runs < 1:
        raise TapmlError(f"--tapml-repeat {value}: give a number of runs of 1 or more (e.g. 20)")
    return runs


def _cli_tolerances(items):
    from tapml.judging.compare import Tolerances
    from tapml.errors import TapmlError
    try:
        return Tolerances.parse(items)
    except TapmlError as e:
        raise TapmlError(str(e).replace("--tol ", "--tapml-tol ", 1)) from None


# --- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tapml_target_spec(pytestconfig) -> str:
    """The TARGET spec the session checks: ``--tapml-target``, the ini key, else ``reference``.
    A generated conftest overrides this to default to the target its known failures came from."""
    return target_option(pytestconfig) or "reference"


def _tokens(config):
    """The token(s) for device servers: ``--tapml-token-file`` / ``--tapml-token-map`` / $TAPML_TOKEN."""
    from tapml.driving.targets import read_tokens
    return read_tokens(_opt(config, "tapml_token_file"), _opt(config, "tapml_token_map"))


def _option_message(error) -> str:
    return str(error).replace("--token-file", "--tapml-token-file").replace("--token-map", "--tapml-token-map")


def worker_index(config) -> int:
    """This process's pytest-xdist worker number (``gw3`` -> 3), 0 without xdist."""
    worker = getattr(config, "workerinput", {}).get("workerid") or os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own count of CPUs
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` with a ``registry://`` target: one worker per live device of the pool."""
    spec = target_option(config)
    if not spec or not spec.startswith("registry://"):
        return None
    from tapml.errors import TapmlError
    from tapml.remote.pool import DevicePool
    try:
        with DevicePool(spec, token=_tokens(config)) as pool:
            return len(pool.devices)
    except TapmlError as e:
        raise pytest.UsageError(f"tapml: --tapml-target {spec}: {_option_message(e)}") from None


class PoolSeat:
    """The device one pytest process (an xdist worker, or the run without xdist) uses from a
    ``registry://`` pool: device ``index`` modulo the pool's size, the pool's live devices sorted
    by target; :meth:`next_device` moves to the next live one when it goes away. Tests call the
    seat as they would the platform (it forwards to the current device's platform, with fault
    injection when asked)."""

    def __init__(self, pool, index: int, faults=None):
        self.pool, self.faults = pool, faults
        self.devices = sorted(pool.devices, key=lambda d: d.target)
        self.lost: dict[str, str] = {}
        self._use(self.devices[index % len(self.devices)])

    def _use(self, device) -> None:
        from tapml.driving.replay import device_info
        self.device = device
        platform = device.platform
        if self.faults:
            from tapml.driving.inject import InjectedPlatform
            platform = InjectedPlatform(platform, self.faults)
        self.platform = platform
        from tapml.errors import DeviceLost
        try:
            self.adapter = device_info(platform, probe=False).get("adapter") or ""
        except DeviceLost:  # met again, and handled, by the first case that runs
            self.adapter = ""

    @property
    def target(self) -> str:
        """The device in use, ``remote://HOST:PORT``."""
        return self.device.target

    def next_device(self, reason: str) -> bool:
        """Leave the current device (``reason``: why) for the next live one after it; False
        when none is left."""
        self.lost[self.device.target] = reason
        order = self.devices.index(self.device)
        for device in self.devices[order + 1:] + self.devices[:order]:
            if device.target not in self.lost:
                self._use(device)
                return True
        return False

    def __getattr__(self, name):
        return getattr(self.platform, name)

    def close(self) -> None:
        self.pool.close()


def kernel_option(config) -> list[str]:
    """The ``--tapml-kernel`` values (or the ini key's), an empty list when none were given."""
    return list(_opt(config, "tapml_kernel") or [])


@pytest.fixture(scope="session")
def tapml_kernels(pytestconfig) -> list[str]:
    """``--kernel OP=FILE.wgsl`` values for the target: ``--tapml-kernel`` (a generated conftest
    overrides this to default to the kernel files its suite carries)."""
    return kernel_option(pytestconfig)


@pytest.fixture(scope="session")
def tapml_target(pytestconfig, tapml_target_spec, tapml_kernels):
    """The opened target platform, shared by the session (one per xdist worker) and closed at
    the end. ``--tapml-inject`` wraps it with fault injection. A ``registry://`` target is a
    :class:`PoolSeat`: this worker's own device of the pool."""
    from tapml.errors import TapmlError
    from tapml.driving.targets import open_target
    try:
        if tapml_target_spec.startswith("registry://"):
            if tapml_kernels:
                raise TapmlError("--tapml-kernel runs on one WGSL device: give one device of the pool as "
                                 "remote://HOST:PORT")
            from tapml.driving.inject import parse_faults
            from tapml.remote.pool import DevicePool
            inject = _opt(pytestconfig, "tapml_inject")
            faults = parse_faults(inject) if inject else None
            pool = DevicePool(tapml_target_spec, token=_tokens(pytestconfig))
            try:
                platform = PoolSeat(pool, worker_index(pytestconfig), faults)
            except BaseException:
                pool.close()
                raise
        else:
            platform = open_target(tapml_target_spec, token=_tokens(pytestconfig),
                                   inject=_opt(pytestconfig, "tapml_inject"), kernels=tapml_kernels or None)
    except TapmlError as e:
        pytest.fail(f"cannot open target {tapml_target_spec}: {_option_message(e)}", pytrace=False)
    yield platform
    platform.close()


_ADAPTERS: dict[int, str] = {}


def _device_properties(platform, target: str) -> list[tuple[str, str]]:
    """The JUnit properties naming the device a case ran on: ``tapml_device``, ``tapml_adapter``."""
    if isinstance(platform, PoolSeat):
        return [("tapml_device", platform.target), ("tapml_adapter", platform.adapter)]
    if id(platform) not in _ADAPTERS:  # the session's platform lives as long as the process
        from tapml.errors import DeviceLost
        from tapml.driving.replay import device_info
        try:
            _ADAPTERS[id(platform)] = device_info(platform, probe=False).get("adapter") or ""
        except DeviceLost:
            return [("tapml_device", target), ("tapml_adapter", "")]
    return [("tapml_device", target), ("tapml_adapter", _ADAPTERS[id(platform)])]


_STORES: dict[str, object] = {}


def load_store(path: str | os.PathLike):
    """The CarveStore at ``path``, opened once per process (tensors stay on disk until read).
    Raises TapmlError when it is missing or corrupt."""
    key = str(Path(path).resolve())
    if key not in _STORES:
        from tapml.carving.store import CarveStore
        _STORES[key] = CarveStore(key)
    return _STORES[key]


def open_store(path: str | os.PathLike):
    """:func:`load_store` for fixtures: a missing or corrupt store fails the test with the reason."""
    from tapml.errors import TapmlError
    try:
        return load_store(path)
    except TapmlError as e:
        pytest.fail(str(e), pytrace=False)


def open_suite_store(path: str | os.PathLike, manifest_sha256: str):
    """The store of a generated suite, checked to be the one the suite was generated from."""
    import hashlib

    from tapml.errors import TapmlError
    from tapml.io import read_regular_file
    manifest = Path(path) / "manifest.json"
    if not os.path.lexists(manifest):
        pytest.fail(f"this suite's carve store {path} is gone; restore it, or carve again and regenerate "
                    "the suite with `tapml gen-tests STORE -o DIR` (--copy-data keeps a copy in the suite)",
                    pytrace=False)
    try:
        raw = read_regular_file(manifest, hint="regenerate the suite with `tapml gen-tests`", follow_links=False)
    except TapmlError as e:
        pytest.fail(str(e), pytrace=False)
    if hashlib.sha256(raw).hexdigest() != manifest_sha256:
        pytest.fail(f"the carve store {path} changed since this suite was generated (its manifest differs); "
                    "regenerate the suite with `tapml gen-tests`", pytrace=False)
    return open_store(path)


def target_option(config) -> str | None:
    """The target the user asked for (``--tapml-target`` or the ini key), or None."""
    return _opt(config, "tapml_target")


@pytest.fixture(scope="session")
def tapml_store(pytestconfig):
    """The store of ``--tapml-store`` (or the ``tapml_store`` ini key)."""
    path = _opt(pytestconfig, "tapml_store")
    if not path:
        pytest.fail("this test needs a carve store: pass --tapml-store DIR (make one with "
                    "`tapml carve MODEL -o DIR`) or set tapml_store in the ini file", pytrace=False)
    return open_store(path)


class CarvedCase:
    """One carved case bound to a target: :meth:`run` returns its verdict, :meth:`check`
    asserts that it passes."""

    def __init__(self, store, case: dict, platform, target: str, tolerances, known_failure: str | None,
                 item=None, baseline=None):
        self.store, self.case, self.platform, self.target = store, case, platform, target
        self.tolerances = tolerances
        self.known_failure = known_failure
        self._item = item
        self.baseline = baseline

    def run(self) -> dict:
        """Run the case on the target; returns the Verdict dict of :func:`tapml.driving.replay.run_case`
        (profiled, with ``device_ms``, when there is a baseline)."""
        from tapml.errors import DeviceLost
        from tapml.driving.profile import RUNS
        from tapml.driving.replay import replay_case
        while True:
            try:
                verdict = replay_case(self.platform, self.store, self.case, self.tolerances,
                                      profile=RUNS if self.baseline is not None else 0,
                                      repeat=repeat_option(self._item.config) if self._item is not None else 1).to_json()
                break
            except DeviceLost as e:
                # A pool's device went away: run the case again on the next live one (each
                # case still gets one verdict); a single device has no other to go to.
                if not isinstance(self.platform, PoolSeat) or not self.platform.next_device(str(e)):
                    raise
        if self._item is not None:
            self._item.user_properties.extend(_device_properties(self.platform, self.target))
            for key in ("op", "node", "module", "status", "max_abs_err", "max_rel_err", "mismatch_fraction",
                        "time_ms", "device_ms"):
                self._item.user_properties.append((f"tapml_{key}", verdict.get(key)))
        return verdict

    def check(self) -> dict:
        """Run the case and raise :class:`CaseFailure` unless it passes; returns the verdict."""
        __tracebackhide__ = True
        verdict = self.run()
        if verdict["status"] != "pass":
            raise CaseFailure(failure_message(verdict, self.target, self._tol_text()) +
                              (f"\nknown failure recorded during migration: {self.known_failure}"
                               if self.known_failure else ""))
        if self.baseline is not None:
            self._check_speed(verdict)
        return verdict

    def _check_speed(self, verdict: dict) -> None:
        __tracebackhide__ = True
        from tapml.driving.profile import SLOWER_THAN, case_times, slower_cases
        slower = slower_cases({"cases": [verdict]}, self.baseline, SLOWER_THAN,
                              remeasure=lambda _verdict: case_times(self.platform, self.store, self.case))
        if slower:
            s = slower[0]
            raise CaseFailure(f"{s['op']} at node {verdict['node']} (case {s['id']}) on {self.target}: "
                              f"{s['ratio']:.2f}x slower than the baseline ({s['device_ms']:.4f} ms, "
                              f"baseline {s['baseline_ms']:.4f} ms; more than {SLOWER_THAN:g}% slower)")

    def _tol_text(self) -> str:
        from tapml.carving.gentests import case_tolerance
        tol = case_tolerance(self.case, self.tolerances)
        return "exact" if tol is None else f"rtol={tol[0]:g} atol={tol[1]:g}"

    def __repr__(self) -> str:
        return f"<CarvedCase {self.case['id']} {self.case['op']} at {self.case['node']} on {self.target}>"


def failure_message(verdict: dict, target: str, tol: str = "") -> str:
    """The message of a failing case: op, node, module, status, error statistics, worst elements."""
    where = f"{verdict['op']} at node {verdict['node']} in module {verdict['module'] or '(top level)'}"
    lines = [f"{where} (case {verdict['id']}) on {target}: {verdict['status']}"]
    if verdict["status"] == "mismatch":
        stats = ", ".join(f"{k}={_fmt(verdict[k])}" for k in ("max_abs_err", "max_rel_err", "mismatch_fraction"))
        lines.append(f"  {stats}" + (f" (tolerance {tol})" if tol else ""))
    if verdict.get("message"):
        lines.append(f"  {verdict['message']}")
    for w in verdict.get("worst", [])[:3]:
        lines.append(f"  at {w['index']}: target {w['target']!r}, reference {w['reference']!r}")
    return "\n".join(lines)


def _fmt(x) -> str:
    return "inf" if x is None else f"{x:.4g}"


def _case_tolerances(op: str, spec: CaseSpec | None, config):
    """``--tapml-tol`` for this op if it names it (or all ops), else the recorded tolerances."""
    from tapml.judging.compare import Tolerances
    cli = _cli_tolerances(_opt(config, "tapml_tol") or [])
    if any(k in cli.overrides for k in (op, op.rsplit(".", 1)[0], "*")):
        return cli
    if spec is not None and spec.rtol is not None:
        return Tolerances({op: (spec.rtol, spec.atol)})
    return cli


@pytest.fixture
def tapml_case(request, tapml_target, tapml_target_spec) -> CarvedCase:
    """The carved case of this test, bound to the session's target. Parametrize it (indirectly)
    with case ids or :func:`case` params; unparametrized, it runs every case of ``tapml_store``."""
    param = getattr(request, "param", None)
    if param is None:
        pytest.fail("tapml_case needs a case: parametrize it with indirect=True, or let the plugin do it "
                    "by asking for tapml_case in a plain test function", pytrace=False)
    spec = param if isinstance(param, CaseSpec) else CaseSpec(str(param))
    marker = request.node.get_closest_marker("tapml")
    store_path = marker.kwargs.get("store") if marker else None
    store = open_store(store_path) if store_path else request.getfixturevalue("tapml_store")
    try:
        case_dict = store.case(spec.case_id)
    except KeyError:
        pytest.fail(f"case {spec.case_id} is not in store {store.path}; regenerate the suite with "
                    "`tapml gen-tests`", pytrace=False)
    known = request.node.get_closest_marker("tapml_known_failure")
    return CarvedCase(store, case_dict, tapml_target, tapml_target_spec,
                      _case_tolerances(case_dict["op"], spec, request.config),
                      known.kwargs.get("reason") if known else None, request.node,
                      baseline=baseline_option(request.config))


def pytest_generate_tests(metafunc):
    """Parametrize plain ``tapml_case`` tests over the cases of their store."""
    if "tapml_case" not in metafunc.fixturenames:
        return
    for m in metafunc.definition.iter_markers("parametrize"):
        names = m.args[0] if m.args else m.kwargs.get("argnames", "")
        if "tapml_case" in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return
    marker = metafunc.definition.get_closest_marker("tapml")
    path = (marker.kwargs.get("store") if marker else None) or _opt(metafunc.config, "tapml_store")
    if not path:
        pytest.fail(f"{metafunc.definition.nodeid} asks for tapml_case: pass --tapml-store DIR "
                    "(a carve store) or parametrize tapml_case yourself", pytrace=False)
    from tapml.carving.gentests import case_test_id, unique_ids
    from tapml.errors import TapmlError
    try:
        store = load_store(path)
    except TapmlError as e:
        pytest.fail(f"--tapml-store: {e}", pytrace=False)
    op = marker.kwargs.get("op") if marker else None
    cases = [c for c in store.cases if op is None or c["op"] == op]
    if not cases:
        pytest.fail(f"{metafunc.definition.nodeid}: store {path} has no cases of {op}; "
                    f"`tapml inspect {path}` lists its ops", pytrace=False)
    ids = unique_ids([(c["id"], case_test_id(c, store.tensor_index)) for c in cases])
    metafunc.parametrize("tapml_case", [CaseSpec(c["id"]) for c in cases], ids=ids, indirect=True)
