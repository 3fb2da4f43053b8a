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
    folder that is fsynced and renamed over ``path``; the folder is fsynced after the rename, so
    the new file survives a power cut. The temp file has a random name and is created
    exclusively (``O_EXCL``, never through a link): two writers never share one and a planted
    name is never written through. Returns the path. OSError when the folder is not writable;
    the temp file never stays behind."""
    import secrets
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp = path.with_name(f".{path.name[:200]}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0), 0o666)
    try:
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
    sync_folder(path.parent)
    return path


def sync_folder(folder: str | Path) -> None:
    """fsync a folder, so that a rename or a new file in it is durable (a no-op where folders
    cannot be opened, as on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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


def open_regular(path: str | Path, where: str | None = None, hint: str = "", follow_links: bool = True):
    """Open the file at ``path`` for reading when it is a regular file; returns ``(fd, size)``
    (the caller closes ``fd``). The file is opened without blocking (a FIFO never waits for a
    writer) and refused unless ``fstat`` says it is a regular file (a FIFO, ``/dev/zero``, a
    socket or a folder is refused, also behind a link); ``follow_links=False`` (for a file that
    lives inside a folder, as a store's manifest or a state's journal) refuses a link itself.
    ``where`` names the file in messages (default: the path); TapmlError (exit 2) otherwise."""
    import stat
    where = str(path) if where is None else where
    tail = f"; {hint}" if hint else ""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    link = f"{where} is a link; tapml reads this file only as a regular file in its folder{tail}"
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
        if os.path.islink(path):  # also where O_NOFOLLOW does not exist
            raise TapmlError(link)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if not follow_links and os.path.islink(path):
            raise TapmlError(link) from None
        raise TapmlError(f"cannot read {where}: {e.strerror}{tail}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise TapmlError(f"{where} is {kind}, not a regular file{tail}")
    return fd, st.st_size


def read_regular_file(path: str | Path, where: str | None = None, hint: str = "",
                      max_bytes: int = MAX_JSON_BYTES, follow_links: bool = True) -> bytes:
    """The bytes of the file at ``path`` when it is a regular file (:func:`open_regular`) of at
    most ``max_bytes``: the read stops there whatever the size said, so nothing here can hang or
    exhaust memory. TapmlError (exit 2) for everything refused."""
    where = str(path) if where is None else where
    tail = f"; {hint}" if hint else ""
    fd, size = open_regular(path, where, hint, follow_links)
    try:
        if size > max_bytes:
            raise TapmlError(f"{where} is {_size(size)}, more than the {_size(max_bytes)} tapml reads "
                             f"from such a file{tail}")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise TapmlError(f"{where} grew past the {_size(max_bytes)} tapml reads from such a file{tail}")
        return b"".join(chunks)
    except OSError as e:
        raise TapmlError(f"cannot read {where}: {e.strerror}{tail}") from None
    finally:
        os.close(fd)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def read_json_file(path: str | Path, where: str | None = None, hint: str = "", max_bytes: int = MAX_JSON_BYTES,
                   follow_links: bool = True):
    """Read the file at ``path`` with :func:`read_regular_file` (a regular file of at most
    ``max_bytes``; ``follow_links=False`` refuses a link) and :func:`parse_json` it; ``where``
    defaults to the path. TapmlError when it cannot be read or is refused."""
    where = str(path) if where is None else where
    return parse_json(read_regular_file(path, where, hint, max_bytes, follow_links), where, hint)


class FileHeld(TapmlError):
    """Another process holds the lock: its message names the file and the holder's pid."""


class ExclusiveLock:
    """An exclusive lock on ``PATH.lock`` for one writer of ``PATH`` (and what goes with it, as a
    state's journal): an advisory ``flock`` (``msvcrt.locking`` on Windows) that the kernel drops
    when its holder dies, so a killed run never leaves a stale lock. The lock file holds the
    holder's pid and is removed on release. ``acquire()`` raises :class:`FileHeld` (exit 2) naming
    ``what`` and the holder's pid when another process has it; acquiring again in the same
    process shares the first lock. Use as a context manager.

    Example::

        with ExclusiveLock("s.json", "--state s.json"):
            ...  # one writer of s.json and its journal
    """

    #: Locks this process holds: lock path -> [fd, how many holders]; a second acquire in the
    #: same process (the CLI around a carve, then the migration itself) shares the first.
    _held: dict[str, list] = {}

    def __init__(self, path: str | Path, what: str):
        self.path = Path(str(path) + ".lock")
        self.what = what
        self._key: str | None = None

    def acquire(self) -> "ExclusiveLock":
        key = os.path.realpath(self.path)
        if key in self._held:
            self._held[key][1] += 1
            self._key = key
            return self
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                             | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError as e:
                raise TapmlError(f"cannot lock {self.what} ({self.path}): {e.strerror}") from None
            try:
                import stat
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise TapmlError(f"cannot lock {self.what}: {self.path} is not a regular file; remove it")
                if not _try_lock(fd):
                    holder = os.read(fd, 32).decode("ascii", "replace").strip()
                    who = f"process {holder}" if holder.isdigit() else "another process"
                    raise FileHeld(f"{self.what} is in use by {who} (lock {self.path}); wait for that run to end, "
                                   "or use another state file")
                try:  # the holder before us may have removed the file between our open and our lock
                    same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
                except FileNotFoundError:
                    same = False
                if same:
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{os.getpid()}\n".encode())
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        self._held[key] = [fd, 1]
        self._key = key
        return self

    def release(self) -> None:
        if self._key is None:
            return
        held = self._held[self._key]
        held[1] -= 1
        if not held[1]:
            del self._held[self._key]
            try:
                os.unlink(self.path)  # while still holding it: a waiter that opened it retries
            except OSError:
                pass
            os.close(held[0])
        self._key = None

    def __enter__(self) -> "ExclusiveLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _try_lock(fd: int) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def load_python_file(path: str, what: str):
    """Import the user's Python file ``path`` as a module and return it: THIS RUNS THAT FILE'S CODE, by
    design (``file.py:factory`` model specs, ``file.py:Class`` backend targets). ``what`` names it in
    errors. TapmlError when the file is missing or raises while importing."""
    import importlib.util
    import sys
    file = Path(path)
    if not file.is_file():
        raise TapmlError(f"{what}: file {path!r} does not exist")
    mod_name = f"tapml_user_{abs(hash(str(file.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a user's file failing to import is bad input
        del sys.modules[mod_name]
        raise TapmlError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    return module


__all__ = ["ExclusiveLock", "load_python_file", "FileHeld", "JsonSyntaxError", "MAX_JSON_BYTES", "open_regular", "parse_json",
           "read_json_file", "read_regular_file", "sync_folder", "write_json_atomic", "write_text_atomic"]
