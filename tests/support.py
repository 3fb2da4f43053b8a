"""Helpers shared by test modules (importable because pytest puts tests/ on sys.path)."""

import contextlib
import functools
import http.server
import itertools
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from tapml.judging.compare import compare_anchored
from tapml.graph import Graph, Node, TensorMeta, run_node
from tapml.platforms.wgsl.registry import sample_cases


def _vulkan_backends():
    try:
        from tapml.platforms.wgpu_native import available_backends
        return available_backends()
    except Exception:  # noqa: BLE001 - no wgpu at all: the device tests say why they skip
        return ()


#: ``reference`` and ``wgpu:vulkan`` (a device test, skipped with the reason where lavapipe is
#: missing): for tests that check one command on the CPU reference and on a real adapter.
REFERENCE_AND_VULKAN = ["reference", pytest.param("wgpu:vulkan", marks=[
    pytest.mark.device, pytest.mark.xdist_group("wgpu"),
    pytest.mark.skipif("vulkan" not in _vulkan_backends(),
                       reason="no wgpu Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")])]


#: The ops that only move or view data (tiny-llama's view, unsqueeze, permute, expand, slice, alias and
#: clone: 46 of its 97 cases). Tests that compile every case of a store through a slow external compiler
#: leave them out; whole-model programs hold them all.
LAYOUT_OPS = frozenset({"aten.view.default", "aten.unsqueeze.default", "aten.permute.default", "aten.expand.default",
                        "aten.slice.Tensor", "aten.alias.default", "aten.clone.default"})


def replay_each_computing_op(store_path, target: str) -> tuple[list[dict], dict]:
    """Replay, in this process, the first case of each op of the store at ``store_path`` that
    computes (not in :data:`LAYOUT_OPS`) on ``target``; returns those cases and the Verdict JSON."""
    from tapml.carving.store import CarveStore
    from tapml.driving.replay import first_cases, replay
    from tapml.driving.targets import open_target
    store = CarveStore(store_path)
    cases = first_cases([c for c in store.cases if c["op"] not in LAYOUT_OPS], 1)
    with open_target(target) as platform:
        return cases, replay(store, platform, target, cases=cases)


#: Skip a test where no Chromium can be started (apt-get install chromium, or TAPML_CHROMIUM).
NEEDS_CHROMIUM = pytest.mark.skipif(shutil.which("chromium") is None and not os.environ.get("TAPML_CHROMIUM"),
                                    reason="no chromium on PATH (apt-get install chromium)")


def in_chromium(test):
    """Mark a test of the browser tier: it needs Chromium and runs in the one browser group."""
    return pytest.mark.browser(pytest.mark.xdist_group("browser")(NEEDS_CHROMIUM(test)))


def on_every_webgpu(check):
    """The two tests a lowering owes every WebGPU runtime here, from ``check(platform)``: lavapipe
    Vulkan and llvmpipe GL (device tier, one platform with its own device each) and Chromium
    (browser tier). Name them in the test module::

        test_x_equals_torch, test_x_equals_torch_in_chromium = on_every_webgpu(_check)
    """
    @pytest.mark.device
    @pytest.mark.xdist_group("wgpu")
    @pytest.mark.parametrize("backend", ["vulkan", "gl"])
    def on_adapters(backend):
        check(own_wgpu(backend))

    @in_chromium
    def in_browser():
        from tapml.platforms.browser import BrowserPlatform
        with BrowserPlatform() as browser:
            check(browser)
    return on_adapters, in_browser


def accepted_samples(lowerings: dict) -> list:
    """``(op, args, kwargs)`` of every sample of ``lowerings`` (op -> Lowering) that its op's schema
    accepts: a sample list may be shared with a sibling overload that takes other arguments."""
    from tapml.platforms.wgsl.registry import case_graph
    out = []
    for op, low in sorted(lowerings.items()):
        for args, kwargs in low.samples():
            try:
                case_graph(op, args, kwargs)
            except (RuntimeError, TypeError, ValueError):
                continue
            out.append((op, args, kwargs))
    return out


