"""The strict JSON reader the verdict documents are read with: typed access to one object of a
parsed document (:class:`_Obj`) and a nesting-depth check; every problem is a
:class:`~tapml.errors.TapmlError` naming the file, the object's path and the key. The names
starting with ``_`` are this package's own, never imported from outside ``tapml.judging.verdict``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tapml.errors import TapmlError

#: Bounds on what a reader accepts from a file.
MAX_DEPTH = 32
MAX_COUNT = (1 << 63) - 1


@dataclass
class _Ctx:
    file: str
    strict: bool
    hint: str


def _a(x) -> str:
    name = {dict: "object", list: "list", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(x), type(x).__name__)
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def check_depth(data, where: str, hint: str = "") -> None:
    """TapmlError naming ``where`` when parsed JSON ``data`` nests deeper than :data:`MAX_DEPTH`."""
    _check_depth(data, _Ctx(where, True, hint))


def _check_depth(data, ctx: _Ctx) -> None:
    stack = [(data, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TapmlError(f"{ctx.file} is not a tapml file: it nests deeper than {MAX_DEPTH} levels" +
                             (f"; {ctx.hint}" if ctx.hint else ""))
        if isinstance(x, dict):
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, depth + 1) for v in x)


_MISSING = object()


class _Obj:
    """Typed access to one JSON object of a document; every problem is a TapmlError naming the
    file, the object's path (``cases[3]``) and the key."""

    def __init__(self, data, ctx: _Ctx, path: str, what: str, top: bool = False):
        self.ctx, self.path, self.what = ctx, path, what
        if not isinstance(data, dict):
            self.fail(f"{'its JSON' if top else 'it'} is {_a(data)}, not an object")
        self.data = data

    def fail(self, problem: str):
        where = f"{self.ctx.file}: {self.path}" if self.path else self.ctx.file
        raise TapmlError(f"{where} is not {self.what}: {problem}" + (f"; {self.ctx.hint}" if self.ctx.hint else ""))

    def _get(self, key: str, default, required: bool):
        if key not in self.data:
            if required or default is _MISSING:
                self.fail(f"it lacks {key}")
            return _MISSING
        return self.data[key]

    def _bad(self, key: str, value, expected: str):
        self.fail(f"{key} is {_a(value)}, expected {expected}")

    def string(self, key: str, default=_MISSING, required: bool = False) -> str | None:
        v = self._get(key, default, required)
        if v is _MISSING or (v is None and self._null_ok(default)):
            return default
        if not isinstance(v, str):
            self._bad(key, v, "a string")
        return v

    def _null_ok(self, default) -> bool:
        # null where a field may be null; in a lenient read, null also stands for "not given"
        return default is None or (default is not _MISSING and not self.ctx.strict)

    def choice(self, key: str, choices: tuple[str, ...], default=_MISSING, required: bool = False) -> str | None:
        v = self.string(key, default, required)
        if v is not None and v not in choices:
            self.fail(f"{key} is {v[:80]!r}, expected one of {', '.join(choices)}")
        return v

    def number(self, key: str, required: bool = False) -> float | None:
        v = self._get(key, None, required)
        if v is _MISSING or v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self._bad(key, v, "a number or null")
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            self.fail(f"{key} is not a finite number")
        return f

    def count(self, key: str, default=_MISSING, required: bool = False) -> int | None:
        v = self._get(key, default, required)
        if v is _MISSING or (v is None and self._null_ok(default)):
            return default
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
            self.fail(f"{key} is {_a(v) if not isinstance(v, int) or isinstance(v, bool) else 'out of range'}, "
                      "expected a non-negative integer")
        return v

    def boolean(self, key: str, default=_MISSING) -> bool:
        v = self._get(key, default, False)
        if v is _MISSING:
            return default
        if not isinstance(v, bool):
            self._bad(key, v, "true or false")
        return v

    def strings(self, key: str, required: bool = False) -> list[str]:
        v = self._get(key, [], required)
        if v is _MISSING or v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            self.fail(f"{key} is not a list of strings")
        return list(v)

    def objects(self, key: str, cls, what: str, required: bool = False) -> list:
        v = self._get(key, [], required)
        if v is _MISSING or v is None:
            return []
        if not isinstance(v, list):
            self._bad(key, v, "a list")
        prefix = f"{self.path}." if self.path else ""
        return [cls._read(_Obj(item, self.ctx, f"{prefix}{key}[{i}]", what)) for i, item in enumerate(v)]

    def object(self, key: str, cls, what: str):
        v = self._get(key, None, False)
        if v is _MISSING or v is None:
            return None
        prefix = f"{self.path}." if self.path else ""
        return cls._read(_Obj(v, self.ctx, prefix + key, what))

    def child(self, key: str, what: str, required: bool = False) -> "_Obj | None":
        v = self._get(key, None, required)
        if v is None and required:
            self._bad(key, v, what)
        if v is _MISSING or v is None:
            return None
        prefix = f"{self.path}." if self.path else ""
        return _Obj(v, self.ctx, prefix + key, what)

    def worst(self, key: str) -> list[dict]:
        v = self._get(key, [], False)
        if v is _MISSING or v is None:
            return []
        if not isinstance(v, list):
            self._bad(key, v, "a list")
        out = []
        for i, w in enumerate(v):
            if not (isinstance(w, dict) and isinstance(w.get("index"), list)
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in w["index"])
                    and all(_scalar(w.get(k)) for k in ("target", "reference"))):
                self.fail(f"{key}[{i}] is not a worst element ({{\"index\": [ints], \"target\", \"reference\"}})")
            out.append({"index": list(w["index"]), "target": w.get("target"), "reference": w.get("reference")})
        return out


def _scalar(x) -> bool:
    if isinstance(x, float):
        return math.isfinite(x)
    return x is None or isinstance(x, (str, bool, int))
