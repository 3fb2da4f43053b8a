"""External backends through the seam, with real file backends (``file.py:Class``) in real worker
processes: the on-disk compile cache, compile and run seconds in verdicts, blame by the control
target, and a backend's failures (compile error, hang, native crash) as verdicts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BACKENDS = textwrap.dedent('''
    import os, time, torch
    from tapml.platforms.backend import Backend, BackendRefused, Compiled

    def _log(what):
        path = os.environ.get("TEST_BACKEND_LOG")
        if path:
            with open(path, "a") as f:
                f.write(what + "\\n")

    def _ops(program):
        return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}

    def _scaled(gm, op, factor):
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and str(node.target) == op:
                with gm.graph.inserting_after(node):
                    new = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, factor))
                node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        gm.recompile()
        return gm

    class Eager(Backend):
        WRONG = None
        def describe(self):
            return {"device": "cpu", "version": "1"}
        def compile(self, program):
            _log("compile")
            gm = _scaled(program.module(), self.WRONG, 1.01) if self.WRONG else program.module()
            return Compiled(handle=gm, artifact=str(program.graph).encode(), artifact_name="graph.txt")
        def run(self, compiled, inputs):
            out = compiled.handle(*inputs)
            return list(out) if isinstance(out, (list, tuple)) else [out]

    class Right(Eager):
        pass

    class WrongGelu(Eager):
        WRONG = "aten.gelu.default"
        control = __file__ + ":Right"

    class RouteControl(Eager):
        WRONG = "aten.gelu.default"

    class RouteBug(Eager):
        WRONG = "aten.gelu.default"
        control = __file__ + ":RouteControl"

    class NoGelu(Eager):
        def compile(self, program):
            if "aten.gelu.default" in _ops(program):
                raise BackendRefused("error: failed to legalize operation 'torch.aten.gelu'\\nnote: see above",
                                     artifact=b"module { gelu }", artifact_name="program.mlir")
            return super().compile(program)

    class Misbehaves(Eager):
        """Hangs on gelu, aborts (a native crash) on the layer norm."""
        def run(self, compiled, inputs):
            graph = str(compiled.handle.graph)
            if "aten.gelu.default" in graph:
                time.sleep(120)
            if "aten.native_layer_norm.default" in graph:
                os.abort()
            return super().run(compiled, inputs)
''')

NUMPY_RUNNER = '''
import json, math
import numpy as np

def run(artifact, inputs, dtypes):
    scale = json.loads(artifact)["scale"]
    x = inputs[0].astype(np.float64)
    erf = np.vectorize(math.erf)
    return [(0.5 * x * (1 + erf(x / math.sqrt(2))) * scale).astype(np.float32)]
'''

OWN_RUNNER = textwrap.dedent('''
    import json, torch
    from tapml.platforms.backend import Backend, Compiled

    class TableGelu(Backend):
        """Its artifact is a JSON table; its repro runner needs only numpy. Gelu comes out 1% large."""
        def describe(self):
            return {"device": "cpu", "version": "1"}
        def compile(self, program):
            return Compiled(handle=None, artifact=json.dumps({"scale": 1.01}).encode(), artifact_name="table.json")
        def run(self, compiled, inputs):
            return [torch.nn.functional.gelu(inputs[0]) * 1.01]
        def repro_runner(self):
            return RUNNER
''') + f"\nRUNNER = {NUMPY_RUNNER!r}\n"

#: the zoo:mlp cases these tests replay: the gelu (c5) and the layer norm after it
CASES = ("c5", "c6")


@pytest.fixture(scope="module")
def backends(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("backends") / "my_backends.py"
    path.write_text(BACKENDS)
    return path


@pytest.fixture(scope="module")
def store(carved):
    from tapml.carving import CarveStore
    return CarveStore(carved("zoo:mlp"))


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPML_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TEST_BACKEND_LOG", str(tmp_path / "log"))
    return tmp_path


def _replay(store, spec: str, cases=CASES) -> dict:
    from tapml.driving.replay import replay_targets
    todo = [c for c in store.cases if c["id"] in cases]
    return replay_targets(store, [spec], cases=todo)[spec]


def _log(env: Path) -> list[str]:
    return (env / "log").read_text().split() if (env / "log").exists() else []


def _by_id(doc: dict) -> dict:
    return {c["id"]: c for c in doc["cases"]}


@pytest.fixture(scope="module")
def documented(tmp_path_factory) -> Path:
    """The example backend of ARCHITECTURE.md's "Backend contract" section, as written there."""
    text = (Path(__file__).resolve().parent.parent / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Backend contract (version 1)"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n\n")]
    path = tmp_path_factory.mktemp("documented") / "my_backend.py"
    path.write_text(code)
    return path


