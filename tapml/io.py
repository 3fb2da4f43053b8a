"""Files in and out: the one atomic writer and the one strict JSON reader.

Every file tapml writes for others to read (store manifests, states, journals rewritten,
``--json`` output, reports, generated suites) goes through :func:`write_text_atomic`: a temp
file in the same folder, fsynced, renamed over the target, so a reader sees the old file or
the new one, never half. Every JSON file tapml reads may come from anyone (SECURITY.md), so
:func:`parse_json` / :func:`read_json_file` refuse what ``json.loads`` would let through:
``NaN``/``Infinity``, floats that overflow, integers beyond 64 bits (each named by its field,
``cases[0].args[1]: ...``), nesting deeper than the parser's stack, non-UTF-8 bytes and files
over :data:`MAX_JSON_BYTES`. Problems are :class:`~tapml.errors.TapmlError` (exit 2).

Example::

    from tapml.io import read_json_file, write_json_atomic
    write_json_atomic("state.json", {"passed": True})
    read_json_file("state.json", "--state state.json", hint="pass a state file")
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tapml.errors import TapmlError

#: Largest JSON file tapml reads.
MAX_JSON_BYTES = 256 << 20
#: Digits (sign included) of the longest integer accepted: 64-bit values have at most 20.
_MAX_INT_CHARS = 21


class JsonSyntaxError(TapmlError):
    """The text is not JSON at all (broken syntax, e.g. a file cut off mid-write)."""


def write_text_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` through a temp file in the same
    folder that is fsynced and renamed over ``path``. Returns the path. OSError when the
    folder is not writable; the temp file never stays behind."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # one per process: two writers never share one
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_json_atomic(path: str | Path, data, indent: int | None = 1) -> Path:
    """Write ``data`` as JSON (finite numbers only: ValueError for NaN/Infinity) atomically
    (see :func:`write_text_atomic`). Returns the path."""
    return write_text_atomic(path, json.dumps(data, indent=indent, allow_nan=False))


class _Refused:
    """What the parser puts in place of a value it refuses, so that the error can name its field."""

    def __init__(self, reason: str):
        self.reason = reason


def _refused_field(value) -> tuple[str, str] | None:
    """``(field path, reason)`` of the first refused value inside ``value``, or None."""
    stack = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, _Refused):
            return path or "(top level)", v.reason
        if isinstance(v, dict):
            stack.extend((f"{path}.{k[:40]}" if path else k[:40], x) for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


def parse_json(text: str | bytes, where: str, hint: str = ""):
    """``json.loads`` for text from anyone. ``where`` names the source in messages (``"--state
    s.json"``), ``hint`` says what to do (``"carve the model again"``).

    Raises :class:`JsonSyntaxError` for broken syntax and TapmlError for everything else it
    refuses (non-finite or overflowing numbers and integers beyond 64 bits, naming the field;
    nesting too deep to parse; bytes that are not UTF-8)."""
    tail = f"; {hint}" if hint else ""
    refused: list[str] = []

    def refuse(reason: str) -> _Refused:
        refused.append(reason)
        return _Refused(reason)

    def integer(digits: str):
        if len(digits) > _MAX_INT_CHARS:
            return refuse(f"an integer of {len(digits.lstrip('-'))} digits is beyond 64 bits")
        return int(digits)

    def number(digits: str):
        value = float(digits)
        return value if math.isfinite(value) else refuse(f"the number {digits[:40]} overflows a float")

    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise TapmlError(f"{where} is not a text file (not UTF-8){tail}") from None
    try:
        data = json.loads(text, parse_int=integer, parse_float=number,
                          parse_constant=lambda name: refuse(f"the JSON constant {name} is not allowed "
                                                             "(numbers must be finite)"))
    except json.JSONDecodeError as e:
        raise JsonSyntaxError(f"{where} is not valid JSON ({e.msg} at line {e.lineno}){tail}") from None
    except RecursionError:
        raise TapmlError(f"{where} is not valid JSON for tapml: it nests too deeply to parse{tail}") from None
    if refused:
        field, reason = _refused_field(data) or ("(top level)", refused[0])
        raise TapmlError(f"{where} is not valid JSON for tapml: {field}: {reason}{tail}")
    return data


def read_json_file(path: str | Path, where: str | None = None, hint: str = "", max_bytes: int = MAX_JSON_BYTES):
    """Read and :func:`parse_json` the file at ``path`` (at most ``max_bytes``); ``where``
    defaults to the path. TapmlError when it cannot be read or is refused."""
    where = str(path) if where is None else where
    tail = f"; {hint}" if hint else ""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > max_bytes:
            raise TapmlError(f"{where} is {size >> 20} MiB, more than the {max_bytes >> 20} MiB a tapml file "
                             f"may have{tail}")
        data = p.read_bytes()
    except OSError as e:
        raise TapmlError(f"cannot read {where}: {e.strerror}") from None
    return parse_json(data, where, hint)


__all__ = ["JsonSyntaxError", "MAX_JSON_BYTES", "parse_json", "read_json_file", "write_json_atomic",
           "write_text_atomic"]
