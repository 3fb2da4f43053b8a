"""The closed op vocabulary: the one place that decides which op names tapml will resolve.

Op names come from files other people send (stores, programs, server requests), so a name is
never followed as an attribute chain. A name is accepted only when

- it reads ``aten.NAME.OVERLOAD`` (lower-case name, no dunder, nothing else), or names one of
  tapml's own packed-weight ops, ``tapml.NAME.default`` (:mod:`tapml.quant`: their kernels check
  the packed sizes and the indices themselves);
- it resolves to a real ``torch._ops.OpOverload`` of the ``aten`` namespace;
- the op is functional: no argument it writes to (in-place ops, ``out=`` variants, ``set_``);
- it returns tensors and only tensors (what a graph node is);
- it does not reach outside tensors: no files (``from_file``, ``save``), printing, RNG or
  grad state, storages, futures or RPC references;
- its kernel's data-dependent arguments can be checked (:mod:`tapml.op_bounds`): no sparse,
  quantized, packed-weight, backend-specific or packed-sequence ops;
- a leading-underscore internal is core ATen (``torch.Tag.core``) or in
  :data:`EXPORTED_INTERNALS` (every op with a WGSL lowering passes; tests/test_layers.py
  checks it, so that this foundation module needs nothing from the platforms above it).

Example::

    from tapml.ops import check_op, resolve_op
    resolve_op("aten.add.Tensor")           # torch.ops.aten.add.Tensor
    check_op("aten.from_file.default")      # ValueError: ... reaches outside tensors ...
"""

from __future__ import annotations

import functools
import re

_NAME = re.compile(r"aten\.([a-z][a-z0-9_]*|_[a-z][a-z0-9_]*)\.([A-Za-z][A-Za-z0-9_]*)")
_MAX_NAME = 160

#: Leading-underscore internals that exported graphs hold although torch may not tag them core:
#: found by carving the zoo and hf: models, or emitted by torch's decompositions (sdpa,
#: upsampling, training-mode batch norm, weight norm). Core ones need no entry.
EXPORTED_INTERNALS = frozenset({
    "_softmax", "_log_softmax", "_to_copy", "_unsafe_view", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional", "_safe_softmax", "_unsafe_index", "_weight_norm_interface",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_adaptive_avg_pool2d", "_upsample_bilinear2d_aa", "_upsample_nearest_exact2d",
    "_upsample_bicubic2d_aa", "_upsample_nearest_exact1d", "_upsample_nearest_exact3d", "_pad_circular",
    "_fft_r2c", "_fft_c2r", "_fft_c2c", "_unique2", "_embedding_bag_forward_only",
    # found by a conformance run of torch's OpInfo samples through torch.export (nn.Bilinear,
    # torch.linalg, complex conjugates, histogramdd, batch norm with its running-stat update)
    "_trilinear", "_linalg_svd", "_linalg_slogdet", "_linalg_det", "_linalg_eigh", "_linalg_solve_ex",
    "_conj", "_conj_physical", "_histogramdd_bin_edges", "_histogramdd_from_bin_cts",
    "_batch_norm_with_update_functional",
})

#: Ops that reach the world outside their tensors (files, stdout, RNG or grad state, storages,
#: RPC). Matched against the op name; the schema checks below catch what a name does not say.
_WORLD = re.compile(r"file|save|load|mmap|shared|share_memory|print|warn|seed|storage|rref|owner|to_here"
                    r"|wait|socket|environ|librar|grad_enabled|autocast|record_stream|profil|pin_memory")
_WORLD_TYPES = re.compile(r"Storage|Future|RRef|Await|Capsule|Object|\bAny\b")
#: Ops whose kernels trust indices or pointers in their data that tapml.op_bounds cannot check:
#: sparse layouts (index arrays taken unchecked), quantized and packed-weight ops (a tensor read as a
#: packed structure), backend-specific kernels (mkldnn, cudnn, miopen, mps), nested tensors; and the
#: packed-sequence overloads of the RNN ops (``batch_sizes``).
_UNCHECKED = re.compile(r"sparse|csr|csc|bsr|bsc|coo|quantiz|fbgemm|mkldnn|miopen|cudnn|(^|_)mps(_|$)|nested"
                        r"|batch_norm_gather_stats")
