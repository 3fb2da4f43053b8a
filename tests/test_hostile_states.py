"""States, verdict files and journals from strangers: every malformed one is refused with exit 2
and a message naming the file and the field (never a traceback), a journal record that does not
fit its schema is never trusted, and real documents survive a typed round trip unchanged."""

import json
import re
import os
import shutil
from pathlib import Path

import pytest
from support import KINDS, make_kind, no_hang, undeclared
from typer.testing import CliRunner

from tapml.errors import DeviceLost, PlatformError, TapmlError, Unsupported
from tapml.driving.journal import journal_path
from tapml.judging.verdict import (CULPRIT_KINDS, FORMAT_VERSION, MigrationState, VerdictDocument, culprit_kind,
                           outcome_verdict, passed, summary)

FAULT = "aten.addmm.default@addmm_1=scale:1.01"  # a culprit with its worst elements, and every stage has work


def tapml(*args):
    from tapml.cli import app
    return CliRunner().invoke(app, [str(a) for a in args])


def refused(r, *expect):
    """Exit 2 with one clear message that says each of ``expect``; no traceback, no crash."""
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output
    for text in expect:
        assert text in r.output, (text, r.output)


@pytest.fixture(scope="module")
def real(mlp, tmp_path_factory):
    """Real documents of zoo:mlp on the reference, made by the CLI: a clean migration, one with
    a fault (culprits, bisection probes, worst elements), and a replay Verdict JSON."""
    work = tmp_path_factory.mktemp("real")
    r = tapml("migrate", mlp.path, "--target", "reference", "--state", work / "clean.json", "-q")
    assert r.exit_code == 0, r.output
    r = tapml("migrate", mlp.path, "--target", "reference", "--state", work / "fault.json", "--inject", FAULT, "-q")
    assert r.exit_code == 1, r.output
    r = tapml("replay", mlp.path, "--target", "reference", "--inject", "aten.relu.default=nan", "--json",
              work / "replay.json", "-q")
    assert r.exit_code == 1, r.output
    return {"work": work, "store": mlp.path, **{k: json.loads((work / f"{k}.json").read_text())
                                                for k in ("clean", "fault", "replay")}}


# --- the typed round trip ------------------------------------------------------------------

def test_real_states_and_verdicts_round_trip_unchanged(real):
    for name in ("clean", "fault"):
        doc = MigrationState.from_json(real[name], name, strict=True)
        assert isinstance(doc, MigrationState)
        assert doc.to_json() == real[name]
        assert doc.passed == real[name]["passed"] == (name == "clean")
        assert real[name]["format_version"] == FORMAT_VERSION and real[name]["complete"]
    fault = MigrationState.from_json(real["fault"], "fault")
    assert [(c.kind, c.nodes) for c in fault.culprits] == [("op", ["addmm_1"])]
    assert fault.culprits[0].worst and any(c.worst for c in fault.cases) and fault.end_to_end.status == "pass"
    replay = VerdictDocument.from_json(real["replay"], "replay")
    assert type(replay) is VerdictDocument and replay.to_json() == real["replay"]
    assert real["replay"]["summary"] == summary(replay.cases) and not replay.passed
    assert {c.status for c in replay.cases} == {"pass", "mismatch"}


def test_every_field_the_writers_write_is_declared_by_the_schema_that_reads_it(real):
    """The schema a document is read with declares every key its writer wrote, at every level
    (kind is read by document_kind before it), so nothing a writer adds is dropped unread: the
    states, the replay Verdict JSON and every record of a journal."""
    from tapml.judging.verdict import CaseVerdictJSON, DeviceJSON, MigrationStateJSON, UnitVerdictJSON, VerdictDocumentJSON
    from tapml.schema import validate
    for name, schema in (("clean", MigrationStateJSON), ("fault", MigrationStateJSON), ("replay", VerdictDocumentJSON)):
        assert undeclared(validate(schema, real[name]), real[name]) == ["kind"], name
    lines = journal_path(real["work"] / "fault.json").read_text().splitlines()
    schemas = {"device": DeviceJSON, "case": CaseVerdictJSON, "unit": UnitVerdictJSON}
    for line in map(json.loads, lines[1:]):
        schema = schemas[line["key"].partition(":")[0]]
        assert undeclared(validate(schema, line["record"]), line["record"]) == [], line["key"]
    assert {json.loads(x)["key"].partition(":")[0] for x in lines[1:]} == set(schemas)


def test_older_files_without_format_version_or_worst_still_read(real):
    old = json.loads(json.dumps(real["fault"]))
    del old["format_version"]
    for c in old["cases"]:
        c.pop("worst")
    doc = MigrationState.from_json(old, "old.json", strict=True)
    assert [c["worst"] for c in doc.to_json()["cases"]] == [[]] * len(old["cases"])
    assert doc.culprits[0].kind == "op" and doc.culprits[0].worst
    newer = {**real["clean"], "format_version": FORMAT_VERSION + 1}
    with pytest.raises(TapmlError, match="format_version 2 is newer"):
        MigrationState.from_json(newer, "new.json")


