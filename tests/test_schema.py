"""tapml.schema: the one way declared document schemas are applied (issue #37 item 4). Every leaf
is strict, and a refusal names the field's path and what it holds, including inside unions."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from pydantic import Field

from tapml.schema import ClosedSchema, Count, Number, Schema, SchemaError, Str, validate


class Part(ClosedSchema):
    label: Str


class Doc(Schema):
    size: Annotated[Count, Field(multiple_of=4)]
    ratio: Number = 1.0
    mode: Literal["a", "b"] = "a"
    pairs: list[tuple[Str, Count] | tuple[Str, Count, Count]] = []
    items: list[Annotated[Count, Field(lt=10)] | Literal["held"] | Part] = []
    table: dict[Annotated[Str, Field(pattern="^[a-z.]+$")], Count] = {}


REFUSED = [
    ({"size": 12.9}, "doc.size", "doc.size is 12.9: input should be a valid integer"),
    ({"size": 12.0}, "doc.size", "doc.size is 12.0: input should be a valid integer"),
    ({"size": "12"}, "doc.size", "doc.size is '12': input should be a valid integer"),
    ({"size": True}, "doc.size", "doc.size is True: input should be a valid integer"),
    ({"size": 6}, "doc.size", "doc.size is 6: input should be a multiple of 4"),
    ({"size": -4}, "doc.size", "doc.size is -4: input should be greater than or equal to 0"),
    ({}, "doc.size", "doc lacks size"),
    ({"size": 4, "ratio": float("nan")}, "doc.ratio", "doc.ratio is nan: a finite number is expected"),
    ({"size": 4, "ratio": False}, "doc.ratio", "doc.ratio is False: input should be a valid number"),
    ({"size": 4, "mode": "c"}, "doc.mode", "doc.mode is 'c': input should be 'a' or 'b'"),
    # a union of tuples: the member that got furthest says what was meant
    ({"size": 4, "pairs": [["x", 1, 2.5]]}, "doc.pairs[0][2]", "doc.pairs[0][2] is 2.5: input should be a valid integer"),
    ({"size": 4, "pairs": [["x", "y"]]}, "doc.pairs[0][1]", "doc.pairs[0][1] is 'y': input should be a valid integer"),
    # a union of a bounded integer, a literal and an object
    ({"size": 4, "items": [12]}, "doc.items[0]", "doc.items[0] is 12: input should be less than 10"),
    ({"size": 4, "items": ["x"]}, "doc.items[0]",
     "doc.items[0] is 'x': input should be a valid integer or 'held' or an object"),
    ({"size": 4, "items": [{"label": 3}]}, "doc.items[0].label", "doc.items[0].label is 3: input should be a valid string"),
    ({"size": 4, "items": [{"label": "p", "more": 1}]}, "doc.items[0].more",
     "doc.items[0].more is 1: extra inputs are not permitted"),
    ([4], "doc", "doc is [4]: input should be an object"),
    # keys of an object: one that is no name is quoted; a key that does not fit is said to be the key
    ({"size": 4, "table": {"aten.mm.default": "x"}}, "doc.table['aten.mm.default']",
     "doc.table['aten.mm.default'] is 'x': input should be a valid integer"),
    ({"size": 4, "table": {"Bad Key": 1}}, "doc.table['Bad Key']",
     "doc.table['Bad Key']: this key does not fit: string should match pattern '^[a-z.]+$'"),
    # two fields wrong: the first is named, with its own problem only
    ({"size": "x", "ratio": -1, "mode": "c"}, "doc.size", "doc.size is 'x': input should be a valid integer"),
]


@pytest.mark.parametrize("data, path, message", REFUSED, ids=[m for _, _, m in REFUSED])
def test_a_refusal_names_the_field_and_what_it_holds(data, path, message):
    with pytest.raises(SchemaError) as refused:
        validate(Doc, data, "doc")
    assert str(refused.value) == message and refused.value.path == path


def test_what_fits_is_read_and_unknown_keys_of_an_open_schema_are_dropped():
    doc = validate(Doc, {"size": 8, "ratio": 2, "pairs": [["x", 1], ["y", 1, 2]], "items": [3, "held", {"label": "p"}],
                         "from_a_newer_writer": {}})
    assert doc.size == 8 and doc.ratio == 2.0 and doc.pairs == [("x", 1), ("y", 1, 2)]
    assert doc.items == [3, "held", Part(label="p")] and not hasattr(doc, "from_a_newer_writer")
    nested = {"size": 4}
    for _ in range(5000):
        nested = {"size": 4, "items": [nested]}
    with pytest.raises(SchemaError):
        validate(Doc, nested, "doc")
