"""The README, walked as a newcomer (issue #29): every ```sh block of its "Using it" section runs as
written, in order, in one shell, in a temporary folder laid out as a clone after `make demo` (its
`.venv` is this one). It fails when a command exits otherwise than its comment says (0 unless the
comment starts with `exit N`), when anything prints a traceback, or when a process or a temporary
folder is left behind. Servers start where a line ends in `&` and count as up once they print
`listening on` (and, with `--register`, `announced`), as the README tells a reader to wait for.

The walk itself is a shell script made from the README: each command verbatim, followed by a
check of its exit status; a background server's output goes to a log of its own.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from support import NEEDS_CHROMIUM, vulkan_or_skip

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SECTION = "## Using it"
TRACEBACK = "Traceback (most recent call last)"
KEPT_BY_DESIGN = ("torchinductor_", "pytest-of-")


def using_it(text: str):
    """``(line number, line)`` of every line between ``## Using it`` and the next level-2 heading."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == SECTION)
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("## "):
            return
        yield i + 1, lines[i]


def readme_commands(text: str) -> list[tuple[int, str, int, bool]]:
    """``(line number, command, expected exit, background)`` of every command line of the ```sh
    blocks between ``## Using it`` and the next level-2 heading; ``background`` is False, True for
    ``CMD &``, or the ``NAME=$!`` of ``CMD & NAME=$!``."""
    commands, in_block = [], False
    for number, line in using_it(text):
        if line.strip().startswith("```"):
            in_block = line.strip() == "```sh" if not in_block else False
            continue
        if not in_block or not line.strip() or line.lstrip().startswith("#"):
            continue
        command, comment = split_comment(line)
        expected = re.match(r"\s*exit (\d+)\b", comment or "")
        background = re.fullmatch(r"(.*[^&])&(\s*[A-Z_]+=\$!)?\s*", command)  # CMD & [NAME=$!]
        commands.append((number, background.group(1).rstrip() if background else command.rstrip(),
                         int(expected.group(1)) if expected else 0,
                         (background.group(2) or "").strip() or True if background else False))
    return commands


def split_comment(line: str) -> tuple[str, str | None]:
    """A shell line and its trailing comment: the first `#` outside quotes that starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:]
    return line, None


def walk_script(commands, logs: Path) -> str:
    """The shell script of the walk: each README command as written, then the check of its exit
    status (``@@FAIL`` lines); a background server waited for until it is up."""
    out = ["set -u", "readme_up() {  # LOG PATTERN...: wait up to 180 s for each pattern in LOG",
           "  local log=$1; shift",
           "  for pattern in \"$@\"; do",
           "    for _ in $(seq 1800); do grep -q -- \"$pattern\" \"$log\" 2>/dev/null && break; sleep 0.1; done",
           "    grep -q -- \"$pattern\" \"$log\" || return 1",
           "  done",
           "}"]
    for n, (line, command, expected, background) in enumerate(commands):
        out.append(f"echo {shlex.quote(f'@@ README.md:{line}: {command}')}; readme_t0=${{EPOCHREALTIME/[.,]/}}")
        if background:
            log = logs / f"server-{line}.log"
            ready = ["listening on"] + (["announced to the registry"] if "--register" in command else [])
            keep = f" {background}" if isinstance(background, str) else ""  # NAME=$!
            out.append(f"{command} > {shlex.quote(str(log))} 2>&1 &{keep}")
            out.append(f"readme_up {shlex.quote(str(log))} {' '.join(map(shlex.quote, ready))} || "
                       f"echo {shlex.quote(f'@@FAIL README.md:{line}: the server never said {ready}')}")
            continue
        out.append(command)
        out.append(f"rc=$?; [ $rc -eq {expected} ] || echo \"@@FAIL README.md:{line}: exit $rc, the README says "
                   f"{expected}\"")
        out.append(f"echo \"@@TOOK README.md:{line}: $(( (${{EPOCHREALTIME/[.,]/}} - readme_t0) / 1000 )) ms\"")
    return "\n".join(out) + "\n"


def marked_processes(marker: str) -> list[int]:
    """Pids of this user's processes whose environment carries ``marker`` (the walk's children)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


#: The walk takes about 7 minutes alone on 2 cores, and took over 20 beside the device tier of a full
#: run (2026-11-27). The test's own timeout must exceed the walk's: pytest-timeout's ends the worker,
#: and the walk's output with it, where the walk's own ends in a failure that prints it.
WALK_TIMEOUT_S = 2100


