"""Reference ops and sizes from a stranger, end to end (issue 26, items 1, 4 and 10's schema part).

The three ways such values reach the reference: a crafted store (``tapml replay``, ``migrate``), a
crafted ``.pt2`` (``tapml carve``) and a client of ``tapml serve --platform reference``. Out-of-range
pooling indices end as an ``error`` verdict or exit 2, never a signal; an output size raised past
what a node declares is refused before anything is allocated (peak RSS measured); node arguments
that do not fit the op's schema are exit 2 naming the node; the local reference runs in a worker
whose address space is limited, so running out of it is an ``error`` verdict for one case.
"""

import json
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from support import store_from_source

SOURCE = '''
import torch


class Pooled(torch.nn.Module):
    def forward(self, g, x, i):
        y = torch.ops.aten.max_pool2d_with_indices_backward.default(g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, i)
        return torch.relu(y) + torch.full((4,), 1.0).sum()


def example():
    x = torch.randn(1, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    out, i = torch.ops.aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
    return torch.ones_like(out), x, i


def factory():
    return Pooled(), example()
'''

#: a command's peak RSS when it refuses before allocating: torch and tapml imported, nothing large
SMALL_RSS_MIB = 1024


def tapml(*args, env=None, timeout=300):
    import os
    return subprocess.run([sys.executable, "-m", "tapml.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def peak_rss_mib(*args, env=None) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``tapml ARGS`` as a child of a small Python process that reports the child's peak RSS."""
    import os
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stdout.write(r.stdout); sys.stderr.write(r.stderr); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")
    r = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "tapml.cli", *map(str, args)],
                       capture_output=True, text=True, timeout=300, env=env)
    return r, int(r.stderr.strip().splitlines()[-1]) / 1024


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    return store_from_source(tmp_path_factory, "pooled", SOURCE).path


