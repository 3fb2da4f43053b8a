"""Reading WGSL source text without compiling it: comments, an entry point's workgroup size, the
storage bindings a shader declares. A device server holds programs to its limits with these
(remote/limits.py) and ``--kernel`` files are checked with them before a device sees them
(:mod:`tapml.platforms.wgsl.user_kernels`); the device's own compiler has the last word.
"""

from __future__ import annotations

import math
import re

_AFTER_ATTRS = re.compile(r"\s*((?:@\s*\w+(?:\s*\([^)]*\))?\s*)*)fn\s+([A-Za-z_]\w*)")
_INT = re.compile(r"\s*(\d{1,10})[iu]?\s*")
#: ``@group(G) @binding(B) var<storage, ACCESS> NAME: array<TYPE>`` (either attribute first).
_STORAGE = re.compile(
    r"((?:@\s*(?:group|binding)\s*\(\s*\d+\s*\)\s*){2})var\s*<\s*storage\s*(?:,\s*(\w+)\s*)?>\s*([A-Za-z_]\w*)\s*:"
    r"\s*array\s*<\s*([A-Za-z0-9_<>]+?)\s*(,[^>]*)?>\s*;")
_ATTR = re.compile(r"@\s*(group|binding)\s*\(\s*(\d+)\s*\)")


def strip_comments(wgsl: str) -> str:
    """WGSL without comments (block comments nest; WGSL has no string literals)."""
    out, i, depth, n = [], 0, 0, len(wgsl)
    while i < n:
        two = wgsl[i:i + 2]
        if two == "/*":
            depth, i = depth + 1, i + 2
        elif depth and two == "*/":
            depth, i = depth - 1, i + 2
        elif depth:
            i += 1
        elif two == "//":
            end = wgsl.find("\n", i)
            i = n if end < 0 else end
        else:
            out.append(wgsl[i])
            i += 1
    return "".join(out)


def workgroup_dims(wgsl: str, entry: str) -> tuple[int, ...]:
    """The ``@workgroup_size(...)`` of entry point ``entry`` (one to three integer literals).
    ValueError when the entry point is not declared exactly once with one such attribute."""
    code = strip_comments(wgsl)
    sizes = []
    for m in re.finditer(r"@\s*workgroup_size\s*\(([^)]*)\)", code):
        fn = _AFTER_ATTRS.match(code, m.end())
        if fn and fn.group(2) == entry:
            sizes.append(m.group(1))
    if len(re.findall(rf"\bfn\s+{re.escape(entry)}\b", code)) != 1 or len(sizes) != 1:
        raise ValueError(f"entry point {entry!r} must be declared once with one @workgroup_size")
    dims = [d for d in sizes[0].split(",") if d.strip()]
    if not 1 <= len(dims) <= 3 or not all(_INT.fullmatch(d) for d in dims):
        raise ValueError(f"@workgroup_size({sizes[0].strip()[:60]}) of {entry!r}: only integer literals are accepted")
    return tuple(int(_INT.fullmatch(d).group(1)) for d in dims)


def workgroup_size(wgsl: str, entry: str) -> int:
    """Invocations per workgroup of entry point ``entry``: the product of :func:`workgroup_dims`."""
    return math.prod(workgroup_dims(wgsl, entry))


def storage_bindings(wgsl: str) -> list[tuple[int, int, str, str, str]]:
    """The storage buffers ``wgsl`` declares, in source order: ``(group, binding, access, name,
    element type)`` for each ``@group(G) @binding(B) var<storage, ACCESS> NAME: array<T>;``
    (access ``read`` when not given). ValueError for a storage binding that is not a
    runtime-sized array."""
    code = strip_comments(wgsl)
    found = []
    for m in _STORAGE.finditer(code):
        attrs = dict((k, int(v)) for k, v in _ATTR.findall(m.group(1)))
        if m.group(5):
            raise ValueError(f"binding {m.group(3)!r} is a fixed-size array<{m.group(4)}{m.group(5)}>; declare "
                             "runtime-sized arrays (array<f32>), tapml binds each tensor whole")
        found.append((attrs.get("group", -1), attrs.get("binding", -1), m.group(2) or "read", m.group(3),
                      re.sub(r"\s+", "", m.group(4))))
    declared = len(re.findall(r"\bvar\s*<\s*storage\b", code))
    if declared != len(found):
        raise ValueError(f"{declared} storage bindings are declared but only {len(found)} read as "
                         "`@group(0) @binding(N) var<storage, ACCESS> NAME: array<TYPE>;`")
    return found


__all__ = ["strip_comments", "workgroup_dims", "workgroup_size", "storage_bindings"]