def test_the_documented_backend_runs_and_a_rerun_loads_from_the_compile_cache(store, documented, env):
    """ARCHITECTURE.md's example backend replays, and its blobs make a re-run load instead of compile;
    a corrupt entry is ignored, compiled again and replaced."""
    spec = f"{documented}:EagerBackend"
    first = _replay(store, spec)
    assert first["summary"]["pass"] == 2 and first["device"]["adapter"] == "cpu"
    assert [c["compile_cached"] for c in first["cases"]] == [False] * 2
    assert all(c["compile_s"] > 0 and c["run_s"] >= 0 for c in first["cases"])
    entries = sorted((env / "cache" / "backends").rglob("*.bin"))
    assert len(entries) >= 2
    second = _replay(store, spec)
    assert second["summary"]["pass"] == 2
    assert [c["compile_cached"] for c in second["cases"]] == [True] * 2
    assert sorted((env / "cache" / "backends").rglob("*.bin")) == entries  # nothing new compiled
    for entry in entries:  # corrupt every entry: each is ignored, compiled again and replaced
        data = bytearray(entry.read_bytes())
        data[-1] ^= 0xFF
        entry.write_bytes(bytes(data))
    third = _replay(store, spec)
    assert third["summary"]["pass"] == 2
    assert [c["compile_cached"] for c in third["cases"]] == [False] * 2
    assert _replay(store, spec)["cases"][0]["compile_cached"] is True


def test_the_cache_reads_only_what_it_wrote(tmp_path):
    from tapml.platforms.compile_cache import CompileCache, cache_key
    cache = CompileCache(tmp_path)
    key = cache_key({"nodes": []}, "B@1", "b", "1", 1)
    assert cache.get(key) is None
    assert cache.put(key, b"blob", "program.mlir", b"mlir")
    assert cache.get(key) == (b"blob", "program.mlir", b"mlir")
    other = cache_key({"nodes": []}, "B@1", "b", "2", 1)  # another backend version: another entry
    assert other != key and cache.get(other) is None
    path = next(tmp_path.rglob("*.bin"))
    import hashlib
    import json
    import struct

    from tapml.platforms.compile_cache import MAGIC, _decode
    payload = b"blobmlir"
    index = {"key": key, "blob": 4, "artifact": 4, "artifact_name": "program.mlir",
             "sha256": hashlib.sha256(payload).hexdigest()}
    for field, value, said in (("blob", 4.0, "index.blob is 4.0"), ("artifact_name", "../x", "index.artifact_name is '../x'"),
                               ("sha256", None, "index.sha256 is None"), ("key", 7, "index.key is 7")):
        text = json.dumps({**index, field: value}).encode()  # a doctored index: its schema refuses it by path
        path.write_bytes(MAGIC + struct.pack("!I", len(text)) + text + payload)
        with pytest.raises(ValueError, match=re.escape(said)):
            _decode(path.read_bytes(), key)
        assert cache.get(key) is None
    path.write_bytes(MAGIC + struct.pack("!I", 60000) + b"[" * 60000 + payload)  # an index nested past Python's stack
    assert cache.get(key) is None
    text = json.dumps(index).encode()
    path.write_bytes(MAGIC + struct.pack("!I", len(text)) + text + payload)
    assert cache.get(key) == (b"blob", "program.mlir", b"mlir")  # the same entry, untouched, reads
    path.write_bytes(path.read_bytes()[:-1])  # cut short
    assert cache.get(key) is None
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")  # never read through a link
    (tmp_path / "elsewhere").write_bytes(b"x")
    assert cache.get(key) is None
    with pytest.raises(ValueError):
        cache.get("../../etc/passwd")
    path.unlink()
    os.mkfifo(path)  # a FIFO never blocks the read
    assert cache.get(key) is None
    path.unlink()


