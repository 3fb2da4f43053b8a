"""The declared schema of a carve store's ``manifest.json``, and the checks it cannot say.

:class:`Manifest` declares every field once (types, required keys, closed sets, bounds); the
writer checks what it writes against it (:meth:`CarveStoreWriter.close`) and the reader reads
with it (:func:`check_manifest`). What a schema cannot say is checked here by hand, after it:
references (a case's tensors name entries of the index, an alias names a stored tensor, a
program input a graph input, a step's inputs are its graph's per-step inputs), a view's stride
having its shape's length and staying inside its tensor, a token below the vocabulary, steps
numbered in order, and the graphs' own refs (:meth:`tapml.graph.Graph.from_schema`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, Discriminator, Field, Tag

from tapml.dtypes import LOW_FLOATS, MODEL_DTYPES
from tapml.quant import SCHEMES as QUANT_SCHEMES
from tapml.graph import Graph, GraphInputJSON, GraphJSON, NodeJSON, ShortText, TensorMeta, TensorMetaJSON, \
    arg_refs, check_call, check_state
from tapml.schema import Bool, ClosedSchema, Count, Int, Schema, Str, field_path, validate

#: The store format this tapml writes and reads; a manifest of another format is refused before its schema.
FORMAT_VERSION = 1
#: safetensors dtype codes of the torch dtypes a store holds.
STORE_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "uint64": "U64", "bool": "BOOL",
                "complex64": "C64", "complex32": "F16"}
#: Dtypes safetensors has no code for, held in a shard as another dtype with a last dim more:
#: complex32 as float16 pairs (real, imaginary), torch's own bytes.
STORED_AS_PAIRS = {"complex32": "float16"}
#: Bounds on a generation read from a store.
MAX_GENERATION_TOKENS = 1 << 20
#: The graphs of a generation, in the order of its steps.
GRAPH_KINDS = ("prefill", "decode")
_ELEMENTS = 1 << 48

StoreDtype = Literal[tuple(STORE_DTYPES)]
GraphKind = Literal[GRAPH_KINDS]


def _printable(text: str) -> str:
    if not text.isprintable():
        raise ValueError("a model spec is printable text")
    return text


def _plain_relative_path(shard: str) -> str:
    """A shard is named by a plain relative path: parts separated by ``/``, none empty, ``.`` or
    ``..``, no backslash, no control character (what the writer writes). Where the path leads,
    links included, is checked when the store opens its shards."""
    parts = shard.split("/")
    if any(p in ("..", ".") for p in parts):
        raise ValueError("a shard path leads outside the store or through '.'; it is relative to the store, as "
                         "shards/tensors-00000.safetensors")
    if "\\" in shard or not shard.isprintable() or not all(parts):
        raise ValueError("a shard path is a plain relative path inside the store, as shards/tensors-00000.safetensors")
    return shard


class StoredTensor(TensorMetaJSON):
    """An entry of the tensor index whose bytes are in a shard."""

    shard: Annotated[Str, Field(min_length=1, max_length=4096), AfterValidator(_plain_relative_path)]
    dtype: StoreDtype


class View(ClosedSchema):
    """How an alias reads its stored tensor's elements: from ``offset``, ``stride`` per dimension."""

    offset: Annotated[Count, Field(lt=_ELEMENTS)]
    stride: tuple[Annotated[Count, Field(lt=_ELEMENTS)], ...]


class AliasTensor(TensorMetaJSON):
    """An entry of the tensor index that is a stored tensor (``alias``) or a ``view`` of it."""

    alias: Str
    dtype: StoreDtype
    view: View = None  # a field left out: None; written null: refused (so below, for every ``= None``)


def _entry_kind(entry: Any) -> str | None:
    if isinstance(entry, dict) and "alias" in entry:
        return None if "shard" in entry else "an alias"
    return "a stored tensor"


TensorEntry = Annotated[
    Union[Annotated[StoredTensor, Tag("a stored tensor")], Annotated[AliasTensor, Tag("an alias")]],
    Discriminator(_entry_kind, custom_error_type="shard_and_alias",
                  custom_error_message="a tensor has a 'shard' or an 'alias', not both")]


class ProgramInput(Schema):
    """A graph input's stored value and what it is to the model."""

    kind: Literal["param", "buffer", "constant", "input"]
    tensor: Str


