"""What a device server lets one request cost, and the checks that hold programs to it.

Every graph and program a client sends is checked here before it reaches the device. Its
types, required fields and closed sets were checked when it was read
(:class:`tapml.platforms.base.ProgramJSON`, the one declaration of a program's JSON); here op
names go through the closed vocabulary (:func:`tapml.ops.check_op`), WGSL programs have what a
schema cannot say checked (names that refer to something, windows inside their buffers, split
tensors that their parts cover exactly), and the work a program asks for is measured and held
to :class:`ServerLimits`: total invocations (workgroups x workgroup size, summed over kernels)
and total buffer bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tapml.errors import Unsupported

DEFAULT_MAX_INVOCATIONS = 1 << 32
DEFAULT_MAX_BUFFER_BYTES = 4096 << 20
DEFAULT_RUN_TIMEOUT_S = 120.0
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
DEFAULT_MAX_REQUEST_ELEMENTS = 1 << 21
MAX_SLOTS = 16384  # tensors one connection may hold in slots (uploads, outputs not downloaded yet)
WORKER_BASE_BYTES = 8 << 30  # address space of a device worker besides its buffers (torch, drivers, JIT)
MAX_KERNELS = 65536
MAX_BUFFERS = 65536
MAX_NODES = 1 << 20
MAX_DIMS = 16
MAX_WGSL_CHARS = 1 << 20


class LimitExceeded(Unsupported):
    """A request asks for more work than the server's limits allow; it never reaches the device."""


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits a device server enforces (``tapml serve`` options in brackets).

    ``max_invocations`` [--max-invocations]: shader invocations one program may dispatch;
    ``max_buffer_bytes`` [--max-buffer-mib]: bytes of device buffers (or tensors, for graph
    programs) one program may declare, and what one connection may hold in each of: tensors in
    slots (uploads not run yet, outputs not downloaded yet, benchmark tensors), inputs kept for
    the next run, outputs kept on the device; ``run_timeout`` [--run-timeout]: seconds one compile or run
    may take on the device, and how long a request waits for a device another client holds;
    ``max_request_bytes`` [--max-request-mib]: bytes of one control message (a JSON request);
    ``max_request_elements`` [--max-request-elements]: JSON values (numbers, strings, lists,
    objects, ...) one request may hold, counted before it is parsed.
    """

    max_invocations: int = DEFAULT_MAX_INVOCATIONS
    max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES
    run_timeout: float = DEFAULT_RUN_TIMEOUT_S
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_request_elements: int = DEFAULT_MAX_REQUEST_ELEMENTS

    def worker_address_space(self) -> int:
        """The address-space limit (RLIMIT_AS) of a device worker: :data:`WORKER_BASE_BYTES` for
        the runtime itself plus four times ``max_buffer_bytes`` (a program's buffers, its inputs
        held for the next run, outputs on their way back, and the tensors of one request)."""
        return WORKER_BASE_BYTES + 4 * self.max_buffer_bytes


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def parse_request(text: str, limits: ServerLimits):
    """A client's JSON request, parsed once it is known to fit ``limits``: at most
    ``max_request_bytes`` characters and ``max_request_elements`` values (an upper bound counted
    from the separators outside strings, before anything is built). Raises :class:`LimitExceeded`
    past a limit and ValueError for text that is not JSON."""
    import json
    if len(text) > limits.max_request_bytes:
        raise LimitExceeded(f"request of {len(text)} bytes; this server takes at most {limits.max_request_bytes} "
                            "(tapml serve --max-request-mib)")
    bare = _JSON_STRING.sub("", text)
    elements = 1 + bare.count(",") + bare.count("[") + bare.count("{")
    del bare
    if elements > limits.max_request_elements:
        raise LimitExceeded(f"request of about {elements} JSON values; this server takes at most "
                            f"{limits.max_request_elements} (tapml serve --max-request-elements)")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("request nests too deeply") from None


def check_ops(graph) -> None:
    """Raise :class:`Unsupported` unless every op of ``graph`` is in tapml's closed vocabulary."""
    if len(graph.nodes) > MAX_NODES:
        raise LimitExceeded(f"graph has {len(graph.nodes)} nodes; a device server takes at most {MAX_NODES}")
    for node in graph.nodes:
        check_node(node)


def check_node(node) -> None:
    """Raise :class:`Unsupported` unless ``node``'s op (a Node, or its JSON) is in tapml's closed vocabulary."""
    from tapml.ops import check_op
    op = node.get("op") if isinstance(node, dict) else node.op
    try:
        check_op(op)
    except ValueError as e:
        raise Unsupported(f"{str(op)[:80]}: only aten ops of tapml's vocabulary run on a device server ({e})") \
            from None


def check_ops_json(graph_json) -> None:
    """:func:`check_ops` on a graph's JSON, before it is parsed: a refused op is reported as
    such (Unsupported), not as a malformed graph. Malformed structure is left to the parser."""
    nodes = graph_json.get("nodes") if isinstance(graph_json, dict) else None
    if isinstance(nodes, list):
        if len(nodes) > MAX_NODES:
            raise LimitExceeded(f"graph has {len(nodes)} nodes; a device server takes at most {MAX_NODES}")
        for node in nodes:
            if isinstance(node, dict):
                check_node(node)