def attention_kernels(names) -> list[str]:
    """The fused attention's kernels among kernel ``names`` (a merged dispatch's name is its bodies'
    joined by ``+``): one kernel where a workgroup takes a row, or the partial results and their
    combination (platforms/wgsl/attention.py)."""
    bodies = [part for n in names for part in n.split("+")]
    return [n for n in bodies if re.fullmatch(r"attention(_part|_combine)?_\d+", n)]


def own_wgpu(backend: str):
    """A WgpuPlatform on ``backend`` with its own device (forced limits stay out of the shared
    platform); skips where the adapter is missing."""
    from tapml.platforms.wgpu_native import WgpuPlatform, available_backends
    if backend not in available_backends():
        pytest.skip(f"no wgpu {backend} adapter (install mesa-vulkan-drivers and libegl-mesa0)")
    return WgpuPlatform(backend)


def vulkan_or_skip():
    """Skip the calling test where wgpu has no Vulkan adapter (lavapipe comes with mesa-vulkan-drivers)."""
    from tapml.platforms.wgpu_native import available_backends
    if "vulkan" not in available_backends():
        pytest.skip("no wgpu Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")


def store_from_source(tmp_path_factory, name: str, source: str, factory: str = "factory"):
    """A CarveStore carved from model code ``source`` (written to ``NAME.py``) by ``factory``."""
    from tapml.carving import CarveStore, carve
    base = tmp_path_factory.mktemp(name)
    (base / f"{name}.py").write_text(source)
    carve(f"{base / f'{name}.py'}:{factory}", base / "store")
    return CarveStore(base / "store")


def interruptible() -> None:
    """``preexec_fn`` for a child a test will Ctrl-C: SIGINT at its default and unblocked, as in a
    terminal. A child inherits an ignored or blocked SIGINT from its parent (a pytest worker may
    have either), and Python then never turns SIGINT into KeyboardInterrupt."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def rss_mib(pid: int) -> float:
    """Resident memory of a process, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


# --- float16 and bfloat16 samples of the registry ------------------------------------------
# Every lowering that claims a low-precision float runs its seeded samples (edge values
# included) cast to that dtype, judged fp64-anchored against torch's CPU result in that dtype.

LOW = (torch.float16, torch.bfloat16)
LOW_FLOORS = {torch.float16: 1e-3, torch.bfloat16: 1e-2}


def finite_normal(inputs: list) -> list:
    """``inputs`` with every NaN, ±Inf and subnormal float replaced by a value of about ±0.5 (±0 kept). For
    devices that do what the WGSL spec allows: assume no NaN or Inf in shader execution and flush
    subnormals to zero (Chromium's Tint on SwiftShader does both); lavapipe and llvmpipe run the
    registry's edge values as they are."""
    out = []
    for t in inputs:
        if t.is_floating_point():
            odd = ~torch.isfinite(t) | ((t != 0) & (t.abs() < torch.finfo(t.dtype).tiny))
            # distinct values (0.5, 0.5 + 2**-8, ...): a sort's ties would make its order ambiguous
            fill = (0.5 + torch.arange(t.numel()).reshape(t.shape) % 64 / 256).to(t.dtype)
            t = torch.where(odd, torch.where(t.isnan(), fill, torch.copysign(fill, t)), t)
        out.append(t)
    return out


def only_ties_reordered(graph: Graph, inputs, out, ref) -> bool:
    """Whether a sort's or topk's ``out`` differs from torch's ``ref`` only in the order of equal
    values (torch leaves it unspecified; replay's verdict accepts it: tapml.judging.compare.tie_dim)."""
    from tapml.judging.compare import indices_pick_equal_values, tie_dim
    node = graph.nodes[0]
    dim = tie_dim(node.op, node.args, node.kwargs)
    if dim is None or len(out) != 2:
        return False
    values, expected = out[0], ref[0]
    same = (values == expected) | (values.isnan() & expected.isnan()) if values.is_floating_point() else values == expected
    return bool(same.all()) and indices_pick_equal_values(inputs[0], dim, out[1], expected)


