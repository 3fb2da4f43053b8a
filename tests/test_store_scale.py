"""A store holds each tensor once: parameters that are also case inputs, and views of them
(``permute``, ``view``, ``slice``), are aliases in its index; aliases read back as the tensors
they stand for; large tensors are memory-mapped copy-on-write; and an index that lies about an
alias (a cycle, a chain, a missing target, another shape, a view past its target) is refused."""

import hashlib
import json
import shutil

import pytest
import torch

from tapml.carving import CarveStore, CarveStoreWriter
from tapml.carving.manifest import tensor_store_manifest
from tapml.errors import TapmlError

LLAMA = {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 352, "vocab_size": 8000}


@pytest.fixture(scope="module")
def llama_store(tmp_path_factory):
    from tapml.carving import carve
    path = tmp_path_factory.mktemp("llama") / "store"
    carve("hf:llama", path, hf_config=LLAMA)
    return CarveStore(path)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def test_each_weight_is_stored_once(llama_store):
    """Every parameter's bytes lie in the shards exactly once, though the embedding, the LM head
    and every linear weight are case inputs (and permuted views of them case outputs)."""
    store = llama_store
    params = {info["tensor"] for info in store.manifest["program_inputs"].values() if info["kind"] == "param"}
    param_bytes = sum(store.tensor(n).nbytes for n in params)
    stored = [n for n, info in store.tensor_index.items() if "alias" not in info]
    counts: dict[str, int] = {}
    for name in stored:
        d = _digest(store.tensor(name))
        counts[d] = counts.get(d, 0) + 1
    for name in params:
        assert counts[_digest(store.tensor(name))] == 1, name
    # The weights' cases (embedding, permute of every linear weight, the LM head mm) all read aliases.
    aliased_inputs = {store.tensor_index[n]["alias"] for c in store.cases for n in c["inputs"]
                      if "alias" in store.tensor_index[n]}
    assert len(aliased_inputs & params) >= 6
    assert any("view" in info for info in store.tensor_index.values())  # permute outputs are views
    on_disk = sum(p.stat().st_size for p in (store.path / "shards").iterdir())
    assert param_bytes < on_disk < 1.25 * param_bytes, (on_disk, param_bytes)


def test_aliases_read_back_as_the_tensors_they_stand_for(llama_store):
    """Every case replays on the reference from the store's (aliased) inputs to its (aliased)
    outputs, and each alias equals its target read through the recorded view."""
    from tapml.platforms.reference import ReferencePlatform
    from tapml.driving.replay import replay
    store = llama_store
    for name, info in store.tensor_index.items():
        if "alias" not in info:
            continue
        t, base = store.tensor(name), store.tensor(info["alias"])
        assert list(t.shape) == info["shape"] and t.is_contiguous()
        view = info.get("view")
        expected = base if view is None else torch.as_strided(base, info["shape"], view["stride"], view["offset"])
        assert torch.equal(t, expected), name
    doc = replay(store, ReferencePlatform(), "reference")
    assert doc["summary"]["pass"] == len(store.cases) and not doc["summary"]["mismatch"]


def test_writer_aliases_live_views_only(tmp_path):
    """Same memory, alive and unmodified: an alias (a view where shape, strides or offset differ);
    written in place since, or another tensor: bytes of its own; small equal tensors: by content."""
    w = CarveStoreWriter(tmp_path / "s", shard_bytes=1 << 20)
    weight = torch.randn(600, 700)  # over CONTENT_DEDUP_BYTES: only the same memory makes an alias
    w.put("w", weight)
    w.put("same", weight)
    w.put("t", weight.t())
    w.put("rows", weight[10:20, 5:9])
    w.put("flat", weight.view(-1))
    x = torch.randn(64)
    w.put("x", x)
    x.add_(1)  # written since it was put: the store must keep what it was
    w.put("x_after", x)
    w.put("copy", weight.clone())  # equal bytes, but large and another tensor: stored
    w.put("small", torch.arange(8.0))
    w.put("small_again", torch.arange(8.0))
    w.close(tensor_store_manifest("m"))
    index = json.loads((tmp_path / "s" / "manifest.json").read_text())["tensors"]
    assert index["same"] == {"alias": "w", "shape": [600, 700], "dtype": "float32"}
    assert index["t"]["view"] == {"offset": 0, "stride": [1, 700]}
    assert index["rows"]["view"] == {"offset": 10 * 700 + 5, "stride": [700, 1]}
    assert index["flat"]["alias"] == "w" and index["small_again"]["alias"] == "small"
    assert "shard" in index["x_after"] and "shard" in index["copy"]
    assert w.aliases == 5 and w.alias_bytes == (3 * weight.numel() + 40 + 8) * 4