def test_the_cache_holds_entries_to_its_size_limit(tmp_path, monkeypatch):
    from tapml.platforms import compile_cache
    cache = compile_cache.CompileCache(tmp_path)
    key = compile_cache.cache_key({}, "B", "b", "1", 1)
    assert cache.put(key, b"x" * 64, "a.bin", b"")
    monkeypatch.setattr(compile_cache, "MAX_ENTRY_BYTES", 32)
    assert cache.get(key) is None  # an entry over the limit is not read
    assert not cache.put(key, b"x" * 64, "a.bin", b"")  # nor written
    monkeypatch.setattr(compile_cache, "MAX_ENTRY_BYTES", 1 << 20)
    assert cache.put(key, b"blob", "../../escape.sh", b"art")  # a name that is no plain file name is dropped
    assert cache.get(key) == (b"blob", "", b"art")


def test_the_cache_evicts_the_least_recently_used_entries_past_its_bound(tmp_path, monkeypatch):
    """Past its bound a write evicts least recently used entries (a hit refreshes one); nothing but
    entries is removed (links, other files, a linked folder, files outside stay); an entry another
    process removed mid-eviction is no error; the bound comes from $TAPML_BACKEND_CACHE_MIB."""
    from tapml.errors import TapmlError
    from tapml.platforms.compile_cache import CompileCache, cache_key
    folder, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    keys = [cache_key({"n": i}, "B", "b", "1", 1) for i in range(6)]
    probe = CompileCache(tmp_path / "probe")
    probe.put(keys[0], b"x" * 100, "a.bin", b"")
    size = next((tmp_path / "probe").rglob("*.bin")).stat().st_size  # every entry below has this size
    cache = CompileCache(folder, max_bytes=3 * size)
    for key in keys[:3]:
        assert cache.put(key, b"x" * 100, "a.bin", b"")
    # planted things that are no entries: a link named as one (to a file outside), a stray file, a
    # folder link named as an entry folder holding an entry-named file, a file outside the cache
    victim = outside / "victim.bin"
    victim.write_bytes(b"mine")
    (folder / keys[3][:2]).mkdir(exist_ok=True)
    planted_link = folder / keys[3][:2] / f"{keys[3][:2]}{'0' * 62}.bin"
    planted_link.symlink_to(victim)
    (folder / "notes.txt").write_text("keep")
    (outside / f"{'f' * 64}.bin").write_bytes(b"z" * 10 * size)
    (folder / "ff").symlink_to(outside, target_is_directory=True)
    assert cache.get(keys[0]) is not None  # a hit: keys[0] is now the most recently used
    assert cache.put(keys[3], b"x" * 100, "a.bin", b"")
    assert [cache.get(k) is not None for k in keys[:4]] == [True, False, True, True]  # keys[1] went
    assert sum(size for _, _, size, _ in cache.entries()) <= cache.max_bytes
    assert victim.read_bytes() == b"mine" and planted_link.is_symlink() and (folder / "notes.txt").exists()
    assert (outside / f"{'f' * 64}.bin").exists()

    class Racing(CompileCache):
        """Another process removes the oldest entry between this one's listing and its removal."""
        def entries(self):
            found = super().entries()
            if found:
                found[0][3].unlink()
            return found

    racing = Racing(folder, max_bytes=3 * size)
    assert racing.put(keys[4], b"x" * 100, "a.bin", b"")
    assert racing.get(keys[4]) is not None and len(racing.entries()) <= 3
    assert not cache.put(keys[5], b"x" * (3 * size), "a.bin", b"")  # one entry over the bound is never kept
    monkeypatch.setenv("TAPML_BACKEND_CACHE_MIB", "3")
    assert CompileCache(folder).max_bytes == 3 << 20
    monkeypatch.setenv("TAPML_BACKEND_CACHE_MIB", "lots")
    with pytest.raises(TapmlError, match="TAPML_BACKEND_CACHE_MIB"):
        CompileCache(folder)


def test_a_device_compiler_bug_is_blamed_on_the_device_compiler(store, backends, env):
    doc = _replay(store, f"{backends}:WrongGelu")
    gelu = _by_id(doc)["c5"]
    assert gelu["status"] == "mismatch" and gelu["blame"] == "device compiler"
    assert gelu["control"] == f"{backends}:Right" and gelu["control_status"] == "pass"
    assert "blame the device compiler" in gelu["message"]
    assert all("blame" not in c for c in doc["cases"] if c["id"] != "c5")  # passing cases are not re-run
    # the new keys survive the verdict file's strict reader, and a bad blame is refused
    from tapml.judging.verdict import VerdictDocument
    back = VerdictDocument.from_json(json.loads(json.dumps(doc)), strict=True).to_json()
    assert _by_id(back)["c5"]["blame"] == "device compiler" and _by_id(back)["c6"]["compile_s"] >= 0
    bad = json.loads(json.dumps(doc))
    bad["cases"][0]["blame"] = "cosmic rays"
    with pytest.raises(Exception, match="blame"):
        VerdictDocument.from_json(bad, strict=True)