def copy_store(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def manifest(store: Path) -> dict:
    return json.loads((store / "manifest.json").read_text())


def write_manifest(store: Path, m: dict) -> None:
    (store / "manifest.json").write_text(json.dumps(m))


def case_of(m: dict, op: str) -> dict:
    return next(c for c in m["cases"] if c["op"] == op)


def poke(store: Path, name: str, values: list[int]) -> None:
    """Overwrite the first elements of int64 tensor ``name`` (or the tensor it aliases) in its shard."""
    index = manifest(store)["tensors"]
    info = index[name]
    name = info.get("alias", name)
    shard = store / index[name]["shard"]
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    start, _ = json.loads(data[8:8 + n])[name]["data_offsets"]
    pos = 8 + n + start
    data[pos:pos + 8 * len(values)] = struct.pack(f"<{len(values)}q", *values)
    shard.write_bytes(bytes(data))


@pytest.mark.slow
def test_store_with_out_of_range_pooling_indices_is_an_error_verdict(pooled, tmp_path, bad=1 << 40):
    store = copy_store(pooled, tmp_path / "store")
    case = case_of(manifest(store), "aten.max_pool2d_with_indices_backward.default")
    poke(store, case["inputs"][2], [bad])
    r = tapml("replay", store, "--target", "reference", "--json", tmp_path / "v.json")
    assert r.returncode == 1, r.stderr
    verdicts = {c["op"]: c for c in json.loads((tmp_path / "v.json").read_text())["cases"]}
    pool = verdicts["aten.max_pool2d_with_indices_backward.default"]
    assert pool["status"] == "error" and f"indices holds {bad}, outside [0, 16)" in pool["message"]
    assert verdicts["aten.relu.default"]["status"] == "pass"


@pytest.mark.slow
def test_store_declaring_a_small_output_for_a_large_full_is_refused_without_allocating(pooled, tmp_path):
    store = copy_store(pooled, tmp_path / "store")
    m = manifest(store)
    node = next(n for n in m["nodes"] if n["op"] == "aten.full.default")
    node["args"][0] = [1 << 29]
    write_manifest(store, m)
    r, rss = peak_rss_mib("replay", store, "--target", "reference")
    assert r.returncode == 2, r.stderr
    assert f"node {node['name']!r} (aten.full.default): declares outputs float32[4], but its arguments make " \
           "float32[536870912]" in r.stderr
    assert rss < SMALL_RSS_MIB
    # the case of that node, declared with the size it computes, is held to the memory budget
    m = manifest(pooled)
    case = case_of(m, "aten.full.default")
    case["args"][0] = [1 << 29]
    case["output_meta"][0]["shape"] = [1 << 29]
    write_manifest(store, m)
    r = tapml("replay", store, "--target", "reference", env={"TAPML_MEMORY_BUDGET_MIB": "256"})
    assert r.returncode == 2 and "memory budget" in r.stderr and case["id"] in r.stderr, r.stderr


@pytest.mark.slow
def test_store_node_arguments_outside_the_schema_are_exit_2_naming_the_node(pooled, tmp_path):
    """(More argument shapes in tests/test_op_bounds.py, in process.)"""
    store = copy_store(pooled, tmp_path / "store")
    m = manifest(store)
    node = next(n for n in m["nodes"] if n["op"] == "aten.relu.default")
    node["args"] = [node["args"][0], 1, [2], "three"]
    write_manifest(store, m)
    r = tapml("migrate", store, "--target", "reference", "--state", tmp_path / "s.json")
    assert r.returncode == 2, r.stderr
    assert f"node {node['name']!r} (aten.relu.default)" in r.stderr and "Traceback" not in r.stderr


def _save_pt2(path: Path, indices: torch.Tensor) -> Path:
    namespace = {}
    exec(SOURCE, namespace)  # noqa: S102 - the test's own model source
    g, x, i = namespace["example"]()
    ep = torch.export.export(namespace["Pooled"](), (g, x, indices if indices is not None else i), strict=False)
    torch.export.save(ep, path)
    return path


@pytest.mark.slow
def test_pt2_with_out_of_range_pooling_indices_is_refused_before_the_op_runs(tmp_path, bad=-3):
    indices = torch.zeros(1, 1, 2, 2, dtype=torch.long)
    indices.view(-1)[1] = bad
    archive = _save_pt2(tmp_path / "pooled.pt2", indices)
    r = tapml("carve", archive, "-o", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert "max_pool2d_with_indices_backward" in r.stderr and f"holds {bad}, outside [0, 16)" in r.stderr
    assert not (tmp_path / "out").exists()


def _raise_full_size(archive: Path, out: Path, size: int) -> Path:
    """The archive with the size argument of its ``aten.full`` raised to ``size`` (its JSON edited, as
    an attacker would; everything else as torch.export.save wrote it)."""
    with zipfile.ZipFile(archive) as z:
        entries = [(info, z.read(info)) for info in z.infolist()]
    changed = 0
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info, data in entries:
            if info.filename.endswith(".json") and b"torch.ops.aten.full.default" in data:
                doc = json.loads(data)
                for node in doc["graph_module"]["graph"]["nodes"]:
                    if node["target"] == "torch.ops.aten.full.default":
                        node["inputs"][0]["arg"] = {"as_ints": [size]}
                        changed += 1
                data = json.dumps(doc).encode()
            z.writestr(info, data)
    assert changed == 1
    return out


@pytest.mark.slow
def test_pt2_with_a_raised_size_argument_is_refused_without_allocating(tmp_path, size=1 << 29, budget_mib="512"):
    """A 2 GiB ``full`` from a small archive is over a 512 MiB budget (tests/test_op_bounds.py: the default)."""
    archive = _save_pt2(tmp_path / "pooled.pt2", None)
    assert archive.stat().st_size < 64 << 10
    raised = _raise_full_size(archive, tmp_path / "raised.pt2", size)
    r, rss = peak_rss_mib("carve", raised, "-o", tmp_path / "out", env={"TAPML_MEMORY_BUDGET_MIB": budget_mib})
    assert r.returncode == 2, r.stderr
    assert f"aten.full.default): output 0 is float32[{size}]" in r.stderr and "memory budget" in r.stderr, r.stderr
    assert rss < SMALL_RSS_MIB
    assert not (tmp_path / "out").exists()


def _pool_graph(indices_meta):
    from tapml.graph import Graph, Node, TensorMeta
    g, x = TensorMeta((1, 1, 2, 2), "float32"), TensorMeta((1, 1, 4, 4), "float32")
    node = Node("mpb", "aten.max_pool2d_with_indices_backward.default",
                [{"ref": "g"}, {"ref": "x"}, [2, 2], [2, 2], [0, 0], [1, 1], False, {"ref": "i"}], {}, [x])
    return Graph([("g", g), ("x", x), ("i", indices_meta)], [node], ["mpb"])


@pytest.mark.slow
def test_reference_server_refuses_out_of_range_indices_and_declared_sizes():
    from tapml.errors import PlatformError, Unsupported
    from tapml.graph import Graph, Node, TensorMeta
    from tapml.remote.client import RemotePlatform
    from tapml.remote.launcher import ServerProcess
    srv = ServerProcess(platform="reference", token="t", args=("--max-buffer-mib", "64"))
    try:
        with RemotePlatform(srv.host, srv.port, token="t") as platform:
            program = platform.compile(_pool_graph(TensorMeta((1, 1, 2, 2), "int64")))
            g, x = torch.ones(1, 1, 2, 2), torch.randn(1, 1, 4, 4)
            _, good = torch.ops.aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
            assert platform.run(program, [g, x, good])[0].shape == x.shape
            for bad in (-1, 16, 1 << 40):
                indices = good.clone()
                indices.view(-1)[0] = bad
                with pytest.raises(PlatformError, match=f"holds {bad}, outside"):
                    platform.run(program, [g, x, indices])
            full = Node("full", "aten.full.default", [[1 << 29], 1.0], {}, [TensorMeta((1,), "float32")])
            with pytest.raises(Unsupported, match="node 'full'.*float32\\[536870912\\]"):
                platform.compile(Graph([], [full], ["full"]))
            assert platform.run(program, [g, x, good])[0].shape == x.shape  # the server and worker live on
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_local_reference_out_of_memory_is_an_error_verdict(pooled, tmp_path):
    """A case that needs more memory than the reference worker's address-space limit: an ``error``
    verdict for that case, the other cases still judged (the worker is replaced)."""
    store = copy_store(pooled, tmp_path / "store")
    m = manifest(store)
    case = case_of(m, "aten.full.default")
    size = 48 << 20
    case["args"][0] = [size]
    case["output_meta"][0]["shape"] = [size]
    out = f"{case['id']}.huge"  # expected: one stored float read 48 Mi times, so the store stays small
    base = next(n for n, t in m["tensors"].items() if "shard" in t and t["dtype"] == "float32")
    m["tensors"][out] = {"alias": base, "shape": [size], "dtype": "float32", "view": {"offset": 0, "stride": [0]}}
    case["outputs"] = [out]
    write_manifest(store, m)
    r = tapml("replay", store, "--target", "reference", "--json", tmp_path / "v.json",
              env={"TAPML_REFERENCE_MEMORY_MIB": "64"})
    assert r.returncode == 1, r.stderr
    verdicts = {c["op"]: c for c in json.loads((tmp_path / "v.json").read_text())["cases"]}
    assert verdicts["aten.full.default"]["status"] == "error"
    assert "memory" in verdicts["aten.full.default"]["message"].lower()
    assert verdicts["aten.relu.default"]["status"] == "pass"
    assert verdicts["aten.max_pool2d_with_indices_backward.default"]["status"] == "pass"