class Case(Schema):
    """One carved case: a node's call with the names of its stored inputs and outputs."""

    id: Str
    op: Str
    node: Str
    #: Every node of the graph that makes this call (``node`` is the first).
    nodes: tuple[Str, ...] = ()
    module: Str
    args: list[Any]
    kwargs: dict[ShortText, Any]
    multi: Bool
    output_meta: Annotated[tuple[TensorMetaJSON, ...], Field(min_length=1)]
    inputs: tuple[Str, ...]
    outputs: tuple[Str, ...]
    instances: Annotated[Count, Field(ge=1)]
    #: In a generation store only: the graph the case's node is in and the steps it occurs in.
    graph: GraphKind = None
    steps: Annotated[tuple[Count, ...], Field(min_length=1)] = None


class DecodeGraph(GraphJSON):
    """A generation's decode graph, with the stored values of its inputs."""

    program_inputs: dict[Str, ProgramInput]


class Step(Schema):
    """One step of a generation: its per-step inputs, the reference's logits and its token."""

    step: Count
    kind: GraphKind
    inputs: dict[Str, Str]
    logits: Str
    token: Count


Tokens = Annotated[Int, Field(ge=1, le=MAX_GENERATION_TOKENS)]


class Generation(Schema):
    """A generation: the prefill (the store's graph) then ``tokens`` decode steps."""

    prompt_len: Tokens
    tokens: Tokens
    max_cache_len: Annotated[Int, Field(ge=1, le=2 * MAX_GENERATION_TOKENS)]
    decode: DecodeGraph
    prefill_state: dict[Str, Str]
    steps: tuple[Step, ...]
    reference_tokens: tuple[Count, ...]


class Manifest(Schema):
    """A carve store's ``manifest.json`` (ARCHITECTURE.md, "CarveStore")."""

    format_version: Int
    model: Annotated[Str, Field(max_length=4096), AfterValidator(_printable)]
    torch_version: Str
    reference_device: Str
    seed: Int
    hf_config: dict[Str, Any] = {}
    dtype: Literal[MODEL_DTYPES] = "float32"  # stores older than --dtype are float32
    quantize: Optional[Literal[QUANT_SCHEMES]] = None  # --quantize: the packed-weight format of its linears
    quantized_ops: Literal["whole", "expand"] = "whole"  # --quantized-ops: the ops whole, or their float chain
    graph_inputs: tuple[GraphInputJSON, ...]
    nodes: tuple[NodeJSON, ...]
    graph_outputs: tuple[Str, ...]
    tensors: dict[Str, TensorEntry]
    program_inputs: dict[Str, ProgramInput]
    model_outputs: dict[Str, Str]
    cases: tuple[Case, ...]
    generation: Generation = None


def tensor_store_manifest(model: str) -> dict:
    """The fields of the manifest of a store that holds tensors and no graph or cases, for
    :meth:`CarveStoreWriter.close` (which adds the tensor index); what benchmarks and tests of
    the writer write."""
    import torch
    return {"model": model, "torch_version": torch.__version__, "reference_device": "cpu", "seed": 0,
            "graph_inputs": [], "nodes": [], "graph_outputs": [], "program_inputs": {}, "model_outputs": {},
            "cases": []}


def check_manifest(raw: dict) -> dict[str, Graph]:
    """Validate a manifest (parsed JSON, ``format_version`` already checked) against
    :class:`Manifest`, then what the schema cannot say; returns its graphs
    (``{"prefill": graph}``, with ``"decode"`` for a generation). ValueError naming the field
    (a :class:`tapml.schema.SchemaError` with its path for what the schema refuses)."""
    m = validate(Manifest, raw)
    graph = Graph.from_schema(m, fields=("graph_inputs", "nodes", "graph_outputs"))
    if m.dtype in LOW_FLOATS and not any(meta.dtype == m.dtype for meta in graph.meta.values()):
        raise ValueError(f"dtype says {m.dtype}, but no value of the graph is {m.dtype}")
    _check_aliases(m.tensors)
    _check_program_inputs(m.program_inputs, graph, m.tensors, "program_inputs")
    if graph.outputs and not m.model_outputs:
        raise ValueError("model_outputs: the reference's outputs are missing")
    for ref, tensor in m.model_outputs.items():
        if ref not in graph.outputs or tensor not in m.tensors:
            raise ValueError(f"model_outputs[{ref[:60]!r}] must map a graph output to a tensor in the index")
    graphs = {"prefill": graph}
    if m.generation is not None:
        graphs = _check_generation(m.generation, graph, m)
    node_names = {kind: {n.name for n in g.nodes} for kind, g in graphs.items()}
    ids = set()
    for i, case in enumerate(m.cases):
        where = f"cases[{i}]: case {case.id[:60]!r}"
        _check_case(case, m, node_names[_case_graph_kind(case, m.generation, where)], where)
        if case.id in ids:
            raise ValueError(f"cases[{i}]: case id {case.id[:60]!r} is used twice")
        ids.add(case.id)
    for kind, g in graphs.items():
        for node in g.nodes:
            if node.case is not None and node.case not in ids:
                raise ValueError(f"{'' if kind == 'prefill' else 'generation.decode: '}node {node.name!r}: field "
                                 f"'case' {node.case[:60]!r} names no case")
    return graphs


