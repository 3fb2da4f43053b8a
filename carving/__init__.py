"""Carving: record every operator's real inputs and outputs as test cases in a CarveStore.

A store appears whole or not at all: :func:`carve` writes into a temporary folder beside the
destination and renames it into place at the end, so a failure or a kill never leaves a half
store (``tapml carve``, ``tapml migrate MODEL`` and the session all carve through it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from tapml.carving.store import CarveStore, CarveStoreWriter
from tapml.errors import TapmlError

__all__ = ["carve", "open_or_carve", "check_store_dtype", "CarveStore", "CarveStoreWriter"]


def carve(spec: str, out: str | Path, *, seed: int = 0, device: str = "cpu", hf_config: dict | None = None,
          shard_bytes: int = 64 << 20, on_start: Callable[[int], None] | None = None,
          on_node: Callable[[str], None] | None = None, dtype: str = "float32", quantize: str | None = None,
          quantized_ops: str = "whole") -> dict:
    """Capture ``spec``, run it on the reference and write a CarveStore at ``out``.

    ``dtype`` (``float32``, ``float16``, ``bfloat16``): the model's floating parameters and
    inputs are cast to it and the reference runs in it; the manifest records it as ``dtype``.
    ``quantize``: the packed-weight scheme its linears and embeddings take
    (:mod:`tapml.frontends.quantize`), recorded as ``quantize``; ``quantized_ops="expand"`` carves
    each quantized op's float chain in its place (recorded as ``quantized_ops``).

    ``out`` may be missing, an empty folder or an older store (replaced). The store is written
    into a temporary folder beside ``out`` and renamed into place when complete; on any
    failure (Ctrl-C included) the temporary folder is removed and ``out`` is left as it was.

    Returns timing and size figures: ``load_s`` (building the model, a checkpoint's weights
    read), ``export_s`` (that and the export), ``carve_s``, ``bytes``, ``cases``, ``nodes``.
    Example: ``carve("zoo:mlp", "stores/mlp")``.
    """
    return write_store_atomically(out, lambda tmp: _carve_into(
        spec, tmp, seed=seed, device=device, hf_config=hf_config, shard_bytes=shard_bytes,
        on_start=on_start, on_node=on_node, dtype=dtype, quantize=quantize, quantized_ops=quantized_ops))


def write_store_atomically(out: str | Path, fill: Callable[[Path], dict]) -> dict:
    """Call ``fill(tmp)`` to write a store into a temporary folder beside ``out``, then rename
    it into place (replacing an empty folder or an older store); on any failure the temporary
    folder is removed and ``out`` is left as it was. Returns what ``fill`` returns."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.carving{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        info = fill(tmp)
        if out.exists():  # an empty folder or an older store: swap, then drop the old one
            old = out.with_name(f".{out.name}.old{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def open_or_carve(model_or_store: str, state_path: str | Path | None = None,
                  on_carve: Callable[[str, Path], None] | None = None,
                  hf_config: dict | None = None, dtype: str | None = None,
                  recorded: str | None = None, quantize: str | None = None,
                  quantized_ops: str = "whole") -> tuple[CarveStore, Path]:
    """A CarveStore for MODEL|STORE: an existing store directory is opened as it is; a model
    spec is carved (:func:`carve`) into ``STATE.store/`` beside the state file, reused when it
    already holds that model, or into a new temporary folder without a state file.
    ``on_carve(spec, path)`` is called before carving; ``hf_config`` overrides an ``hf:`` model's
    config and ``dtype`` is the ``--dtype`` to carve in (None: float32, or the dtype a ``.pt2``
    or factory model has) and ``quantize`` the ``--quantize`` scheme; a reused store must have been
    carved with the same. A STORE given with a ``dtype`` other than its own, or with ``quantize``, is
    refused. Returns ``(store, path)``.

    ``STATE.store/`` may have been put there by someone else, so it is reused only when this run
    can prove a run of its own made it: ``recorded`` is the manifest digest that the state's
    journal recorded (:func:`tapml.driving.journal.recorded_store`), and the folder must be this user's
    and hold that very manifest; otherwise TapmlError (exit 2) says to remove it."""
    path = Path(model_or_store)
    if dtype is not None:
        from tapml.dtypes import check_model_dtype
        try:
            check_model_dtype(dtype)
        except ValueError as e:
            raise TapmlError(str(e)) from None
    from tapml.frontends.checkpoint import is_checkpoint_folder
    if path.is_dir() and not is_checkpoint_folder(path):
        if hf_config:
            raise TapmlError(f"{model_or_store} is a store: --hf-config applies to an hf: MODEL spec to carve")
        if quantize is not None:
            raise TapmlError(f"{model_or_store} is a store: --quantize applies to a MODEL spec to carve (a store "
                             "keeps the weights it was carved with)")
        store = CarveStore(path)
        check_store_dtype(store, dtype)
        return store, path
    from tapml.frontends.models import is_model_file
    if path.exists() and not path.is_dir() and not is_model_file(model_or_store):
        raise TapmlError(f"{model_or_store} is a file, not a carve store or a model spec")
    if state_path is None:
        out = Path(tempfile.mkdtemp(prefix="tapml-session-")) / "store"
    else:
        state_path = Path(state_path)
        if not state_path.parent.is_dir():
            raise TapmlError(f"cannot write --state {state_path}: directory {state_path.parent} does not exist")
        out = state_path.with_name(state_path.stem + ".store")
    if os.path.lexists(out):
        _check_recorded(out, recorded, state_path)
        store = CarveStore(out)
        if store.manifest_sha256 != recorded:
            raise TapmlError(_not_proven(out, state_path, "its manifest is not the one the journal recorded"))
        # zoo: and hf: models are float32 unless asked; a .pt2 or factory model may come in its own dtype.
        wanted = dtype or ("float32" if model_or_store.startswith(("zoo:", "hf:")) else store.dtype)
        if store.model != model_or_store or store.manifest.get("hf_config", {}) != (hf_config or {}) \
                or store.dtype != wanted or store.quantize != quantize or store.quantized_ops != quantized_ops:
            raise TapmlError(f"{out} holds a store of {store.model} (--hf-config "
                             f"{store.manifest.get('hf_config') or 'none'}, --dtype {store.dtype}, --quantize "
                             f"{store.quantize or 'none'}), not {model_or_store} (--hf-config {hf_config or 'none'}, "
                             f"--dtype {wanted}, --quantize {quantize or 'none'}); remove it or use another --state")
        return store, out
    if on_carve:
        on_carve(model_or_store, out)
    carve(model_or_store, out, hf_config=hf_config, dtype=dtype or "float32", quantize=quantize,
          quantized_ops=quantized_ops)
    return CarveStore(out), out


