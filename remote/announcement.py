"""Announcing a device on an rpyc registry, and what an announcement (or a device's caps, as a
client shows them) may hold.

A server registers as :data:`SERVICE_NAME` and as an alias that carries its platform, adapter,
backend and features (:func:`announcement`; :func:`parse_announcement` reads one back);
:func:`parse_registry` and :func:`registry_client` reach the registry a ``--register`` or
``--registry`` option names. Anyone who can reach an rpyc registry can announce a device, so an
announcement is a peer's word: :func:`check_announcement` keeps only the fields ``tapml devices``
shows, each of the type it is shown as, bounded in length (:class:`AnnouncementJSON`). Escaping what is printed is the
printer's job.
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from tapml.errors import TapmlError
from tapml.schema import Schema, SchemaError, Str, validate

if TYPE_CHECKING:
    from tapml.remote.device import Device

SERVICE_NAME = "TAPML"

MAX_TEXT = 200
MAX_FEATURES = 256


_Text = Annotated[Str, Field(max_length=MAX_TEXT)]


class AnnouncementJSON(Schema):
    """What an announcement (or a device's caps, as ``tapml devices`` shows them) may hold: every
    field optional, each of the type it is shown as, bounded in length; other keys are dropped."""

    platform: _Text | None = None
    adapter: _Text | None = None
    backend: _Text | None = None
    features: Annotated[list[_Text], Field(max_length=MAX_FEATURES)] | None = None


def check_announcement(info) -> dict | None:
    """The announcement ``info`` (a parsed JSON value) as ``{"platform", "adapter", "backend": str,
    "features": [str]}`` (fields it lacks are left out), or None when it does not fit
    :class:`AnnouncementJSON`: ``{"features": 5}`` is refused, not shown.

    Example: ``check_announcement({"platform": "wgpu", "features": ["shader-f16"]})`` is that dict;
    ``check_announcement({"features": 5})`` is None.
    """
    try:
        return validate(AnnouncementJSON, info).model_dump(exclude_none=True)
    except SchemaError:
        return None


def announcement(device: Device) -> list[str]:
    """Registry aliases of a device: ``TAPML`` and ``TAPML-<base32 JSON>`` carrying its platform,
    adapter, backend and features (base32 because the registry upper-cases names; the full caps
    come from the device itself, over an authenticated connection)."""
    import base64
    info = {"platform": device.spec}
    if device._caps is not None:
        info.update({k: device._caps.get(k) for k in ("adapter", "backend", "features")})
    text = json.dumps(info, separators=(",", ":"))
    if len(text) > 600:  # the registry takes one UDP datagram per registration
        text = json.dumps({"platform": device.spec[:100], "adapter": str(info.get("adapter"))[:200]})
    return [SERVICE_NAME, f"{SERVICE_NAME}-" + base64.b32encode(text.encode()).decode()]


def parse_announcement(name: str) -> dict | None:
    """Inverse of :func:`announcement` for one alias; None when it is not one, or when a field
    has the wrong type (:func:`~tapml.remote.announcement.check_announcement`)."""
    import base64
    if not name.upper().startswith(f"{SERVICE_NAME}-"):
        return None
    try:
        info = json.loads(base64.b32decode(name[len(SERVICE_NAME) + 1:].upper()).decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return check_announcement(info)


def parse_registry(spec: str) -> tuple[str, str, int]:
    """``[udp://|tcp://]HOST[:PORT]`` -> (mode, host, port); TapmlError says what is wrong."""
    from rpyc.utils.registry import REGISTRY_PORT
    m = re.fullmatch(r"(?:(udp|tcp)://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+)(?::(\d{1,5}))?", spec or "")
    if not m or (m.group(3) and not 0 < int(m.group(3)) < 65536):
        raise TapmlError(f"bad registry {spec!r}; expected [udp://|tcp://]HOST[:PORT], e.g. udp://127.0.0.1:{REGISTRY_PORT}")
    return m.group(1) or "udp", m.group(2).strip("[]"), int(m.group(3) or REGISTRY_PORT)


def registry_client(spec: str, timeout: float = 2.0):
    """An rpyc registry client for a ``[udp://|tcp://]HOST[:PORT]`` spec."""
    from rpyc.utils.registry import TCPRegistryClient, UDPRegistryClient
    mode, host, port = parse_registry(spec)
    quiet = logging.getLogger("tapml.registry")
    quiet.setLevel(logging.CRITICAL)
    if mode == "tcp":
        return TCPRegistryClient(host, port=port, timeout=timeout, logger=quiet)
    return UDPRegistryClient(ip=host, port=port, timeout=timeout, logger=quiet)


__all__ = ["SERVICE_NAME", "check_announcement", "announcement", "parse_announcement", "parse_registry",
           "registry_client"]
