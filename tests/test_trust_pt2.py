""".pt2 archives from strangers never run code, and an internal error is one line and exit 3.

The crafted archives are real ones written by torch.export.save with one entry replaced or
added: a pickle whose ``__reduce__`` opens (creates) a marker file, in every place a torch
loader would unpickle, plus the other ways an archive can make torch run code (AOTInductor
libraries, sympified expressions, guard code, node targets resolved under ``torch``).
"""

import io
import json
import os
import pickle
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

TAPML = [sys.executable, "-m", "tapml.cli"]


class MarkerPickle:
    """Unpickling this creates ``path``: the stand-in for any code an attacker would run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.register_buffer("shift", torch.full((4,), 0.5))
        self.scale = torch.tensor([1.0, 2.0, 3.0, 4.0])  # a tensor constant

    def forward(self, x):
        return torch.tanh(self.linear(x)) * self.scale + self.shift


@pytest.fixture(scope="module")
def real_pt2(tmp_path_factory):
    """A real archive saved by torch.export.save, and the model's output on its example input."""
    torch.manual_seed(0)
    model, x = Model().eval(), torch.randn(2, 8)
    path = tmp_path_factory.mktemp("pt2") / "model.pt2"
    torch.export.save(torch.export.export(model, (x,)), path)
    with torch.no_grad():
        return path, model(x)


def rewrite(src: Path, dst: Path, change) -> Path:
    """Copy the archive ``src`` to ``dst``; ``change(entries)`` edits the {name: bytes} dict in place."""
    with zipfile.ZipFile(src) as z:
        entries = {name: z.read(name) for name in z.namelist()}
    change(entries)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return dst


def root_of(entries) -> str:
    return next(iter(entries)).partition("/")[0]


def torch_saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def edit_json(entries, name, edit):
    data = json.loads(entries[name])
    edit(data)
    entries[name] = json.dumps(data).encode()


def nodes(program):
    return program["graph_module"]["graph"]["nodes"]