def test_one_outcome_mapping_and_device_lost_stays_an_exception():
    e = PlatformError("shader broke")
    e.region = ["a", "b", "c"]
    assert (outcome_verdict(e).status, outcome_verdict(e).message) == ("error", "in region a..c (3 nodes): shader broke")
    assert outcome_verdict(Unsupported("no f64")).status == "unsupported"
    k = KeyError("x")
    k.region = ["mm"]
    assert outcome_verdict(k).message == "in mm: KeyError: 'x'"
    with pytest.raises(DeviceLost, match="device lost: gone"):
        outcome_verdict(DeviceLost("gone"))
    # one closed list of culprit kinds, which migrate and the session both draw from
    assert {culprit_kind(s, n, alone) for s in ("mismatch", "error", "unsupported") for n in (1, 3)
            for alone in (True, False)} == set(CULPRIT_KINDS)
    assert passed([{"status": "pass"}]) and not passed([{"status": "pass"}], needs_end_to_end=True)


# --- tapml report on crafted states --------------------------------------------------------

WRONG = {str: 12345, list: "x", dict: [1], int: "x", bool: "yes", float: "x", type(None): 7}


def _write(tmp_path, data, name="s.json"):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else (data if isinstance(data, str) else json.dumps(data)).encode())
    return path


def test_report_refuses_a_wrong_type_in_every_top_level_field(real, tmp_path):
    state = real["fault"]
    assert len(state) >= 18
    for key, value in state.items():
        bad = _write(tmp_path, {**state, key: WRONG[type(value)]})
        r = tapml("report", bad, "-o", tmp_path / "r.html")
        refused(r, str(bad), key)
        assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("path, value, expect", [
    (("cases", 0, "status"), "fine", "cases[0].status is 'fine': input should be 'pass', 'mismatch'"),
    (("cases", 0, "max_abs_err"), "big", "cases[0].max_abs_err is 'big': input should be a valid number"),
    (("cases", 0, "max_abs_err"), 10 ** 400, "cases[0].max_abs_err: an integer of 401 digits is beyond 64 bits"),
    (("cases", 0, "instances"), 10 ** 30, "cases[0].instances: an integer of 31 digits is beyond 64 bits"),
    (("cases", 0, "instances"), 2 ** 63, "cases[0].instances is 9223372036854775808: input should be less than or equal to 9223372036854775807"),
    (("cases", 0, "worst"), [{"index": ["a"]}], "cases[0].worst[0].index[0] is 'a': input should be a valid integer"),
    (("cases", 1), "pass", "cases[1] is 'pass': input should be an object"),
    (("units", 0, "nodes"), 5, "units[0].nodes is 5: input should be a valid list"),
    (("units", 0, "kind"), "galaxy", "units[0].kind is 'galaxy': input should be 'op', 'region' or 'model'"),
    (("culprits", 0, "kind"), "region", "culprits[0].kind is 'region': input should be 'op', 'node'"),
    (("culprits", 0, "probes"), -1, "probes"),
    (("placement", "nodes", "addmm"), "gpu", "placement.nodes.addmm is 'gpu': input should be 'target' or 'reference'"),
    (("placement", "ops_share"), 7.5, "ops_share"),
    (("end_to_end", "status"), 5, "end_to_end.status is 5: input should be 'pass'"),
    (("device", "limits"), {"x": {"y": 1}}, "device.limits"),
    (("device", "float_model"), {"nan_inf": "yes"}, "device.float_model"),
    (("device", "float_model"), {"<script>": True}, "device.float_model"),
    (("tolerances",), {"aten.mm.default": [1, -1]}, "tolerances"),
    (("summary",), {"pass": "all"}, "summary"),
])
def test_report_refuses_a_malformed_nested_field(real, tmp_path, path, value, expect):
    state = json.loads(json.dumps(real["fault"]))
    holder = state
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    r = tapml("report", _write(tmp_path, state), "-o", tmp_path / "r.html")
    refused(r, expect)


