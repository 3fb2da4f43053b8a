"""Hybrid execution: run a graph with each node placed on the reference or on the target.

A *placement* maps node names to ``"target"`` or ``"reference"`` (nodes it does not name run
on the reference). Consecutive target nodes in topological order form a *region*: the region
is compiled into one :class:`~tapml.platforms.base.KernelProgram` with
``platform.compile(graph.subgraph(names))``, its intermediates never leave the device, and
tensors cross between host and device only at region boundaries. Reference nodes run eagerly
with torch.

Example::

    store = CarveStore("stores/llama")
    runner = HybridRunner(store.graph, platform)
    placement = {n.name: "target" for n in store.graph.nodes}
    outputs = runner.run(store.program_inputs(), placement)
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Iterable

from tapml.errors import PlatformError
from tapml.graph import Graph, Node, run_graph, run_node

TARGET, REFERENCE = "target", "reference"

@dataclass
class Segment:
    """A maximal run of consecutive nodes with the same placement."""

    where: str
    nodes: list[Node]

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @functools.cached_property
    def produced(self) -> frozenset[str]:
        """Every ref the segment's nodes make."""
        return frozenset(r for n in self.nodes for r in n.output_refs)


@dataclass
class RegionRun:
    """What one target region did during a hybrid run."""

    nodes: list[str]
    inputs: list[str]
    outputs: list[str]
    bytes_in: int
    bytes_out: int
    compile_ms: float
    run_ms: float
    cached: bool

    def to_json(self) -> dict:
        return {"first": self.nodes[0], "last": self.nodes[-1], "nodes": len(self.nodes),
                "inputs": len(self.inputs), "outputs": len(self.outputs), "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "compile_ms": round(self.compile_ms, 3),
                "run_ms": round(self.run_ms, 3), "cached": self.cached}


@dataclass
class HybridResult:
    """Values asked for (graph outputs plus ``keep``) and a record of every target region run."""

    values: dict
    regions: list[RegionRun] = field(default_factory=list)
    reference_ms: float = 0.0


def segments(graph: Graph, placement: dict[str, str]) -> list[Segment]:
    """Split the graph's nodes (in topological order) into runs of equal placement."""
    out: list[Segment] = []
    for node in graph.nodes:
        where = TARGET if placement.get(node.name) == TARGET else REFERENCE
        if out and out[-1].where == where:
            out[-1].nodes.append(node)
        else:
            out.append(Segment(where, [node]))
    return out


