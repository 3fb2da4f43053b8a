"""Every JSON document tapml writes says what it is (``kind``, ``format_version``), readers dispatch
on ``kind`` alone, documents written before that are read by the key rules (the saved examples in
tests/golden/documents, written by tapml before kinds existed), and ``tapml report`` renders
every kind a user looks at in HTML, Markdown and JUnit (#37)."""

import json
import shutil
from pathlib import Path

import pytest
from support import undeclared
from typer.testing import CliRunner

from tapml.cli import app
from tapml.errors import TapmlError
from tapml.judging.verdict import KINDS, document_kind

GOLDEN = Path(__file__).parent / "golden" / "documents"
runner = CliRunner()


def tapml(*args):
    return runner.invoke(app, [str(a) for a in args])


#: What a report of each kind must say, per format: proof it read what the document holds.
NAMES = {
    "verdict": {"md": ["(replay): ✅ passed; 10 pass"], "junit": ['tests="10"', "zoo:mlp.op.aten.addmm.default"],
                "html": ['<span class="chip">replay</span>', "aten.addmm.default"]},
    "migration-state": {"md": ["(migration): ✅ passed", "- end to end: ✅ pass"],
                        "junit": ["zoo:mlp.model", "zoo:mlp.op.aten.addmm.default"],
                        "html": ['<span class="chip">migration</span>']},
    "matrix": {"md": ["## Op coverage", "`aten.addmm.default`"], "junit": ["zoo:mlp.op.aten.addmm.default"],
               "html": ['id="coverage"']},
    "generation": {"md": ["(generation): ✅ passed; 3 steps, 3 pass", "### Generation: 3 steps",
                          "| step | kind | reference token | target token |"],
                   "junit": ['name="step 0 prefill"', 'name="step 2 decode"'],
                   "html": ["Generation: 3 steps, 3 pass", "reference token</th>"]},
    "preflight": {"md": ["(preflight): ", "## Preflight of zoo:mlp", "`aten.addmm.default`"],
                  "junit": ['name="aten.addmm.default fits wgpu:vulkan"', "zoo:mlp.preflight"],
                  "html": ["What splits and what is over a limit, per op", "Device limits checked",
                           "max-storage-buffer-binding-size"]},
    "bench": {"md": ["(bench): ", "## Benchmark", "| `size_bytes` | 1048576 |"], "junit": ["benchmark on"],
              "html": ["Figures</h3>", "<code>socket.round_trip_ms</code>"]},
    "precision": {"md": ["(precision): ", "in float16"], "junit": ["end to end in float16 with keep_float32"],
                  "html": ["Ops that must stay in float32"]},
}
SUFFIX = {"md": ".md", "junit": ".xml", "html": ".html"}


def assert_report_names(doc: Path, kind: str, model: str, target: str, tmp_path: Path, exit_code: int = 0) -> None:
    """``tapml report DOC`` in every format exits like the document's verdict (``exit_code``) and
    names the model, the target and what :data:`NAMES` says this kind holds."""
    for fmt, wanted in NAMES[kind].items():
        out = tmp_path / f"{doc.stem}{SUFFIX[fmt]}"
        r = tapml("report", doc, "-o", out, "-q")
        assert r.exit_code == exit_code, (doc.name, fmt, r.output)
        text = out.read_text()
        for phrase in (model, target, *wanted):
            assert phrase in text, (doc.name, fmt, phrase)


OLDER = (("verdict", "verdict", "zoo:mlp"), ("state", "migration-state", "zoo:mlp"), ("matrix", "matrix", "zoo:mlp"),
         ("gen", "generation", "zoo:tiny-llama"), ("gen16", "generation", "zoo:tiny-llama"),
         ("preflight", "preflight", "zoo:mlp"))


def test_older_documents_are_read_by_the_key_rules_and_render(tmp_path):
    """The saved documents without kind: each is told apart by its keys and renders in every format.
    A float16 generation (it holds keep_float32) is a generation, not a precision analysis."""
    for name, kind, model in OLDER:
        doc = GOLDEN / f"old-{name}.json"
        data = json.loads(doc.read_text())
        assert "kind" not in data
        assert document_kind(data) == kind, name
        assert_report_names(doc, kind, model, "wgpu:vulkan", tmp_path)
    assert "keep_float32" in json.loads((GOLDEN / "old-gen16.json").read_text())
    assert "wgpu:gl" in (tmp_path / "old-matrix.md").read_text()


def test_kind_decides_and_a_bad_kind_or_version_says_what_to_fix(tmp_path):
    """kind overrides the keys; an unknown kind, a newer format_version and a kind report does not
    render are each exit 2 naming the file and what to pass instead."""
    gen = json.loads((GOLDEN / "old-gen16.json").read_text())
    assert document_kind({**gen, "kind": "generation", "format_version": 1}) == "generation"
    for doc, message in (({**gen, "kind": "recipe"}, "kind 'recipe' is not a kind of document tapml writes"),
                         ({**gen, "kind": "generation", "format_version": 9}, "generation format_version 9 is newer"),
                         ({**gen, "kind": "generation", "format_version": "1"}, "format_version is not a non-negative"),
                         ({"kind": "journal-header", "format_version": 1, "format": "tapml-migration/1"},
                          "is a journal-header document (the first line of a migration's STATE.journal), "
                          "which tapml report does not render"),
                         ({"kind": "bench", "format_version": 1, "passed": "yes"}, "passed is 'yes': input should be a valid boolean"),
                         ({**gen, "kind": "preflight", "format_version": 1}, "lacks ops")):
        path = tmp_path / "doc.json"
        path.write_text(json.dumps(doc))
        r = tapml("report", path, "-f", "md")
        assert r.exit_code == 2 and message in r.output, (message, r.output)
        assert "Traceback" not in r.output
    with pytest.raises(TapmlError, match="not a kind of document"):
        document_kind({"kind": ["generation"]}, "x.json")
    assert set(KINDS) == {"verdict", "migration-state", "matrix", "journal-header", "generation", "precision", "fleet",
                          "preflight", "bench"}