def _meta_bytes(meta) -> int:
    from tapml.graph import torch_dtype
    if len(meta.shape) > MAX_DIMS:
        raise ValueError(f"tensor shape {list(meta.shape)[:MAX_DIMS + 1]} has more than {MAX_DIMS} dimensions")
    try:
        itemsize = torch_dtype(meta.dtype).itemsize
    except (KeyError, ValueError, TypeError, AttributeError):
        raise ValueError(f"unknown dtype {str(meta.dtype)[:40]!r}") from None
    return math.prod(meta.shape) * itemsize


def graph_bytes(graph) -> int:
    """Bytes of every tensor a graph declares (inputs and node outputs)."""
    return sum(_meta_bytes(m) for _, m in graph.inputs) + sum(_meta_bytes(m) for n in graph.nodes for m in n.outputs)


def check_graph(graph, limits: ServerLimits) -> None:
    """Vocabulary and size checks of a graph a client sends to ``compile``: every node's outputs
    computed on the meta device must be what it declares, each within the buffer cap (and the
    machine's memory budget), before the declared bytes are held to the cap."""
    check_ops(graph)
    check_real_sizes(graph, limits)
    _check_bytes(graph_bytes(graph), limits, "graph")


def check_real_sizes(graph, limits: ServerLimits) -> None:
    """:func:`tapml.meta_sizes.check_graph_sizes` with this server's cap: LimitExceeded naming the node."""
    from tapml.meta_sizes import check_graph_sizes, memory_budget
    try:
        check_graph_sizes(graph, min(limits.max_buffer_bytes, memory_budget()))
    except ValueError as e:
        raise LimitExceeded(f"{e} (tapml serve --max-buffer-mib {limits.max_buffer_bytes >> 20})") from None


def _check_bytes(nbytes: int, limits: ServerLimits, what: str) -> None:
    if nbytes > limits.max_buffer_bytes:
        raise LimitExceeded(f"{what} declares {nbytes} bytes of tensors; this server allows "
                            f"{limits.max_buffer_bytes} (tapml serve --max-buffer-mib)")


def workgroup_size(wgsl: str, entry: str) -> int:
    """Invocations per workgroup of entry point ``entry`` (its integer-literal ``@workgroup_size``);
    ValueError otherwise. The reader is :mod:`tapml.platforms.wgsl.source`, imported on first use so
    that this module stays light."""
    from tapml.platforms.wgsl.source import workgroup_size as read
    return read(wgsl, entry)


def _check_parts(program, buffers: dict) -> None:
    """The split tensors of a WGSL program (``parts``): each names its part buffers, which exist,
    belong to no other tensor, have its role and dtype and 1-D metas of their element counts,
    hold those elements, and cover the tensor's elements in order exactly once; the parts of an
    input or output stand in a row, in order, in the program's inputs or outputs, and nowhere else.
    ValueError otherwise."""
    from tapml.platforms.base import WGSL_TYPES  # imported on first use: this module stays light
    if not program.parts:
        return
    if len(program.parts) > MAX_BUFFERS:
        raise ValueError(f"program splits {len(program.parts)} tensors; at most {MAX_BUFFERS}")
    if len(program.input_meta) != len(program.inputs) or len(program.output_meta) != len(program.outputs):
        raise ValueError("a program with split tensors gives a meta for each of its inputs and outputs")
    owner: dict[str, str] = {}
    for t in program.parts:
        label = t.name[:40]
        _meta_bytes(t.meta)
        numel = math.prod(t.meta.shape)
        if numel >= 1 << 31:
            raise ValueError(f"split tensor {label!r}: {numel} elements; kernels index at most 2**31 - 1")
        if not 2 <= len(t.parts) <= MAX_BUFFERS:
            raise ValueError(f"split tensor {label!r} must have between 2 and {MAX_BUFFERS} parts")
        expected = 0
        storage = None
        for part in t.parts:
            name, start, count = part
            if name not in buffers:
                raise ValueError(f"split tensor {label!r}: part {str(name)[:40]!r} names no buffer")
            if name in owner:
                raise ValueError(f"split tensor {label!r}: buffer {name[:40]!r} is already a part of {owner[name][:40]!r}")
            owner[name] = t.name
            b = buffers[name]
            if start != expected or count <= 0:
                raise ValueError(f"split tensor {label!r}: part {name[:40]!r} covers [{start}, +{count}); the parts "
                                 f"must cover its elements in order, this one from element {expected}")
            expected += count
            if b.role != t.role or b.meta is None or tuple(b.meta.shape) != (count,) or b.meta.dtype != t.meta.dtype:
                raise ValueError(f"split tensor {label!r}: part {name[:40]!r} must be a buffer of role {t.role} "
                                 f"holding {t.meta.dtype}[{count}]")
            if storage not in (None, b.dtype) or b.size < count * WGSL_TYPES[b.dtype]:
                raise ValueError(f"split tensor {label!r}: part {name[:40]!r} ({b.dtype}, {b.size} bytes) does not "
                                 f"hold {count} elements of the tensor's one storage type")
            storage = b.dtype
        if expected != numel:
            raise ValueError(f"split tensor {label!r}: its parts cover {expected} of its {numel} elements")
        names = [n for n, _, _ in t.parts]
        for role, listed in (("input", program.inputs), ("output", program.outputs)):
            found = [i for i, n in enumerate(listed) if n in set(names)]
            if t.role != role:
                if found:
                    raise ValueError(f"split tensor {label!r} ({t.role}): its parts are listed as program {role}s")
                continue
            if len(found) != len(names) or [listed[i] for i in found] != names or \
                    found != list(range(found[0], found[0] + len(names))):
                raise ValueError(f"split tensor {label!r}: its parts must be program {role}s, once each, in a row, in order")


