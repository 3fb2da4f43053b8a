"""TARGET specs -> platforms: ``reference[:cuda]``, ``wgpu[:vulkan|metal|dx12|gl]``, ``browser``,
``remote://HOST:PORT``. Heavy modules are imported only for the target asked for."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tapml.errors import TapmlError

WGPU_BACKENDS = ("vulkan", "metal", "dx12", "gl")
TARGET_HELP = ("reference, reference:cuda, wgpu, wgpu:vulkan, wgpu:metal, wgpu:dx12, wgpu:gl, browser, "
               "remote://HOST:PORT")


def read_token(token_file: str | None = None) -> str | None:
    """The shared device-server token: from ``token_file``, else ``$TAPML_TOKEN``, else None."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise TapmlError(f"cannot read --token-file {token_file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise TapmlError(f"--token-file {token_file} is not a text file holding the token") from None
        if not token:
            raise TapmlError(f"--token-file {token_file} is empty")
        return token
    return os.environ.get("TAPML_TOKEN") or None


def parse_remote(spec: str) -> tuple[str, int]:
    """``"remote://127.0.0.1:18861"`` -> ``("127.0.0.1", 18861)``; TapmlError for a bad spec."""
    m = re.fullmatch(r"remote://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", spec)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise TapmlError(f"bad remote target {spec!r}; expected remote://HOST:PORT, e.g. remote://127.0.0.1:18861")
    return m.group(1).strip("[]"), int(m.group(2))


def check_target(spec: str) -> str:
    """Validate a TARGET spec's syntax without opening anything; returns it."""
    if not isinstance(spec, str):
        raise TapmlError("target must be a string")
    if spec in ("reference", "reference:cpu", "reference:cuda", "wgpu", "browser"):
        return spec
    if spec.startswith("wgpu:") and spec[5:] in WGPU_BACKENDS:
        return spec
    if spec.startswith("remote://"):
        parse_remote(spec)
        return spec
    raise TapmlError(f"unknown target {spec!r}; use one of: {TARGET_HELP}")


def open_target(spec: str, *, token: str | None = None, inject: list[str] | None = None):
    """Open the platform a TARGET spec names, wrapped with fault injection when asked.

    Example: ``open_target("wgpu:vulkan")``, ``open_target("remote://127.0.0.1:18861", token=t)``.
    """
    check_target(spec)
    faults = None
    if inject:
        from tapml.inject import parse_faults
        faults = parse_faults(inject)  # validate before opening a device
    if spec.startswith("reference"):
        from tapml.platforms.reference import ReferencePlatform
        platform = ReferencePlatform("cuda" if spec.endswith("cuda") else "cpu")
    elif spec.startswith("wgpu"):
        try:
            from tapml.platforms.wgpu_native import WgpuPlatform
        except ImportError as e:
            raise TapmlError(f"target {spec} needs the wgpu package ({e}); run the README's setup") from None
        platform = WgpuPlatform(spec[5:] or None)
    elif spec == "browser":
        try:
            from tapml.platforms.browser import BrowserPlatform
        except ImportError as e:
            raise TapmlError(f"target browser is not available: {e}") from None
        platform = BrowserPlatform()
    else:
        host, port = parse_remote(spec)
        try:
            from tapml.remote.client import RemotePlatform
        except ImportError as e:
            raise TapmlError(f"remote targets are not available: {e}") from None
        platform = RemotePlatform(host, port, token=token)
    if faults:
        from tapml.inject import InjectedPlatform
        platform = InjectedPlatform(platform, faults)
    return platform