def test_journal_header_carries_its_kind_and_older_headers_still_read(tmp_path):
    """A new journal's header line says kind journal-header; reading gives the options alone, so an
    old journal (no kind) and a new one with the same options compare equal when resuming."""
    from tapml.driving.journal import Journal, journal_text
    old = tmp_path / "old.journal"
    shutil.copy(GOLDEN / "old-journal.jsonl", old)
    header, records = Journal.read(old)
    assert records == {} and header["format"] == "tapml-migration/1" and "kind" not in header
    new = tmp_path / "new.journal"
    new.write_text(journal_text(header, {}))
    line = json.loads(new.read_text().splitlines()[0])["header"]
    assert line["kind"] == "journal-header" and line["format_version"] == KINDS["journal-header"]["format_version"]
    assert Journal.read(new)[0] == header
    new.write_text(json.dumps({"header": {**line, "kind": "verdict"}}) + "\n")
    with pytest.raises(TapmlError, match="its header is not a journal header"):
        Journal.read(new)


@pytest.mark.device
@pytest.mark.slow
def test_every_command_that_writes_json_says_its_kind_and_renders(carved, tmp_path):
    """replay (one target and two), migrate (--state, its journal and --json), inspect --target,
    generate (float32, and float16 with --keep-float32), precision and bench transport on real
    stores: every file has kind and format_version, and every one renders in every format naming
    what it holds (the journal is read by --resume, not rendered)."""
    import shutil as sh
    store = sh.copytree(carved("zoo:mlp"), tmp_path / "mlp")
    d = tmp_path
    runs = [
        (("replay", store, "-t", "wgpu:vulkan", "--json", d / "verdict.json"), "verdict.json", "verdict"),
        (("replay", store, "-t", "wgpu:vulkan", "-t", "reference", "--json", d / "matrix.json"), "matrix.json",
         "matrix"),
        (("migrate", store, "-t", "wgpu:vulkan", "--state", d / "state.json", "--json", d / "migrate.json"),
         "state.json", "migration-state"),
        (("inspect", store, "-t", "wgpu:vulkan", "--json", d / "preflight.json"), "preflight.json", "preflight"),
        (("generate", "zoo:tiny-llama", "-t", "wgpu:vulkan", "--tokens", 2, "--prompt-len", 4, "--json",
          d / "gen.json"), "gen.json", "generation"),
        (("generate", "zoo:tiny-llama", "-t", "wgpu:vulkan", "--tokens", 2, "--prompt-len", 4, "--dtype", "float16",
          "--keep-float32", "aten._softmax.default", "--json", d / "gen16.json"), "gen16.json", "generation"),
        (("precision", "zoo:mlp", "-t", "wgpu:vulkan", "--json", d / "precision.json"),
         "precision.json", "precision"),
        (("bench", "transport", "--size-mib", 1, "--repeat", 1, "--calls", 5, "--json", d / "bench.json"),
         "bench.json", "bench"),
    ]
    for args, name, kind in runs:
        r = tapml(*args, *(("-q",) if args[0] != "bench" else ()))
        assert r.exit_code in (0, 1), (args, r.output)
        data = json.loads((d / name).read_text())
        assert data["kind"] == kind and data["format_version"] == KINDS[kind]["format_version"], name
        assert document_kind(data) == kind
    assert json.loads((d / "migrate.json").read_text())["kind"] == "migration-state"
    # every key each writer wrote is declared by the schema its reader validates it with
    from tapml.judging import verdict as v
    from tapml.reports.schemas import MatrixJSON
    from tapml.schema import validate
    schemas = {"verdict": v.VerdictDocumentJSON, "migration-state": v.MigrationStateJSON, "matrix": MatrixJSON,
               "preflight": v.PreflightJSON, "generation": v.GenerationJSON, "precision": v.PrecisionJSON}
    docs = [json.loads((d / name).read_text()) for _, name, kind in runs if kind in schemas]
    docs += list(json.loads((d / "matrix.json").read_text())["verdicts"].values())
    for data in docs:
        assert undeclared(validate(schemas[data["kind"]], data), data) == ["kind"], data["kind"]
    header = json.loads((d / "state.json.journal").read_text().splitlines()[0])["header"]
    assert header["kind"] == "journal-header"
    assert json.loads((d / "gen16.json").read_text())["keep_float32"]  # the field that fooled the old rules
    for name, kind, model in (("verdict", "verdict", "zoo:mlp"), ("state", "migration-state", "zoo:mlp"),
                              ("matrix", "matrix", "zoo:mlp"), ("preflight", "preflight", "zoo:mlp"),
                              ("gen", "generation", "zoo:tiny-llama"), ("gen16", "generation", "zoo:tiny-llama"),
                              ("precision", "precision", "zoo:mlp")):
        assert_report_names(d / f"{name}.json", kind, model, "wgpu:vulkan", tmp_path)
    bench = json.loads((d / "bench.json").read_text())  # its round-trip goal may be missed on a loaded machine
    assert_report_names(d / "bench.json", "bench", "tapml bench", bench["target"], tmp_path,
                        exit_code=0 if bench["passed"] else 1)