class HybridRunner:
    """Runs one graph under changing placements on one platform, caching compiled regions.

    ``platform`` is any :class:`~tapml.platforms.base.Platform`. Compilation and run failures
    propagate as the platform raised them (:class:`~tapml.errors.Unsupported`,
    :class:`~tapml.errors.PlatformError`), with ``.region`` set to the region's node names.
    """

    def __init__(self, graph: Graph, platform):
        self.graph = graph
        self.platform = platform
        from tapml.platforms.program_cache import ProgramCache
        self._programs = ProgramCache()
        self._subgraphs = ProgramCache()  # a region's subgraph costs O(graph) to cut; runs repeat
        self.compile_ms: dict[tuple[str, str], float] = {}
        #: compile() calls that missed this runner's program cache
        self.programs_compiled = 0
        #: the HybridResult of the last :meth:`step`
        self.last_result: HybridResult | None = None
        self._plans: dict = {}
        self._last_plan: tuple | None = None  # (placement, keep, plan) of the last _plan call

    def program(self, names: list[str], keep: Iterable[str] = ()) -> tuple[object, Graph, bool, float]:
        """(program, subgraph, cached, compile_ms) of the region made of ``names``."""
        keep = sorted(keep)
        skey = _region_key(names, keep)
        sub = self._subgraphs.get(skey)
        if sub is None:
            sub = self.graph.subgraph(names, keep_outputs=keep)
            self._subgraphs.put(skey, sub)
        key = _region_key(names, sub.outputs)  # keeping what is already an output changes nothing
        program = self._programs.get(key)
        if program is not None:
            return program, sub, True, 0.0
        start = time.perf_counter()
        program = self.platform.compile(sub)
        ms = (time.perf_counter() - start) * 1e3
        self._programs.put(key, program)
        self.programs_compiled += 1
        self.compile_ms[(names[0], names[-1])] = ms
        return program, sub, False, ms

    def run(self, inputs: dict, placement: dict[str, str], keep: Iterable[str] = (),
            resident: set[str] = frozenset()) -> HybridResult:
        """Run the graph; returns the graph outputs and the refs in ``keep`` by ref.

        ``inputs`` holds a tensor for every graph input (parameters and user inputs), or a
        ResidentTensor on the platform; refs in ``resident`` that a target region produces stay
        on the device (returned as ResidentTensors).
        """
        from tapml.platforms.base import ResidentTensor
        missing = [r for r, _ in self.graph.inputs if r not in inputs]
        if missing:
            raise ValueError(f"hybrid run lacks graph inputs: {', '.join(missing[:5])}")
        keep = set(keep)
        segs, free_after = self._plan(placement, keep)
        env = {r: inputs[r] for r, _ in self.graph.inputs}
        result = HybridResult(values={})
        for i, seg in enumerate(segs):
            if seg.where == REFERENCE:
                start = time.perf_counter()
                for n in seg.nodes:
                    for r in n.input_refs:
                        if isinstance(env[r], ResidentTensor):  # its consumer is on the host: it crosses
                            env[r] = self.platform.read(env[r])
                    env.update(zip(n.output_refs, run_node(n, env.__getitem__)))
                result.reference_ms += (time.perf_counter() - start) * 1e3
            else:
                result.regions.append(self._run_region(seg, env, keep, resident))
            for r in free_after.get(i, ()):
                env.pop(r, None)
        result.values = {r: env[r] for r in self.graph.outputs}
        result.values.update({r: env[r] for r in keep if r in env})
        return result

    def _plan(self, placement: dict[str, str], keep: set[str]) -> tuple[list[Segment], dict[int, list[str]]]:
        """The segments of ``placement`` and, per segment, the values no later segment reads (freed
        after it), kept per placement and ``keep``: a generation runs every step under the same ones."""
        last = self._last_plan  # a generation asks again with an equal placement every step
        if last is not None and last[1] == keep and last[0] == placement:
            return last[2]
        key = (tuple(n.name for n in self.graph.nodes if placement.get(n.name) == TARGET), frozenset(keep))
        plans = self._plans
        if key in plans:
            self._last_plan = (dict(placement), set(keep), plans[key])
            return plans[key]
        segs = segments(self.graph, placement)
        last_use: dict[str, int] = {}
        for i, seg in enumerate(segs):
            for n in seg.nodes:
                for r in n.input_refs:
                    last_use[r] = i
        wanted = set(self.graph.outputs) | keep
        free_after: dict[int, list[str]] = {}
        for r, i in last_use.items():
            if r not in wanted:
                free_after.setdefault(i, []).append(r)
        if len(plans) >= 16:  # a migration tries many placements; a generation one
            plans.clear()
        plans[key] = segs, free_after
        self._last_plan = (dict(placement), set(keep), plans[key])
        return segs, free_after

    def step(self, inputs: dict, state_values: dict, placement: dict[str, str],
             keep: Iterable[str] = ()) -> tuple[dict, dict]:
        """One call of a graph with state (``graph.state``: state input -> output ref).

        ``inputs`` holds every other graph input (parameters, the step's token ids and
        positions); ``state_values`` a value per state input: a host tensor, or a
        :class:`~tapml.platforms.base.ResidentTensor` a previous step left on the target.
        State produced on the target stays there (a ResidentTensor, fed device-side to the
        next step); state produced on the reference stays on the host; a value whose consumer
        is on the other side is moved explicitly. Returns ``(outputs by ref, new state values
        by state input name)``; outputs other than state are host tensors. The step's region
        records are in :attr:`last_result`. Example::

            out, cache = runner.step({**params, **store.step_inputs(1)}, cache, placement)
        """
        state = self.graph.state
        if not state:
            raise ValueError("step() runs a graph with state; this graph has none (use run())")
        missing = sorted(set(state) - set(state_values))
        if missing:
            raise ValueError(f"step lacks state values: {', '.join(missing[:5])}")
        result = self.run({**inputs, **{k: state_values[k] for k in state}}, placement, keep,
                          resident=set(state.values()))
        self.last_result = result
        outputs = {r: v if r in state.values() else self.to_host(v) for r, v in result.values.items()}
        return outputs, {name: result.values[ref] for name, ref in state.items()}

    def to_host(self, value):
        """``value`` on the host: a tensor as is, a ResidentTensor downloaded from the platform."""
        from tapml.platforms.base import ResidentTensor
        return self.platform.read(value) if isinstance(value, ResidentTensor) else value

    def _run_region(self, seg: Segment, env: dict, keep: set[str], resident: set[str] = frozenset()) -> RegionRun:
        from tapml.platforms.base import ResidentTensor
        names = seg.names
        produced = seg.produced
        try:
            program, sub, cached, compile_ms = self.program(names, keep & produced)
            args = [env[r] for r, _ in sub.inputs]
            kept = [i for i, r in enumerate(sub.outputs) if r in resident]
            if kept:
                self._read_back_outputs_of(program, env, {r for r, _ in sub.inputs})
            start = time.perf_counter()
            if kept or any(isinstance(a, ResidentTensor) for a in args):
                outs = self.platform.run(program, args, keep=kept)
            else:
                outs = self.platform.run(program, args)
            run_ms = getattr(self.platform, "last_run_ms", None) or (time.perf_counter() - start) * 1e3
        except Exception as e:  # noqa: BLE001 - tag with the region, re-raise the platform's own error
            e.region = names
            raise
        if len(outs) != len(sub.outputs):
            err = PlatformError(f"region {names[0]}..{names[-1]} returned {len(outs)} outputs, expected "
                                f"{len(sub.outputs)}")
            err.region = names
            raise err
        env.update(zip(sub.outputs, outs))
        return RegionRun(nodes=names, inputs=[r for r, _ in sub.inputs], outputs=list(sub.outputs),
                         bytes_in=sum(int(t.nbytes) for t in args if not isinstance(t, ResidentTensor)),
                         bytes_out=sum(int(t.nbytes) for t in outs if not isinstance(t, ResidentTensor)),
                         compile_ms=compile_ms, run_ms=float(run_ms), cached=cached)


    def _read_back_outputs_of(self, program, env: dict, args: set[str]) -> None:
        """Download the live values an earlier run of ``program`` left on the device that this run
        does not take (``args``): running it again overwrites them (regions of identical layers
        compile to one program, so layer 1's run of a decode step would make layer 0's cache stale
        while the graph still needs it). Those it takes, the previous step's cache, stay resident."""
        from tapml.platforms.base import ResidentTensor
        device = program.device_program() if hasattr(program, "device_program") else program
        key = getattr(device, "key", None)
        if key is None:
            return
        for ref, value in list(env.items()):
            if isinstance(value, ResidentTensor) and value.program == key and ref not in args:
                env[ref] = self.platform.read(value)


