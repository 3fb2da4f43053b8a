"""WgslPlatform: the base of every platform that runs host-compiled WGSL KernelPrograms.

Support checks and compilation are :func:`tapml.platforms.wgsl.supports` and
:func:`tapml.platforms.wgsl.compile_graph` for the device's caps, the same for every runtime;
a runtime (wgpu-native in-process, a browser page) only implements the
:class:`~tapml.platforms.base.RuntimePlatform` hooks ``_caps``, ``_prepare`` and ``_execute``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

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

    #: The int64 tensors the last run held in two words (refs of its graph), see :meth:`run`.
    last_wide: tuple[str, ...] = ()

    def _supports(self, node: Node) -> str | None:
        from tapml.platforms.wgsl import supports
        return supports(node, self.caps())

    def _compile(self, graph: Graph) -> KernelProgram:
        """Compiled once per graph, caps, tuned matmul tiles and forced compile settings: a run's limits preflight and the run itself compile
        the same cases (:mod:`tapml.driving.preflight`), as do repeated replays in a session."""
        import hashlib
        import json

        from tapml.platforms.program_cache import ProgramCache
        from tapml.platforms.wgsl import compile_graph
        from tapml.platforms.wgsl.int64 import static_wide_refs, widen
        from tapml.platforms.wgsl.codegen import forced_state
        from tapml.platforms.wgsl.matmul import tiles_state
        caps = self.caps()
        original, static = graph, static_wide_refs(graph)
        if static:  # ints no i32 literal holds: their results in two words from the start
            graph = widen(graph, static)
        key = hashlib.sha256(json.dumps([graph.to_json(), caps, tiles_state(caps), forced_state()], sort_keys=True,
                                        default=str).encode()).hexdigest()
        compiled = self.__dict__.setdefault("_compiled", ProgramCache(max_entries=COMPILED_PROGRAMS))
        program = compiled.get(key)
        if program is None:
            program = compile_graph(graph, caps)
            self._check_compiled(program)
            compiled.put(key, program, sum(len(b.data or b"") for b in program.buffers))
        graphs = self.__dict__.setdefault("_graphs", OrderedDict())
        graphs[program.key] = (original, static)
        graphs.move_to_end(program.key)
        while len(graphs) > COMPILED_PROGRAMS:
            graphs.popitem(last=False)
        return program

    def run(self, program: KernelProgram, inputs: list, keep=()) -> list:
        """:meth:`Platform.run`, with int64 values past i32 held in two words: where an int64
        input, or an int64 value the graph computes from these inputs, does not fit in i32,
        the program's graph is compiled again with those tensors in two words
        (:mod:`tapml.platforms.wgsl.int64`) and that program runs instead. ``last_wide`` names
        them (empty when the run held every int64 in i32). A float64 input (a constant the
        program holds as float32, :func:`~tapml.platforms.wgsl.registry.float64_held_as_float32`)
        is converted here, and refused (``Unsupported``) unless float32 holds its values exactly."""
        from tapml.platforms.wgsl.registry import exact_float32
        inputs = [exact_float32(t, f"input {i}") if getattr(t, "dtype", None) is torch.float64 else t
                  for i, t in enumerate(inputs)]
        return super().run(self.for_values(program, inputs), inputs, keep)

    def for_values(self, program: KernelProgram, inputs: list) -> KernelProgram:
        """The program to run for ``inputs``: ``program``, or its graph compiled with the int64
        tensors whose values do not fit in i32 in two words."""
        from tapml.platforms.base import wrap_errors
        from tapml.platforms.wgsl.int64 import wide_refs, widen
        self.last_wide = ()
        known = self.__dict__.get("_graphs", {}).get(program.key)
        if known is None:  # a program compiled elsewhere runs as it is
            return program
        graph, static = known[:2]
        if len(known) == 2:  # worked out on the first run, kept with the program
            from tapml.platforms.wgsl.int64 import wide_plan
            plan = wide_plan(graph) if any(m.dtype == "int64" for m in graph.meta.values()) else None
            known = self._graphs[program.key] = (graph, static, plan)
        plan = known[2]
        if plan is None or not (plan.int64_inputs or plan.dynamic or plan.const_wide):
            self.last_wide = tuple(sorted(static))
            return program
        wide = wide_refs(graph, inputs, plan) | static
        self.last_wide = tuple(sorted(wide))
        if wide == static:
            return program
        return wrap_errors(self._compile, widen(graph, wide))

    def _check_compiled(self, program: KernelProgram) -> None:
        """Hook: device-side checks of a freshly compiled program (nothing by default)."""

    def prepared(self, program: KernelProgram):
        if program.key not in self.programs:
            check_workgroups(program, self.caps())
        return super().prepared(program)


__all__ = ["WgslPlatform"]
