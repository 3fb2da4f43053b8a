"""The migration journal: an append-only JSON-lines file beside a state file.

Every verdict is appended (flushed and fsynced) the moment it is made, so a killed migration
resumes where it stopped. The first line is a header (the options the migration was started
with); then one ``{"key", "record"}`` line per record, typed by
:func:`tapml.judging.verdict.journal_record`: ``device`` -> the device dict, ``case:ID`` ->
:class:`~tapml.judging.verdict.CaseVerdict`, ``unit:ID`` -> :class:`~tapml.judging.verdict.UnitVerdict`.

Example::

    journal = Journal(journal_path("gpt2.json"), header, resume=True)
    journal.put("device", {"adapter": "cpu"})
    journal.close()
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tapml.errors import TapmlError
from tapml.io import MAX_JSON_BYTES, JsonSyntaxError, open_regular, parse_json, read_regular_file, write_text_atomic
from tapml.judging.verdict import check_depth, document_kind, journal_record, stamp
from tapml.schema import ClosedSchema, SchemaError, Str, validate


class JournalHeaderLineJSON(ClosedSchema):
    """The first line: the options the migration was started with (compared as a whole with the
    options of a resume, never read field by field), with its ``kind`` and ``format_version``."""

    header: dict[str, Any]


class JournalRecordLineJSON(ClosedSchema):
    """Every later line: a record under its key (``device``, ``case:ID``, ``unit:ID``), whose own
    schema :func:`~tapml.judging.verdict.journal_record` reads it with."""

    key: Str
    record: Any

#: What a refused journal's message tells the user to do.
START_OVER = "remove it and its state file to start over"


def journal_path(state_path: str | Path) -> Path:
    """The JSON-lines journal kept beside a state file."""
    state_path = Path(state_path)
    return state_path.with_name(state_path.name + ".journal")


def journal_text(header: dict, records: dict[str, object]) -> str:
    """The journal's lines for ``header`` and ``{key: record}`` (records are dicts or verdicts)."""
    lines = [json.dumps({"header": stamp("journal-header", header)}, allow_nan=False)]
    lines += [json.dumps({"key": key, "record": _plain(record)}, allow_nan=False) for key, record in records.items()]
    return "\n".join(lines) + "\n"


def _plain(record):
    return record if isinstance(record, dict) else record.to_json()


def _option_mismatch(old: dict, new: dict, path: Path) -> str:
    diffs = [f"{k}: journal has {old.get(k)!r}, now {new.get(k)!r}" for k in sorted(set(old) | set(new))
             if old.get(k) != new.get(k)]
    return (f"cannot resume from {path}: it was made with other options ({'; '.join(diffs)}); "
            "rerun with the same options, or without --resume to start over")


def recorded_store(state_path: str | Path) -> str | None:
    """The ``store_manifest_sha256`` that the journal beside ``state_path`` recorded (the store a
    migration with this state carved or used), or None when there is no such journal, it is not
    this user's regular file, or its header names no store. Never raises: it is a proof, or none."""
    path = journal_path(state_path)
    try:
        if hasattr(os, "geteuid") and os.lstat(path).st_uid != os.geteuid():
            return None
        fd, _ = open_regular(path, follow_links=False)
        try:
            head = os.read(fd, 1 << 20)  # the header line; the records after it do not matter here
        finally:
            os.close(fd)
        header = parse_json(head.split(b"\n", 1)[0], str(path)).get("header")
        digest = header.get("store_manifest_sha256") if isinstance(header, dict) else None
    except (OSError, TapmlError, AttributeError):
        return None
    return digest if isinstance(digest, str) and len(digest) == 64 else None


#: Header keys that journals written by an older tapml lack; such a journal still resumes.
NEWER_HEADER_KEYS = ("store_manifest_sha256",)


def _as_old(header: dict, old: dict) -> dict:
    """``header`` without the :data:`NEWER_HEADER_KEYS` that ``old`` lacks."""
    return {k: v for k, v in header.items() if k in old or k not in NEWER_HEADER_KEYS}


class Journal:
    """An append-only JSON-lines file of ``{"key", "record"}`` lines, each flushed and fsynced.

    The first line is a header (the options the migration was started with). Reading tolerates
    a torn last line, which is what a kill in the middle of a write leaves behind, and nothing
    else: a record that does not fit its schema (:func:`~tapml.judging.verdict.journal_record`) makes
    the whole journal refused. Records are typed: the device dict, :class:`CaseVerdict`,
    :class:`UnitVerdict`.
    """

    def __init__(self, path: Path, header: dict, resume: bool):
        self.path = Path(path)
        self.records: dict[str, object] = {}
        if resume and os.path.lexists(self.path):
            old_header, self.records = self.read(self.path)
            if old_header is not None and old_header != _as_old(header, old_header):
                raise TapmlError(_option_mismatch(old_header, header, self.path))
        # A fresh file, or the old records without a torn tail, so that appends start on a new line.
        write_text_atomic(self.path, journal_text(header, self.records))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        self._file = os.fdopen(fd, "a")

    @staticmethod
    def read(path: Path) -> tuple[dict | None, dict[str, object]]:
        """``(header, {key: typed record})`` of a journal file; TapmlError when a line other than
        the last is not JSON, or any line does not fit its schema."""
        header, records = None, {}
        raw = read_regular_file(path, f"journal {path}", START_OVER, MAX_JSON_BYTES, follow_links=False)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise TapmlError(f"journal {path} is not a text file; {START_OVER}") from None
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            where = f"journal {path} line {i + 1}"
            try:
                item = parse_json(line, where, START_OVER)
            except JsonSyntaxError:
                if i >= len(lines) - 2:  # torn final line from a kill mid-write
                    break
                raise TapmlError(f"journal {path} is corrupt at line {i + 1}; {START_OVER}") from None
            check_depth(item, where, START_OVER)
            first = header is None and not records
            try:
                line = validate(JournalHeaderLineJSON if first else JournalRecordLineJSON, item, "line")
            except SchemaError as e:
                raise TapmlError(f"{where} is not a journal line (a header first, then {{\"key\", \"record\"}} "
                                 f"lines): {e}; {START_OVER}") from None
            if first:
                if "kind" in line.header and document_kind(line.header, where) != "journal-header":
                    raise TapmlError(f"{where}: its header is not a journal header; {START_OVER}")
                # kind and format_version say what the line is, not what the migration ran with
                header = {k: v for k, v in line.header.items() if k not in ("kind", "format_version")}
            else:
                records[line.key] = journal_record(line.key, line.record, where, START_OVER)
        return header, records

    def get(self, key: str):
        return self.records.get(key)

    def put(self, key: str, record) -> None:
        """Record ``record`` (a device dict or a verdict) under ``key`` and make the line
        durable before returning."""
        self.records[key] = record
        self._file.write(json.dumps({"key": key, "record": _plain(record)}, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


__all__ = ["Journal", "journal_path", "journal_text", "recorded_store", "START_OVER"]
