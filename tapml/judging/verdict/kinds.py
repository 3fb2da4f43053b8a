"""What a JSON document tapml writes is: its ``kind`` and ``format_version`` (ARCHITECTURE.md,
"Documents"). Every document carries both; readers dispatch on ``kind`` alone
(:func:`document_kind`). A document written before kinds existed has no ``kind``: it is read by
the key-based rules of :data:`FALLBACK_RULES`, in their order (tested with the saved documents in
tests/golden/documents).

Example::

    document_kind({"kind": "generation", "format_version": 1, ...})   # "generation"
    document_kind({"target": "wgpu", "cases": [...]})                 # "verdict" (older form)
"""

from __future__ import annotations

from tapml.errors import TapmlError

#: Every kind, with what writes it and the version of its format this tapml writes and reads.
KINDS: dict[str, dict] = {
    "verdict": {"writer": "tapml replay --json", "format_version": 1},
    "migration-state": {"writer": "tapml migrate --state (and its --json)", "format_version": 1},
    "matrix": {"writer": "tapml replay/migrate --json with several --target", "format_version": 1},
    "journal-header": {"writer": "the first line of a migration's STATE.journal", "format_version": 1},
    "generation": {"writer": "tapml generate --json", "format_version": 1},
    "precision": {"writer": "tapml precision --json", "format_version": 1},
    "fleet": {"writer": "tapml fleet --json", "format_version": 1},
    "preflight": {"writer": "tapml inspect STORE --target T --json", "format_version": 1},
    "bench": {"writer": "tapml bench --json (and its subcommands)", "format_version": 1},
}

#: How a document without ``kind`` (written before kinds) is told apart, first match wins.
#: A generation is asked before a precision analysis: a float16 generation holds ``keep_float32``.
FALLBACK_RULES: tuple[tuple[str, str], ...] = (
    ("matrix", "has verdicts and no cases"),
    ("generation", "has steps and no cases"),
    ("precision", "has keep_float32 and ops and no cases"),
    ("preflight", "has ops, limits and summary and no cases"),
    ("migration-state", "has cases and one of format, units, culprits, placement, end_to_end"),
    ("verdict", "has cases"),
)

STATE_KEYS = ("format", "units", "culprits", "placement", "end_to_end")


def stamp(kind: str, doc: dict) -> dict:
    """``doc`` with ``kind`` and this tapml's ``format_version`` of that kind first."""
    return {"kind": kind, "format_version": KINDS[kind]["format_version"],
            **{k: v for k, v in doc.items() if k not in ("kind", "format_version")}}


def _fallback_kind(data: dict) -> str | None:
    has = data.__contains__
    if has("cases"):
        return "migration-state" if any(map(has, STATE_KEYS)) else "verdict"
    if has("verdicts"):
        return "matrix"
    if has("steps"):
        return "generation"
    if has("keep_float32") and has("ops"):
        return "precision"
    if has("ops") and has("limits") and has("summary"):
        return "preflight"
    return None


def document_kind(data, where: str = "<document>") -> str | None:
    """The kind of a parsed document: its ``kind`` when it has one (TapmlError when that is not a
    kind tapml writes, or its ``format_version`` is newer than this tapml reads), else the kind
    :data:`FALLBACK_RULES` give an older document, else None (not a tapml document)."""
    if not isinstance(data, dict):
        return None
    if "kind" not in data:
        return _fallback_kind(data)
    kind = data["kind"]
    if not isinstance(kind, str) or kind not in KINDS:
        raise TapmlError(f"{where}: kind {str(kind)[:80]!r} is not a kind of document tapml writes "
                         f"({', '.join(KINDS)}); pass a file tapml wrote")
    version = data.get("format_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise TapmlError(f"{where}: format_version is not a non-negative integer; pass a file tapml wrote")
    if version > KINDS[kind]["format_version"]:
        raise TapmlError(f"{where}: {kind} format_version {version} is newer than this tapml reads "
                         f"({KINDS[kind]['format_version']}); upgrade tapml to read this JSON of "
                         f"`{KINDS[kind]['writer']}`")
    return kind


__all__ = ["KINDS", "FALLBACK_RULES", "stamp", "document_kind"]