def _not_proven(out: Path, state_path, why: str) -> str:
    return (f"{out} exists, but this migration cannot prove it carved it ({why}); tapml reuses only a store its "
            f"own run recorded in --state {state_path}'s journal: remove {out}, pass it as MODEL if you trust it, "
            "or use another --state")


def _check_recorded(out: Path, recorded: str | None, state_path) -> None:
    """TapmlError unless ``out`` is a folder of this user (not a link) and a journal recorded a store."""
    import stat
    st = os.lstat(out)
    if not stat.S_ISDIR(st.st_mode):
        raise TapmlError(_not_proven(out, state_path, "it is not a folder"))
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise TapmlError(_not_proven(out, state_path, "it belongs to another user"))
    if recorded is None:
        raise TapmlError(_not_proven(out, state_path, "no journal beside the state records a store"))


def check_store_dtype(store: CarveStore, dtype: str | None) -> None:
    """TapmlError (exit 2) when ``--dtype`` was given with a STORE carved in another dtype."""
    if dtype is not None and dtype != store.dtype:
        raise TapmlError(f"{store.path} was carved in {store.dtype}, not {dtype}: a store keeps its dtype; leave "
                         f"--dtype out, or carve the model again with --dtype {dtype}")


def _model_inputs(graph) -> list:
    """The graph's inputs less the packed weights and scales of quantized ops (q4f16_1's float16
    scales are the format's, not the model's dtype)."""
    from tapml.quant import packed_positions
    packed = {n.args[i]["ref"] for n in graph.nodes for i in packed_positions(n.op)
              if i < len(n.args) and isinstance(n.args[i], dict) and "ref" in n.args[i]}
    used_elsewhere = {r for n in graph.nodes if not packed_positions(n.op) for r in n.input_refs}
    return [(ref, meta) for ref, meta in graph.inputs if ref not in packed or ref in used_elsewhere]