def _bare_store(tmp_path, tensors: dict, edit=None):
    """A minimal valid store holding ``tensors`` (no graph), its index edited by ``edit``."""
    from tapml.carving.store import MANIFEST
    w = CarveStoreWriter(tmp_path / "s")
    for name, t in tensors.items():
        w.put(name, t)
    w.close(tensor_store_manifest("m"))
    path = tmp_path / "s" / MANIFEST
    m = json.loads(path.read_text())
    if edit:
        edit(m["tensors"])
    path.write_text(json.dumps(m))
    return tmp_path / "s"


def test_large_tensors_are_mapped_copy_on_write(tmp_path):
    big = torch.randn(512, 1024)  # 2 MiB: memory-mapped
    store = CarveStore(_bare_store(tmp_path, {"big": big, "view": big.t(), "small": torch.ones(3, dtype=torch.bool)}))
    t = store.tensor("big")
    assert torch.equal(t, big) and torch.equal(store.tensor("view"), big.t())
    t.add_(1)  # changing what was read never reaches the shard
    assert torch.equal(store.tensor("big"), big)
    assert store.tensor("small").dtype == torch.bool and store.tensor("small").all()


def test_a_store_without_aliases_still_opens(tmp_path):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    store = CarveStore(_bare_store(tmp_path, {"a": a, "b": b}))
    assert all("shard" in info for info in store.tensor_index.values())
    assert torch.equal(store.tensor("a"), a) and torch.equal(store.tensor("b"), b)


def _set(name, **fields):
    return lambda index: index[name].update(fields)


@pytest.mark.parametrize("edit, message", [
    (lambda ix: (ix["v"].update(alias="w2"), ix.__setitem__("w2", {"alias": "v", "shape": [300, 700],
                                                                   "dtype": "float32"})),
     "is an alias itself; an alias must name a stored tensor (no chains or cycles)"),
    (lambda ix: ix["v"].update(alias="v"), "is an alias itself"),
    (_set("v", alias="nowhere"), "field 'alias' 'nowhere' names no tensor of the store"),
    (_set("v", alias=["w"]), "tensors.v.alias is ['w']: input should be a valid string"),
    (_set("same", shape=[700, 300]), "differs from its alias 'w' ([300, 700]) and no 'view' says how to read it"),
    (_set("same", dtype="float16"), "dtype float16 differs from its alias 'w'"),
    (_set("v", view={"offset": 1, "stride": [1, 700]}), "its view reads element 210000 of 'w', which has 210000"),
    (_set("v", view={"offset": -1, "stride": [1, 700]}), "tensors.v.view.offset is -1: input should be greater than or equal to 0"),
    (_set("v", view={"offset": 0, "stride": [1]}), "tensors.v.view.stride has 1 strides for a shape of 2 dimensions"),
    (_set("v", shard="shards/tensors-00000.safetensors"), "a 'shard' or an 'alias', not both"),
])
def test_hostile_aliases_are_refused(tmp_path, edit, message):
    weight = torch.randn(300, 700)
    path = _bare_store(tmp_path, {"w": weight, "same": weight, "v": weight.t()}, edit)
    with pytest.raises(TapmlError) as e:
        CarveStore(path)
    assert message in str(e.value) and "carve the model again" in str(e.value)


def test_hostile_alias_exits_2_on_the_command_line(tmp_path, carved):
    """The CLI refuses a store whose alias forms a cycle with exit 2 and a message naming it."""
    from typer.testing import CliRunner

    from tapml.cli import app
    store = tmp_path / "store"
    shutil.copytree(carved("zoo:mlp"), store)
    m = json.loads((store / "manifest.json").read_text())
    alias = next(n for n, info in m["tensors"].items() if "alias" in info)
    m["tensors"][m["tensors"][alias]["alias"]] = {"alias": alias, "shape": m["tensors"][alias]["shape"],
                                                   "dtype": m["tensors"][alias]["dtype"]}
    (store / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(app, ["replay", str(store), "--target", "reference"])
    assert r.exit_code == 2, r.output
    assert "no chains or cycles" in " ".join(r.output.split()) and "Traceback" not in r.output
