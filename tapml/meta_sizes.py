"""What a graph's ops really allocate, computed on the meta device before anything runs.

A graph from a store, a ``.pt2`` or a client declares each node's output shape and dtype, but a
node's arguments decide what torch allocates: ``aten.full([2**29], ...)`` declared as a 4-byte
tensor would still take 2 GiB. :func:`check_graph_sizes` runs every node on the meta device
(shapes and dtypes only, no data) from the graph's input metadata, holds the result to the node's
declared outputs, and holds every output to a byte budget; arguments that do not fit the op's
schema are refused the same way, naming the node. Ops whose output size depends on the data
(``nonzero``, ``unique``, ``masked_select``, ``bincount``) have no meta result: their declared
output stands, held to the budget, and :mod:`tapml.op_bounds` bounds the real one when they run.

:func:`guard_call` is the same check for one call with real arguments, made right before the
carving tracer runs it (a ``.pt2`` whose sizes depend on the data runs before its graph is known).
:func:`tapml.graph.run_node` checks only the bounds of :mod:`tapml.op_bounds` (cheaper than a meta
call per node): the graphs it runs were checked here when they were read (a store when it is opened,
a server's graph when it is compiled or loaded). The meta calls leave ``torch._dynamo`` unimported
(:func:`_dynamo_left_unimported`): importing it would cost every command that opens a store a second.

The budget (:func:`memory_budget`) is ``$TAPML_MEMORY_BUDGET_MIB`` MiB, or half of this machine's
physical memory; a device server holds graphs to its ``--max-buffer-mib`` on top.

Example::

    check_graph_sizes(store.graph)   # ValueError: node 'full': aten.full.default computes float32[536870912] ...
"""

from __future__ import annotations

import contextlib
from typing import Any

from tapml.op_bounds import BUDGET_ENV, OutOfBounds, check_call, memory_budget
#: torch's meta kernels and its CPU kernels disagree on a few small auxiliary outputs (the saved
#: statistics of ``_native_batch_norm_legit_no_training`` are [C] on meta, [0] on the CPU): an
#: output computed on meta that differs from its declared metadata is refused only when it is
#: larger than the declared one and than this many bytes.
SMALL_OUTPUT_BYTES = 64 << 10


class OverBudget(OutOfBounds):
    """A node's output is larger than the memory budget, or larger than the node declares."""


def _to_meta(value: Any) -> Any:
    import torch
    if isinstance(value, torch.Tensor):
        return value if value.device.type == "meta" else value.to("meta")
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def meta_results(op_name: str, args, kwargs) -> list | None:
    """What ``op_name`` returns for ``args``/``kwargs`` (tensors on any device) computed on the meta
    device: its tensors (a list, in return order), or None when the op has no meta kernel (its output
    size depends on the data, or its meta kernel fails on its own). RuntimeError when torch refuses the
    arguments (they do not fit the op's schema, or the op's own checks)."""
    import torch
    from tapml.ops import resolve_op
    op = resolve_op(op_name)
    args, kwargs = list(_to_meta(list(args))), _to_meta(dict(kwargs))
    names = [a.name for a in op._schema.arguments]
    if "device" in names:  # factory ops allocate where they are told: tell them meta
        i = names.index("device")
        if i < len(args):
            args[i] = torch.device("meta")
        else:
            kwargs["device"] = torch.device("meta")
    try:
        out = op(*args, **kwargs)
    except NotImplementedError:
        return None
    except RuntimeError as e:
        # an op whose result needs the values (repeat_interleave, narrow with a tensor start) says "meta";
        # any other RuntimeError is torch refusing the arguments: the schema, or the op's own checks
        if "meta" in str(e).lower():
            return None
        raise
    except Exception:  # noqa: BLE001 - a meta kernel's own failure (training batch norm: TypeError, ZeroDivisionError)
        return None
    return list(out) if isinstance(out, (list, tuple)) else [out]


#: False once a meta kernel asked the stand-in of :func:`_dynamo_left_unimported` for more than
#: ``disable``: from then on this process imports the real ``torch._dynamo``.
_dynamo_stand_in_fits = True


@contextlib.contextmanager
def _dynamo_left_unimported():
    """Meta calls inside run without importing ``torch._dynamo`` (over a second of CPU, which every
    command that opens a store would pay for nothing). Yields a list that is empty unless a kernel
    asked the stand-in for more than ``disable``: then what ran inside must run again.

    torch's Python meta kernels are wrapped by ``torch._compile._disable_dynamo``, which imports
    ``torch._dynamo`` on a wrapped kernel's first call only to ask ``torch._dynamo.disable`` for a
    wrapper that keeps Dynamo from tracing into it; outside a compilation that wrapper changes
    nothing. So while ``torch._dynamo`` is not imported yet, a stand-in module whose ``disable``
    returns the kernel itself takes its place; afterwards the stand-in and the kernels' cached
    wrappers are removed, and a later real import (``torch.export``) wraps them as torch would.
    Only the main thread uses the stand-in."""
    global _dynamo_stand_in_fits
    import sys
    import threading
    import types
    asked = []
    if not _dynamo_stand_in_fits or "torch._dynamo" in sys.modules \
            or threading.current_thread() is not threading.main_thread():
        yield asked
        return
    import torch
    wrapped = []

    def disable(fn=None, recursive=True, wrapping=True):
        if fn is None:  # decorator form
            return lambda f: disable(f, recursive, wrapping)
        wrapped.append(fn)
        return fn

    class StandIn(types.ModuleType):
        def __getattr__(self, name):
            asked.append(name)
            raise AttributeError(f"torch._dynamo stand-in has no {name!r}")

    stand_in = StandIn("torch._dynamo")
    stand_in.disable = disable
    sys.modules["torch._dynamo"] = stand_in
    try:
        yield asked
    finally:
        if sys.modules.get("torch._dynamo") is stand_in:
            del sys.modules["torch._dynamo"]
        if torch.__dict__.get("_dynamo") is stand_in:
            del torch._dynamo
        for fn in wrapped:
            getattr(fn, "__dict__", {}).pop("__dynamo_disable", None)
        if asked:
            _dynamo_stand_in_fits = False