_UNCHECKED_OVERLOADS = frozenset({"data", "data_legacy", "input_legacy"})


def check_op(name) -> None:
    """Raise ValueError (naming the op and why) unless ``name`` is in the vocabulary.

    Example: ``check_op("aten.add_.Tensor")`` raises ``ValueError: op 'aten.add_.Tensor' is
    refused: it writes to its argument 'self' (in-place or out= variant) ...``.
    """
    resolve_op(name)


def resolve_op(name):
    """``"aten.add.Tensor"`` -> ``torch.ops.aten.add.Tensor``; ValueError (naming the op and
    why) for a name outside the vocabulary. See the module docstring for the rules."""
    if not isinstance(name, str):
        raise ValueError(f"op name must be a string, not {type(name).__name__}")
    return _resolve(name)


def _refuse(name: str, why: str) -> ValueError:
    shown = name if len(name) <= 100 else name[:100] + "..."
    return ValueError(f"op {shown!r} is refused: {why}")


_TAPML_NAME = re.compile(r"tapml\.([a-z][a-z0-9_]*)\.default")


@functools.lru_cache(maxsize=4096)
def _resolve(name: str):
    import torch
    if (q := _TAPML_NAME.fullmatch(name) if len(name) <= _MAX_NAME else None) is not None:
        from tapml import quant
        if q.group(1) not in quant.OPS:
            raise _refuse(name, f"tapml has no op {q.group(1)!r} (its own ops: {', '.join(sorted(quant.OPS))})")
        return quant.op(q.group(1))
    m = _NAME.fullmatch(name) if len(name) <= _MAX_NAME else None
    if m is None:
        raise _refuse(name, "tapml accepts only functional core ATen ops named aten.NAME.OVERLOAD "
                            "(other namespaces and attribute chains are not ops)")
    op_name, overload = m.groups()
    try:
        packet = getattr(torch.ops.aten, op_name)
    except (AttributeError, RuntimeError):
        packet = None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise _refuse(name, f"torch {torch.__version__} has no aten op {op_name!r}")
    if overload not in packet.overloads():
        raise _refuse(name, f"aten.{op_name} has no overload {overload!r} "
                            f"(it has {', '.join(sorted(packet.overloads())[:12])})")
    op = getattr(packet, overload)
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        raise _refuse(name, "it is not an aten operator overload")
    schema = op._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if written or schema.is_mutable:
        raise _refuse(name, f"it writes to its argument {', '.join(map(repr, written)) or 'state'} "
                            "(in-place or out= variant); only functional ops are accepted")
    if _WORLD.search(op_name) or any(_WORLD_TYPES.search(str(a.type)) for a in schema.arguments):
        raise _refuse(name, "it reaches outside tensors (files, printing, RNG or grad state, storages, RPC)")
    if _UNCHECKED.search(op_name) or (overload in _UNCHECKED_OVERLOADS and "batch_sizes" in
                                        {a.name for a in schema.arguments}) or op_name.startswith("quantized_"):
        raise _refuse(name, "its kernel trusts indices or packed data that tapml cannot check (sparse, quantized, "
                            "packed-weight, backend-specific or packed-sequence op; see tapml/op_bounds.py)")
    if not schema.returns or not all(_is_tensor_type(r.type) for r in schema.returns):
        raise _refuse(name, "it does not return tensors, so it is no graph node")
    if op_name.startswith("_") and not (torch.Tag.core in op.tags or op_name in EXPORTED_INTERNALS):
        raise _refuse(name, "it is a torch internal (leading underscore) that is neither core ATen nor "
                            "one that exported graphs hold")
    return op


def _is_tensor_type(t) -> bool:
    import torch
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.ListType):
        t = t.getElementType()
        if isinstance(t, torch.OptionalType):
            t = t.getElementType()
    return isinstance(t, torch.TensorType)


__all__ = ["EXPORTED_INTERNALS", "check_op", "resolve_op"]
