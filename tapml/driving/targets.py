"""TARGET specs -> platforms: ``reference[:cuda]``, ``wgpu[:vulkan|metal|dx12|gl]``, ``browser``,
``remote://HOST:PORT``, ``registry://HOST:PORT[?platform=P]`` (a pool), from one table (``tapml.platforms.targets.TARGETS``), wrapped with fault
injection when asked; and the device-server token. Heavy modules are imported only for the
target asked for."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tapml.errors import TapmlError
from tapml.platforms.targets import (TARGET_HELP, TARGETS, WGPU_BACKENDS, RegistryTarget, TargetKind, check_target,
                                     open_platform, parse_registry_target, parse_remote, token_for)

__all__ = ["TARGETS", "TARGET_HELP", "WGPU_BACKENDS", "RegistryTarget", "TargetKind", "check_target", "open_platform",
           "open_backend", "open_reference", "open_target", "takes_kernels", "parse_registry_target", "parse_remote", "read_token", "read_tokens", "spread", "token_for"]


#: Largest token file read (a token is at most 4096 characters).
MAX_TOKEN_FILE_BYTES = 64 << 10


def read_token(token_file: str | None = None) -> str | None:
    """The shared device-server token: from ``token_file``, else ``$TAPML_TOKEN``, else None."""
    if token_file:
        from tapml.io import read_regular_file
        try:
            token = read_regular_file(token_file, f"--token-file {token_file}", max_bytes=MAX_TOKEN_FILE_BYTES
                                      ).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise TapmlError(f"--token-file {token_file} is not a text file holding the token") from None
        if not token:
            raise TapmlError(f"--token-file {token_file} is empty")
        _warn_if_shared(token_file)
        return token
    return os.environ.get("TAPML_TOKEN") or None


def _warn_if_shared(token_file: str) -> None:
    """Warn on stderr, as ssh does for a key, when users other than the owner may read or change the token file."""
    try:
        mode = os.stat(token_file).st_mode & 0o777
    except OSError:
        return
    if mode & 0o077:
        print(f"warning: --token-file {token_file} has mode {mode:04o}: other users of this machine can read the "
              f"token; make it private with `chmod 600 {token_file}`", file=sys.stderr, flush=True)


def read_tokens(token_file: str | None = None, token_map: str | None = None):
    """What ``token=`` of :func:`open_target` takes from the CLI: the token map of ``--token-map``
    (a JSON file, see :func:`tapml.remote.pool.read_token_map`), else :func:`read_token`.
    TapmlError when both are given."""
    if token_map:
        if token_file:
            raise TapmlError("give --token-file (one token for every server) or --token-map (a token per server), "
                             "not both; a token map's \"*\" entry is the token for servers it does not name")
        from tapml.remote.pool import read_token_map
        return read_token_map(token_map)
    return read_token(token_file)


def spread(platform, items: list, work, **options) -> list | None:
    """Run ``work(device_platform, item)`` for every item spread over the devices of a pool
    (a ``registry://`` target, fault-injected or not; see :meth:`tapml.remote.pool.DevicePool.map`,
    which takes ``options``); returns ``[(result, device target), ...]`` in the items' order, or
    None when ``platform`` is not a pool (then the caller runs the items itself)."""
    from tapml.driving.inject import InjectedPlatform
    from tapml.remote.pool import PoolPlatform
    faults = platform.faults if isinstance(platform, InjectedPlatform) else None
    pool = platform.inner if faults is not None else platform
    if not isinstance(pool, PoolPlatform):
        return None
    if faults:
        return pool.pool.map(items, lambda device, item: work(InjectedPlatform(device, faults), item), **options)
    return pool.pool.map(items, work, **options)


#: env: how many MiB the reference worker's address space may grow past what it maps at start
REFERENCE_MEMORY_ENV = "TAPML_REFERENCE_MEMORY_MIB"
#: a local reference op has no wall-clock limit of its own; this only ends a worker that hangs
REFERENCE_TIMEOUT_S = 24 * 3600.0


def open_reference(spec: str):
    """The ``reference`` target run the way a device server runs it: torch in a worker process
    (:class:`tapml.remote.device_worker.WorkerPlatform`) whose address space may grow by at most
    ``$TAPML_REFERENCE_MEMORY_MIB`` MiB (default: twice the memory budget of
    :func:`tapml.meta_sizes.memory_budget`, i.e. the machine's physical memory), so that an op that
    crashes or runs out of memory is an ``error`` verdict for its case, not the end of the command.
    ``reference:cuda`` runs in a worker too, without the address-space limit (CUDA maps more address
    space than it uses). TapmlError for a bad ``$TAPML_REFERENCE_MEMORY_MIB``."""
    import os

    from tapml.meta_sizes import memory_budget
    from tapml.remote.device_worker import WorkerPlatform
    text = os.environ.get(REFERENCE_MEMORY_ENV)
    try:
        headroom = (int(text) << 20) if text else 2 * memory_budget()
    except ValueError as e:
        headroom, why = 0, str(e)
    if headroom <= 0:
        raise TapmlError(why if not text else f"{REFERENCE_MEMORY_ENV}={text[:40]!r}: give a positive number of MiB")
    return WorkerPlatform(spec, timeout=REFERENCE_TIMEOUT_S, memory_headroom=None if spec.endswith("cuda") else headroom)


#: env: seconds one compile or run of an external backend may take before its worker is killed (a hang is bounded)
BACKEND_TIMEOUT_ENV = "TAPML_BACKEND_TIMEOUT_S"
BACKEND_TIMEOUT_S = 600.0


def open_backend(spec: str):
    """An external backend's target (``iree:vulkan``, ``ort``, an installed or ``file.py:Class``
    backend) in a worker process of its own (:class:`tapml.remote.device_worker.WorkerPlatform`): a
    crash of its native code is an ``error`` verdict for the case, and a compile or run past
    ``$TAPML_BACKEND_TIMEOUT_S`` seconds (default 600) kills the worker and is one too."""
    from tapml.remote.device_worker import WorkerPlatform
    text = os.environ.get(BACKEND_TIMEOUT_ENV)
    try:
        timeout = float(text) if text else BACKEND_TIMEOUT_S
    except ValueError:
        timeout = -1.0
    if not timeout > 0:
        raise TapmlError(f"{BACKEND_TIMEOUT_ENV}={(text or '')[:40]!r}: give a positive number of seconds")
    return WorkerPlatform(spec, timeout=timeout)


#: TARGET prefixes that run tapml's WGSL, so that ``--kernel`` files can replace its lowerings there.
KERNEL_TARGETS = ("wgpu", "browser", "remote://")


def takes_kernels(spec: str) -> bool:
    """Whether ``--kernel`` files apply to the TARGET ``spec`` (a WGSL target: wgpu, browser, remote://)."""
    return spec.startswith(KERNEL_TARGETS)


def open_target(spec: str, *, token: str | None = None, inject: list[str] | None = None,
                limits: dict[str, int] | None = None, kernels: list[str] | None = None):
    """Open the platform a TARGET spec names, wrapped with fault injection when asked.

    ``kernels``: ``--kernel OP=FILE.wgsl`` values, the user's own kernels in place of tapml's
    lowerings of their ops (:class:`tapml.platforms.kernel_override.KernelOverridePlatform`);
    TapmlError for a bad file or a target that runs no WGSL.

    ``token``: None, one token, or a token map ``{"HOST:PORT": token, "*": fallback}`` (:func:`read_tokens`).
    ``limits``: device limits to lower for the compiler (``--device-limit``, :meth:`Platform.force_limits`);
    TapmlError when the platform refuses them.

    Example: ``open_target("wgpu:vulkan")``, ``open_target("remote://127.0.0.1:18861", token=t)``,
    ``open_target("registry://127.0.0.1:18811?platform=wgpu", token=t)`` (a pool, see :func:`spread`).
    """
    check_target(spec)
    faults = None
    if inject:
        from tapml.driving.inject import parse_faults
        faults = parse_faults(inject)  # validate before opening a device
    overrides = None
    if kernels:
        from tapml.platforms.wgsl.user_kernels import parse_kernel_options
        overrides = parse_kernel_options(kernels)  # validate before opening a device
        if not takes_kernels(spec):
            hint = "; give one device of the pool as remote://HOST:PORT" if spec.startswith("registry://") else ""
            raise TapmlError(f"--kernel replaces a lowering of tapml's WGSL compiler, and {spec} runs no WGSL of "
                             f"tapml's: use it with wgpu, wgpu:vulkan, wgpu:gl, browser or remote://HOST:PORT{hint}")
    from tapml.platforms.targets import backend_prefix
    if spec.startswith("reference"):
        platform = open_reference(spec)
    elif backend_prefix(spec) is not None:
        platform = open_backend(spec)
    else:
        platform = open_platform(spec, token)
    if limits:
        force = getattr(platform, "force_limits", None)
        try:
            if force is None:
                raise ValueError("this target cannot lower its device limits")
            force(dict(limits))
        except ValueError as e:
            platform.close()
            raise TapmlError(f"--device-limit on {spec}: {e}") from None
    if overrides:
        from tapml.platforms.kernel_override import KernelOverridePlatform
        try:
            platform = KernelOverridePlatform(platform, overrides)
        except TapmlError:
            platform.close()
            raise
    if faults:
        from tapml.driving.inject import InjectedPlatform
        platform = InjectedPlatform(platform, faults)
    return platform
