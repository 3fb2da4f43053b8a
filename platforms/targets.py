"""The table of platform kinds: TARGET spec prefix -> the runtime that opens it.

Adding a platform is its runtime module and one line in :data:`TARGETS`. Platforms are named
as ``"module:Class"`` strings and imported only when a target of theirs is opened, so this
table sits with the backends: the device server's worker opens its platform through it, and
``tapml.targets`` (fault injection, tokens) builds on it.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Callable

from tapml.errors import TapmlError

WGPU_BACKENDS = ("vulkan", "metal", "dx12", "gl")


@dataclass(frozen=True)
class TargetKind:
    """How TARGET specs starting with one prefix open a platform.

    ``platform`` is ``"module:Class"`` (imported only when such a target is opened),
    ``forms`` the specs it accepts (None: ``check`` validates them), ``args(spec, token)`` the
    constructor's keyword arguments, ``needs`` what to install when the module cannot be imported.
    """

    platform: str
    forms: tuple[str, ...] | None
    args: Callable[[str, str | None], dict]
    needs: str = ""
    check: Callable[[str], object] | None = None


#: TARGET spec prefix -> its kind. Adding a platform is its runtime module and one line here.
TARGETS: dict[str, TargetKind] = {
    "reference": TargetKind("tapml.platforms.reference:ReferencePlatform", ("reference", "reference:cpu", "reference:cuda"),
                            lambda spec, token: {"device": "cuda" if spec.endswith("cuda") else "cpu"}),
    "wgpu": TargetKind("tapml.platforms.wgpu_native:WgpuPlatform", ("wgpu", *(f"wgpu:{b}" for b in WGPU_BACKENDS)),
                       lambda spec, token: {"backend": spec[5:] or None}, "the wgpu package; run the README's setup"),
    "browser": TargetKind("tapml.platforms.browser:BrowserPlatform", ("browser",), lambda spec, token: {},
                          "the websockets package; run the README's setup"),
    "remote://": TargetKind("tapml.remote.client:RemotePlatform", None, lambda spec, token: {
        **dict(zip(("host", "port"), parse_remote(spec))), "token": token}, "rpyc; run the README's setup",
        check=lambda spec: parse_remote(spec)),
}
TARGET_HELP = ", ".join(form for kind in TARGETS.values() for form in (kind.forms or ("remote://HOST:PORT",)))


def parse_remote(spec: str) -> tuple[str, int]:
    """``"remote://127.0.0.1:18861"`` -> ``("127.0.0.1", 18861)``; TapmlError for a bad spec."""
    m = re.fullmatch(r"remote://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", spec)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise TapmlError(f"bad remote target {spec!r}; expected remote://HOST:PORT, e.g. remote://127.0.0.1:18861")
    return m.group(1).strip("[]"), int(m.group(2))


def _kind(spec: str) -> TargetKind:
    prefix = max((p for p in TARGETS if spec.startswith(p)), key=len, default=None)
    kind = TARGETS.get(prefix) if prefix is not None else None
    if kind is None or (kind.forms is not None and spec not in kind.forms):
        raise TapmlError(f"unknown target {spec!r}; use one of: {TARGET_HELP}")
    if kind.check is not None:
        kind.check(spec)
    return kind


def check_target(spec: str) -> str:
    """Validate a TARGET spec's syntax without opening anything; returns it."""
    if not isinstance(spec, str):
        raise TapmlError("target must be a string")
    _kind(spec)
    return spec


def open_platform(spec: str, token: str | None = None):
    """Open the platform a TARGET spec names (no fault injection; see ``tapml.targets.open_target``)."""
    kind = _kind(check_target(spec))
    module, _, cls = kind.platform.partition(":")
    try:
        factory = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise TapmlError(f"target {spec} needs {kind.needs or 'a module that is missing'} ({e})") from None
    return factory(**kind.args(spec, token))
