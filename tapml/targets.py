"""TARGET specs -> platforms: ``reference[:cuda]``, ``wgpu[:vulkan|metal|dx12|gl]``, ``browser``,
``remote://HOST:PORT``, from one table (``tapml.platforms.targets.TARGETS``), wrapped with fault
injection when asked; and the device-server token. Heavy modules are imported only for the
target asked for."""

from __future__ import annotations

import os
from pathlib import Path

from tapml.errors import TapmlError
from tapml.platforms.targets import TARGET_HELP, TARGETS, WGPU_BACKENDS, TargetKind, check_target, open_platform, parse_remote

__all__ = ["TARGETS", "TARGET_HELP", "WGPU_BACKENDS", "TargetKind", "check_target", "open_platform", "open_target",
           "parse_remote", "read_token"]


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


def open_target(spec: str, *, token: str | None = None, inject: list[str] | None = None):
    """Open the platform a TARGET spec names, wrapped with fault injection when asked.

    Example: ``open_target("wgpu:vulkan")``, ``open_target("remote://127.0.0.1:18861", token=t)``.
    """
    check_target(spec)
    faults = None
    if inject:
        from tapml.inject import parse_faults
        faults = parse_faults(inject)  # validate before opening a device
    platform = open_platform(spec, token)
    if faults:
        from tapml.inject import InjectedPlatform
        platform = InjectedPlatform(platform, faults)
    return platform
