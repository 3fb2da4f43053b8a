"""The on-disk compile cache of external backends: a re-run does not recompile.

An entry is what :meth:`Backend.compile` gave for one graph -- its ``blob`` (the compiled form)
and its ``artifact`` (the backend's own input, for repros) -- kept under
``$TAPML_CACHE_DIR/backends/`` (default ``~/.cache/tapml/backends/``) by a key that hashes the
graph's content, the backend's class and TARGET spec, its ``describe()["version"]`` and the
contract version: a new backend version or another device never meets an old entry.
``TAPML_BACKEND_CACHE=off`` turns the cache off.

The folder is bounded: past ``$TAPML_BACKEND_CACHE_MIB`` MiB (default 2048) of entries, a write
evicts the least recently used ones (a hit refreshes an entry's time) until the rest fit. Eviction
removes only regular files named as entries, in the entry folders directly under the cache folder
(never through a link), and an entry that another process removed first is simply gone.

The folder is untrusted input like any file tapml reads: an entry is one regular file (never
followed through a link) of at most :data:`MAX_ENTRY_BYTES`, a fixed header, a JSON index and
the bytes it describes, checked against a SHA-256 it carries; nothing in it is unpickled or run
(the blob goes to the backend's own :meth:`Backend.load`). An entry that fails any check is
ignored and compiled again, and the new entry replaces it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import time
from pathlib import Path
from typing import Annotated

from pydantic import Field

from tapml.errors import TapmlError
from tapml.schema import Count, Schema, Str, validate

MAGIC = b"TAPMLCC1"
_HEADER = struct.Struct("!8sI")  # magic, length of the JSON index
#: The largest cache entry read or written (blob and artifact together).
MAX_ENTRY_BYTES = 1 << 30
MAX_INDEX_BYTES = 64 << 10
#: env: ``off`` (or ``0``) turns the compile cache off
CACHE_ENV = "TAPML_BACKEND_CACHE"
ARTIFACT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


class CacheEntryIndexJSON(Schema):
    """The JSON index at the head of a compile-cache entry: whose entry it is, the byte counts of
    its blob and artifact, the artifact's file name (empty: none) and the payload's SHA-256."""

    key: Str
    blob: Count
    artifact: Count
    artifact_name: Annotated[Str, Field(pattern=f"^(?:{ARTIFACT_NAME.pattern})?$")]
    sha256: Annotated[Str, Field(pattern="^[0-9a-f]{64}$")]
#: env: the most MiB the cache folder's entries may take together (least recently used ones go first)
CACHE_MIB_ENV = "TAPML_BACKEND_CACHE_MIB"
DEFAULT_CACHE_BYTES = 2 << 30
_ENTRY_FILE = re.compile(r"[0-9a-f]{64}\.bin")
_ENTRY_FOLDER = re.compile(r"[0-9a-f]{2}")


def cache_folder() -> Path:
    """``$TAPML_CACHE_DIR/backends`` (default ``~/.cache/tapml/backends``, under ``$XDG_CACHE_HOME`` when set)."""
    base = os.environ.get("TAPML_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tapml")
    return Path(base) / "backends"


def cache_bytes() -> int:
    """The cache's bound in bytes: ``$TAPML_BACKEND_CACHE_MIB`` MiB, default 2 GiB. TapmlError for a
    value that is not a positive whole number of MiB."""
    text = os.environ.get(CACHE_MIB_ENV, "").strip()
    if not text:
        return DEFAULT_CACHE_BYTES
    if not text.isdigit() or int(text) <= 0:
        raise TapmlError(f"{CACHE_MIB_ENV}={text[:40]!r}: give a positive whole number of MiB (default "
                         f"{DEFAULT_CACHE_BYTES >> 20})")
    return int(text) << 20


def cache_enabled() -> bool:
    """False when ``$TAPML_BACKEND_CACHE`` is ``off``/``0``/``no``/``false``."""
    return os.environ.get(CACHE_ENV, "").strip().lower() not in ("off", "0", "no", "false")


def cache_key(graph_json: dict, backend_id: str, spec: str, version: str, contract_version: int) -> str:
    """The key of a graph compiled by one backend: SHA-256 over everything that changes the compiled form."""
    text = json.dumps({"graph": graph_json, "backend": backend_id, "spec": spec, "version": version,
                       "contract": contract_version}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class CompileCache:
    """Compiled programs of external backends on disk (see the module's docstring).

    Example::

        cache = CompileCache()
        entry = cache.get(key)          # (blob, artifact_name, artifact) or None
        cache.put(key, blob, "program.mlir", mlir_bytes)
    """

    def __init__(self, folder: str | Path | None = None, max_bytes: int | None = None):
        self.folder = Path(folder) if folder is not None else cache_folder()
        self.max_bytes = cache_bytes() if max_bytes is None else int(max_bytes)

    def _path(self, key: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError(f"bad compile-cache key {key[:80]!r}")
        return self.folder / key[:2] / f"{key}.bin"

    def get(self, key: str) -> tuple[bytes, str, bytes] | None:
        """``(blob, artifact_name, artifact)`` of the entry for ``key``; None when there is none or it
        fails a check (then it is compiled again)."""
        from tapml.io import read_regular_file
        path = self._path(key)
        if not path.exists():
            return None
        try:
            data = read_regular_file(path, max_bytes=MAX_ENTRY_BYTES + MAX_INDEX_BYTES + _HEADER.size,
                                     follow_links=False)
            entry = _decode(data, key)
        except (TapmlError, ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError, RecursionError):
            return None
        _touch(path)
        return entry

    def put(self, key: str, blob: bytes, artifact_name: str, artifact: bytes) -> bool:
        """Keep an entry (atomically; a folder that cannot be written is no error: the compile simply
        is not kept). Returns whether it was written."""
        from tapml.io import write_text_atomic
        if len(blob) + len(artifact) > MAX_ENTRY_BYTES:
            return False
        path = self._path(key)
        payload = bytes(blob) + bytes(artifact)
        index = json.dumps({"key": key, "blob": len(blob), "artifact": len(artifact),
                            "artifact_name": artifact_name if ARTIFACT_NAME.fullmatch(artifact_name or "") else "",
                            "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        data = _HEADER.pack(MAGIC, len(index)) + index + payload
        if len(data) > self.max_bytes:
            return False  # it would evict everything and still not fit
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_text_atomic(path, data)
        except OSError:
            return False
        _touch(path)
        self.evict()
        return True

    def entries(self) -> list[tuple[int, str, int, Path]]:
        """``(last use in ns, key, bytes, path)`` of every entry, least recently used first: regular
        files named ``KEY.bin`` in the two-character folders directly under the cache folder (a link,
        a folder reached through a link, a temp file or anything else there is not an entry). An entry
        removed while this looks is left out."""
        found = []
        try:
            folders = [f for f in os.scandir(self.folder) if _ENTRY_FOLDER.fullmatch(f.name)]
        except OSError:
            return []
        for folder in folders:
            try:
                if not folder.is_dir(follow_symlinks=False):
                    continue
                files = [f for f in os.scandir(folder.path) if _ENTRY_FILE.fullmatch(f.name)
                         and f.name.startswith(folder.name)]
            except OSError:
                continue  # removed while we looked
            for f in files:
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if f.is_file(follow_symlinks=False):
                    found.append((st.st_mtime_ns, f.name[:-4], st.st_size, Path(f.path)))
        return sorted(found)

    def evict(self) -> int:
        """Remove least recently used entries until the rest take at most ``max_bytes``; returns how
        many bytes it removed. An entry another process removed first counts as removed."""
        entries = self.entries()
        total, freed = sum(size for _, _, size, _ in entries), 0
        for _, _, size, path in entries:
            if total - freed <= self.max_bytes:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            freed += size
        return freed


def _touch(path: Path) -> None:
    """Mark an entry used now (its mtime, in ns: file systems' own clocks are too coarse to order
    entries written in one run). A file that is gone or cannot be changed keeps its time."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now), follow_symlinks=False)
    except (OSError, NotImplementedError):
        pass


def _decode(data: bytes, key: str) -> tuple[bytes, str, bytes]:
    """An entry's ``(blob, artifact_name, artifact)``; ValueError for anything malformed."""
    magic, n = _HEADER.unpack_from(data)
    if magic != MAGIC or n > MAX_INDEX_BYTES or len(data) < _HEADER.size + n:
        raise ValueError("not a compile-cache entry")
    index = validate(CacheEntryIndexJSON, json.loads(data[_HEADER.size:_HEADER.size + n]), "index")
    if index.key != key:
        raise ValueError("entry of another key")
    if index.blob + index.artifact > MAX_ENTRY_BYTES:
        raise ValueError("malformed index")
    payload = data[_HEADER.size + n:]
    if len(payload) != index.blob + index.artifact or hashlib.sha256(payload).hexdigest() != index.sha256:
        raise ValueError("entry cut short or changed")
    return payload[:index.blob], index.artifact_name, payload[index.blob:]
