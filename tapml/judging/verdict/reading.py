"""How the verdict documents are read: each is declared once as a :class:`~tapml.schema.Schema`
(the classes ending in ``JSON`` beside the types they are read into), checked with
:func:`tapml.schema.validate` once per document, and every problem becomes a
:class:`~tapml.errors.TapmlError` naming the file, the field's path and what is expected
(:class:`_Reader`). What a schema cannot say stays here: the nesting depth
(:func:`check_depth`) and the strict (resume) read's rule that every key the writer always writes
is there (:attr:`Written.ALWAYS`). The names starting with ``_`` are this package's own, never
imported from outside ``tapml.judging.verdict``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AfterValidator, Field
from pydantic_core import PydanticUndefined

from tapml.errors import TapmlError
from tapml.schema import MAX_COUNT, Number, Schema, SchemaError, validate

#: Bounds on what a reader accepts from a file.
MAX_DEPTH = 32

#: A finite number of 0 or more (an error, a time, a rate, a bound).
NonNegative = Annotated[Number, Field(ge=0)]


def _json_scalar(x: Any) -> Any:
    if x is None or isinstance(x, (str, bool)):
        return x
    if isinstance(x, int) and abs(x) <= MAX_COUNT:
        return x
    if isinstance(x, float) and math.isfinite(x):
        return x
    raise ValueError("a finite number, string, boolean or null is expected")


#: One JSON value that is not a container: a string, boolean, null, a 64-bit integer or a finite number.
Scalar = Annotated[Any, AfterValidator(_json_scalar)]


class Written(Schema):
    """A part of a document tapml writes. ``ALWAYS``: the keys its writer always writes, which a
    strict read (resuming) needs; a lenient read takes older files without them. A field typed
    ``X | None`` whose default is not None takes null as "not given" in a lenient read only."""

    ALWAYS: ClassVar[tuple[str, ...]] = ()


M = TypeVar("M", bound=Schema)
_NULLED: dict[type, dict[str, Any]] = {}


def _nulled(cls: type) -> dict[str, Any]:
    """The fields of ``cls`` where null stands for "not given", with their defaults."""
    if cls not in _NULLED:
        _NULLED[cls] = {name: f.default for name, f in cls.model_fields.items()
                        if f.default is not None and f.default is not PydanticUndefined and f.default_factory is None}
    return _NULLED[cls]


class _Reader:
    """One read of one file: ``where`` names it in messages, ``strict`` says whether every key
    the writer always writes must be there, ``hint`` says what file was expected and ``what``
    what document it must be (``a verdict file``)."""

    def __init__(self, where: str, strict: bool, hint: str, what: str = ""):
        self.where, self.strict, self.hint, self.what = where, strict, hint, what

    def fail(self, problem: str, what: str = ""):
        """Raise the TapmlError of ``problem`` (``what``: the document that was expected, this
        reader's by default)."""
        what = what or self.what
        where = f"{self.where} is not {what}" if what else self.where
        raise TapmlError(f"{where}: {problem}" + (f"; {self.hint}" if self.hint else ""))

    def document(self, data) -> None:
        """Refuse parsed JSON that is no object, or nests deeper than :data:`MAX_DEPTH`."""
        _check_depth(data, self)
        if not isinstance(data, dict):
            self.fail(f"its JSON is {_a(data)}, not an object", "a tapml document")

    def check(self, schema: type[M], data, root: str = "") -> M:
        """``data`` validated against ``schema`` (its path under ``root``); TapmlError otherwise."""
        try:
            return validate(schema, data, root)
        except SchemaError as e:
            self.fail(str(e))

    def values(self, m: Written, path: str = "") -> dict:
        """The fields of ``m`` as keyword arguments, null that stands for "not given" as its
        default; in a strict read, TapmlError unless every key of ``ALWAYS`` was given, and none
        of those nulls."""
        out = dict(m.__dict__)
        nulled = _nulled(type(m))
        for name, default in nulled.items():
            if out[name] is None:
                if self.strict and name in m.model_fields_set:
                    self.fail(f"{_at(path, name)} is null, expected {_a(default)}")
                out[name] = default
        if self.strict:
            for key in m.ALWAYS:
                if key not in m.model_fields_set:
                    self.fail(f"{path or 'the document'} lacks {key}")
        return out

    def present(self, m: Written, keys: tuple[str, ...], path: str = "") -> dict:
        """The fields of ``keys`` that ``m`` was given, in that order (checked as :meth:`values`)."""
        given = self.values(m, path)
        return {k: given[k] for k in keys if k in m.model_fields_set}


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _a(x) -> str:
    if isinstance(x, Schema):
        return "an object"
    name = {dict: "object", list: "list", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(x), type(x).__name__)
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def check_depth(data, where: str, hint: str = "") -> None:
    """TapmlError naming ``where`` when parsed JSON ``data`` nests deeper than :data:`MAX_DEPTH`."""
    _check_depth(data, _Reader(where, True, hint))


def _check_depth(data, reader: _Reader) -> None:
    stack = [(data, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_DEPTH:
            reader.fail(f"it nests deeper than {MAX_DEPTH} levels", "a tapml file")
        if isinstance(x, dict):
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, depth + 1) for v in x)


__all__ = ["MAX_DEPTH", "MAX_COUNT", "NonNegative", "Scalar", "Written", "check_depth"]
