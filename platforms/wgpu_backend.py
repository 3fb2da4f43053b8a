"""tapml's WGSL compiler on wgpu-native as a :class:`~tapml.platforms.backend.Backend`.

``WgpuBackend("wgpu:vulkan")`` compiles each program with :func:`tapml.platforms.wgsl.compile_graph`
for the adapter's caps and runs it through :class:`~tapml.platforms.wgpu_native.WgpuPlatform`; its
artifact is the WGSL of the program's kernels (``kernels.wgsl``). Extend it in your own file to
check a change of ours the way any backend is checked (``--target my_backend.py:Mine``)::

    from tapml.platforms.wgpu_backend import WgpuBackend

    class Mine(WgpuBackend):
        default_form = "wgpu:vulkan"      # the adapter a file backend opens
        def compile(self, program):
            ...                           # change the ExportedProgram, then
            return super().compile(program)
"""

from __future__ import annotations

from tapml.platforms.platform_backend import PlatformBackend
from tapml.platforms.targets import WGPU_BACKENDS


class WgpuBackend(PlatformBackend):
    """tapml's WGSL compiler on a wgpu-native adapter: ``wgpu`` (the best one), ``wgpu:vulkan``,
    ``wgpu:gl``, ``wgpu:metal`` or ``wgpu:dx12``."""

    forms = ("wgpu", *(f"wgpu:{b}" for b in WGPU_BACKENDS))
    default_form = "wgpu"
    needs = "the wgpu package; run the README's setup"

    def artifact(self, compiled) -> tuple[str, bytes]:
        """The WGSL source of every kernel, in dispatch order, each under a comment naming it."""
        text = "\n".join(f"// kernel {k.name} (entry {k.entry}, workgroups {list(k.workgroups)})\n{k.wgsl}"
                         for k in compiled.kernels)
        return "kernels.wgsl", text.encode()


__all__ = ["WgpuBackend"]
