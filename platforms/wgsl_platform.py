"""WgslPlatform: the base of every platform that runs host-compiled WGSL KernelPrograms.

Support checks and compilation are :func:`tapml.platforms.wgsl.supports` and
:func:`tapml.platforms.wgsl.compile_graph` for the device's caps, the same for every runtime;
a runtime (wgpu-native in-process, a browser page) only implements the
:class:`~tapml.platforms.base.RuntimePlatform` hooks ``_caps``, ``_prepare`` and ``_execute``.
"""

from __future__ import annotations

from tapml.graph import Graph, Node
from tapml.platforms.base import KernelProgram, RuntimePlatform, check_workgroups


#: Compiled programs a platform keeps (by graph and caps), so that compiling a graph again is free.
COMPILED_PROGRAMS = 512


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
        """Compiled once per graph, caps and matmul tile choice: a run's limits preflight and the run itself compile
        the same cases (:mod:`tapml.driving.preflight`), as do repeated replays in a session."""
        import hashlib
        import json

        from tapml.platforms.program_cache import ProgramCache
        from tapml.platforms.wgsl import compile_graph
        from tapml.platforms.wgsl.matmul import tiles_state
        caps = self.caps()
        key = hashlib.sha256(json.dumps([graph.to_json(), caps, tiles_state(caps)], sort_keys=True,
                                        default=str).encode()).hexdigest()
        compiled = self.__dict__.setdefault("_compiled", ProgramCache(max_entries=COMPILED_PROGRAMS))
        program = compiled.get(key)
        if program is None:
            program = compile_graph(graph, caps)
            self._check_compiled(program)
            compiled.put(key, program, sum(len(b.data or b"") for b in program.buffers))
        return program

    def _check_compiled(self, program: KernelProgram) -> None:
        """Hook: device-side checks of a freshly compiled program (nothing by default)."""

    def prepared(self, program: KernelProgram):
        if program.key not in self.programs:
            check_workgroups(program, self.caps())
        return super().prepared(program)


__all__ = ["WgslPlatform"]
