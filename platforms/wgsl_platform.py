"""WgslPlatform: the base of every platform that runs host-compiled WGSL KernelPrograms.

Support checks and compilation are :func:`tapml.platforms.wgsl.supports` and
:func:`tapml.platforms.wgsl.compile_graph` for the device's caps, the same for every runtime;
a runtime (wgpu-native in-process, a browser page) only implements the
:class:`~tapml.platforms.base.RuntimePlatform` hooks ``_caps``, ``_prepare`` and ``_execute``.
"""

from __future__ import annotations

from tapml.graph import Graph, Node
from tapml.platforms.base import KernelProgram, RuntimePlatform, check_workgroups


class WgslPlatform(RuntimePlatform):
    """A :class:`RuntimePlatform` whose programs the host compiles to WGSL for the device's caps.

    Every program is checked against the device's workgroup limits before it is prepared; a
    runtime that can check a program without preparing it (build its pipelines, so that a shader
    the device refuses fails ``compile`` rather than the first run) does so in ``_check_compiled``.
    """

    def _supports(self, node: Node) -> str | None:
        from tapml.platforms.wgsl import supports
        return supports(node, self.caps())

    def _compile(self, graph: Graph) -> KernelProgram:
        from tapml.platforms.wgsl import compile_graph
        program = compile_graph(graph, self.caps())
        self._check_compiled(program)
        return program

    def _check_compiled(self, program: KernelProgram) -> None:
        """Hook: device-side checks of a freshly compiled program (nothing by default)."""

    def prepared(self, program: KernelProgram):
        if program.key not in self.programs:
            check_workgroups(program, self.caps())
        return super().prepared(program)


__all__ = ["WgslPlatform"]
