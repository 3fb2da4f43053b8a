"""Strings from files and peers, made safe to show on a terminal.

A case id, a module path, a model spec, an op name in a document, a journal message or a
platform a registry announces may come from anyone (SECURITY.md). Printed as they are, an ESC
or OSC sequence drives the terminal (retitles it, hides text, writes to the clipboard) and a
``[/]`` or ``[bold]`` is rich markup (a ``MarkupError`` ends the command). :func:`shown` is the
one helper every such string goes through before it reaches rich.

Example::

    from tapml.text import shown
    console.print(f"[bold]{shown(case_id)}[/] failed")
"""

from __future__ import annotations

import re

# C0 controls but tab, DEL, C1 controls, line/paragraph separators, bidi overrides and
# isolates (which reorder what follows them), and lone surrogates; _UNSHOWABLE_IN_LINES keeps "\n".
_UNSHOWABLE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_UNSHOWABLE_IN_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _visible(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def plain(value) -> str:
    """``str(value)`` with every control character (C0 but tab, DEL, C1), line separator, bidi
    override and lone surrogate written as a visible escape (``\\x1b``): one line of text that
    cannot drive a terminal. Example: ``plain("a\\x1b[31mb")`` -> ``'a\\\\x1b[31mb'``."""
    return _UNSHOWABLE.sub(_visible, str(value))


def plain_lines(value) -> str:
    """:func:`plain` that keeps line breaks (``\\n``): for text of several lines."""
    return _UNSHOWABLE_IN_LINES.sub(_visible, str(value))


def shown(value, lines: bool = False) -> str:
    """:func:`plain` (:func:`plain_lines` when ``lines``) with rich markup escaped: a string from
    a file or a peer, ready to be put into a rich markup string or a table cell.
    Example: ``shown("[/]x")`` -> ``'\\\\[/]x'``."""
    from rich.markup import escape
    return escape(plain_lines(value) if lines else plain(value))


__all__ = ["plain", "plain_lines", "shown"]