def crafted(kind: str, marker: Path):
    """``change(entries)`` that plants the attack ``kind``; the marker file is what it would create."""
    evil_torch, evil_pickle = torch_saved(MarkerPickle(marker)), pickle.dumps(MarkerPickle(marker))

    def change(entries):
        r = root_of(entries)
        weights = f"{r}/data/weights/model_weights_config.json"
        constants = f"{r}/data/constants/model_constants_config.json"
        program = f"{r}/models/model.json"
        if kind == "sample-inputs":  # torch.load(weights_only=True), then its fallback to weights_only=False
            entries[f"{r}/data/sample_inputs/model.pt"] = evil_torch
        elif kind == "sample-inputs-raw-pickle":  # the pre-zip torch.save format
            entries[f"{r}/data/sample_inputs/model.pt"] = evil_pickle
        elif kind == "sample-inputs-global":  # a real torch.save file whose pickle names another callable
            entries[f"{r}/data/sample_inputs/model.pt"] = torch_saved(((torch.zeros(2, 8), MarkerPickle(marker)), {}))
        elif kind == "weight-use-pickle":  # torch.load(weights_only=False)
            edit_json(entries, weights, lambda c: c["config"]["linear.weight"].update(use_pickle=True))
            entries[f"{r}/data/weights/weight_0"] = evil_torch
        elif kind == "constant-use-pickle":
            edit_json(entries, constants, lambda c: c["config"]["scale"].update(use_pickle=True))
            entries[f"{r}/data/constants/tensor_0"] = evil_torch
        elif kind == "opaque-object":  # pickle.loads
            edit_json(entries, constants,
                      lambda c: c["config"]["scale"].update(path_name="opaque_obj_0", use_pickle=True))
            entries[f"{r}/data/constants/opaque_obj_0"] = evil_pickle
        elif kind == "custom-object":  # torch._C._pickle_load_obj
            edit_json(entries, constants,
                      lambda c: c["config"]["scale"].update(path_name="custom_obj_0", use_pickle=True))
            entries[f"{r}/data/constants/custom_obj_0"] = evil_torch
        elif kind == "legacy-weights":  # data/weights/model.pt is unpickled whole
            entries[f"{r}/data/weights/model.pt"] = evil_torch
        elif kind == "legacy-constants":
            entries[f"{r}/data/constants/model.pt"] = evil_torch
        elif kind == "legacy-layout":  # the pre-2.8 zip that torch.export.load falls back to
            from torch._export.serde.schema import SCHEMA_VERSION
            model_json = entries[program]
            entries.clear()
            entries.update({"version": ".".join(map(str, SCHEMA_VERSION)).encode(),
                            "serialized_exported_program.json": model_json,
                            "serialized_state_dict.pt": evil_torch, "serialized_constants.pt": evil_torch,
                            "serialized_example_inputs.pt": evil_torch})
        elif kind == "sympy-expression":  # sympify evaluates the string
            def symbolic_size(p):
                size = p["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0]
                size.clear()
                size["as_expr"] = {"expr_str": f"open({str(marker)!r}, 'w') and 2", "hint": {"as_int": 2}}
            edit_json(entries, program, symbolic_size)
        elif kind == "guard-code":  # exec'd by ExportedProgram.module()
            edit_json(entries, program, lambda p: p.update(guards_code=[f"open({str(marker)!r}, 'w')"]))
        elif kind == "node-target":  # resolved as an attribute chain under torch, called when run
            edit_json(entries, program, lambda p: nodes(p)[1].update(target="torch.serialization.os.system"))
        elif kind == "parameter-name":  # written into ExportedProgram.module()'s generated forward
            evil = f'bias"),open({str(marker)!r},"w"),getattr(self,"w'

            def rename_in_program(p):
                for spec in p["graph_module"]["signature"]["input_specs"]:
                    if spec.get("parameter", {}).get("parameter_name") == "linear.weight":
                        spec["parameter"]["parameter_name"] = f"linear.{evil}"
            edit_json(entries, program, rename_in_program)
            edit_json(entries, weights,
                      lambda c: c["config"].update({f"linear.{evil}": c["config"].pop("linear.weight")}))
        elif kind == "value-name":  # a graph value's name is a variable in generated code
            edit_json(entries, program, lambda p: p["graph_module"]["signature"]["input_specs"][-1]["user_input"]
                      ["arg"]["as_tensor"].update(name=f"x=open({str(marker)!r},'w')"))
        elif kind == "forward-arg-name":  # a parameter of the generated forward
            edit_json(entries, program, lambda p: p["graph_module"]["module_call_graph"][0]["signature"]
                      .update(forward_arg_names=[f"x=open({str(marker)!r},'w')"]))
        elif kind == "keyword-name":  # in_spec dict keys are quoted into generated code
            def keyword(p):
                sig = p["graph_module"]["module_call_graph"][0]["signature"]
                spec = json.loads(sig["in_spec"])
                spec[1]["children_spec"][1]["context"] = json.dumps([f"k':open({str(marker)!r},'w'),'"])
                sig["in_spec"] = json.dumps(spec)
            edit_json(entries, program, keyword)
        elif kind == "operator-argument":  # resolved as an attribute chain under torch
            edit_json(entries, program, lambda p: nodes(p)[1]["inputs"].append(
                {"name": "fn", "arg": {"as_operator": "torch.serialization.os.system"}, "kind": 1}))
        elif kind == "aotinductor":  # a shared library torch would dlopen
            entries[f"{r}/data/aotinductor/model/model.so"] = b"\x7fELF" + bytes(60)
        else:
            raise AssertionError(kind)
    return change


ATTACKS = ["sample-inputs", "sample-inputs-raw-pickle", "sample-inputs-global", "weight-use-pickle",
           "constant-use-pickle", "opaque-object", "custom-object", "legacy-weights", "legacy-constants",
           "legacy-layout", "sympy-expression", "node-target", "parameter-name", "value-name", "forward-arg-name",
           "keyword-name", "operator-argument", "aotinductor"]
# What the refusal says, so that a user knows what to change.
HINTS = {"sample-inputs": "will not unpickle", "sample-inputs-raw-pickle": "not a zip",
         "sample-inputs-global": "will not unpickle", "weight-use-pickle": "stored as a pickle",
         "constant-use-pickle": "stored as a pickle", "opaque-object": "custom or opaque object",
         "custom-object": "custom or opaque object", "legacy-weights": "legacy pickled format",
         "legacy-constants": "legacy pickled format", "legacy-layout": "old torch.export zip layout",
         "sympy-expression": "not a plain sympy shape expression",
         "node-target": "outside the ops tapml accepts", "parameter-name": "not a dotted name",
         "value-name": "not a plain Python name", "forward-arg-name": "not a plain Python name",
         "keyword-name": "not a plain Python name", "operator-argument": "an operator argument",
         "aotinductor": "AOTInductor"}
# Attacks that torch alone runs, on torch.export.load or on calling the loaded program's
# module() (proves the crafted archives are live, not duds).
LIVE_IN_TORCH = ["sample-inputs", "sample-inputs-raw-pickle", "sample-inputs-global", "weight-use-pickle",
                 "constant-use-pickle", "opaque-object", "legacy-weights", "legacy-constants", "legacy-layout",
                 "sympy-expression", "parameter-name"]


@pytest.mark.parametrize("kind", LIVE_IN_TORCH)
def test_crafted_archives_do_run_code_in_torch_export_load(real_pt2, tmp_path, kind):
    marker = tmp_path / "MARKER"
    path = rewrite(real_pt2[0], tmp_path / "evil.pt2", crafted(kind, marker))
    try:
        torch.export.load(path).module()(torch.zeros(2, 8))
    except Exception:  # noqa: BLE001 - most fail after the code ran; the marker is what counts
        pass
    assert marker.exists(), f"the {kind} archive no longer runs code in torch: update the attack"


RESAVE = "re-save it from the model with torch.export.save(torch.export.export(model, args), FILE)"


def test_carve_refuses_the_reported_pt2_in_a_real_process(real_pt2, tmp_path):
    marker = tmp_path / "MARKER"
    path = rewrite(real_pt2[0], tmp_path / "evil.pt2", crafted("sample-inputs", marker))
    r = subprocess.run(TAPML + ["carve", str(path), "-o", str(tmp_path / "out")], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()
    message = " ".join(r.stderr.split())
    assert message.startswith("error:") and "Traceback" not in r.stderr
    assert HINTS["sample-inputs"] in message and RESAVE in message, message


@pytest.mark.parametrize("kind", ATTACKS)
def test_carve_refuses_every_crafted_pt2_before_anything_runs(real_pt2, tmp_path, kind):
    from typer.testing import CliRunner

    from tapml.cli import app
    marker = tmp_path / "MARKER"
    path = rewrite(real_pt2[0], tmp_path / "evil.pt2", crafted(kind, marker))
    r = CliRunner().invoke(app, ["carve", str(path), "-o", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert not marker.exists()
    assert not (tmp_path / "out").exists()
    message = " ".join(r.output.split())
    assert message.startswith("error:") and "Traceback" not in r.output
    assert HINTS[kind] in message and RESAVE in message, message


def test_guard_code_in_a_pt2_is_dropped_never_run(real_pt2, tmp_path):
    from tapml.frontends.models import load_model
    marker = tmp_path / "MARKER"
    path = rewrite(real_pt2[0], tmp_path / "guarded.pt2", crafted("guard-code", marker))
    ep, (x,) = load_model(str(path))
    torch.testing.assert_close(ep.module()(x), real_pt2[1], rtol=0, atol=0)  # module() execs guard code
    assert not marker.exists()
    torch.export.load(path).module()(x)
    assert marker.exists()  # what torch alone would have done


def test_a_legitimate_pt2_carves_with_its_weights_constants_and_inputs(real_pt2, tmp_path):
    from tapml.carving import CarveStore
    from tapml.frontends.models import load_model
    path, expected = real_pt2
    r = subprocess.run(TAPML + ["carve", str(path), "-o", str(tmp_path / "store"), "-q"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    store = CarveStore(tmp_path / "store")
    assert {"aten.tanh.default", "aten.mul.Tensor", "aten.add.Tensor"} <= {c["op"] for c in store.cases}
    ep, (x,) = load_model(str(path))
    assert x.shape == (2, 8) and x.dtype == torch.float32
    torch.testing.assert_close(ep.module()(x), expected, rtol=0, atol=0)


class TrainingIRModel(torch.nn.Module):
    """What torch.export.export keeps before decomposition: in-place ops, a no_grad region
    (a higher-order op with a subgraph), a Python-operator spelling (``aten.__and__``)."""

    def forward(self, x):
        y = x.clone()
        y.mul_(2.0)
        with torch.no_grad():
            z = torch.relu(y) + 1.0
        mask = (x > -0.5) & (x < 0.5)
        return torch.where(mask, z, y)


def test_a_pt2_in_training_ir_carves_the_same_as_the_model(tmp_path):
    from tapml.carving import CarveStore, carve
    from tapml.frontends.models import load_model
    torch.manual_seed(0)
    x = torch.randn(3, 5)
    ep = torch.export.export(TrainingIRModel(), (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"aten.mul_.Tensor", "aten.__and__.Tensor", "wrap_with_set_grad_enabled"} <= targets
    torch.export.save(ep, tmp_path / "train.pt2")
    loaded, (x_loaded,) = load_model(str(tmp_path / "train.pt2"))
    assert torch.equal(x_loaded, x)
    torch.testing.assert_close(loaded.module()(x), TrainingIRModel()(x), rtol=0, atol=0)
    carve(str(tmp_path / "train.pt2"), tmp_path / "store")
    assert {"aten.relu.default", "aten.bitwise_and.Tensor", "aten.where.self"} <= {
        c["op"] for c in CarveStore(tmp_path / "store").cases}


def test_a_pt2_without_example_inputs_or_with_a_stray_entry_exits_2(real_pt2, tmp_path):
    from tapml.errors import TapmlError
    from tapml.frontends.models import load_model

    def drop_inputs(entries):
        entries[f"{root_of(entries)}/data/sample_inputs/model.pt"] = b""

    def stray(entries):
        entries[f"{root_of(entries)}/../../escape"] = b"x"

    with pytest.raises(TapmlError, match="holds no example inputs"):
        load_model(str(rewrite(real_pt2[0], tmp_path / "a.pt2", drop_inputs)))
    with pytest.raises(TapmlError, match="leaves its folder"):
        load_model(str(rewrite(real_pt2[0], tmp_path / "b.pt2", stray)))
    (tmp_path / "c.pt2").write_bytes(b"not a zip")
    with pytest.raises(TapmlError, match="not a zip archive"):
        load_model(str(tmp_path / "c.pt2"))


FUZZ_VALUES = [None, True, 0, -1, 2**70, 1.5, "", "x", "torch.ops.aten.add.Tensor", [], {}, [1, 2],
               {"as_int": 3}, {"as_expr": {"expr_str": "s0"}}, "a" * 300]


def test_fuzzed_pt2_archives_load_or_exit_2(real_pt2, tmp_path, figure):
    """Random JSON fields, flipped archive bytes and flipped pickle bytes: every archive either
    loads or is refused with TapmlError (exit 2), never another exception (which would be exit 3)."""
    import random

    from tapml.errors import TapmlError
    from tapml.frontends.pt2 import load_pt2
    rng = random.Random(1234)
    original = real_pt2[0].read_bytes()
    with zipfile.ZipFile(real_pt2[0]) as z:
        base = {name: z.read(name) for name in z.namelist()}

    def mutate_json(document):
        paths = []
        pending = [(document, [])]
        while pending:
            value, path = pending.pop()
            paths.append(path)
            items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
            pending.extend((child, path + [key]) for key, child in items)
        if len(paths) < 2:  # already mutated down to one value
            return
        path = rng.choice(paths[1:])
        parent = document
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and rng.random() < 0.15:
            del parent[path[-1]]
        else:
            parent[path[-1]] = rng.choice(FUZZ_VALUES)

    def flip(data: bytes, count: int) -> bytes:
        data = bytearray(data)
        for _ in range(count):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)

    outcomes = {"loaded": 0, "refused": 0}
    json_entries = [name for name in base if name.endswith(".json")]
    inputs = next(name for name in base if name.endswith("sample_inputs/model.pt"))
    for i in range(150):
        path = tmp_path / f"fuzz{i}.pt2"
        entries = dict(base)
        what = rng.choice(json_entries + ["archive bytes", "pickle bytes"])
        if what == "archive bytes":
            path.write_bytes(flip(original, rng.randint(1, 5)))
        else:
            if what == "pickle bytes":
                with zipfile.ZipFile(io.BytesIO(entries[inputs])) as inner:
                    records = {name: inner.read(name) for name in inner.namelist()}
                pkl = next(name for name in records if name.endswith("data.pkl"))
                records[pkl] = flip(records[pkl], rng.randint(1, 3))
                buffer = io.BytesIO()
                with zipfile.ZipFile(buffer, "w") as inner:
                    for name, data in records.items():
                        inner.writestr(name, data)
                entries[inputs] = buffer.getvalue()
            else:
                document = json.loads(entries[what])
                for _ in range(rng.randint(1, 3)):
                    mutate_json(document)
                entries[what] = json.dumps(document).encode()
            with zipfile.ZipFile(path, "w") as z:
                for name, data in entries.items():
                    z.writestr(name, data)
        try:
            load_pt2(path)
            outcomes["loaded"] += 1
        except TapmlError as e:
            assert str(e)
            outcomes["refused"] += 1
    figure("fuzzed .pt2 archives tried", sum(outcomes.values()))
    assert outcomes["refused"] > 100 and sum(outcomes.values()) == 150


# --- exit 3: internal errors ----------------------------------------------------------------

BREAK_OPEN_STORE = """
import runpy, sys
import tapml.carving.store as store
class Broken:
    def __init__(self, *a, **k):
        raise RuntimeError("disk gremlin\\nsecond line")
store.CarveStore = Broken
sys.argv = ["tapml"] + sys.argv[1:]
runpy.run_module("tapml.cli", run_name="__main__")
"""


def test_an_internal_error_is_one_line_exit_3_and_a_private_details_file(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    store = tmp_path / "store"
    store.mkdir()
    r = subprocess.run([sys.executable, "-c", BREAK_OPEN_STORE, "inspect", str(store)], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("internal error: RuntimeError: disk gremlin")
    details = Path(lines[0].rsplit("details in ", 1)[1].strip())
    assert details.parent == tmp_path / "cache" / "tapml" and details.name.startswith("tapml-crash-")
    assert stat.S_IMODE(details.stat().st_mode) == 0o600
    text = details.read_text()
    assert "Traceback" in text and "RuntimeError: disk gremlin" in text and "__init__" in text
    assert "inspect" in text  # the command line, to reproduce it


def test_usage_errors_bad_input_and_ctrl_c_keep_their_codes(tmp_path):
    from typer.testing import CliRunner

    import tapml.carving.store as store_module
    from tapml.cli import app
    runner = CliRunner()
    assert runner.invoke(app, ["inspect"]).exit_code == 2  # click: missing argument
    assert runner.invoke(app, ["replay", str(tmp_path), "--no-such-flag"]).exit_code == 2
    r = runner.invoke(app, ["inspect", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "internal error" not in r.output  # TapmlError: bad input
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    r = runner.invoke(app, ["carve", "zoo:mlp", "-o", str(tmp_path / "taken")])
    assert r.exit_code == 2 and "choose another -o" in r.output  # typer.Exit raised by the command itself

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    original = store_module.CarveStore
    store_module.CarveStore = interrupted
    try:
        r = runner.invoke(app, ["inspect", str(tmp_path)])
    finally:
        store_module.CarveStore = original
    assert r.exit_code == 130 and "internal error" not in r.output