@pytest.mark.parametrize("make, expect", [
    (lambda s: {k: v for k, v in s.items() if k != "cases"}, "the document lacks cases"),
    (lambda s: {k: v for k, v in s.items() if k != "target"}, "the document lacks target"),
    (lambda s: {**s, "cases": [{"status": "pass"}]}, "cases[0] lacks op"),
    (lambda s: {**s, "units": [{"id": "u"}]}, "units[0] lacks status"),
    (lambda s: {**s, "format": "tapml-migration/9"}, "format is 'tapml-migration/9'"),
    (lambda s: json.dumps(s).replace('"max_abs_err": 0.0', '"max_abs_err": NaN', 1), "NaN"),
    (lambda s: json.dumps(s).replace('"time_ms": ', '"time_ms": Infinity, "x": ', 1), "Infinity"),
    (lambda s: json.dumps(s).replace('"max_abs_err": 0.0', '"max_abs_err": -Infinity', 1), "-Infinity"),
    (lambda s: json.dumps(s).replace('"nodes": 10', '"nodes": 1' + "0" * 5000, 1), "not valid JSON"),
    (lambda s: '{"target": "x", "cases": ' + "[" * 50000 + "]" * 50000 + "}", "nests too deeply"),
    (lambda s: {**s, "device": {**s["device"], "limits": {"deep": json.loads("[" * 100 + "]" * 100)}}},
     "nests deeper than"),
    (lambda s: [s], "its JSON is a list, not an object"),
    (lambda s: "null", "its JSON is a null"),
    (lambda s: '"a string"', "its JSON is a string"),
    (lambda s: "3", "its JSON is an integer"),
    (lambda s: b"\x89PNG\r\n\x1a\n\xff\xfe\x00garbage" + os.urandom(64), "not a text file"),
    (lambda s: "", "not valid JSON"),
    (lambda s: json.dumps(s)[: len(json.dumps(s)) // 2], "not valid JSON"),
])
def test_report_refuses_missing_keys_nonfinite_numbers_depth_and_garbage(real, tmp_path, make, expect):
    bad = _write(tmp_path, make(real["fault"]))
    r = tapml("report", bad, "-o", tmp_path / "r.html")
    refused(r, str(bad), expect)
    assert not (tmp_path / "r.html").exists()


def test_report_recomputes_what_a_state_claims(real, tmp_path):
    # "passed": true and a doctored summary on a state with a culprit change nothing.
    lying = {**real["fault"], "passed": True, "summary": {"pass": 99, "mismatch": 0, "unsupported": 0, "error": 0}}
    r = tapml("report", _write(tmp_path, lying), "--json", tmp_path / "r.json", "-q")
    assert r.exit_code == 1, r.output
    data = json.loads((tmp_path / "r.json").read_text())[0]
    assert not data["passed"] and data["summary"] == summary(real["fault"]["cases"])


# --- tapml migrate --resume on crafted journals and states ---------------------------------

@pytest.fixture
def resumable(real, tmp_path):
    """A copy of the clean migration's state and journal, to be doctored."""
    state = tmp_path / "s.json"
    shutil.copy(real["work"] / "clean.json", state)
    shutil.copy(journal_path(real["work"] / "clean.json"), journal_path(state))
    lines = [json.loads(line) for line in journal_path(state).read_text().splitlines()]
    return state, lines


def _resume(real, state):
    return tapml("migrate", real["store"], "--target", "reference", "--state", state, "--resume")


def _lines(lines):
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)


def _case_keys(lines):
    return [i for i, x in enumerate(lines) if isinstance(x, dict) and str(x.get("key", "")).startswith("case:")]


def test_a_bare_pass_record_is_never_trusted(real, resumable):
    state, lines = resumable
    header = lines[0]
    # Every case "passed", the review's forged journal: refused, not "everything passed".
    forged = [header] + [{"key": x["key"], "record": {"status": "pass"}} for x in lines[1:]
                         if x["key"].startswith("case:")]
    journal_path(state).write_text(_lines(forged))
    r = _resume(real, state)
    refused(r, str(journal_path(state)), "lacks", "remove it and its state file to start over")
    assert "everything passed" not in r.output
    assert journal_path(state).read_text() == _lines(forged)  # refused, not rewritten


def _doctor(lines, index, change):
    lines = json.loads(json.dumps(lines))
    lines[index] = change(lines[index])
    return lines


@pytest.mark.parametrize("change, expect", [
    (lambda x: {**x, "record": {**x["record"], "status": "fine"}}, "status is 'fine'"),
    (lambda x: {**x, "record": {k: v for k, v in x["record"].items() if k != "node"}}, "record lacks node"),
    (lambda x: {**x, "record": {**x["record"], "id": "c99"}}, "holds the verdict of 'c99'"),
    (lambda x: {**x, "record": {**x["record"], "op": "aten.mm.default"}}, "has another op"),
    (lambda x: {**x, "record": {**x["record"], "max_abs_err": "0"}}, "record.max_abs_err is '0': input should be a valid number"),
    (lambda x: {**x, "record": [x["record"]]}, "input should be an object"),
    (lambda x: {**x, "key": "case:"}, "is not device, case:ID or unit:ID"),
    (lambda x: {**x, "key": "secret"}, "is not device, case:ID or unit:ID"),
    (lambda x: {**x, "key": 5}, "line.key is 5: input should be a valid string"),
    (lambda x: {"key": x["key"]}, "is not a journal line"),
    (lambda x: [x], "is not a journal line"),
    (lambda x: json.dumps(x).replace('"max_abs_err": 0.0', '"max_abs_err": NaN'), "NaN"),
    (lambda x: json.dumps(x).replace('"instances": 1', '"instances": 1' + "0" * 5000), "not valid JSON"),
    (lambda x: '{"key": "case:c0", "record": ' + "[" * 50000 + "]" * 50000 + "}", "nests too deeply"),
    (lambda x: "{not json", "is corrupt at line"),
])
def test_resume_refuses_a_case_record_that_does_not_fit(real, resumable, change, expect):
    state, lines = resumable
    i = _case_keys(lines)[0]
    doctored = _doctor(lines, i, change)
    journal_path(state).write_text(_lines(doctored))
    r = _resume(real, state)
    refused(r, expect, "start over")
    assert "everything passed" not in r.output


@pytest.mark.parametrize("change, expect", [
    (lambda r: {k: v for k, v in r.items() if k != "id"}, "record lacks id"),
    (lambda r: {k: v for k, v in r.items() if k != "nodes"}, "record lacks nodes"),
    (lambda r: {**r, "nodes": ["addmm_1"]}, "has another nodes"),
    (lambda r: {**r, "kind": "model"}, "has another kind"),
    (lambda r: {**r, "on_target": True}, "on_target"),
])
def test_resume_refuses_a_unit_record_that_does_not_fit(real, resumable, change, expect):
    state, lines = resumable
    i = next(i for i, x in enumerate(lines) if str(x.get("key", "")).startswith("unit:region:"))
    doctored = _doctor(lines, i, lambda x: {**x, "record": change(x["record"])})
    journal_path(state).write_text(_lines(doctored))
    refused(_resume(real, state), expect, "start over")


@pytest.mark.parametrize("make, expect", [
    (lambda lines: lines[1:], "is not a journal line"),  # no header
    (lambda lines: [{"header": [1]}] + lines[1:], "is not a journal line"),
    (lambda lines: lines[:1] + [{"key": "device", "record": "a gpu"}] + lines[2:], "record is 'a gpu': input should be an object"),
    (lambda lines: lines[:1] + [{"key": "device", "record": {"adapter": 1}}] + lines[2:], "record.adapter is 1: input should be a valid string"),
    (lambda lines: [lines[0]] + lines, "is not a journal line"),  # a second header
])
def test_resume_refuses_a_journal_whose_structure_is_wrong(real, resumable, make, expect):
    state, lines = resumable
    journal_path(state).write_text(_lines(make(lines)))
    refused(_resume(real, state), expect, "start over")


def test_resume_refuses_binary_garbage_for_a_journal(real, resumable):
    state, _ = resumable
    journal_path(state).write_bytes(b"\xff\xfe\x00\x01" + os.urandom(256))
    refused(_resume(real, state), "is not a text file", "start over")


def test_resume_tolerates_a_torn_last_line_only(real, resumable):
    state, lines = resumable
    journal_path(state).write_text(_lines(lines[:-3]) + '{"key": "unit:region:0", "rec')
    r = _resume(real, state)
    assert r.exit_code == 0, r.output
    assert strip_times(json.loads(state.read_text())) == strip_times(real["clean"])


def strip_times(x):
    if isinstance(x, dict):
        return {k: strip_times(v) for k, v in x.items() if k not in ("time_ms",)}
    if isinstance(x, list):
        return [strip_times(v) for v in x]
    return x


@pytest.mark.parametrize("make, expect", [
    (lambda s, replay: replay, "lacks format"),  # a replay Verdict JSON is no migration state
    (lambda s, replay: {**s, "cases": [{**s["cases"][0], "status": "fine"}]}, "status is 'fine'"),
    (lambda s, replay: {**s, "cases": [{"id": "c0", "op": "aten.permute.default", "status": "pass"}]}, "lacks node"),
    (lambda s, replay: {**s, "units": [{"status": "pass"}]}, "units[0] lacks id"),
    (lambda s, replay: {k: v for k, v in s.items() if k != "tolerances"}, "the document lacks tolerances"),
    (lambda s, replay: {**s, "format": "tapml-migration/0"}, "format is 'tapml-migration/0'"),
    (lambda s, replay: json.dumps(s).replace('"time_ms": ', '"time_ms": NaN, "x": ', 1), "NaN"),
    (lambda s, replay: "[" * 50000 + "]" * 50000, "nests too deeply"),
    (lambda s, replay: b"\x00\xff binary", "not a text file"),
    (lambda s, replay: "[]", "its JSON is a list"),
])
def test_resume_from_a_crafted_state_without_journal_is_refused(real, resumable, make, expect):
    state, _ = resumable
    journal_path(state).unlink()
    crafted = make(real["clean"], real["replay"])
    _write(state.parent, crafted, state.name)
    before = state.read_bytes()
    r = _resume(real, state)
    refused(r, f"--state {state}", expect, "without --resume")
    assert state.read_bytes() == before and not journal_path(state).exists()



# --- every other file a command reads: links, FIFOs, devices, folders, huge files ----------

def _precision_doc() -> dict:
    return {"format_version": 1, "kind": "precision", "model": "zoo:mlp", "dtype": "float16", "target": "reference",
            "device": None, "ops": [], "keep_float32": [], "keep_float32_modules": [], "rounds": 0,
            "end_to_end": {"before": {"status": "pass"}, "after": {"status": "pass"}}}


#: role -> (file name, how to make the valid file, the command that reads it, given the file)
FILE_ROLES = {
    "state (report)": ("s.json", lambda real, p: shutil.copy(real["work"] / "fault.json", p),
                       lambda real, p, tmp: ["report", p, "-o", tmp / "r.html"]),
    "precision document (report)": ("p.json", lambda real, p: p.write_text(json.dumps(_precision_doc())),
                                    lambda real, p, tmp: ["report", p, "-o", tmp / "r.html"]),
    "state (resume)": ("s.json", lambda real, p: shutil.copy(real["work"] / "clean.json", p),
                       lambda real, p, tmp: ["migrate", real["store"], "--state", p, "--resume"]),
    "journal (resume)": ("s.json.journal",
                         lambda real, p: shutil.copy(journal_path(real["work"] / "clean.json"), p),
                         lambda real, p, tmp: ["migrate", real["store"], "--state", tmp / "s.json", "--resume"]),
    "state (gen-tests)": ("g.json", lambda real, p: shutil.copy(real["work"] / "fault.json", p),
                          lambda real, p, tmp: ["gen-tests", real["store"], "-o", tmp / "suite", "--state", p]),
    "baseline": ("b.json", lambda real, p: shutil.copy(real["work"] / "replay.json", p),
                 lambda real, p, tmp: ["replay", real["store"], "--baseline", p]),
    "keep-float32 precision JSON": ("k.json", lambda real, p: p.write_text(json.dumps(_precision_doc())),
                                    lambda real, p, tmp: ["migrate", real["store"], "--state", tmp / "m.json",
                                                          "--keep-float32", p]),
    "token file": ("token", lambda real, p: p.write_text("secret"),
                   lambda real, p, tmp: ["replay", real["store"], "--target", "remote://127.0.0.1:9", "--token-file", p]),
    "token map": ("tokens.json", lambda real, p: p.write_text('{"*": "secret"}'),
                  lambda real, p, tmp: ["replay", real["store"], "--target", "registry://127.0.0.1:9",
                                        "--token-map", p]),
    ".pt2 archive": ("m.pt2", lambda real, p: p.write_bytes(b"PK"),
                     lambda real, p, tmp: ["carve", p, "-o", tmp / "out"]),
}


# a .pt2 holds the weights, so it is read whole whatever its size: "huge" is not a hostile .pt2
FILE_KINDS = [(role, kind) for role in sorted(FILE_ROLES) for kind in KINDS
              if (role, kind) != (".pt2 archive", "huge")]


@pytest.mark.parametrize("role,kind", FILE_KINDS)
def test_every_file_a_command_reads_must_be_a_regular_file_of_bounded_size(real, tmp_path, role, kind):
    """A FIFO (which would block a reader), a link to /dev/zero (endless), a folder or a 300 MiB
    file in place of each file a command reads: exit 2 naming the file, at once. A journal lives
    beside its state, so a link there is refused too; the other files are named by the user and
    a link to a regular file is followed."""
    name, make, command = FILE_ROLES[role]
    outside = tmp_path / "outside"
    outside.mkdir()
    if role == "journal (resume)":
        shutil.copy(real["work"] / "clean.json", tmp_path / "s.json")
    path = tmp_path / name
    valid = outside / f"valid-{name}"
    make(real, valid)
    make_kind(path, kind, outside, valid=valid)
    with no_hang():
        r = tapml(*command(real, path, tmp_path))
    if kind == "link-outside" and role != "journal (resume)":
        assert r.exit_code != 3 and "Traceback" not in r.output, r.output  # followed: the file is valid
        return
    refused(r, name)
    assert "internal error" not in r.output


def test_stale_chromium_profiles_only_this_users_and_pid_files_that_are_small_regular_files(tmp_path, monkeypatch):
    """Profiles left by killed tapml processes are removed; a pid file that is a FIFO or a link to
    /dev/zero neither blocks nor is read without bound, a profile that is a link (to a folder of
    the victim's) or another user's folder is left alone."""
    import tempfile

    from tapml.platforms import chromium
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess_pid_that_exited()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "tapml.pid").write_text(str(dead))
    (victim / "precious").write_text("keep")
    profiles = {}
    for name in ("stale", "fifo", "dev-zero", "garbage", "link", "foreign"):
        profiles[name] = tmp_path / f"{chromium.PROFILE_PREFIX}{name}"
    for name in ("stale", "fifo", "dev-zero", "garbage", "foreign"):
        profiles[name].mkdir()
    (profiles["stale"] / "tapml.pid").write_text(str(dead))
    os.mkfifo(profiles["fifo"] / "tapml.pid")
    (profiles["dev-zero"] / "tapml.pid").symlink_to("/dev/zero")
    (profiles["garbage"] / "tapml.pid").write_text("9" * 100)
    profiles["link"].symlink_to(victim, target_is_directory=True)
    (profiles["foreign"] / "tapml.pid").write_text(str(dead))
    if os.geteuid() == 0:
        os.chown(profiles["foreign"], 65534, 65534)
    with no_hang(10):
        chromium._remove_stale_profiles()
    assert not profiles["stale"].exists()
    for name in ("fifo", "dev-zero", "garbage", "link"):
        assert os.path.lexists(profiles[name]), name
    assert (victim / "precious").read_text() == "keep"
    assert profiles["foreign"].exists() == (os.geteuid() == 0)