def test_a_route_bug_is_blamed_on_the_route(store, backends, env):
    gelu = _by_id(_replay(store, f"{backends}:RouteBug"))["c5"]
    assert gelu["status"] == "mismatch" and gelu["blame"] == "route" and gelu["control_status"] == "mismatch"
    assert "blame the route" in gelu["message"]


def test_a_compile_error_is_unsupported_with_the_trimmed_message_and_the_artifact(store, backends, env):
    from tapml.driving.targets import open_target
    spec = f"{backends}:NoGelu"
    by_id = _by_id(_replay(store, spec))
    assert by_id["c5"]["status"] == "unsupported"
    assert "failed to legalize operation 'torch.aten.gelu'" in by_id["c5"]["message"]
    assert "note: see above" not in by_id["c5"]["message"]  # only the error lines
    assert by_id["c6"]["status"] == "pass"
    gelu = next(c for c in store.cases if c["id"] == "c5")
    with open_target(spec) as platform:
        with pytest.raises(Exception, match="legalize"):
            platform.compile(store.case_graph(gelu))
        assert platform.last_artifact == ("program.mlir", b"module { gelu }")  # from the worker, for the repro


@pytest.mark.slow
def test_a_hang_and_a_native_crash_are_errors_and_the_next_cases_run_in_fresh_workers(store, backends, env, tmp_path):
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, "-m", "tapml.cli", "replay", str(store.path), "--target",
                        f"{backends}:Misbehaves", "--json", str(out)], capture_output=True, text=True, timeout=300,
                       # 30 s: a fresh worker's first export alone took over 5 s on a loaded machine
                       env={**os.environ, "COLUMNS": "200", "TAPML_BACKEND_TIMEOUT_S": "30"})
    assert r.returncode == 1, r.stdout + r.stderr  # a finding, never exit 3
    assert "Traceback" not in r.stderr
    assert "from the compile cache), run " in r.stdout  # where the time went
    by_id = _by_id(json.loads(out.read_text()))
    assert by_id["c5"]["status"] == "error" and "30 s" in by_id["c5"]["message"]  # the hang, bounded
    assert by_id["c6"]["status"] == "error" and "worker died during the run" in by_id["c6"]["message"]  # abort()
    assert sum(c["status"] == "pass" for c in by_id.values()) == len(by_id) - 2


def _repro(store, case: str, target: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tapml.cli", "repro", str(store.path), case, "-o", str(out),
                           "--target", target], capture_output=True, text=True, timeout=300)


def _run_repro(python, folder: Path) -> tuple[int, dict]:
    r = subprocess.run([str(python), "run.py", "--json"], capture_output=True, text=True, timeout=300, cwd=folder)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r.returncode, json.loads(r.stdout)


@pytest.mark.slow
def test_repro_of_a_backend_case_reruns_it_by_reimporting_the_backend(store, backends, env, tmp_path):
    made = _repro(store, "c5", f"{backends}:WrongGelu", tmp_path / "wrong")
    assert made.returncode == 0, made.stdout + made.stderr
    assert "gives mismatch" in made.stdout
    plan = json.loads((tmp_path / "wrong" / "plan.json").read_text())
    assert plan["artifact"] == "graph.txt" and plan["backend"] == f"{backends}:WrongGelu"
    assert "gelu" in (tmp_path / "wrong" / "graph.txt").read_text()
    rc, result = _run_repro(sys.executable, tmp_path / "wrong")
    assert rc == 1 and result["status"] == "fail" and "elements beyond" in result["message"]
    # a compile error: the folder keeps the artifact the backend failed on, and run.py fails the same way
    made = _repro(store, "c5", f"{backends}:NoGelu", tmp_path / "refused")
    assert made.returncode == 0 and "gives unsupported" in made.stdout, made.stdout + made.stderr
    assert (tmp_path / "refused" / "program.mlir").read_bytes() == b"module { gelu }"
    rc, result = _run_repro(sys.executable, tmp_path / "refused")
    assert rc == 1 and "failed to legalize" in result["message"]