def check_program(program, limits: ServerLimits, kind: str) -> dict:
    """Validate a KernelProgram a client sends (or the server compiled) and hold it to ``limits``.

    ``kind`` is the program kind this server runs (``wgsl`` or ``graph``). Returns the work it
    asks for, ``{"invocations", "buffer_bytes"}``. Raises ValueError for a malformed program,
    :class:`Unsupported` for ops outside the vocabulary and :class:`LimitExceeded` past a limit.
    """
    from tapml.graph import Graph
    if program.kind != kind:
        raise ValueError(f"this server runs {kind!r} programs, not {program.kind!r}")
    for meta in (*program.input_meta, *program.output_meta):
        _meta_bytes(meta)
    if kind == "graph":
        if program.parts:
            raise ValueError("a graph program has no split tensors (parts)")
        if not isinstance(program.graph, dict):
            raise ValueError("a graph program needs its graph")
        graph = Graph.from_json(program.graph)
        check_ops(graph)
        check_real_sizes(graph, limits)
        nbytes = graph_bytes(graph)
        _check_bytes(nbytes, limits, "program")
        return {"invocations": 0, "buffer_bytes": nbytes}
    if program.graph is not None:
        raise ValueError("a wgsl program carries no graph")
    if len(program.buffers) > MAX_BUFFERS or len(program.kernels) > MAX_KERNELS:
        raise LimitExceeded(f"program has {len(program.buffers)} buffers and {len(program.kernels)} kernels; "
                            f"a device server takes at most {MAX_BUFFERS} and {MAX_KERNELS}")
    buffers = {}
    nbytes = 0
    for b in program.buffers:
        if b.name in buffers:
            raise ValueError(f"buffer name {b.name[:40]!r} is repeated")
        if (b.role == "const") != (b.data is not None) or (b.data is not None and len(b.data) != b.size):
            raise ValueError(f"buffer {b.name}: only const buffers carry data, exactly size bytes of it")
        if b.meta is not None:
            _meta_bytes(b.meta)
        buffers[b.name] = b
        nbytes += b.size
    for name in (*program.inputs, *program.outputs):
        if name not in buffers:
            raise ValueError(f"program input/output {name[:40]!r} names no buffer")
    _check_parts(program, buffers)
    # outputs are read back through a buffer of their size, and a poison buffer refills them
    nbytes += sum(buffers[n].size for n in set(program.outputs)) + max(
        (buffers[n].size for n in program.outputs), default=0)
    _check_bytes(nbytes, limits, "program")
    invocations = 0
    for k in program.kernels:
        if len(k.wgsl) > MAX_WGSL_CHARS:
            raise LimitExceeded(f"kernel {k.name[:40]}: WGSL of {len(k.wgsl)} characters; at most {MAX_WGSL_CHARS}")
        for name, _access, *window in k.bindings:
            if name not in buffers:
                raise ValueError(f"kernel {k.name[:40]}: binding {name[:40]!r} names no buffer")
            if window and not (window[0] % 16 == 0 and window[0] + window[1] <= buffers[name].size):
                raise ValueError(f"kernel {k.name[:40]}: window {window} of buffer {name[:40]!r} is not inside its "
                                 f"{buffers[name].size} bytes at an offset that is a multiple of 16")
        try:
            per_group = workgroup_size(k.wgsl, k.entry)
        except ValueError as e:
            raise ValueError(f"kernel {k.name[:40]}: {e}") from None
        invocations += math.prod(k.workgroups) * per_group
    if invocations > limits.max_invocations:
        raise LimitExceeded(f"program dispatches {invocations} shader invocations; this server allows "
                            f"{limits.max_invocations} per run (tapml serve --max-invocations)")
    return {"invocations": invocations, "buffer_bytes": nbytes}


__all__ = ["ServerLimits", "LimitExceeded", "parse_request", "MAX_SLOTS", "check_ops", "check_ops_json", "check_node", "check_graph",
           "check_program", "check_real_sizes",
           "workgroup_size", "DEFAULT_MAX_INVOCATIONS", "DEFAULT_MAX_BUFFER_BYTES", "DEFAULT_RUN_TIMEOUT_S"]