def _meta(entry: StoredTensor | AliasTensor) -> TensorMeta:
    return TensorMeta(entry.shape, entry.dtype)


def _check_aliases(index: dict[str, StoredTensor | AliasTensor]) -> None:
    """An alias names a tensor stored in a shard (no chains, so no cycles) of its dtype, and
    reads only that tensor's elements: the same shape, or a ``view`` inside it."""
    for name, info in index.items():
        if not isinstance(info, AliasTensor):
            continue
        where, target = field_path(("tensors", name)), info.alias
        stored = index.get(target)
        if stored is None:
            raise ValueError(f"{where}: field 'alias' {target[:60]!r} names no tensor of the store")
        if isinstance(stored, AliasTensor):
            raise ValueError(f"{where}: its alias {target[:60]!r} is an alias itself; an alias must name a stored "
                             "tensor (no chains or cycles)")
        if stored.dtype != info.dtype:
            raise ValueError(f"{where}: dtype {info.dtype} differs from its alias {target[:60]!r} ({stored.dtype})")
        if info.view is None:
            if stored.shape != info.shape:
                raise ValueError(f"{where}: shape {list(info.shape)} differs from its alias {target[:60]!r} "
                                 f"({list(stored.shape)}) and no 'view' says how to read it")
            continue
        if len(info.view.stride) != len(info.shape):
            raise ValueError(f"{where}.view.stride has {len(info.view.stride)} strides for a shape of "
                             f"{len(info.shape)} dimensions; a view has one stride per dimension")
        last = info.view.offset + sum((d - 1) * s for d, s in zip(info.shape, info.view.stride))
        if math.prod(info.shape) and last >= math.prod(stored.shape):
            raise ValueError(f"{where}: its view reads element {last} of {target[:60]!r}, which has "
                             f"{math.prod(stored.shape)}")


def _check_case(case: Case, m: Manifest, node_names: set[str], where: str) -> None:
    check_call(case.op, case.args, case.kwargs, where)
    if len(case.outputs) != len(case.output_meta) or (len(case.output_meta) > 1 and not case.multi):
        raise ValueError(f"{where}: fields 'outputs' and 'output_meta' must name the same tensors "
                         "(one, or several with 'multi')")
    for name in case.inputs + case.outputs:
        if name not in m.tensors:
            raise ValueError(f"{where} refers to tensor {name[:60]!r}, which is not in the index")
    for ref in arg_refs(case.args) + arg_refs(list(case.kwargs.values())):
        if ref not in case.inputs:
            raise ValueError(f"{where}: its arguments read {ref[:60]!r}, which is not one of its 'inputs'")
    if case.node not in node_names:
        raise ValueError(f"{where}: field 'node' {case.node[:60]!r} is no node of the graph")


def _case_graph_kind(case: Case, generation: Generation | None, where: str) -> str:
    """Which graph a case's node is in; a generation's cases say it, with the steps they occur in."""
    if generation is None:
        if case.graph is not None or case.steps is not None:
            raise ValueError(f"{where}: fields 'graph' and 'steps' belong to a generation store, and this store "
                             "has none")
        return "prefill"
    last = generation.tokens
    if case.graph is None or case.steps is None:
        raise ValueError(f"{where}: a case of a generation names its 'graph' ({', '.join(GRAPH_KINDS)}) and 'steps'")
    if case.steps[-1] > last or list(case.steps) != sorted(set(case.steps)):
        raise ValueError(f"{where}: field 'steps' must be a non-empty increasing list of step indices 0 to {last}")
    return case.graph