def low_precision_case(graph: Graph, inputs, dtype):
    """The sample ``graph`` with its float32 inputs in ``dtype``: (graph, inputs, torch's outputs,
    float64 outputs), or None when torch refuses the op in that dtype (or in float64: tapml.quant's
    packed-weight ops take their scales in one dtype only)."""
    low = [t.to(dtype) if t.dtype == torch.float32 else t for t in inputs]
    node = graph.nodes[0]
    env = dict(zip([r for r, _ in graph.inputs], low))
    wide = {r: t.double() if t.dtype == dtype else t for r, t in env.items()}
    try:
        ref = run_node(node, env.__getitem__)
        ref64 = [r.double() if r.is_floating_point() else r for r in run_node(node, wide.__getitem__)]
    except (RuntimeError, NotImplementedError, ValueError):  # ValueError: a packed format's scales are of one dtype
        return None
    node = Node(node.name, node.op, node.args, node.kwargs, [TensorMeta.of(r) for r in ref], node.multi)
    g = Graph(inputs=[(r, TensorMeta.of(t)) for (r, _), t in zip(graph.inputs, low)], nodes=[node],
              outputs=graph.outputs)
    return g, low, ref, ref64


#: The most kernel forms of one op (and dtype) the browser tier runs: see :class:`KernelForms`.
BROWSER_FORMS = 2
#: The same for llvmpipe GL in the device tier (tests/test_wgsl_ops.py); lavapipe runs every sample.
GL_FORMS = 6
_LITERAL = re.compile(r"\b(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:e[-+]?\d+)?)[uif]?\b")


class KernelForms:
    """Which of an op's samples bring a kernel form not run yet, at most ``most`` forms
    (``most=None``: every sample, as lavapipe runs them).

    A form is a compiled program's WGSL with its numeric literals folded: samples that differ only
    in sizes and constants compile to one form. Given the sample's inputs, a form is also told apart
    by whether they hold NaN, Inf or subnormals, so an op's edge-value sample still runs. The browser
    tier runs the first ``BROWSER_FORMS`` forms of each op (its SwiftShader builds a pipeline per
    program, 0.1-1.5 s each, serially on one worker), llvmpipe GL the first ``GL_FORMS``; every
    sample of every form runs on lavapipe in the device tier, from the same compiler.
    """

    def __init__(self, most: int | None = BROWSER_FORMS):
        self.most, self.seen = most, set()

    def is_new(self, program, inputs=()) -> bool:
        if self.most is None:
            return True
        if len(self.seen) >= self.most:
            return False
        form = (tuple(_LITERAL.sub("#", k.wgsl) for k in program.kernels), tuple(map(_edges, inputs)))
        if form in self.seen:
            return False
        self.seen.add(form)
        return True


def _edges(t: torch.Tensor) -> tuple[bool, bool]:
    """Whether a float tensor holds NaN or Inf, and whether it holds subnormals."""
    if not t.is_floating_point() or not t.numel():
        return False, False
    finite = torch.isfinite(t)
    tiny = (t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)
    return not bool(finite.all()), bool(tiny.any())


def run_low_precision_samples(platform, op: str, edges: bool = True, forms: int | None = None) -> int:
    """Run the registry's samples of ``op`` cast to every low-precision float it claims on
    ``platform``, judged fp64-anchored against torch in that dtype; returns how many ran.
    ``edges=False``: without NaN, Inf and subnormal inputs (:func:`finite_normal`). ``forms``: only
    the samples of the first that many kernel forms of each dtype (:class:`KernelForms`)."""
    from tapml.platforms.wgsl import load_lowerings
    low = load_lowerings()[op]
    ran = 0
    for dtype in LOW:
        if str(dtype).removeprefix("torch.") not in low.dtypes:
            continue
        torch.manual_seed(0)
        new_forms = KernelForms(forms)
        for graph, inputs in sample_cases(op):
            if not any(t.dtype == torch.float32 for t in inputs):
                continue
            case = low_precision_case(graph, inputs if edges else finite_normal(inputs), dtype)
            if case is None:
                continue
            g, ins, ref, ref64 = case
            program = platform.compile(g)
            if not new_forms.is_new(program, ins):
                continue
            out = platform.run(program, ins)
            assert [o.dtype for o in out] == [r.dtype for r in ref], f"{op} {dtype}: output dtypes"
            if low.compare_values:
                res = compare_anchored(out, ref, ref64, floor=LOW_FLOORS[dtype])
                assert res.passed or only_ties_reordered(g, ins, out, ref), f"{op} {dtype}: {res.message}; worst {res.worst}"
            ran += 1
    return ran


