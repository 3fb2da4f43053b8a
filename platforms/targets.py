"""The table of platform kinds: TARGET spec prefix -> the runtime that opens it.

Adding a platform is its runtime module and one line in :data:`TARGETS`. Platforms are named
as ``"module:Class"`` strings and imported only when a target of theirs is opened, so this
table sits with the backends: the device server's worker opens its platform through it, and
``tapml.driving.targets`` (fault injection, tokens) builds on it.
"""

from __future__ import annotations

import functools
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
    usage: str = ""


#: TARGET spec prefix -> its kind. Adding a platform is its runtime module and one line here.
TARGETS: dict[str, TargetKind] = {
    "reference": TargetKind("tapml.platforms.reference:ReferencePlatform", ("reference", "reference:cpu", "reference:cuda"),
                            lambda spec, token: {"device": "cuda" if spec.endswith("cuda") else "cpu"}),
    "wgpu": TargetKind("tapml.platforms.wgpu_native:WgpuPlatform", ("wgpu", *(f"wgpu:{b}" for b in WGPU_BACKENDS)),
                       lambda spec, token: {"backend": spec[5:] or None}, "the wgpu package; run the README's setup"),
    "browser": TargetKind("tapml.platforms.browser:BrowserPlatform", ("browser",), lambda spec, token: {},
                          "the websockets package; run the README's setup"),
    "remote://": TargetKind("tapml.remote.client:RemotePlatform", None, lambda spec, token: {
        **dict(zip(("host", "port"), parse_remote(spec))), "token": token_for(token, spec)}, "rpyc; run the README's setup",
        check=lambda spec: parse_remote(spec), usage="remote://HOST:PORT"),
    "registry://": TargetKind("tapml.remote.pool:PoolPlatform", None, lambda spec, token: {"spec": spec, "token": token},
                              "rpyc; run the README's setup", check=lambda spec: parse_registry_target(spec),
                              usage="registry://HOST:PORT[?platform=P]"),
}

#: Built-in external backends (:mod:`tapml.platforms.backend`): TARGET prefix -> ``"module:Class"``.
#: Installed packages add more through the :data:`BACKEND_ENTRY_POINTS` entry-point group.
BUILTIN_BACKENDS = {"iree": "tapml.platforms.iree:IreeBackend", "ort": "tapml.platforms.ort:OrtBackend",
                    "ort-web": "tapml.platforms.ort_web:OrtWebBackend",
                    "tinygrad": "tapml.platforms.tinygrad:TinygradBackend"}
#: tapml's own compilers behind the Backend contract (:mod:`tapml.platforms.platform_backend`): table prefix
#: -> ``"module:Class"``. ``--target wgpu:vulkan`` runs the platform itself; these classes are what a
#: ``path/file.py:Class`` backend extends, and what :class:`~tapml.platforms.external.BackendPlatform` takes.
OWN_BACKENDS = {"wgpu": "tapml.platforms.wgpu_backend:WgpuBackend",
                "reference": "tapml.platforms.reference_backend:ReferenceBackend"}
#: The entry-point group a package registers its backends in: ``name = "module:Class"``, name the TARGET prefix.
BACKEND_ENTRY_POINTS = "tapml.backends"
#: ``path/to/file.py:Class``: a backend class in the user's own file (running the spec runs that file's code).
FILE_BACKEND = re.compile(r"(?P<path>[^:]+\.py):(?P<name>[A-Za-z_][A-Za-z0-9_]*)")

TARGET_HELP = ", ".join(form for kind in TARGETS.values() for form in (kind.forms or (kind.usage,))) + \
    ", iree:vulkan, iree:llvm-cpu, ort, ort-web:webgpu, ort-web:wasm, tinygrad:webgpu, tinygrad:cpu, an installed backend's PREFIX[:DEVICE], path/to/file.py:Class"


