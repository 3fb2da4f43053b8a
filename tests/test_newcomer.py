"""Issue #29, the README walked as a newcomer: what a new user meets on the way, one test per item
(the README itself runs in tests/test_readme.py)."""

import re

import typer
from typer.testing import CliRunner

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
