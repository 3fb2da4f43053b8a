"""The ``tapml`` command line. Thin: each command parses, calls the library, renders.

Importing this package registers every command on :data:`app`: shared pieces live in
:mod:`tapml.cli.common`, and each module below adds its commands with ``@app.command()``.
A new command is one new module here, imported below. Torch, wgpu and transformers are
imported inside commands so ``tapml --help`` is instant.

Exit codes: 0 everything checked passed, 1 something did not pass, 2 bad usage or input,
3 an internal error: one line on stderr, the traceback in a private file
(``$XDG_CACHE_HOME/tapml/tapml-crash-*.txt``, else ``~/.cache/tapml/``, else the temp dir), 130 Ctrl-C.
"""

from __future__ import annotations

from tapml.cli.common import EXIT_FINDING, EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, app

# Each import adds that module's commands to `app`; the order is the order of `tapml --help`.
from tapml.cli import store  # noqa: E402,F401 - carve, inspect, replay
from tapml.cli import gentests  # noqa: E402,F401 - gen-tests
from tapml.cli import migrate  # noqa: E402,F401 - migrate
from tapml.cli import session  # noqa: E402,F401 - session
from tapml.cli import generate  # noqa: E402,F401 - generate
from tapml.cli import precision  # noqa: E402,F401 - precision
from tapml.cli import remote  # noqa: E402,F401 - serve, registry, devices
from tapml.cli import fleet  # noqa: E402,F401 - fleet
from tapml.cli import bench  # noqa: E402,F401 - bench, bench transport
from tapml.cli import report  # noqa: E402,F401 - report
from tapml.cli import repro  # noqa: E402,F401 - repro
from tapml.cli import targets  # noqa: E402,F401 - targets


def main() -> None:
    """The ``tapml`` console script."""
    try:
        app(prog_name="tapml")
    except KeyboardInterrupt:  # a Ctrl-C before a command started or after it ended
        raise SystemExit(130)


__all__ = ["app", "main", "EXIT_OK", "EXIT_FINDING", "EXIT_USAGE", "EXIT_INTERNAL"]