def _nbytes(shape, dtype) -> int:
    import math
    return math.prod(shape) * dtype.itemsize


def _check_budget(what: str, shape, dtype, budget: int) -> None:
    nbytes = _nbytes(shape, dtype)
    if nbytes > budget:
        raise OverBudget(f"{what} is {str(dtype).removeprefix('torch.')}{list(shape)}, {nbytes} bytes: over the "
                         f"memory budget of {budget} bytes (set {BUDGET_ENV} to allow more)")


def guard_call(op_name: str, args, kwargs, budget: int | None = None) -> None:
    """Before the reference runs one call: its data-dependent arguments within bounds
    (:func:`tapml.op_bounds.check_call`) and each tensor it will return within ``budget`` bytes
    (default :func:`memory_budget`), computed on the meta device. Raises :class:`OutOfBounds`."""
    check_call(op_name, args, kwargs)
    budget = memory_budget() if budget is None else budget
    try:
        results = meta_results(op_name, args, kwargs)
    except Exception:  # noqa: BLE001 - the op refuses its arguments itself when it runs: an error verdict
        return
    for i, t in enumerate(results or ()):
        if t is not None and hasattr(t, "shape"):
            _check_budget(f"{op_name}: output {i}", t.shape, t.dtype, budget)


def check_graph_sizes(graph, budget: int | None = None) -> int:
    """Run ``graph`` (a :class:`tapml.graph.Graph`) on the meta device from its input metadata and
    hold every node to its declared outputs (shape and dtype; see :data:`SMALL_OUTPUT_BYTES`) and every tensor to ``budget`` bytes
    (default :func:`memory_budget`). Returns the bytes of all tensors the graph computes. Raises
    ValueError naming the node: arguments that do not fit the op's schema, an output other than
    declared, or one over the budget."""
    with _dynamo_left_unimported() as asked:
        try:
            total = _check_graph_sizes(graph, memory_budget() if budget is None else budget)
        except ValueError:
            if not asked:
                raise
    if asked:  # a meta kernel needed the real torch._dynamo: check again with it
        return check_graph_sizes(graph, budget)
    return total


def _check_graph_sizes(graph, budget: int) -> int:
    import torch

    from tapml.graph import TensorMeta, decode_arg, node_results, torch_dtype
    env = {}
    for name, meta in graph.inputs:
        _check_budget(f"graph input {name[:60]!r}", meta.shape, torch_dtype(meta.dtype), budget)
        env[name] = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device="meta")
    total = 0
    for node in graph.nodes:
        where = f"node {node.name[:60]!r} ({node.op})"
        try:
            args = decode_arg(node.args, env.__getitem__)
            kwargs = {k: decode_arg(v, env.__getitem__) for k, v in node.kwargs.items()}
            results = meta_results(node.op, args, kwargs)
            if results is not None:
                results = node_results(node, results if node.multi else results[0])
                computed = [TensorMeta.of(t) for t in results]
        except Exception as e:  # noqa: BLE001 - any refusal of the arguments names the node
            raise ValueError(f"{where}: its arguments do not fit the op ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:300] if str(e) else ''})") from None
        for i, meta in enumerate(node.outputs):
            _check_budget(f"{where}: output {i}", meta.shape, torch_dtype(meta.dtype), budget)
        if results is not None:
            for i, got in enumerate(computed):
                _check_budget(f"{where}: output {i}", got.shape, torch_dtype(got.dtype), budget)
            if len(computed) != len(node.outputs) or any(
                    got != meta and got.nbytes > max(meta.nbytes, SMALL_OUTPUT_BYTES)
                    for got, meta in zip(computed, node.outputs)):
                raise OverBudget(f"{where}: declares outputs {_metas(node.outputs)}, but its arguments make "
                                 f"{_metas(computed)}")
        for ref, meta in zip(node.output_refs, node.outputs):
            env[ref] = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device="meta")
            total += _nbytes(meta.shape, torch_dtype(meta.dtype))
    return total


def _metas(metas) -> str:
    return ", ".join(f"{m.dtype}{list(m.shape)}" for m in metas)[:300]


__all__ = ["BUDGET_ENV", "OverBudget", "check_graph_sizes", "guard_call", "memory_budget", "meta_results"]