def subprocess_pid_that_exited() -> int:
    import subprocess
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# --- crafted documents that must be exit 2 (not 3) -----------------------------------------

@pytest.mark.parametrize("doc, edit", [
    ("fault", lambda d: d.update(target=None)),
    ("replay", lambda d: d.update(target=None)),
    ("precision", lambda d: d.update(end_to_end=None)),
    ("precision", lambda d: d["end_to_end"].update(before=None)),
    ("precision", lambda d: d["end_to_end"].update(after=None)),
    ("precision", lambda d: d["end_to_end"]["before"].update(status=None)),
])
def test_crafted_documents_with_nulls_exit_2(real, tmp_path, doc, edit):
    data = _precision_doc() if doc == "precision" else json.loads(json.dumps(real[doc]))
    edit(data)
    path = _write(tmp_path, data)
    refused(tapml("report", path, "-o", tmp_path / "r.html"), str(path))
    if doc == "precision":
        refused(tapml("migrate", real["store"], "--state", tmp_path / "m.json", "--keep-float32", path), str(path))
    elif doc == "replay":
        refused(tapml("replay", real["store"], "--baseline", path), str(path))
    else:
        shutil.copy(path, tmp_path / "r.json")
        refused(tapml("migrate", real["store"], "--state", tmp_path / "r.json", "--resume"), "r.json")