def _region_key(names: list[str], refs) -> str:
    """A cache key of a region (its node names) with a set of output refs."""
    return "\0".join(names) + "\1" + "\0".join(refs)


def reference_values(graph: Graph, inputs: dict) -> dict:
    """Every value of the graph (inputs and every node output) computed on the reference."""
    everything = Graph(inputs=graph.inputs, nodes=graph.nodes,
                       outputs=[r for n in graph.nodes for r in n.output_refs], meta=graph.meta)
    values = run_graph(everything, dict(inputs))
    values.update(inputs)
    return values


def node_flops(node: Node, meta: dict) -> int:
    """A rough FLOP count of one node, by its op's registry entry
    (:func:`tapml.platforms.wgsl.registry.node_flops`): 2·M·N·K for matrix products and
    convolutions, a few per element for normalizations and softmax, zero for views, one per
    output element for everything else."""
    from tapml.platforms.wgsl.registry import node_flops as registry_flops
    return registry_flops(node, meta)


def placement_shares(graph: Graph, placement: dict[str, str]) -> dict:
    """Share of nodes and of estimated FLOPs placed on the target."""
    total_ops = len(graph.nodes)
    on_target = [n for n in graph.nodes if placement.get(n.name) == TARGET]
    flops = {n.name: node_flops(n, graph.meta) for n in graph.nodes}
    total_flops = sum(flops.values())
    target_flops = sum(flops[n.name] for n in on_target)
    ops_share = len(on_target) / total_ops if total_ops else 1.0
    return {"ops_total": total_ops, "ops_on_target": len(on_target), "ops_share": round(ops_share, 6),
            "flops_total": total_flops, "flops_on_target": target_flops,
            "flops_share": round(target_flops / total_flops, 6) if total_flops else round(ops_share, 6)}


__all__ = ["HybridRunner", "HybridResult", "RegionRun", "Segment", "segments", "reference_values",
           "node_flops", "placement_shares", "TARGET", "REFERENCE"]
