"""The schemas of the documents that hold the verdicts of several targets: a multi-target
document (``replay``/``migrate --json`` with several ``--target``, :class:`MatrixJSON`) and a
fleet document (``tapml fleet --json``, :class:`FleetJSON`). Each verdict inside is a Verdict JSON
or migration state, validated by :mod:`tapml.judging.verdict`; the stored ``matrix`` is derived
and recomputed on read, so it only has to be an object. References between fields (a target
named twice, runs keyed by unknown devices) are checked by :mod:`tapml.reports.data`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from tapml.judging.verdict import PoolDeviceJSON
from tapml.schema import Count, Schema, Str

#: Most targets one multi-target document may hold.
MAX_TARGETS = 64
#: Most devices and models one fleet document may hold.
MAX_FLEET_DEVICES, MAX_FLEET_MODELS = 1024, 10000

Name = Annotated[Str, Field(min_length=1)]


class MatrixJSON(Schema):
    """A multi-target document: ``targets`` (1 to :data:`MAX_TARGETS`) and one verdict document per target."""

    format_version: Count = 0
    targets: Annotated[list[Str], Field(min_length=1, max_length=MAX_TARGETS)]
    verdicts: dict[Str, Any]
    matrix: dict[Str, Any] = {}


class FleetJSON(Schema):
    """A fleet document: the models, the devices (each a :class:`~tapml.judging.verdict.PoolDeviceJSON`),
    and ``runs`` (model -> device target -> Verdict JSON)."""

    format_version: Count = 0
    models: Annotated[list[Name], Field(min_length=1, max_length=MAX_FLEET_MODELS)]
    devices: Annotated[list[PoolDeviceJSON], Field(min_length=1, max_length=MAX_FLEET_DEVICES)]
    runs: dict[Str, dict[Str, Any]]
    left_out: dict[Str, Str] = {}
    matrix: dict[Str, Any] = {}


__all__ = ["MatrixJSON", "FleetJSON", "MAX_TARGETS", "MAX_FLEET_DEVICES", "MAX_FLEET_MODELS"]
