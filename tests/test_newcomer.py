"""Issue #29, the README walked as a newcomer: what a new user meets on the way, one test per item
(the README itself runs in tests/test_readme.py)."""

import json
import re

import typer
from typer.testing import CliRunner

import pytest
from support import headless_chromium, in_chromium, vulkan_or_skip
from tapml.cli import app

runner = CliRunner()


def _commands(group, path=()):
    yield path, group
    for name, sub in getattr(group, "commands", {}).items():
        yield from _commands(sub, path + (name,))


def test_no_help_text_loses_a_bracketed_word():
    """Every `[...]` of every command's and option's help (`[udp://|tcp://]HOST[:PORT]`) shows in --help as written."""
    checked = 0
    for path, cmd in _commands(typer.main.get_command(app)):
        r = runner.invoke(app, [*path, "--help"], terminal_width=2000, env={"COLUMNS": "2000"})
        assert r.exit_code == 0, r.output
        shown = " ".join(r.output.split())
        texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
        for text in texts:
            for word in re.findall(r"\S*\[[^\]\s]*\]\S*", " ".join(text.split())):
                checked += 1
                assert word in shown, f"`tapml {' '.join(path)} --help` lost {word!r}"
    assert checked >= 10


# --- serve, registry and the token file (items 2, 9, 14) -------------------------------------

import os  # noqa: E402
import re as _re  # noqa: E402,F401
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

TAPML = [sys.executable, "-m", "tapml.cli"]


def _run(*args, **kwargs):
    return subprocess.run([*TAPML, *map(str, args)], capture_output=True, text=True, timeout=120, **kwargs)