def walk(tmp_path: Path, commands) -> tuple[str, list[str], list[str]]:
    """Run the walk; returns (its output, the failures found, what was left behind)."""
    clone, logs = tmp_path / "clone", tmp_path / "logs"
    for folder in (clone, logs):
        folder.mkdir()
    # The walk's own temp dir, to see what is left in it; short, as Chromium's singleton socket path
    # must fit a unix socket's 108 bytes (under pytest's tmp_path Chromium aborts).
    tmp = Path(tempfile.mkdtemp(prefix="tw-"))
    (clone / ".venv").symlink_to(sys.prefix)  # the venv running the tests: `make test` runs them from .venv
    shutil.copytree(README.parent / "examples" / "kernels", clone / "examples" / "kernels")  # tracked example kernels
    script = tmp_path / "walk.sh"
    script.write_text(walk_script(commands, logs))
    marker = f"TAPML_README_WALK={uuid.uuid4().hex}"
    runtime = Path(f"/tmp/tapml-xdg-{os.getuid()}")
    runtime.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "TAPML_CACHE_DIR": str(tmp_path / "cache"),
           "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR") or str(runtime), "COLUMNS": "100",
           marker.split("=")[0]: marker.split("=")[1]}
    env.pop("TAPML_TOKEN", None)
    try:
        r = subprocess.run(["bash", str(script)], cwd=clone, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=WALK_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # what it printed so far says where it stood
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        r = subprocess.CompletedProcess(e.cmd, -9, text(e.stdout) + f"\n@@FAIL the walk ran past {WALK_TIMEOUT_S} s\n",
                                        text(e.stderr))
    output = r.stdout + r.stderr + "".join(f"\n@@ {log.name}\n{log.read_text(errors='replace')}"
                                           for log in sorted(logs.iterdir()))
    failures = re.findall(r"^@@FAIL (.*)$", r.stdout, re.M)
    if r.returncode != 0:
        failures.append(f"the walk's shell exited {r.returncode}")
    if TRACEBACK in output:
        failures.append("a traceback was printed")
    deadline = time.monotonic() + 15  # a server told to stop may take a moment to go
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [f"process {pid}: {command_line(pid)}" for pid in marked_processes(marker)]
    for pid in marked_processes(marker):
        os.kill(pid, signal.SIGKILL)
    # torch's compile cache and pytest's last three base folders are kept on purpose by those tools
    left += [f"temporary {p.name}" for p in tmp.iterdir() if not p.name.startswith(KEPT_BY_DESIGN)]
    shutil.rmtree(tmp, ignore_errors=True)
    return output, failures, left


def shown_outputs(text: str) -> list[tuple[list[int], list[str]]]:
    """``(line numbers of a ```sh block's commands, the lines of the output shown)`` for every ```text
    block of the "Using it" section that follows a ```sh block in the same subsection: what the README
    shows those commands print."""
    commands = [number for number, *_ in readme_commands(text)]
    shown, block, sh_lines, kind, opened = [], [], [], None, 0
    for number, line in using_it(text):
        if line.startswith("### "):
            sh_lines = []
        if line.strip().startswith("```"):
            if kind is None:
                kind, block, opened = line.strip()[3:], [], number
            else:
                if kind == "sh":
                    sh_lines = [n for n in commands if opened < n < number]
                elif kind == "text" and sh_lines:
                    shown.append((sh_lines, [b for b in block if b.strip()]))
                kind = None
        elif kind is not None:
            block.append(line)
    return shown


def flat(text: str) -> str:
    """Text with table rules and runs of white space folded: what a terminal's wrapping cannot change."""
    return " ".join(text.replace("│", " ").split())


def printed_by(output: str, line: int) -> str:
    """What the walk's command of README line ``line`` printed."""
    return output.split(f"@@ README.md:{line}:", 1)[1].split("\n@@ ", 1)[0]


def test_readme_commands_are_parsed_with_their_exit_codes():
    commands = readme_commands(README.read_text())
    assert len(commands) >= 35
    assert any(expected == 1 for _, _, expected, _ in commands)
    assert sum(bool(background) for *_, background in commands) >= 4
    assert all(not c.startswith("$T serve") or background for _, c, _, background in commands)
    assert [b for *_, b in commands if b] == ["SERVER=$!", "PAGE=$!", "REGISTRY=$!", "SERVER=$!"]


# Not in the browser tier's xdist group, though it opens Chromium: a group runs on one worker, and the
# walk (~20 min of a full run) after the group's ~20 min was the run's longest chain (2026-11-29).
@pytest.mark.slow
@pytest.mark.device
@pytest.mark.browser
@pytest.mark.timeout(WALK_TIMEOUT_S + 300)
@NEEDS_CHROMIUM
def test_readme_runs_as_written(tmp_path, figure):
    vulkan_or_skip()
    started = time.monotonic()
    output, failures, left = walk(tmp_path, readme_commands(README.read_text()))
    figure("README walk s", round(time.monotonic() - started, 1))
    took = sorted(((int(ms), line) for line, ms in re.findall(r"^@@TOOK README\.md:(\d+): (\d+) ms$", output, re.M)),
                  reverse=True)
    figure("README walk's slowest lines (s)", ", ".join(f"{line}: {ms / 1000:.0f}" for ms, line in took[:12]))
    assert not failures and not left, "\n".join(failures + [f"left behind: {x}" for x in left]) + "\n" + output[-6000:]
    # What the README shows its commands print, they still print (the ORT and IREE examples).
    for lines, shown in shown_outputs(README.read_text()):
        said = "".join(printed_by(output, n) for n in lines)
        for line in shown:
            assert flat(line) in flat(said), f"README shows {line!r}; its commands printed:\n{said[-3000:]}"
    # The ort-web example's migration: sin and cos named and kept on the reference, end to end passing.
    state = json.loads((tmp_path / "clone" / "examples" / "rope4k.json").read_text())
    assert sorted(c["op"] for c in state["culprits"]) == ["aten.cos.default", "aten.sin.default"]
    assert state["end_to_end"]["status"] == "pass"
    # The ORT example's migration: the sum named and kept on the reference, the rest on ort, end to end passing.
    state = json.loads((tmp_path / "clone" / "examples" / "sum16.json").read_text())
    culprits = [(c["kind"], c["op"]) for c in state["culprits"]]
    assert culprits == [("op", "aten.sum.dim_IntList")] and state["end_to_end"]["status"] == "pass", state["culprits"]


def test_the_output_the_readme_shows_is_found_for_the_ort_iree_and_tinygrad_examples():
    shown = shown_outputs(README.read_text())
    assert len(shown) == 4 and all(lines and said for lines, said in shown)
    ort, iree, tinygrad, ort_web = shown
    assert "on ort (cpu (CPUExecutionProvider))" in ort[1][-1] and len(ort[0]) == 4
    assert "iree:vulkan cannot compile" in iree[1][0] and len(iree[0]) == 2
    assert "control tinygrad:cpu fails too" in tinygrad[1][0] and len(tinygrad[0]) == 1
    assert "aten.sin.default" in ort_web[1][1] and "5 error on ort-web:webgpu" in ort_web[1][-1] and len(ort_web[0]) == 4
    output = "@@ README.md:7: $T replay x\nc2 aten.sum.dim_IntList:  dtype float32\n@@ README.md:8: next\nother\n"
    assert flat(printed_by(output, 7)) == "$T replay x c2 aten.sum.dim_IntList: dtype float32"


def test_the_walk_fails_on_a_wrong_flag_a_traceback_and_what_is_left_behind(tmp_path):
    """The README's own first lines, then what the walk must catch: a command given a wrong flag (the
    README says exit 0, it exits 2), a traceback, a server never stopped, a temporary folder left."""
    first = readme_commands(README.read_text())[:2]  # mkdir -p examples && cd examples; T=../.venv/bin/tapml
    assert first[1][1].startswith("T=")
    mutated = first + [(900, "$T inspect stores/llama --no-such-flag", 0, False),
                       (901, "../.venv/bin/python -c 'raise SystemExit(0) if 0 else 1/0'", 1, False),
                       (902, "$T registry --port 0", 0, True),
                       (903, "mktemp -d", 0, False)]
    output, failures, left = walk(tmp_path, mutated)
    assert "README.md:900: exit 2, the README says 0" in failures, failures
    assert "a traceback was printed" in failures
    assert any("registry --port 0" in x for x in left) and any(x.startswith("temporary tmp.") for x in left), left
