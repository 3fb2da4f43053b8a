"""tapml: port PyTorch models to WebGPU, Vulkan, Metal and OpenGL the top-down way.

``tapml.Session`` (interactive offloading from Python) is imported on first use, so that
``import tapml`` stays light.
"""

import logging as _logging

# torchao (a dependency, for --quantize) logs a warning for each CUDA kernel library it cannot load
# on a machine without CUDA, whoever imports it (transformers does, to build any model): noise that
# says nothing about what tapml runs. torch's notes on torchao's enums likewise.
for _name in ("torchao", "torch.utils._pytree"):
    if _logging.getLogger(_name).level == _logging.NOTSET:
        _logging.getLogger(_name).setLevel(_logging.ERROR)


def version() -> str:
    """The installed tapml version (``"dev"`` when running from a source tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version as package_version
    try:
        return package_version("tapml")
    except PackageNotFoundError:
        return "dev"


def __getattr__(name: str):
    if name == "Session":
        from tapml.driving.session import Session
        return Session
    raise AttributeError(f"module 'tapml' has no attribute {name!r}")