@functools.cache
def installed_backends() -> dict[str, str]:
    """Every external backend this environment can open: TARGET prefix -> ``"module:Class"``, the
    built-in ones and those of installed packages' ``tapml.backends`` entry points (a package may
    not take a built-in or table prefix). Read once per process: do not change the dict it returns."""
    from importlib.metadata import entry_points
    found = dict(BUILTIN_BACKENDS)
    for ep in entry_points(group=BACKEND_ENTRY_POINTS):
        if ep.name not in found and not any(ep.name.startswith(p.rstrip(":/")) for p in TARGETS):
            found[ep.name] = ep.value
    return found


#: The top-level imports each built-in target needs, checked (found, never imported) by :func:`describe_targets`.
TARGET_REQUIRES = {"reference": ("torch",), "wgpu": ("wgpu",), "browser": ("websockets",), "remote://": ("rpyc",),
                   "registry://": ("rpyc",), "iree": ("iree.compiler", "iree.runtime", "iree.turbine"),
                   "ort": ("onnxruntime", "onnx", "onnxscript"), "ort-web": ("websockets", "onnx", "onnxscript"),
                   "tinygrad": ("tinygrad", "pydawn", "onnx", "onnxscript")}
#: What each built-in backend needs besides its Python packages, for ``tapml targets`` (default: the extra).
BUILTIN_BACKEND_NEEDS = {"ort-web": "onnxruntime-web from npm (the README's setup installs it into platforms/web/ort), "
                                    "Chromium, and pip install 'tapml[backends]'"}


def ort_web_folder():
    """The onnxruntime-web package folder the ort-web targets serve: ``$TAPML_ORT_WEB``, else where the
    README's setup installs it (``npm ci`` in platforms/web/ort)."""
    import os
    from pathlib import Path
    return Path(os.environ.get("TAPML_ORT_WEB") or Path(__file__).parent / "web" / "ort" / "node_modules" / "onnxruntime-web")


def ort_web_missing() -> list[str]:
    """What the ort-web targets lack here (onnxruntime-web's files, Chromium), found without importing them."""
    import os
    import shutil
    folder = ort_web_folder()
    missing = [f"onnxruntime-web ({folder / 'dist' / 'ort.min.mjs'})"] if not (folder / "dist" / "ort.min.mjs").is_file() else []
    from tapml.platforms.chromium import CHROMIUM_NAMES
    if not (os.environ.get("TAPML_CHROMIUM") or any(shutil.which(name) for name in CHROMIUM_NAMES)):
        missing.append("chromium")
    return missing


#: The TARGET specs each built-in backend takes (its class says so too; this table is read without importing it).
BUILTIN_BACKEND_FORMS = {"iree": ("iree:vulkan", "iree:llvm-cpu"), "ort": ("ort",),
                         "ort-web": ("ort-web:webgpu", "ort-web:wasm"), "tinygrad": ("tinygrad:webgpu", "tinygrad:cpu")}