def test_serve_on_a_taken_port_prints_no_page_url():
    """The browser page's URL is printed once the port is ours; a failed listen leaves no URL that leads nowhere."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = _run("serve", "--platform", "browser", "--no-launch", "--port", taken.getsockname()[1])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot listen" in r.stderr and "--port" in r.stderr
    assert "http" not in r.stdout, r.stdout


def _wait_for_line(lines, pattern, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for line in list(lines):
            if _re.search(pattern, line):
                return line
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r} within {seconds} s in: {''.join(lines)}")


def test_serve_register_and_the_registry_say_what_was_announced():
    import threading

    from tapml.remote.launcher import ServerProcess
    reg = subprocess.Popen([*TAPML, "registry", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    reg_lines: list = []
    try:
        reg_lines.append(reg.stdout.readline())
        registry = _re.search(r"listening on (udp://\S+)", reg_lines[0]).group(1)
        threading.Thread(target=lambda: reg_lines.extend(reg.stdout), daemon=True).start()
        srv = ServerProcess(platform="reference", args=("--register", registry))
        try:
            line = _wait_for_line(srv.lines, "announced to the registry")
            assert registry in line and "tapml devices --registry" in line
            _wait_for_line(reg_lines, rf"remote://127\.0\.0\.1:{srv.port} announced itself")
        finally:
            assert srv.stop() == 0
        _wait_for_line(reg_lines, rf"remote://127\.0\.0\.1:{srv.port} no longer announced")
    finally:
        reg.send_signal(signal.SIGTERM)
        assert reg.wait(10) == 0


def test_a_token_file_others_can_read_is_warned_about(tmp_path, carved):
    token = tmp_path / "tok"
    token.write_text("secret\n")
    store = carved("zoo:mlp")
    for mode, warned in ((0o644, True), (0o600, False)):
        token.chmod(mode)
        r = _run("replay", store, "--target", "remote://127.0.0.1:1", "--token-file", token)
        assert r.returncode == 2, r.stderr
        assert ("chmod 600" in r.stderr) is warned, r.stderr
        if warned:
            assert f"mode {mode:04o}" in r.stderr and "other users" in r.stderr


def test_a_missing_store_path_says_no_store_there(tmp_path):
    """`tapml fleet stores/gpt2 ...` where no earlier command made stores/gpt2 (item 1)."""
    missing = tmp_path / "stores" / "gpt2"
    r = _run("fleet", missing, "--target", "registry://127.0.0.1:9")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"no store at {missing}" in r.stderr and "carving" not in r.stderr
    r = _run("migrate", missing, "--target", "reference", "--state", tmp_path / "s.json")
    assert r.returncode == 2 and f"no store at {missing}" in r.stderr, r.stderr


def test_the_conformance_script_runs_as_the_readme_says():
    """`scripts/conformance.py --target T --out DIR` needs the execute bit (in git too) and a shebang (item 5)."""
    from pathlib import Path
    script = Path(__file__).parent.parent / "scripts" / "conformance.py"
    assert os.access(script, os.X_OK)
    assert script.read_text().startswith("#!/usr/bin/env python")
    staged = subprocess.run(["git", "ls-files", "-s", "scripts/conformance.py"], cwd=script.parent.parent,
                            capture_output=True, text=True)
    assert staged.returncode != 0 or not staged.stdout or staged.stdout.startswith("100755"), staged.stdout


# --- the repro folder outside the venv, and from disk (item 3) --------------------------------

def _repro_templates(tmp_path):
    from importlib import resources

    from tapml.driving.repro import TEMPLATES
    for name in TEMPLATES:
        (tmp_path / name).write_bytes((resources.files("tapml") / "templates" / "repro" / name).read_bytes())
    return tmp_path


def test_repro_run_py_without_wgpu_exits_2_saying_what_to_install(tmp_path):
    """`python run.py` with a Python that lacks wgpu/numpy (here: the venv's without its site-packages)."""
    folder = _repro_templates(tmp_path)
    r = subprocess.run([sys.executable, "-S", "run.py"], cwd=folder, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "pip install wgpu numpy" in r.stderr, r.stderr


@in_chromium
def test_repro_page_opened_from_disk_asks_for_the_files(tmp_path):
    """Chromium refuses a module script on a file:// page: the page must still run and offer the file picker."""
    folder = _repro_templates(tmp_path)
    r = headless_chromium((folder / "index.html").as_uri(), "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "waiting for the repro folder" in r.stdout and 'id="pick" style="display: block;"' in r.stdout, r.stdout


@in_chromium
def test_chromium_leaves_no_temp_folder_behind():
    """Chromium's /tmp/org.chromium.Chromium.* folder (its singleton socket, which the profile links to)
    goes with the profile on close (item 15)."""
    from pathlib import Path

    from tapml.platforms.chromium import ChromiumProcess
    browser = ChromiumProcess("about:blank")
    try:
        link = Path(browser.profile) / "SingletonSocket"
        deadline = time.monotonic() + 30
        while not link.is_symlink() and time.monotonic() < deadline:
            time.sleep(0.2)
        folder = Path(os.readlink(link)).parent
        assert folder.name.startswith("org.chromium.") and folder.is_dir(), folder
    finally:
        browser.close()
    assert not Path(browser.profile).exists() and not folder.exists()


def test_migrate_resume_says_what_the_journal_supplied(carved, tmp_path):
    """`migrate --resume` printed what a fresh run prints (item 8)."""
    store, state = carved("zoo:mlp"), tmp_path / "s.json"
    r = runner.invoke(app, ["migrate", str(store), "--target", "reference", "--state", str(state)])
    assert r.exit_code == 0, r.output
    assert "resumed" not in r.output
    r = runner.invoke(app, ["migrate", str(store), "--target", "reference", "--state", str(state), "--resume"])
    assert r.exit_code == 0, r.output
    assert _re.search(r"op stage: (\d+) to check \(\1 already in the journal\)", r.output), r.output
    m = _re.search(r"resumed on reference: (\d+) verdicts from \S+s\.json\.journal, 0 checked now", r.output)
    assert m and int(m.group(1)) > 10, r.output


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_replay_repeat_and_guards_say_what_they_checked(carved):
    """`replay --repeat 20 --guards` printed only the plain replay line (item 9)."""
    vulkan_or_skip()
    r = runner.invoke(app, ["replay", str(carved("zoo:mlp")), "--target", "wgpu:vulkan", "--repeat", "3", "--guards"])
    assert r.exit_code == 0, r.output
    assert "repeat: 10 cases run 3 times each, 0 of them flaky" in r.output, r.output
    assert "guards: 10 cases checked, 0 of them wrote out of bounds" in r.output, r.output


def test_bench_says_what_missed_goals_a_missing_transport_and_the_tile_cache_mean(tmp_path):
    """`bench` exited 0 with goals shown as missed and nothing saying only --check fails on them;
    `transport` was null with no word why; the tuned tiles were written silently (item 7). The
    report is shaped as tapml.bench.run_suite makes it (a whole run takes minutes)."""
    from tapml.bench import GOALS
    from tapml.cli.bench import render_suite_notes
    from tapml.cli.common import out
    from tapml.platforms.wgsl.matmul import cache_path
    goals = {k: {"goal": f"{op} {bound:g}", "value": 0.0, "met": k != "migrate_max_s"} for k, (op, bound) in GOALS.items()}
    report = {"goals": goals, "transport": None, "autotune": {"cache": str(cache_path())}}
    for check in (False, True):
        with out.capture() as shown:
            render_suite_notes(report, check)
        text = " ".join(shown.get().split())
        assert f"saved to {cache_path()}: every later compile on this device uses them" in text
        assert "transport: not measured: only a remote://HOST:PORT target has one" in text
        assert ("1 goal(s) missed (migrate_max_s)" in text and
                ("exit 1 (--check)" if check else "add --check to exit 1 on a missed goal") in text), text


@pytest.mark.slow
def test_bench_scale_prints_the_verdict_it_timed(tmp_path):
    """`bench scale` is titled "time to a verdict": it prints the verdict (item 9)."""
    r = _run("bench", "scale", "--target", "reference", "--model", "zoo:mlp", env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert _re.search(r"verdict: migrated, everything passed on reference in [\d.]+ s \(100\.0% of ops", r.stdout), r.stdout


# --- 80 columns (item 12) -----------------------------------------------------------------------

def _at_80(*args):
    return _run(*args, env={**os.environ, "COLUMNS": "80"})


def test_tables_never_cut_an_op_name_at_80_columns(carved, tmp_path):
    from tapml.carving.store import CarveStore
    store = carved("zoo:tiny-llama")
    ops = {c["op"] for c in CarveStore(store).cases}
    r = _at_80("inspect", store)
    assert r.returncode == 0, r.stderr
    assert all(op in r.stdout for op in ops), sorted(op for op in ops if op not in r.stdout)
    assert max(map(len, r.stdout.splitlines())) <= 80
    mlp = carved("zoo:mlp")
    r = _at_80("replay", mlp, "--inject", "aten.addmm.default=scale:1.5", "--inject", "aten.relu.default=offset:1")
    assert r.returncode == 1, r.stderr
    assert "aten.addmm.default" in r.stdout and "aten.relu.default" in r.stdout, r.stdout
    assert "rtol=0.001 atol=0.0001" in " ".join(r.stdout.split()), r.stdout  # a tolerance keeps its words whole


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_preflight_at_80_columns_keeps_op_names_and_binary_units(carved):
    """`inspect --device-limit ...=4KiB` showed a 4 KiB binding as `4.1 kB`: over the limit at a glance."""
    vulkan_or_skip()
    r = _at_80("inspect", carved("zoo:tiny-llama"), "--target", "wgpu:vulkan", "--device-limit",
               "max-storage-buffer-binding-size=4KiB")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "aten.embedding.default" in r.stdout and "aten.scalar_tensor.default" in r.stdout, r.stdout
    assert " kB" not in r.stdout and " MB" not in r.stdout and "4 KiB" in r.stdout, r.stdout


def test_report_of_a_precision_analysis_says_what_it_wrote(carved, tmp_path):
    """`report p.json` said `1 state(s), 0 culprit(s)` of a precision document (item 10)."""
    store = carved("zoo:fp16-absorbed", dtype="float16")
    r = runner.invoke(app, ["precision", str(store), "--target", "reference", "--json", str(tmp_path / "p.json")])
    assert r.exit_code in (0, 1), r.output
    r = runner.invoke(app, ["report", str(tmp_path / "p.json"), "-o", str(tmp_path / "p.html")])
    shown = " ".join(r.output.split())
    assert _re.search(r"wrote html report -> \S+p\.html: precision analysis of zoo:fp16-absorbed in float16 on "
                      r"reference: \d+ ops, per op and per module along the depth, \d+ kept in float32", shown), shown
    assert "culprit" not in shown


def test_gen_tests_suggests_the_pytest_that_has_the_plugin(carved, tmp_path):
    """gen-tests suggested a bare `pytest`: the system's, without -n or the tapml plugin (item 4)."""
    import shlex
    r = _run("gen-tests", carved("zoo:mlp"), "-o", tmp_path / "gen")
    assert r.returncode == 0, r.stderr
    command = r.stderr.split("run: ", 1)[1].strip()
    assert shlex.split(command)[:3] == [sys.executable, "-m", "pytest"], command
    ran = subprocess.run(shlex.split(command) + ["-q", "-p", "no:cacheprovider"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert ran.returncode == 0 and "10 passed" in ran.stdout, ran.stdout[-2000:]


# --- the HTML report as a person sees it (item 13) -----------------------------------------------

LAYOUT_SCRIPT = """<script>
window.addEventListener("load", () => {
  const facts = {cut_tables: [], outside: [], overlapping: [], plot_widths: []};
  document.querySelectorAll(".table-wrap").forEach((w) => {
    if (w.scrollWidth > w.clientWidth + 1) facts.cut_tables.push(`${w.querySelector("table").id}: ${w.scrollWidth} > ${w.clientWidth}`);
  });
  document.querySelectorAll("svg.module-plot").forEach((svg) => {
    const box = svg.getBoundingClientRect();
    facts.plot_widths.push(Math.round(box.width));
    svg.querySelectorAll("text").forEach((t) => {
      const r = t.getBoundingClientRect();
      if (r.right > box.right + 1 || r.bottom > box.bottom + 1 || r.left < box.left - 1 || r.top < box.top - 1)
        facts.outside.push(t.textContent);
    });
    const xs = [...svg.querySelectorAll("text.xlabel")].map((t) => parseFloat(t.getAttribute("x")));
    for (let i = 1; i < xs.length; i++)  // rotated 55 degrees: neighbours are dx * sin(55) apart across their lines
      if ((xs[i] - xs[i - 1]) * Math.sin(55 * Math.PI / 180) < 12) facts.overlapping.push(xs[i]);
  });
  const pre = document.createElement("pre");
  pre.id = "layout-facts";
  pre.textContent = JSON.stringify(facts);
  document.body.appendChild(pre);
});
</script>"""


@pytest.mark.slow
@in_chromium
def test_html_report_layout_at_1280_and_1920_px(carved, tmp_path):
    """Rotated plot labels overlapped and were cut at the right edge, the per-op table's last column was cut at
    1280 px, and a precision plot of two modules was squeezed into 150 px of a wide panel."""
    store = carved("zoo:tiny-gpt2")
    state = tmp_path / "g.json"
    r = runner.invoke(app, ["migrate", str(store), "--target", "reference", "--state", str(state),
                            "--inject", "aten.addmm.default=scale:1.01", "-q"])
    assert r.exit_code == 1, r.output
    precise = carved("zoo:fp16-absorbed", dtype="float16")
    r = runner.invoke(app, ["precision", str(precise), "--target", "reference", "--json", str(tmp_path / "p.json")])
    assert r.exit_code in (0, 1), r.output
    for doc in ("g", "p"):
        assert runner.invoke(app, ["report", str(tmp_path / f"{doc}.json"), "-o", str(tmp_path / f"{doc}.html")]).exit_code in (0, 1)
        page = tmp_path / f"{doc}-measured.html"
        page.write_text((tmp_path / f"{doc}.html").read_text().replace("</body>", LAYOUT_SCRIPT + "</body>"))
        for width in (1280, 1920):
            shown = headless_chromium(page.as_uri(), "--dump-dom", f"--window-size={width},1600")
            m = _re.search(r'<pre id="layout-facts">(.*?)</pre>', shown.stdout)
            assert m, shown.stderr[-2000:]
            facts = json.loads(m.group(1).replace("&quot;", '"').replace("&gt;", ">").replace("&amp;", "&"))
            assert facts["plot_widths"], facts
            assert not facts["cut_tables"] and not facts["outside"] and not facts["overlapping"], (doc, width, facts)
            assert min(facts["plot_widths"]) >= 600, (doc, width, facts)
