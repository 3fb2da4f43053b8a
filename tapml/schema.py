"""The declared schemas of the JSON documents tapml reads, and the one way they are applied.

Each document kind (a program a client sends, a carve store's manifest, a Verdict JSON, a
migration state, ...) is declared once as a :class:`Schema`: a strict pydantic model whose
fields say the types, the required keys and the closed sets. :func:`validate` checks parsed JSON
against one and turns pydantic's errors into one message that names the field's path
(``kernels[0].workgroups[1]``) and what it holds, so a reader never checks a type by hand.
What a schema cannot say (references between fields, nesting depth, NaN and int64 rules) stays
in the reader that needs it.

pydantic is imported by the modules that declare schemas, which are imported on first use:
``tapml --help`` never loads it.
"""

from __future__ import annotations

import re
import math
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError

#: The leaf types of a schema. Every leaf is strict (an integer field takes no ``12.9``, ``12.0``,
#: ``"12"`` or ``true``; a string field no number); containers are not, so a JSON list is a tuple.
Int = Annotated[int, Strict()]
Count = Annotated[int, Strict(), Field(ge=0, le=(1 << 63) - 1)]
Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]


def _finite(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError("a finite number is expected")
    return x


#: A JSON number (an integer or not, never a boolean) that is finite.
Number = Annotated[float, Strict(), AfterValidator(_finite)]


class Schema(BaseModel):
    """A document (or part of one) as tapml reads it: leaves declared with :data:`Int`,
    :data:`Count`, :data:`Str`, :data:`Bool`, :data:`Number` or a ``Literal`` (a closed set),
    unknown keys ignored (a newer writer may add some), and the instance frozen."""

    model_config = ConfigDict(extra="ignore", frozen=True, hide_input_in_errors=True)


class ClosedSchema(Schema):
    """A :class:`Schema` that refuses keys it does not declare (requests a server runs)."""

    model_config = ConfigDict(extra="forbid")


class SchemaError(ValueError):
    """Parsed JSON that its declared schema refuses; the message names the field's path."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


M = TypeVar("M", bound=BaseModel)
_UNION_TAG = re.compile(r"[^A-Za-z0-9_]")


_NO_DATA = object()


def field_path(loc: tuple, root: str = "", data: Any = _NO_DATA) -> str:
    """``("kernels", 0, "workgroups", 1)`` -> ``kernels[0].workgroups[1]`` (under ``root`` when
    given); a key that is no identifier is quoted, ``tensors['in.x'].shape``, and a long one cut.
    With ``data`` (the document that pydantic's error ``loc`` is about), the tags pydantic puts in
    a path for the members of a union are left out: a part that is no key of the object at that
    point and is no identifier."""
    path, value = root, data
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif data is _NO_DATA or isinstance(value, dict) and part in value or not _UNION_TAG.search(part):
            key = part if len(part) <= 60 else part[:60] + "..."
            path += (f".{key}" if path else key) if part.isidentifier() else f"[{key!r}]"
        else:
            continue
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            value = None
    return path


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except RecursionError:
        text = f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= 40 else text[:40] + "..."


def describe(error: ValidationError, data: Any, root: str = "") -> tuple[str, str]:
    """``(path, problem)`` for the one error of ``error`` a user should fix first: the deepest
    (a union's members each fail; the member that got furthest says what was meant)."""
    best = max(error.errors(include_url=False, include_input=False), key=lambda e: len(e["loc"]))
    loc = tuple(best["loc"])
    path = field_path(loc, root, data) or root or "the document"
    if best["type"] == "missing":
        parent = field_path(loc[:-1], root, data)
        return path, f"{parent or 'the document'} lacks {loc[-1]}"
    value, found = data, True
    for part in loc:
        if isinstance(part, str) and _UNION_TAG.search(part) and not (isinstance(value, dict) and part in value):
            continue
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            found = False
            break
    # a model's class name means nothing to whoever wrote the JSON
    message = "input should be an object" if best["type"] == "model_type" else best["msg"].removeprefix("Value error, ")
    message = message[0].lower() + message[1:] if message else "is not valid"
    if loc and loc[-1] == "[key]":  # the key of an object's entry, not its value
        return path, f"{path}: this key does not fit: {message}"
    held = f" is {_shown(value)}" if found else ""
    return path, f"{path}{held}: {message}"


def validate(schema: type[M], data: Any, root: str = "") -> M:
    """``data`` (parsed JSON) as an instance of ``schema``; :class:`SchemaError` naming the
    field's path (under ``root``, e.g. ``program``) and what to fix otherwise."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        path, problem = describe(e, data, root)
        raise SchemaError(problem, path) from None
    except RecursionError:
        raise SchemaError(f"{root or 'the document'} nests too deeply", root) from None


__all__ = ["Int", "Count", "Str", "Bool", "Number", "Schema", "ClosedSchema", "SchemaError", "validate", "describe", "field_path"]