def _carve_into(spec: str, out: Path, *, seed: int, device: str, hf_config: dict | None, shard_bytes: int,
                on_start: Callable[[int], None] | None, on_node: Callable[[str], None] | None,
                dtype: str = "float32", quantize: str | None = None, quantized_ops: str = "whole") -> dict:
    import torch
    from torch.export.graph_signature import OutputKind

    from tapml.frontends.capture import export, placeholder_values, program_inputs
    from tapml.carving.tracer import CarvingInterpreter, RealValueRecorder
    from tapml.dtypes import graph_dtype
    from tapml.graph import Graph, graph_from_fx, needs_real_values
    from tapml.meta_sizes import check_graph_sizes
    from tapml.frontends.models import load_model

    if device not in ("cpu", "cuda"):
        raise TapmlError(f"--device must be cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise TapmlError("--device cuda: no CUDA device on this machine; use --device cpu")
    t0 = time.perf_counter()
    model, example = load_model(spec, seed=seed, hf_config=hf_config, dtype=dtype, quantize=quantize,
                                quantized_ops=quantized_ops)
    loaded = time.perf_counter()
    ep = export(model, example)
    if device == "cuda":
        from torch.export.passes import move_to_device_pass
        ep = move_to_device_pass(ep, "cuda")
    inputs = program_inputs(ep, example)
    run_args = placeholder_values(ep, example, device)
    try:
        # Data-dependent shapes and scalars (x[mask], nonzero, x.item()) take the reference run's values.
        real_values = RealValueRecorder(ep.graph_module).record(*run_args) if needs_real_values(ep.graph) else None
        graph = graph_from_fx(ep.graph, real_values=real_values)
    except ValueError as e:
        raise TapmlError(f"the exported graph cannot be represented: {e}") from None
    try:  # what each node really allocates, before the first op runs
        check_graph_sizes(graph)
    except ValueError as e:
        raise TapmlError(f"{spec}: {e}") from None
    t1 = time.perf_counter()

    writer = CarveStoreWriter(out, shard_bytes=shard_bytes)
    stored_inputs = {name: {"kind": kind, "tensor": writer.put(f"in.{name}", t)} for name, kind, t in inputs}
    if on_start:
        on_start(len(graph.nodes))
    interp = CarvingInterpreter(ep.graph_module, graph, writer, on_node=on_node)
    with torch.no_grad():
        result = interp.run(*run_args, enable_io_processing=False)
    leaves = [x for spec, x in zip(ep.graph_signature.output_specs, result)
              if spec.kind != OutputKind.TOKEN and isinstance(x, torch.Tensor)]
    model_outputs = {ref: writer.put(f"out.{i}", t) for i, (ref, t) in enumerate(zip(graph.outputs, leaves))}
    graph_json = graph.to_json()
    writer.close({
        "model": spec, "hf_config": hf_config or {}, "torch_version": torch.__version__,
        "reference_device": device, "seed": seed,
        # float32 asked of a model that is low-precision itself (a .pt2, a factory): its own dtype
        "dtype": dtype if dtype != "float32" else graph_dtype(Graph(inputs=_model_inputs(graph), nodes=[], outputs=[])),
        **({"quantize": quantize} if quantize else {}),
        **({"quantized_ops": quantized_ops} if quantize and quantized_ops != "whole" else {}),
        "graph_inputs": graph_json["inputs"], "nodes": graph_json["nodes"], "graph_outputs": graph_json["outputs"],
        "program_inputs": stored_inputs, "model_outputs": model_outputs, "cases": interp.cases,
    })
    t2 = time.perf_counter()
    return {"load_s": loaded - t0, "export_s": t1 - t0, "carve_s": t2 - t1, "bytes": writer.bytes_written,
            "cases": len(interp.cases), "nodes": len(graph.nodes), "ops": len({c["op"] for c in interp.cases}),
            "shards": writer._shard, "peak_pending_bytes": writer.peak_pending_bytes}