def _check_program_inputs(program_inputs: dict[str, ProgramInput], graph: Graph, index: dict, field: str) -> None:
    """Every graph input has an entry naming a stored tensor of its shape and dtype, and nothing
    else has one."""
    for name, meta in graph.inputs:
        info = program_inputs.get(name)
        if info is None:
            raise ValueError(f"{field}: graph input {name[:60]!r} has no entry with a 'kind' and a 'tensor'")
        stored = index.get(info.tensor)
        if stored is None or _meta(stored) != meta:
            raise ValueError(f"{field}[{name[:60]!r}]: tensor {info.tensor[:60]!r} is not in the index "
                             "or has another shape or dtype than the graph input")
    extra = sorted(set(program_inputs) - {name for name, _ in graph.inputs})
    if extra:
        raise ValueError(f"{field}: {extra[0][:60]!r} is no graph input")


def _check_generation(g: Generation, prefill: Graph, m: Manifest) -> dict[str, Graph]:
    """What the schema cannot say of a store's ``generation`` (see :mod:`tapml.carving.generation`);
    returns ``{"prefill": graph with its state, "decode": graph}``."""
    index = m.tensors
    if g.max_cache_len < g.prompt_len + g.tokens:
        raise ValueError(f"generation.max_cache_len {g.max_cache_len} cannot hold prompt_len + tokens "
                         f"({g.prompt_len + g.tokens})")
    decode = Graph.from_schema(g.decode, "generation.decode")
    _check_program_inputs(g.decode.program_inputs, decode, index, "generation.decode.program_inputs")
    prefill = Graph(inputs=prefill.inputs, nodes=prefill.nodes, outputs=prefill.outputs,
                    state=check_state(g.prefill_state, prefill, "generation.prefill_state"))
    graphs = {"prefill": prefill, "decode": decode}
    if not prefill.state or set(prefill.state) != set(decode.state):
        raise ValueError("generation: 'prefill_state' and 'decode.state' must name the same state inputs (the cache)")
    for name in prefill.state:
        if prefill.meta[name] != decode.meta[name]:
            raise ValueError(f"generation: state input {name[:60]!r} has another shape or dtype in the decode graph")
    logits, per_step_inputs = {}, {}
    for kind, graph in graphs.items():
        taken = set(graph.state.values())
        rest = [r for r in graph.outputs if r not in taken]
        if len(rest) != 1 or len(graph.meta[rest[0]].shape) != 3:
            raise ValueError(f"generation: the {kind} graph must have one output besides its state: logits "
                             "[batch, seq, vocab]")
        logits[kind] = graph.meta[rest[0]]
    for kind, entries in (("prefill", m.program_inputs), ("decode", g.decode.program_inputs)):
        per_step_inputs[kind] = {name for name, _ in graphs[kind].inputs if entries[name].kind == "input"}
        if per_step_inputs[kind] & set(graphs[kind].state):
            raise ValueError(f"generation: a state input of the {kind} graph is also a per-step input")
    if len(g.steps) != g.tokens + 1:
        raise ValueError(f"generation.steps must be a list of {g.tokens + 1} steps (the prefill, then one per token)")
    for i, s in enumerate(g.steps):
        where = f"generation.steps[{i}]"
        kind = "prefill" if i == 0 else "decode"
        if s.step != i or s.kind != kind:
            raise ValueError(f"{where}: must be an object with 'step' {i} and 'kind' {kind!r}")
        if set(s.inputs) != per_step_inputs[kind]:
            raise ValueError(f"{where}: field 'inputs' must map the {kind} graph's per-step inputs "
                             f"({', '.join(sorted(per_step_inputs[kind]))[:200]}) to tensors")
        for name, tensor in s.inputs.items():
            stored = index.get(tensor)
            if stored is None or _meta(stored) != graphs[kind].meta[name]:
                raise ValueError(f"{where}.inputs[{name[:60]!r}] must name a stored tensor of the input's shape "
                                 "and dtype")
        vocab = logits[kind].shape[-1]
        stored = index.get(s.logits)
        if stored is None or _meta(stored) != TensorMeta((vocab,), logits[kind].dtype):
            raise ValueError(f"{where}: field 'logits' must name a stored tensor [{vocab}] of {logits[kind].dtype}")
        if not s.token < vocab:
            raise ValueError(f"{where}: field 'token' must be a token id below {vocab}")
    if list(g.reference_tokens) != [s.token for s in g.steps[:g.tokens]]:
        raise ValueError("generation.reference_tokens must be the tokens of steps 0 to tokens-1")
    return graphs


__all__ = ["Manifest", "check_manifest", "tensor_store_manifest", "FORMAT_VERSION", "STORE_DTYPES", "STORED_AS_PAIRS", "GRAPH_KINDS", "MAX_GENERATION_TOKENS"]