def _missing(modules) -> list[str]:
    """The modules of ``modules`` that cannot be found (nothing is imported but their parent packages)."""
    import importlib.util
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def describe_targets(specs: tuple[str, ...] = ()) -> list[dict]:
    """Every kind of target this environment knows, for ``tapml targets``: the built-in table, the
    built-in backends, the ``tapml.backends`` entry points, and each of ``specs`` (a
    ``file.py:Class`` spec runs that file to read its class). Each entry: ``{"target", "kind"
    (own backend|platform|backend|entry point|file), "forms", "source" (module:Class or file), "needs",
    "importable", "missing" (what cannot be found), "control"}``; tapml's own compilers behind the
    Backend contract (:data:`OWN_BACKENDS`, kind ``own backend``) name their Backend class as
    ``source`` and the platform their TARGET forms run as ``platform``. No device is opened and, but for
    ``specs``, no backend module is imported: whether a kind is importable is whether its modules
    can be found."""
    from importlib.metadata import entry_points
    rows = []
    for prefix, kind in TARGETS.items():
        own = OWN_BACKENDS.get(prefix)
        modules = (kind.platform.split(":")[0],) + ((own.split(":")[0],) if own else ())
        missing = _missing(TARGET_REQUIRES.get(prefix, ()) + modules)
        rows.append({"target": prefix.rstrip(":/"), "kind": "own backend" if own else "platform",
                     "forms": list(kind.forms or (kind.usage,)), "source": own or kind.platform,
                     "needs": kind.needs or "tapml itself", "importable": not missing, "missing": missing,
                     "control": None, **({"platform": kind.platform} if own else {})})
    for prefix, value in BUILTIN_BACKENDS.items():
        missing = _missing(TARGET_REQUIRES.get(prefix, ()) + (value.split(":")[0],))
        if prefix == "ort-web":
            missing += ort_web_missing()
        rows.append({"target": prefix, "kind": "backend", "forms": list(BUILTIN_BACKEND_FORMS.get(prefix, (prefix,))),
                     "source": value, "needs": BUILTIN_BACKEND_NEEDS.get(prefix, "pip install 'tapml[backends]' (the README's setup installs it)"),
                     "importable": not missing, "missing": missing, "control": None})
    for ep in entry_points(group=BACKEND_ENTRY_POINTS):
        if ep.name in BUILTIN_BACKENDS or any(ep.name.startswith(p.rstrip(":/")) for p in TARGETS):
            continue
        missing = _missing((ep.value.split(":")[0],))
        dist = getattr(ep, "dist", None)
        rows.append({"target": ep.name, "kind": "entry point", "forms": [f"{ep.name}[:DEVICE]"], "source": ep.value,
                     "needs": f"the package {dist.name if dist else 'that registered it'}", "importable": not missing,
                     "missing": missing, "control": None})
    for spec in specs:
        row = {"target": spec, "kind": "file" if FILE_BACKEND.fullmatch(spec) else "backend", "forms": [spec],
               "source": spec, "needs": "", "importable": False, "missing": [], "control": None}
        try:
            check_target(spec)
            if backend_prefix(spec) is None:
                raise TapmlError(f"{spec} is not an external backend; `tapml targets` lists the built-in kinds")
            cls = load_backend_class(spec)
            row.update(source=f"{row['source'] if row['kind'] == 'file' else cls.__module__}:{cls.__name__}",
                       needs=cls.needs or "nothing more", importable=True, control=cls.control,
                       forms=[spec] if row["kind"] == "file" else list(cls.forms or (spec,)))
        except TapmlError as e:
            row["missing"] = [str(e)]
        rows.append(row)
    return rows


def backend_prefix(spec: str) -> str | None:
    """The backend a TARGET spec names -- its prefix (``iree`` for ``iree:vulkan``), or the spec
    itself for a ``file.py:Class`` spec -- or None when it names no external backend."""
    if not isinstance(spec, str) or spec.startswith(tuple(TARGETS)):
        return None
    if FILE_BACKEND.fullmatch(spec):
        return spec
    prefix = spec.split(":", 1)[0]
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", prefix):
        return None
    return prefix if prefix in installed_backends() else None


def load_backend_class(spec: str):
    """The :class:`~tapml.platforms.backend.Backend` subclass a backend TARGET spec names (its module
    imported, or its file run). TapmlError saying what to install or fix."""
    from tapml.platforms.backend import CONTRACT_VERSION, Backend
    m = FILE_BACKEND.fullmatch(spec)
    if m:
        from tapml.io import load_python_file
        module = load_python_file(m["path"], f"target {spec}")
        cls = getattr(module, m["name"], None)
        where = m["path"]
    else:
        prefix = spec.split(":", 1)[0]
        value = installed_backends()[prefix]
        module_name, _, name = value.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            needs = "pip install 'tapml[backends]' (the README's setup installs it)" if prefix in BUILTIN_BACKENDS else \
                f"the package that registered {prefix!r} fully installed"
            raise TapmlError(f"target {spec} needs {needs} ({e})") from None
        cls, where = getattr(module, name, None), module_name
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TapmlError(f"target {spec}: {where} has no Backend subclass named {spec.rsplit(':', 1)[-1] if m else name!r}")
    if getattr(cls, "contract_version", None) != CONTRACT_VERSION:
        raise TapmlError(f"target {spec}: {cls.__name__} implements backend contract version "
                         f"{getattr(cls, 'contract_version', None)!r}; this tapml speaks version {CONTRACT_VERSION}")
    if cls.forms and spec not in cls.forms and not m:
        raise TapmlError(f"unknown target {spec!r}; {cls.__name__} takes: {', '.join(cls.forms)}")
    return cls


