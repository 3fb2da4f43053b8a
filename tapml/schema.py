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
import re
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError

#: The leaf types of a schema. Every leaf is strict (an integer field takes no ``12.9``, ``12.0``,
#: ``"12"`` or ``true``; a string field no number); containers are not, so a JSON list is a tuple.
Int = Annotated[int, Strict()]
#: The largest count a document may hold (a signed 64-bit integer).
MAX_COUNT = (1 << 63) - 1
Count = Annotated[int, Strict(), Field(ge=0, le=MAX_COUNT)]
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
_ABSENT = object()
_OBJECT = re.compile(r"a valid dictionary or instance of \w+")


def _wrong_type(kind: str) -> bool:
    """Whether a pydantic error type says the value is of the wrong type (not out of a bound)."""
    return kind.endswith("_type") or kind in ("literal_error", "is_instance_of", "union_tag_invalid", "enum")


def _walk(loc: tuple, data: Any, missing: bool) -> tuple[list, Any]:
    """The parts of pydantic's ``loc`` that are real keys and indexes of ``data`` (the tags it
    puts in a path for the members of a union are not), and the value found there (``_ABSENT``
    when the error is a ``missing`` key)."""
    parts, value = [], data
    for i, part in enumerate(loc):
        if isinstance(part, int):
            parts.append(part)
            value = value[part] if isinstance(value, list) and -len(value) <= part < len(value) else _ABSENT
        elif isinstance(value, dict) and part in value:
            parts.append(part)
            value = value[part]
        elif missing and i == len(loc) - 1 and isinstance(value, dict):
            parts.append(part)  # a key the document lacks
            value = _ABSENT
        # else: a union member's tag
    return parts, value


def field_path(parts, root: str = "") -> str:
    """``["kernels", 0, "workgroups", 1]`` -> ``kernels[0].workgroups[1]`` (under ``root`` when
    given); a key that is no identifier is quoted, and a long one cut: ``tolerances['aten.mm.default']``."""
    path = root
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier():
            path += f".{part}" if path else part
        else:
            path += f"[{(part if len(part) <= 60 else part[:60] + '...')!r}]"
    return path


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except RecursionError:
        text = f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= 40 else text[:40] + "..."


def describe(error: ValidationError, data: Any, root: str = "") -> tuple[str, str]:
    """``(path, problem)`` for the field of ``error`` a user should fix first: the deepest one (of
    a union's members, the one that got furthest says what was meant; where none got further,
    each says what it would take)."""
    found = [(*_walk(tuple(e["loc"]), data, e["type"] == "missing"), e)
             for e in error.errors(include_url=False, include_input=False)]
    depth = max(len(parts) for parts, _, _ in found)
    deepest = [(parts, value, e) for parts, value, e in found if len(parts) == depth]
    # of a union's members, one that found the value beats one that lacks it, and one whose
    # type fits but whose bound does not says what was meant
    deepest = [x for x in deepest if x[1] is not _ABSENT] or deepest
    deepest = [x for x in deepest if x[0] == deepest[0][0]]  # one field: the first one
    deepest = [x for x in deepest if not _wrong_type(x[2]["type"])] or deepest
    parts, value, first = deepest[0]
    path = field_path(parts, root) or root or "the document"
    if first["type"] == "missing":
        return path, f"{field_path(parts[:-1], root) or 'the document'} lacks {parts[-1]}"
    wanted = []
    for _, _, e in deepest:
        # a model's class name means nothing to whoever wrote the JSON
        text = _OBJECT.sub("an object", e["msg"].removeprefix("Value error, "))
        text = text[0].lower() + text[1:] if text else "is not valid"
        if text not in wanted:
            wanted.append(text)
    said = wanted[0] + "".join(" or " + w.removeprefix("input should be ") for w in wanted[1:])
    if first["loc"] and first["loc"][-1] == "[key]":  # the key of an object's entry, not its value
        return path, f"{path}: this key does not fit: {said}"
    held = "" if value is _ABSENT else f" is {_shown(value)}"
    return path, f"{path}{held}: {said}"


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


__all__ = ["MAX_COUNT", "Int", "Count", "Str", "Bool", "Number", "Schema", "ClosedSchema", "SchemaError", "validate", "describe", "field_path"]