@pytest.mark.slow
def test_repro_with_the_backends_own_runner_needs_only_its_package(store, tmp_path, env):
    import numpy
    own = tmp_path / "own_backend.py"
    own.write_text(OWN_RUNNER)
    made = _repro(store, "c5", f"{own}:TableGelu", tmp_path / "repro")
    assert made.returncode == 0, made.stdout + made.stderr
    folder = tmp_path / "repro"
    assert json.loads((folder / "table.json").read_text()) == {"scale": 1.01}
    assert not (folder / "program.pt2").exists()
    # a Python that can import numpy and nothing else of this environment (no torch, no tapml)
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    source = Path(numpy.__file__).parent
    (site / "numpy").symlink_to(source)
    for libs in source.parent.glob("numpy.libs"):
        (site / libs.name).symlink_to(libs)
    python = venv / "bin" / "python"
    assert subprocess.run([str(python), "-c", "import torch"], capture_output=True, cwd=venv).returncode != 0
    rc, result = _run_repro(python, folder)
    assert rc == 1 and result["status"] == "fail" and "elements beyond" in result["message"]


@pytest.mark.slow
def test_a_backend_served_by_tapml_serve_replays_over_remote(store, backends, env):
    """``tapml serve --platform file.py:Class`` serves the backend (graphs, compiled by it on the server);
    its control names a file of the server's machine, so the client blames nothing."""
    from tapml.remote.launcher import ServerProcess
    srv = ServerProcess(platform=f"{backends}:WrongGelu", token="t0ken")
    try:
        from tapml.driving.replay import replay_targets
        spec = f"remote://{srv.host}:{srv.port}"
        doc = replay_targets(store, [spec], token="t0ken", cases=[c for c in store.cases if c["id"] in CASES])[spec]
        by_id = _by_id(doc)
        assert by_id["c5"]["status"] == "mismatch" and "blame" not in by_id["c5"]
        assert by_id["c6"]["status"] == "pass"
        assert doc["device"]["backend"].startswith(f"{backends}:WrongGelu")
    finally:
        assert srv.stop() == 0


def test_targets_lists_every_kind_without_opening_a_device(tmp_path):
    from typer.testing import CliRunner

    from tapml.cli import app
    tiny = tmp_path / "tiny_backend.py"
    tiny.write_text("from tapml.platforms.backend import Backend\n\n"
                    "class Tiny(Backend):\n    needs = 'nothing at all'\n    control = 'reference'\n")
    r = CliRunner().invoke(app, ["targets", f"{tiny}:Tiny", "--json", str(tmp_path / "t.json")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    rows = {row["target"]: row for row in json.loads((tmp_path / "t.json").read_text())["targets"]}
    assert {"reference", "wgpu", "browser", "remote", "registry", "iree", "ort", f"{tiny}:Tiny"} <= set(rows)
    assert rows["wgpu"]["kind"] == "own backend" and "wgpu:vulkan" in rows["wgpu"]["forms"]
    assert rows["wgpu"]["source"] == "tapml.platforms.wgpu_backend:WgpuBackend"
    assert rows["wgpu"]["platform"] == "tapml.platforms.wgpu_native:WgpuPlatform"
    assert rows["reference"]["kind"] == "own backend" and rows["browser"]["kind"] == "platform"
    assert rows["reference"]["source"] == "tapml.platforms.reference_backend:ReferenceBackend"
    assert rows["iree"]["kind"] == "backend" and rows["iree"]["forms"] == ["iree:vulkan", "iree:llvm-cpu"]
    file_row = rows[f"{tiny}:Tiny"]
    assert file_row["kind"] == "file" and file_row["importable"] and file_row["control"] == "reference"
    assert file_row["needs"] == "nothing at all"
    # the table as a terminal 200 columns wide shows it (CliRunner's console is sized at import)
    shown = subprocess.run([sys.executable, "-m", "tapml.cli", "targets", f"{tiny}:Tiny"], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"}, timeout=120).stdout
    cells = re.sub(r"[\s│┃]+", "", shown)
    assert "nothingatall" in cells and "control:reference" in cells
    # a spec that cannot be loaded says why, and is exit 1
    for spec, why in ((f"{tmp_path}/missing.py:Nope", "does not exist"), ("wgpu:vulkan", "not an external backend")):
        r = CliRunner().invoke(app, ["targets", spec, "--json", str(tmp_path / "bad.json")], env={"COLUMNS": "200"})
        row = next(x for x in json.loads((tmp_path / "bad.json").read_text())["targets"] if x["target"] == spec)
        assert r.exit_code == 1 and not row["importable"] and why in row["missing"][0], row