@dataclass(frozen=True)
class RegistryTarget:
    """A parsed ``registry://HOST:PORT[?platform=P][&mode=udp|tcp]`` target: the registry's
    address and protocol (``udp``, as ``tapml registry`` runs by default, or ``tcp``) and the
    platform kind a device server must serve to join the pool (None: any)."""

    host: str
    port: int
    mode: str = "udp"
    platform: str | None = None


def parse_registry_target(spec: str) -> RegistryTarget:
    """``"registry://127.0.0.1:18811?platform=wgpu:vulkan"`` -> its :class:`RegistryTarget`;
    TapmlError saying what to fix for a bad spec."""
    from urllib.parse import parse_qsl
    usage = "expected registry://HOST:PORT[?platform=P][&mode=udp|tcp], e.g. registry://127.0.0.1:18811?platform=wgpu"
    m = re.fullmatch(r"registry://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})(?:\?([A-Za-z0-9_.:=&-]*))?", spec)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise TapmlError(f"bad registry target {spec[:200]!r}; {usage}")
    try:
        query = parse_qsl(m.group(3) or "", keep_blank_values=True, strict_parsing=bool(m.group(3)))
    except ValueError:
        query = [("", "")]
    options = dict(query)
    unknown = sorted(set(options) - {"platform", "mode"})
    if unknown or len(options) != len(query):
        raise TapmlError(f"bad registry target {spec[:200]!r}: only platform= and mode= may follow '?', each once; {usage}")
    mode = options.get("mode", "udp")
    if mode not in ("udp", "tcp"):
        raise TapmlError(f"bad registry target {spec[:200]!r}: mode={mode!r}; use mode=udp or mode=tcp")
    platform = options.get("platform")
    if platform is not None:
        if platform.startswith(("remote://", "registry://")) or not platform:
            raise TapmlError(f"bad registry target {spec[:200]!r}: platform= names what the device servers serve "
                             f"(reference, wgpu, wgpu:vulkan, browser, ...), not {platform!r}")
        _kind(platform)
    return RegistryTarget(m.group(1).strip("[]"), int(m.group(2)), mode, platform)


def token_for(token, target: str) -> str | None:
    """The token for one ``remote://HOST:PORT`` target: ``token`` itself when it is a string
    (or None), else its entry in a token map (``{"HOST:PORT": token, "*": fallback}``)."""
    if token is None or isinstance(token, str):
        return token
    address = target.removeprefix("remote://")
    return token.get(address, token.get("*"))


def parse_remote(spec: str) -> tuple[str, int]:
    """``"remote://127.0.0.1:18861"`` -> ``("127.0.0.1", 18861)``; TapmlError for a bad spec."""
    m = re.fullmatch(r"remote://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", spec)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise TapmlError(f"bad remote target {spec!r}; expected remote://HOST:PORT, e.g. remote://127.0.0.1:18861")
    return m.group(1).strip("[]"), int(m.group(2))


def _kind(spec: str) -> TargetKind | None:
    """The table kind of a TARGET spec, None for an external backend's spec; TapmlError for an unknown one."""
    if backend_prefix(spec) is not None:
        return None
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
    """Open the platform a TARGET spec names (no fault injection; see ``tapml.driving.targets.open_target``).
    An external backend opens here, in this process (``open_target`` puts it in a worker)."""
    kind = _kind(check_target(spec))
    if kind is None:
        from tapml.platforms.external import BackendPlatform
        cls = load_backend_class(spec)
        try:
            return BackendPlatform(cls(spec))
        except TapmlError:
            raise
        except Exception as e:  # noqa: BLE001 - a backend that cannot open its device says why
            raise TapmlError(f"target {spec} could not open: {type(e).__name__}: {e}") from None
    module, _, cls = kind.platform.partition(":")
    try:
        factory = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise TapmlError(f"target {spec} needs {kind.needs or 'a module that is missing'} ({e})") from None
    return factory(**kind.args(spec, token))