# --- one writer per state -------------------------------------------------------------------

def _migrate_process(store, state):
    import subprocess
    import sys
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    return subprocess.Popen([sys.executable, "-m", "tapml.cli", "migrate", str(store), "--target", "reference",
                             "--state", str(state), "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _holder_pid(lock, proc, timeout: float = 120.0) -> int | None:
    """The pid in ``lock`` once ``proc`` holds it (None when ``proc`` ended first)."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            text = lock.read_text().strip()
        except OSError:
            text = ""
        if text.isdigit():
            return int(text)
        time.sleep(0.002)
    return None


def test_a_second_migration_of_a_held_state_exits_2_naming_the_holders_pid(mlp, tmp_path):
    """Two real `tapml migrate` processes on one state: the first holds the lock (frozen with
    SIGSTOP while it does, so the second surely meets it); the second exits 2 naming the first's
    pid and writes nothing; the first then finishes its own state, and the lock goes with it."""
    import signal
    import subprocess
    import sys
    for attempt in range(3):  # the first may finish before it is seen holding the lock
        state = tmp_path / f"s{attempt}.json"
        first = _migrate_process(mlp.path, state)
        pid = _holder_pid(Path(f"{state}.lock"), first)
        if pid is not None:
            break
        first.communicate()
    assert pid == first.pid
    first.send_signal(signal.SIGSTOP)
    try:
        env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
        second = subprocess.run([sys.executable, "-m", "tapml.cli", "migrate", str(mlp.path), "--target", "reference",
                                 "--state", str(state), "--inject", "aten.relu.default=nan", "-q"],
                                capture_output=True, text=True, timeout=300, env=env)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2, second.stderr
    assert f"in use by process {first.pid}" in " ".join(second.stderr.split()) and "Traceback" not in second.stderr
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    written = json.loads(state.read_text())
    assert written["passed"] and written["inject"] == []  # the first's state, not a mix with the second's
    assert not Path(f"{state}.lock").exists()


def test_the_lock_is_shared_within_a_process_and_dropped_with_its_holder(tmp_path):
    from tapml.io import ExclusiveLock, FileHeld
    state = tmp_path / "s.json"
    with ExclusiveLock(state, "--state s.json"):
        with ExclusiveLock(state, "--state s.json"):  # the CLI around a carve, then the migration
            assert Path(f"{state}.lock").read_text().strip() == str(os.getpid())
        assert Path(f"{state}.lock").exists()
    assert not Path(f"{state}.lock").exists()
    import subprocess
    import sys
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from tapml.io import ExclusiveLock; "
                               f"ExclusiveLock({str(state)!r}, 'x').acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FileHeld, match=f"--state s.json is in use by process {holder.pid}"):
            ExclusiveLock(state, "--state s.json").acquire()
    finally:
        holder.kill()
        holder.wait()
    with ExclusiveLock(state, "--state s.json"):  # the kernel dropped the dead holder's lock
        pass
    lock = Path(f"{state}.lock")
    for kind in ("fifo", "dev-zero", "folder"):  # planted where the lock goes: refused, never written
        make_kind(lock, kind, tmp_path)
        with no_hang(), pytest.raises(TapmlError, match="cannot lock --state s.json"):
            ExclusiveLock(state, "--state s.json").acquire()


def test_the_atomic_writer_uses_a_unique_exclusive_temp_file_and_syncs_the_folder(tmp_path, monkeypatch):
    import secrets
    import stat
    import threading

    from tapml import io
    target, victim = tmp_path / "s.json", tmp_path / "victim"
    victim.write_text("keep")
    monkeypatch.setattr(secrets, "token_hex", lambda n: "ab" * n)
    planted = tmp_path / f".s.json.{'ab' * 8}.tmp"
    planted.symlink_to(victim)  # a temp name someone guessed: never written through, never replaced
    with pytest.raises(FileExistsError):
        io.write_text_atomic(target, "mine")
    assert victim.read_text() == "keep" and planted.is_symlink() and not target.exists()
    monkeypatch.undo()
    planted.unlink()
    temps, synced, real_replace, real_fsync = [], [], os.replace, os.fsync

    def replace(src, dst):
        temps.append(os.path.basename(src))
        return real_replace(src, dst)

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        return real_fsync(fd)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    writers = [threading.Thread(target=lambda i=i: [io.write_text_atomic(target, f"{i}:{k}") for k in range(20)])
               for i in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert len(temps) == len(set(temps)) == 80  # every write its own temp file
    assert target.read_text() in {f"{i}:19" for i in range(4)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "victim"]  # no temp file left
    assert synced.count(True) == 80 and synced.count(False) == 80  # the file, then its folder, each time


# --- a store beside the state is reused only when this run can prove it carved it -----------

def test_a_strangers_store_beside_the_state_is_not_reused(mlp, tmp_path):
    state, beside = tmp_path / "s.json", tmp_path / "s.store"
    shutil.copytree(mlp.path, beside)  # a store of the very model named, put there by someone else
    m = json.loads((beside / "manifest.json").read_text())
    m["cases"][0]["module"] = "planted"
    (beside / "manifest.json").write_text(json.dumps(m))
    refused(tapml("migrate", "zoo:mlp", "--state", state), str(beside), "cannot prove",
            "no journal beside the state records a store")
    assert not state.exists()
    shutil.rmtree(beside)
    r = tapml("migrate", "zoo:mlp", "--state", state, "-q")  # carves it: the journal records it
    assert r.exit_code == 0, r.output
    manifest = beside / "manifest.json"
    carved_at = manifest.stat().st_mtime_ns
    r = tapml("migrate", "zoo:mlp", "--state", state, "-q")  # proven: reused, not carved again
    assert r.exit_code == 0, r.output
    assert manifest.stat().st_mtime_ns == carved_at
    recorded = manifest.read_bytes()
    swapped = json.loads(recorded)
    swapped["cases"][0]["module"] = "planted"
    manifest.write_text(json.dumps(swapped))  # a stranger's manifest of the same model in its place
    refused(tapml("migrate", "zoo:mlp", "--state", state, "--resume"), "not the one the journal recorded")
    if os.geteuid() == 0:  # a folder of another user, even holding the recorded manifest
        manifest.write_bytes(recorded)
        os.chown(beside, 65534, 65534)
        refused(tapml("migrate", "zoo:mlp", "--state", state), "belongs to another user")


def test_a_journal_resumes_only_on_the_store_it_recorded(tmp_path):
    """A journal's header records the store's manifest digest: another store is refused; a
    journal from before the digest existed still resumes (and records it from then on)."""
    from tapml.driving.journal import Journal, recorded_store
    path = journal_path(tmp_path / "s.json")
    Journal(path, {"format": "f", "target": "reference"}, resume=False).close()
    assert recorded_store(tmp_path / "s.json") is None
    Journal(path, {"format": "f", "target": "reference", "store_manifest_sha256": "a" * 64}, resume=True).close()
    assert recorded_store(tmp_path / "s.json") == "a" * 64
    with pytest.raises(TapmlError, match="store_manifest_sha256: journal has 'a+', now 'b+'"):
        Journal(path, {"format": "f", "target": "reference", "store_manifest_sha256": "b" * 64}, resume=True)


def test_fleet_and_matrix_documents_of_real_verdicts_read_back_and_malformed_ones_name_the_field(real):
    """A fleet document (``fleet_document``, the writer of ``tapml fleet --json``) and a multi-target
    one of real Verdict JSON read back, every key declared; each malformed field is refused with
    the file, the field's path and what is expected."""
    from tapml.reports.data import fleet_document, matrix_document, parse_fleet_document, parse_matrix_document
    from tapml.reports.schemas import FleetJSON, MatrixJSON
    from tapml.schema import validate
    replay = real["replay"]
    device = {"target": "reference", "adapter": "cpu", "backend": "torch", "platform": "reference", "served": 10,
              "status": "ok"}
    fleet = json.loads(json.dumps(fleet_document({"zoo:mlp": {"reference": replay}}, [device], left_out={"x": "gone"})))
    matrix = json.loads(json.dumps(matrix_document({"reference": replay})))
    assert undeclared(validate(FleetJSON, fleet), fleet) == ["kind"] and undeclared(validate(MatrixJSON, matrix), matrix) == ["kind"]
    assert [s.target for s in parse_fleet_document(fleet, "f.json")] == ["reference"]
    assert [s.target for s in parse_matrix_document(matrix, "m.json")] == ["reference"]
    for change, expect in (
            (lambda d: d.update(models="zoo:mlp"), "models is 'zoo:mlp': input should be a valid list"),
            (lambda d: d.update(models=[]), "models is []: list should have at least 1 item"),
            (lambda d: d["devices"][0].update(target=""), "devices[0].target is '': string should have at least 1 character"),
            (lambda d: d["devices"][0].update(served="10"), "devices[0].served is '10': input should be a valid integer"),
            (lambda d: d["devices"].append(dict(device)), "a device appears twice in devices"),
            (lambda d: d.update(left_out={"x": 1}), "left_out.x is 1: input should be a valid string"),
            (lambda d: d["runs"]["zoo:mlp"].update({"wgpu:gl": replay}), "runs['zoo:mlp'] is not an object keyed by targets"),
            (lambda d: d["runs"]["zoo:mlp"]["reference"]["cases"][0].update(op=5),
             "runs['zoo:mlp']['reference'] is not a verdict file: cases[0].op is 5: input should be a valid string"),
            (lambda d: d.update(format_version=9), "format_version 9 is newer")):
        bad = json.loads(json.dumps(fleet))
        change(bad)
        with pytest.raises(TapmlError) as e:
            parse_fleet_document(bad, "f.json")
        assert str(e.value).startswith("f.json") and expect in str(e.value), (expect, str(e.value))


# --- a wrong type anywhere is refused naming its path ---------------------------------------

def _nodes(x, path=()):
    """Every (path, value) below parsed JSON ``x``: containers and leaves."""
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        yield path + (k,), v
        yield from _nodes(v, path + (k,))


def _shown_path(path) -> str:
    """A path as messages write it: ``cases[3].status``, ``tolerances['aten.mm.default'][0]``."""
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k) if k.isidentifier() else f"[{k!r}]"
    return out


def _any_scalar(path) -> bool:
    # a worst element's values and a device limit may be any number, string, boolean or null
    return (len(path) >= 2 and path[-1] in ("target", "reference") and "worst" in path) or path[:2] == ("device", "limits")


#: Values of another JSON type than a leaf of each type holds (a float field takes an integer,
#: a nullable field its type: a null leaf gets a list of integers, which no nullable field takes).
_WRONG = {str: lambda st: st.integers() | st.booleans() | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
          int: lambda st: st.text(max_size=5) | st.booleans() | st.lists(st.integers(), max_size=2),
          float: lambda st: st.text(max_size=5) | st.booleans() | st.lists(st.floats(allow_nan=False), max_size=2),
          bool: lambda st: st.text(max_size=5) | st.integers() | st.floats(allow_nan=False, allow_infinity=False),
          type(None): lambda st: st.lists(st.integers(), min_size=1, max_size=2),
          list: lambda st: st.text(max_size=5) | st.integers() | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
          dict: lambda st: st.text(max_size=5) | st.integers() | st.lists(st.integers(), min_size=1, max_size=2)}


def test_a_wrong_type_at_any_field_path_is_refused_naming_that_path(real):
    """Hypothesis puts a value of another JSON type at a field of a real migration state, replay
    Verdict JSON or journal record (every path of every one of them, containers included):
    the strict and the lenient read both refuse it with TapmlError naming the file and that path."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tapml.judging.verdict import journal_record
    records = [json.loads(line) for line in journal_path(real["work"] / "fault.json").read_text().splitlines()[1:]]
    record = next(r for r in records if r["key"].startswith("unit:"))
    docs = {"fault": real["fault"], "replay": real["replay"], "case": next(r for r in records if r["key"].startswith("case:"))["record"],
            "unit": record["record"], "device": next(r for r in records if r["key"] == "device")["record"]}
    keys = {"case": next(r["key"] for r in records if r["key"].startswith("case:")), "unit": record["key"], "device": "device"}
    paths = sorted({(name, path) for name, doc in docs.items() for path, _ in _nodes(doc) if not _any_scalar(path)
                    and (name not in keys or path[0] != "id")}, key=repr)  # a record's id is checked against its key
    assert len(paths) > 300
    tried = set()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.data())
    def check(data):
        name, path = data.draw(st.sampled_from(paths))
        doc = json.loads(json.dumps(docs[name]))
        holder = doc
        for k in path[:-1]:
            holder = holder[k]
        holder[path[-1]] = data.draw(_WRONG[type(holder[path[-1]])](st))
        tried.add((name, path))
        for strict in (True, False):
            with pytest.raises(TapmlError) as e:
                if name in keys:
                    journal_record(keys[name], doc, "j.journal line 3", "start over")
                else:
                    VerdictDocument.from_json(doc, "s.json", strict=strict)
            where, shown = ("j.journal line 3", f"record.{_shown_path(path)}") if name in keys else \
                ("s.json", _shown_path(path))
            assert re.match(rf"{re.escape(where)}\b.*?: {re.escape(shown)}(\W|$)", str(e.value)), \
                (name, path, holder[path[-1]], str(e.value))

    check()
    assert len(tried) > 150