# --- integer and bool dtypes derived from float samples --------------------------------------

INT_AND_BOOL = ("int64", "int32", "int16", "int8", "uint8", "bool")


@functools.cache
def sampled_dtypes(op: str) -> frozenset[str]:
    """The dtypes the registry's samples of ``op`` hold in an input or output (float32 stands for
    float16 and bfloat16 too: the low-precision tests cast it)."""
    torch.manual_seed(0)
    seen = set()
    for graph, inputs in sample_cases(op):
        seen |= {str(t.dtype).removeprefix("torch.") for t in inputs} | {m.dtype for m in graph.nodes[0].outputs}
    return frozenset(seen | ({"float16", "bfloat16"} if "float32" in seen else set()))


def _as_dtype(t: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype == "bool":
        return t > 0
    info = torch.iinfo(getattr(torch, dtype))
    return (t * 10).round().clamp(max(info.min, -2**31), min(info.max, 2**31 - 1)).to(getattr(torch, dtype))


def derived_dtype_cases(op: str, dtype: str):
    """The samples of ``op`` with their float32 inputs turned into ``dtype`` (ten times the value,
    rounded; bool: positive), for the integer and bool dtypes an entry claims but samples no case
    of: ``(graph, inputs, torch's outputs)``, skipping those torch refuses."""
    torch.manual_seed(0)
    for graph, inputs in sample_cases(op):
        if not any(t.dtype == torch.float32 for t in inputs):
            continue
        cast = [_as_dtype(t, dtype) if t.dtype == torch.float32 else t for t in inputs]
        node = graph.nodes[0]
        env = dict(zip([r for r, _ in graph.inputs], cast))
        try:
            ref = run_node(node, env.__getitem__)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            continue
        node = Node(node.name, node.op, node.args, node.kwargs, [TensorMeta.of(r) for r in ref], node.multi)
        yield (Graph(inputs=[(r, TensorMeta.of(t)) for (r, _), t in zip(graph.inputs, cast)], nodes=[node],
                     outputs=graph.outputs), cast, ref)


# --- splitting under a forced small binding limit ------------------------------------------

def _family_cases():
    """One op per family with inputs of a few KiB, so that even a device whose windows must start
    at multiples of 256 bytes (Chromium) splits them: family -> (op, args, kwargs)."""
    from tapml.platforms.wgsl.registry import rand, randint
    torch.manual_seed(0)
    return {
        "elementwise": ("aten.add.Tensor", (rand(64, 33), rand(64, 33)), {}),
        "reduction": ("aten.sum.dim_IntList", (rand(40, 50), [1]), {}),
        "matmul": ("aten.mm.default", (rand(24, 40), rand(36, 40).t()), {}),
        "batched matmul": ("aten.bmm.default", (rand(3, 20, 16), rand(3, 16, 24)), {}),
        "convolution": ("aten.convolution.default",
                        (rand(1, 4, 16, 16), rand(8, 4, 3, 3), rand(8), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
        "pooling": ("aten.max_pool2d_with_indices.default", (rand(1, 4, 16, 16), [2, 2], [2, 2]), {}),
        "gather": ("aten.embedding.default", (rand(300, 16), randint(5, 7, hi=300)), {}),
        "indexing": ("aten.index.Tensor", (rand(200, 8), [randint(30, hi=200)]), {}),
        "scatter": ("aten.index_put.default", (rand(200, 8), [torch.randperm(200)[:30]], rand(30, 8)), {}),
        "view copy": ("aten.permute.default", (rand(16, 20, 8), [2, 0, 1]), {}),
        "concatenation": ("aten.cat.default", ([rand(20, 16), rand(30, 16)], 0), {}),
        "normalization": ("aten.native_layer_norm.default", (rand(32, 48), [48], rand(48), rand(48), 1e-5), {}),
        "softmax": ("aten._softmax.default", (rand(32, 64), -1, False), {}),
        "scan": ("aten.cumsum.default", (rand(32, 40), 1), {}),
        "arg reduction": ("aten.argmax.default", (rand(40, 50), 1), {}),
        "sort": ("aten.sort.stable", (rand(2, 2100),), {"stable": True}),  # rows past a block: multi-pass
    }


SPLIT_FAMILIES = _family_cases()


def run_split(platform, graph, inputs, dtype=None, parts: bool = False) -> bool | None:
    """Run a one-node ``graph`` on ``inputs`` (cast to ``dtype`` when given, judged fp64-anchored)
    on ``platform`` with max-storage-buffer-binding-size forced to half its largest buffer, so that
    buffer is bound through windows; asserts the result against torch. Returns whether a buffer
    was split (None: the case does not apply: unsupported, or too small to split here).

    With ``parts``, the binding size is forced to a quarter of the largest buffer (a third or a
    half where a kernel would bind more windows than the device allows) and max-buffer-size to
    twice that, so the largest tensor is held in several buffers (parts) of two windows each;
    returns whether a tensor was held in parts with a part bound through two windows (None as
    well when every such choice is more bindings than a kernel may have on the device)."""
    from tapml.judging.compare import compare_tensor
    from tapml.errors import Unsupported
    from tapml.platforms.wgsl import load_lowerings
    op = graph.nodes[0].op
    if dtype is not None:
        if not any(t.dtype == torch.float32 for t in inputs):
            return None
        case = low_precision_case(graph, inputs, dtype)
        if case is None:
            return None
        graph, inputs, ref, ref64 = case
    else:
        ref = run_node(graph.nodes[0], dict(zip([r for r, _ in graph.inputs], inputs)).__getitem__)
    platform.__dict__.pop("forced_limits", None)
    try:
        largest = max([b.size for b in platform.compile(graph).buffers], default=0)
    except Unsupported:
        return None
    align = platform.caps()["limits"].get("min-storage-buffer-offset-alignment", 256)
    if largest < (4 if parts else 2) * align:
        return None
    if parts:
        # windows of a quarter of the largest buffer, or of a third or a half where a kernel would
        # bind more windows than the device allows; buffers of two windows, fewer than the largest
        choices = [{"max-storage-buffer-binding-size": w, "max-buffer-size": 2 * w}
                   for w in dict.fromkeys(largest // d // align * align for d in (4, 3, 2)) if 0 < 2 * w < largest]
    else:
        choices = [{"max-storage-buffer-binding-size": largest // 2 // align * align}]
    for i, limits in enumerate(choices):
        platform.force_limits(limits)
        try:
            program = platform.compile(graph)
            out = platform.run(program, inputs)
            break
        except Unsupported as e:
            if not parts or "max-storage-buffers-per-shader-stage" not in str(e):
                raise
            if i == len(choices) - 1:
                return None  # every choice of windows is more bindings than a kernel may have here
        finally:
            platform.__dict__.pop("forced_limits", None)
    else:
        return None
    if load_lowerings()[op].compare_values:
        results = ([compare_anchored(out, ref, ref64, floor=LOW_FLOORS[dtype])] if dtype is not None
                   else [compare_tensor(o, r) for o, r in zip(out, ref)])
        for res in results:
            assert res.passed, f"{op} split ({dtype or 'float32'}{', parts' if parts else ''}): {res.message}; worst {res.worst}"
    if parts:
        windows: dict[str, set] = {}
        for k in program.kernels:
            for b in k.bindings:
                windows.setdefault(b[0], set()).add(tuple(b[2:]))
        return any(len(windows.get(name, ())) >= 2 for t in program.parts for name, _, _ in t.parts)
    return any(len(b) == 4 for k in program.kernels for b in k.bindings)


def run_split_samples(platform, op: str, dtype=None) -> int:
    """:func:`run_split` on each of the registry's samples of ``op``; returns how many split."""
    torch.manual_seed(0)
    return sum(bool(run_split(platform, graph, inputs, dtype)) for graph, inputs in sample_cases(op))


def run_split_families(platform, dtype=None, parts: bool = False) -> dict[str, bool | None]:
    """:func:`run_split` on each family's case of :data:`SPLIT_FAMILIES`: family -> split?
    (with ``parts``: held in several buffers?)"""
    from tapml.platforms.wgsl.registry import case_graph
    return {family: run_split(platform, *case_graph(op, args, kwargs), dtype, parts=parts)
            for family, (op, args, kwargs) in SPLIT_FAMILIES.items()}


# --- files that are not what they say ---------------------------------------------------------

#: What :func:`make_kind` puts where a file should be.
KINDS = ("fifo", "dev-zero", "folder", "huge", "link-outside")


def make_kind(path: Path, kind: str, outside: Path, valid: Path | None = None) -> None:
    """Put a ``kind`` thing at ``path`` (replacing what is there): ``fifo``, ``dev-zero`` (a link to
    /dev/zero), ``folder``, ``huge`` (a sparse 300 MiB file), ``link-outside`` (a link to a copy of
    ``valid`` in the folder ``outside``)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(300 << 20)
    elif kind == "link-outside":
        copy = outside / f"copy-of-{path.name}"
        shutil.copy(valid, copy)
        path.symlink_to(copy)
    else:
        raise ValueError(kind)


@contextlib.contextmanager
def no_hang(seconds: int = 20):
    """Raise TimeoutError in the block (instead of hanging the suite) after ``seconds``; a FIFO
    opened for reading blocks until a writer comes, so this is how a test proves nothing waits."""
    import signal

    def alarm(signum, frame):
        raise TimeoutError(f"blocked for {seconds} s")
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def headless_chromium(url: str, *args: str, timeout: float = 90):
    """Run the system Chromium once on ``url`` with tapml's headless flags, a fresh profile and its temp
    folders inside it (all removed after), plus ``args`` (``--dump-dom``, ``--screenshot=PATH
    --window-size=W,H``); returns the CompletedProcess (text)."""
    import subprocess
    import tempfile

    from tapml.platforms.chromium import CHROMIUM_FLAGS, find_chromium
    with tempfile.TemporaryDirectory(prefix="tapml-test-chromium-") as profile:
        os.mkdir(os.path.join(profile, "tmp"))
        env = {**os.environ, "TMPDIR": os.path.join(profile, "tmp")}
        return subprocess.run([find_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
                              capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def shipping_code(checkpoint: Path, tmp_path: Path) -> tuple[Path, Path, dict]:
    """``(folder, marker, env)``: a copy of the llama ``checkpoint`` folder whose config's auto_map names
    the modeling file it ships, which writes ``marker`` when it runs; ``env`` keeps transformers' module
    cache under tmp_path (for the commands a test starts)."""
    import json
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    marker = tmp_path / "ran"
    (folder / "modeling_tiny.py").write_text(
        f"from transformers import LlamaForCausalLM\nopen({str(marker)!r}, 'w').write('ran')\n\n\n"
        "class ShippedLlama(LlamaForCausalLM):\n    pass\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_tiny.ShippedLlama"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, marker, {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_MODULES_CACHE": str(tmp_path / "modules")}


def undeclared(model, data, path: str = "") -> list[str]:
    """The keys of parsed JSON ``data`` that the schema ``model`` was validated from does not
    declare, at every level (a writer's field its reader's schema would silently drop):
    ``[]`` when the writer and its schema agree."""
    from tapml.schema import Schema
    fields = type(model).model_fields
    declared = {f.alias or name: name for name, f in fields.items()}
    out = [f"{path}.{k}".lstrip(".") for k in data if k not in declared]
    for key, name in declared.items():
        value, held = getattr(model, name), data.get(key)
        if isinstance(value, Schema) and isinstance(held, dict):
            out += undeclared(value, held, f"{path}.{key}")
        elif isinstance(value, list) and isinstance(held, list):
            out += [p for i, (v, d) in enumerate(zip(value, held)) if isinstance(v, Schema)
                    for p in undeclared(v, d, f"{path}.{key}[{i}]")]
        elif isinstance(value, dict) and isinstance(held, dict):
            out += [p for k, v in value.items() if isinstance(v, Schema) for p in undeclared(v, held[k], f"{path}.{key}.{k}")]
    return out


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def repro_page_result(folder: Path, page: str = "index.html", timeout: float = 120) -> str:
    """The text of #result once a repro folder's page, served over http on loopback, has a verdict."""
    import json
    import threading
    import time

    from websockets.sync.client import connect

    from tapml.platforms.chromium import ChromiumProcess
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(_QuietHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    chromium = ChromiumProcess(f"http://127.0.0.1:{server.server_port}/{page}",
                               extra_flags=("--remote-debugging-port=0",))
    try:
        port_file = Path(chromium.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            assert chromium.exited() is None and time.monotonic() < deadline, "chromium opened no DevTools port"
            time.sleep(0.1)
        port, path = port_file.read_text().splitlines()[:2]
        with connect(f"ws://127.0.0.1:{port}{path}", max_size=16 << 20) as ws:
            calls = iter(range(1, 1 << 30))

            def call(method, params=None, session=None):
                n = next(calls)
                ws.send(json.dumps({"id": n, "method": method, "params": params or {},
                                    **({"sessionId": session} if session else {})}))
                while True:
                    msg = json.loads(ws.recv(timeout=30))
                    if msg.get("id") == n:
                        assert "error" not in msg, msg
                        return msg["result"]

            deadline = time.monotonic() + timeout
            text = ""
            while time.monotonic() < deadline:
                pages = [t for t in call("Target.getTargets")["targetInfos"]
                         if t["type"] == "page" and t["url"].startswith("http://127.0.0.1")]
                if pages:
                    session = call("Target.attachToTarget", {"targetId": pages[0]["targetId"], "flatten": True})
                    expr = "document.getElementById('result')?.textContent ?? ''"
                    while time.monotonic() < deadline:
                        r = call("Runtime.evaluate", {"expression": expr, "returnByValue": True},
                                 session["sessionId"])
                        text = r["result"].get("value") or ""
                        if text.startswith(("PASS", "FAIL", "CANNOT RUN")):
                            return text
                        time.sleep(0.2)
                time.sleep(0.2)
            raise AssertionError(f"the page gave no verdict in {timeout} s (last: {text!r})")
    finally:
        chromium.close()
        server.shutdown()
        server.server_close()


def exported(fn, *inputs):
    """The core-ATen ExportedProgram of ``fn(*inputs)`` (a tuple of outputs), as BackendPlatform hands it
    to a backend."""
    class Program(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)
    return torch.export.export(Program(), inputs, strict=False).run_decompositions()


#: A linear weight over a forced binding limit: rows of 160 bytes (K = 40) in windows of 64 KiB, so that
#: most column blocks of a product kernel lie in one window (read directly) and some straddle two
#: (read through the accessor), and one row itself straddles the first boundary (64 KiB is no whole
#: number of rows).
SPLIT_WEIGHT = (40, 2000, 1 << 16)


@contextlib.contextmanager
def split_weight_linear(platform, rows: int, seed: int):
    """``(graph, [x, w, bias])`` of ``linear(x, w, bias)`` with ``rows`` rows and a
    :data:`SPLIT_WEIGHT` weight (x's first elements large, subnormal and signed zero), compiled
    inside the block under that binding limit; the limit is lifted after it."""
    from tapml.graph import graph_from_fx
    k, n, limit = SPLIT_WEIGHT
    gen = torch.Generator().manual_seed(seed)
    x, w, bias = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x[0, :4] = torch.tensor([1e20, -1e-40, -0.0, 3.0])
    ep = exported(lambda a, b, c: (torch.nn.functional.linear(a, b, c),), x, w, bias)
    platform.force_limits({"max-storage-buffer-binding-size": limit})
    try:
        yield graph_from_fx(ep.graph, ep.graph_signature), [x, w, bias]
    finally:
        platform.force_limits({})


def reads_windows_directly(wgsl: str) -> bool:
    """Whether a kernel reads windows 0 and 1 of a split buffer in its own code (``_w0[(i) - ...]``),
    not only inside the accessor that picks a window per element."""
    return "_w0[(" in wgsl and "_w1[((" in wgsl


# --- int64 past i32: limit-value cases of any op that claims int64 --------------------------

def _single_case(graph, inputs):
    """``(graph, inputs, torch's outputs)`` of a one-node case, its metas taken from these inputs;
    None where torch refuses them."""
    node = graph.nodes[0]
    env = dict(zip([r for r, _ in graph.inputs], inputs))
    try:
        ref = run_node(node, env.__getitem__)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, IndexError):
        return None
    node = Node(node.name, node.op, node.args, node.kwargs, [TensorMeta.of(r) for r in ref], node.multi)
    return (Graph(inputs=[(r, TensorMeta.of(t)) for (r, _), t in zip(graph.inputs, inputs)], nodes=[node],
                  outputs=graph.outputs), inputs, ref)


def wide_limit_cases(op: str, most: int = 4):
    """Up to ``most`` cases of ``op`` whose int64 operands hold values past the i32 range: the
    registry's samples (and their float inputs turned into int64), with one int64 operand at a
    time (then all of them) replaced by values at the i32 and int64 limits (``wide_ints``) or
    moved past i32. A replacement torch refuses (an index past the tensor, a count past memory)
    is skipped: such an operand can never hold those values. ``(graph, inputs, torch's outputs)``."""
    from tapml.platforms.wgsl.int64 import I32_MAX, I32_MIN, wide_ints
    torch.manual_seed(0)
    # lazily: the derived cases run torch on every sample, and a polynomial's degree of 2**31 loops
    # that often per element; most ops find their cases among the int64 samples first
    bases = itertools.chain(((g, i) for g, i in sample_cases(op) if any(t.dtype == torch.int64 for t in i)),
                            ((g, i) for g, i, _ in derived_dtype_cases(op, "int64")))

    def moved(t, how):
        if t.dtype != torch.int64 or not t.numel():
            return t
        return wide_ints(*t.shape) if how == "limits" else t + 3 * 2**31

    out, seen = [], set()
    for graph, inputs in bases:
        slots = [i for i, t in enumerate(inputs) if t.dtype == torch.int64 and t.numel()]
        for chosen in [[i] for i in slots] + ([slots] if len(slots) > 1 else []):
            for how in ("limits", "shifted"):
                wide = [moved(t, how) if i in chosen else t for i, t in enumerate(inputs)]
                if not any(((t < I32_MIN) | (t > I32_MAX)).any() for t in wide if t.dtype == torch.int64):
                    continue
                case = _single_case(graph, wide)
                key = (graph.nodes[0].args.__repr__(), tuple(chosen), how)
                if case is not None and key not in seen and \
                        not any(t.dtype == torch.float64 for t in case[2]):  # float64: refused by design
                    seen.add(key)
                    out.append(case)
                    if len(out) >= most:
                        return out
    return out


def uint64_cases(op: str, most: int = 4):
    """Up to ``most`` cases of ``op`` on uint64 operands holding values past 2**63 and near 2**64:
    the int64 limit-value cases of :func:`wide_limit_cases` (and the registry's int64 samples) with
    one int64 operand at a time, then all, converted to uint64 (negative values wrap, as torch
    converts them), where torch computes the op on them. ``(graph, inputs, torch's outputs)``."""
    from tapml.platforms.wgsl.registry import sample_cases
    torch.manual_seed(0)
    bases = [(g, i) for g, i, _ in wide_limit_cases(op, most=8)]
    bases += [(g, i) for g, i in sample_cases(op) if any(t.dtype == torch.int64 for t in i)]
    out, seen = [], set()
    for graph, inputs in bases:
        slots = [i for i, t in enumerate(inputs) if t.dtype == torch.int64 and t.numel()]
        for chosen in [[i] for i in slots] + ([slots] if len(slots) > 1 else []):
            converted = [t.to(torch.uint64) if i in chosen else t for i, t in enumerate(inputs)]
            case = _single_case(graph, converted)
            key = (repr(graph.nodes[0].args), tuple(chosen), tuple(tuple(t.shape) for t in inputs))
            if case is None or key in seen or not any(m.dtype == "uint64" for m in case[0].meta.values()):
                continue
            seen.add(key)
            out.append(case)
            if len(out) >= most:
                return out
    return out
