"""CarveStore: a directory of carved test cases (``manifest.json`` + safetensors shards).

Written incrementally by :class:`CarveStoreWriter` (tensors are flushed to a new shard every
``shard_bytes``, so a store never sits whole in memory) and read lazily by :class:`CarveStore`,
which validates the manifest and every shard header on open. No pickle anywhere.

A tensor is stored once: one that is the same memory as a tensor already written (a parameter
that is also a case's input, a view such as ``permute`` or ``view`` of it) or, when small, the
same bytes, is an *alias* in the index, ``{"alias": NAME, "shape", "dtype"}``, with ``"view":
{"offset", "stride"}`` (in elements) when it is a strided view of NAME's elements. An alias
names a stored tensor, never another alias.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import weakref
from pathlib import Path

import torch

from tapml.carving.manifest import FORMAT_VERSION, GRAPH_KINDS, STORE_DTYPES, STORED_AS_PAIRS, Manifest, check_manifest
from tapml.errors import TapmlError
from tapml.graph import Graph, Node, TensorMeta
from tapml.io import open_regular, parse_json, read_regular_file, write_json_atomic
from tapml.schema import validate

MANIFEST = "manifest.json"
#: Bytes reserved for a shard's safetensors header; a shard closes early when its header would not fit.
HEADER_RESERVE = 64 << 10
#: Tensors of at most this many bytes are also stored once by content (a hash of their bytes).
CONTENT_DEDUP_BYTES = 1 << 20
#: Tensors of at least this many bytes are read memory-mapped (copy-on-write), smaller ones copied.
MMAP_MIN_BYTES = 1 << 20
#: Bounds on the shards of a store read from anyone, checked before any header is parsed: a
#: shard's header (tapml writes :data:`HEADER_RESERVE`), all headers together, and shards.
MAX_SHARD_HEADER_BYTES = 1 << 20
MAX_STORE_HEADER_BYTES = 512 << 20
MAX_SHARDS = 1 << 14  # each open shard is one mapping; Linux allows 65530 per process


class CarveStoreWriter:
    """Streams tensors into safetensors shards and writes the manifest at the end.

    Each tensor's bytes go to the open shard file the moment it is put (no copy is kept, so a
    later in-place change cannot reach the store and memory stays flat); the shard's header is
    written into space reserved at its start (padded with spaces, as the format allows) when
    the shard reaches ``shard_bytes`` or the writer closes.

    A tensor put while an earlier one that shares its memory is still alive and unmodified (same
    storage, same ``_version``) is written as an alias of it (a view when its shape, strides or
    offset differ); a tensor of at most :data:`CONTENT_DEDUP_BYTES` with the bytes, shape and
    dtype of one already written is an alias too. The earlier tensor is only weakly referenced:
    once it is freed its memory may be reused, and nothing aliases it any more.
    ``aliases`` and ``alias_bytes`` count what was not written.
    """

    def __init__(self, path: str | Path, shard_bytes: int = 64 << 20):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "shards").mkdir(exist_ok=True)
        self.shard_bytes = shard_bytes
        self.tensors: dict[str, dict] = {}
        self._pending: dict[str, dict] = {}
        self._pending_dtypes: dict[str, str] = {}  # the dtype of each pending tensor, as the index records it
        self._pending_bytes = 0
        self._header_bytes = 2
        self._file = None
        self._shard = 0
        self.bytes_written = 0
        self.peak_pending_bytes = 0
        self.aliases = 0
        self.alias_bytes = 0
        # (device, storage address) -> [(weakref to the tensor put, its _version, name, offset, numel)]
        self._live: dict[tuple, list[tuple]] = {}
        self._by_content: dict[tuple, str] = {}

    def put(self, name: str, tensor: torch.Tensor) -> str:
        """Write a tensor under ``name`` into the open shard, or an alias of one already
        written with the same memory or bytes; returns the name."""
        if name in self.tensors or name in self._pending:
            raise ValueError(f"tensor {name!r} written twice")
        meta = TensorMeta.of(tensor)
        code = STORE_DTYPES.get(meta.dtype)
        if code is None:
            raise ValueError(f"tensor {name!r}: a store cannot hold dtype {meta.dtype}")
        alias, digest = self._same_memory(tensor), None
        if alias is None:
            t = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()  # a conj view: its values
            nbytes = t.numel() * t.element_size()
            if 0 < nbytes <= CONTENT_DEDUP_BYTES:
                digest = (meta.dtype, meta.shape, hashlib.blake2b(
                    memoryview(t.reshape(-1).view(torch.uint8).numpy()), digest_size=32).digest())
                if digest in self._by_content:
                    alias = (self._by_content[digest], None)
        if alias is not None:
            target, view = alias
            self.tensors[name] = {"alias": target, "shape": list(meta.shape), "dtype": meta.dtype,
                                  **({"view": view} if view else {})}
            self.aliases += 1
            self.alias_bytes += meta.nbytes
            return name
        shape = list(meta.shape) + ([2] if meta.dtype in STORED_AS_PAIRS else [])  # safetensors' view of it
        entry = {"dtype": code, "shape": shape, "data_offsets": [self._pending_bytes, self._pending_bytes + nbytes]}
        self._pending_dtypes[name] = meta.dtype
        size = len(json.dumps({name: entry}, separators=(",", ":")))
        if self._file is not None and (self._header_bytes + size + 32 > HEADER_RESERVE):
            self.flush()
            entry["data_offsets"] = [0, nbytes]
            size = len(json.dumps({name: entry}, separators=(",", ":")))
        if size + 32 > HEADER_RESERVE:
            raise ValueError(f"tensor name {name[:40]!r}... is too long for a shard header")
        if self._file is None:
            self._file = open(self.path / f"shards/tensors-{self._shard:05d}.safetensors", "wb")
            self._file.seek(8 + HEADER_RESERVE)
        if nbytes:
            self._file.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._pending[name] = entry
        self._header_bytes += size
        self._pending_bytes += nbytes
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)
        if digest is not None:
            self._by_content[digest] = name
        if nbytes and tensor.is_contiguous():
            key = (str(tensor.device), tensor.untyped_storage().data_ptr())
            self._live.setdefault(key, []).append(
                (weakref.ref(tensor), tensor._version, name, tensor.storage_offset(), tensor.numel()))
        if self._pending_bytes >= self.shard_bytes:
            self.flush()
        return name

    def _same_memory(self, tensor: torch.Tensor) -> tuple[str, dict | None] | None:
        """``(name, view)`` of a written tensor, still alive and unmodified, whose elements
        ``tensor`` reads (``view`` None when it is that tensor exactly), else None."""
        if tensor.numel() == 0 or tensor.is_conj() or tensor.is_neg():  # a lazy conj: other values, same memory
            return None
        entries = self._live.get((str(tensor.device), tensor.untyped_storage().data_ptr()))
        for entry in list(entries or ()):
            ref, version, name, offset, numel = entry
            base = ref()
            if base is None or base._version != version:  # freed (its memory may be reused) or written
                entries.remove(entry)
                continue
            if base.dtype != tensor.dtype or tensor._version != version:
                continue
            start = tensor.storage_offset() - offset
            last = start + sum((d - 1) * s for d, s in zip(tensor.shape, tensor.stride()))
            if start < 0 or last >= numel or any(s < 0 for s in tensor.stride()):
                continue
            if start == 0 and tensor.shape == base.shape and tensor.is_contiguous():
                return name, None
            return name, {"offset": start, "stride": list(tensor.stride())}
        return None

    def flush(self) -> None:
        """Close the open shard: write its header into the reserved space."""
        if self._file is None:
            return
        shard = f"shards/tensors-{self._shard:05d}.safetensors"
        header = json.dumps(self._pending, separators=(",", ":")).encode()
        header += b" " * (HEADER_RESERVE - len(header))
        self._file.seek(0)
        self._file.write(struct.pack("<Q", HEADER_RESERVE) + header)
        self._file.close()
        self._file = None
        for name, entry in self._pending.items():
            dtype = self._pending_dtypes.pop(name)
            self.tensors[name] = {"shard": shard, "dtype": dtype,
                                  "shape": entry["shape"][:-1] if dtype in STORED_AS_PAIRS else entry["shape"]}
        self.bytes_written += self._pending_bytes
        self._shard += 1
        self._pending, self._pending_bytes, self._header_bytes = {}, 0, 2

    def close(self, manifest: dict) -> None:
        """Flush the last shard and write ``manifest.json`` (with the tensor index) atomically;
        what is written is first checked against :class:`~tapml.carving.manifest.Manifest`, the
        declaration the reader reads it with (a :class:`tapml.schema.SchemaError` naming the field)."""
        self.flush()
        document = {"format_version": FORMAT_VERSION, **manifest, "tensors": self.tensors}
        validate(Manifest, document)
        write_json_atomic(self.path / MANIFEST, document)


def _shard_header_bytes(path: Path, where: str) -> int:
    """The header length a shard declares, read from its first 8 bytes before anything parses
    it: a regular file (not a link, FIFO or device) whose header is at most
    :data:`MAX_SHARD_HEADER_BYTES` and lies inside the file."""
    fd, size = open_regular(path, f"shard {where}", "carve the model again", follow_links=False)
    try:
        head = os.read(fd, 8)
    finally:
        os.close(fd)
    if len(head) < 8:
        raise TapmlError(f"shard {where} is truncated (no header); carve the model again")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_SHARD_HEADER_BYTES or 8 + n > size:
        raise TapmlError(f"shard {where} declares a {n}-byte header in a {size}-byte file (tapml reads "
                         f"headers of at most {MAX_SHARD_HEADER_BYTES >> 10} KiB); the store is corrupt")
    return n


def _open_shard(path: Path, where: str):
    """The shard opened with ``safetensors.safe_open`` (which refuses a header that is not
    JSON of its schema, and data offsets that overlap, leave gaps or pass the end of the file)."""
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        reason = " ".join(str(e).split())[:200]
        raise TapmlError(f"shard {where} is not a valid safetensors file ({reason}): it is truncated or corrupt; "
                         "carve the model again") from None


def _meta(entry: dict) -> TensorMeta:
    """The shape and dtype of an entry of an open store's manifest (checked once, when it opened)."""
    return TensorMeta(tuple(entry["shape"]), entry["dtype"])


class CarveStore:
    """A carved store opened for reading. Raises TapmlError when it is missing or corrupt.

    Stores may come from anyone: opening one validates every field of the manifest against its
    declared schema (:class:`~tapml.carving.manifest.Manifest`) and what that cannot say (op
    names against the vocabulary of :mod:`tapml.ops`, arguments, refs, the tensor index's
    aliases), once, and every shard header, and refuses shards that lie outside the store
    (symlinks included). ``manifest``, ``cases`` and ``tensor_index`` are the JSON as read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not self.path.is_dir():
            raise TapmlError(f"store {str(path)!r} does not exist; create it with `tapml carve MODEL -o {path}`")
        if not os.path.lexists(manifest_path):
            raise TapmlError(f"{path} is not a carve store (no {MANIFEST}); create it with `tapml carve`")
        root = self.path.resolve()
        raw = read_regular_file(manifest_path, str(manifest_path), "carve the model again", follow_links=False)
        #: sha256 of the manifest's bytes: what a migration records to prove which store it used.
        self.manifest_sha256 = hashlib.sha256(raw).hexdigest()
        self.manifest = parse_json(raw, str(manifest_path), "carve the model again")
        if not isinstance(self.manifest, dict):
            raise TapmlError(f"{manifest_path} is not a JSON object; carve the model again")
        version = self.manifest.get("format_version", FORMAT_VERSION)
        if type(version) is not int or version != FORMAT_VERSION:  # another format may have another schema
            raise TapmlError(f"{path} has store format {str(version)[:40]!r}; this tapml reads format {FORMAT_VERSION}")
        try:
            graphs = check_manifest(self.manifest)
        except ValueError as e:
            raise TapmlError(f"{manifest_path} is malformed: {e}; carve the model again") from None
        #: The manifest's cases and tensor index as read (every field checked by :class:`Manifest`).
        self.cases, self.tensor_index = self.manifest["cases"], self.manifest["tensors"]
        self._check_sizes(graphs, manifest_path)
        self._step_graphs = graphs
        self.graph = Graph(inputs=graphs["prefill"].inputs, nodes=graphs["prefill"].nodes,
                           outputs=graphs["prefill"].outputs)
        self._by_id = {c["id"]: c for c in self.cases}
        self._shards, self._shards_path = {}, {}
        by_shard: dict[str, dict[str, dict]] = {}
        for name, info in self.tensor_index.items():
            if "shard" in info:
                by_shard.setdefault(info["shard"], {})[name] = info
        if len(by_shard) > MAX_SHARDS:
            raise TapmlError(f"{manifest_path} names {len(by_shard)} shards, more than the {MAX_SHARDS} tapml reads; "
                             "the store is corrupt")
        header_bytes, paths = 0, {}
        for shard in sorted(by_shard):  # every header bounded before any is parsed
            shown_shard = repr(shard[:80])
            try:
                shard_path = (self.path / shard).resolve()
            except (OSError, RuntimeError, ValueError):
                raise TapmlError(f"{manifest_path}: shard path {shown_shard} cannot be resolved") from None
            if root not in shard_path.parents:
                raise TapmlError(f"{manifest_path} points outside the store: shard {shown_shard} "
                                 f"resolves to {shard_path} (links included); refusing to read it")
            if not shard_path.exists():
                raise TapmlError(f"store {path} is missing shard {shown_shard}; carve the model again")
            header_bytes += _shard_header_bytes(shard_path, f"{shown_shard} of {path}")
            if header_bytes > MAX_STORE_HEADER_BYTES:
                raise TapmlError(f"the shard headers of {path} pass {MAX_STORE_HEADER_BYTES >> 20} MiB in all, more "
                                 "than tapml reads; the store is corrupt")
            paths[shard] = shard_path
        for shard, shard_path in paths.items():
            shown_shard = repr(shard[:80])
            shard_file = _open_shard(shard_path, f"{shown_shard} of {path}")
            names = by_shard[shard]
            if set(shard_file.keys()) != set(names):
                extra = sorted(set(shard_file.keys()) - set(names))
                what = f"holds tensor {extra[0][:60]!r}, which the index puts elsewhere" if extra else \
                    f"lacks tensor {sorted(set(names) - set(shard_file.keys()))[0][:60]!r}"
                raise TapmlError(f"shard {shown_shard} {what}; the store is corrupt")
            for name, info in names.items():
                entry = shard_file.get_slice(name)
                held = list(info["shape"]) + ([2] if info["dtype"] in STORED_AS_PAIRS else [])
                if list(entry.get_shape()) != held or entry.get_dtype() != STORE_DTYPES[info["dtype"]]:
                    raise TapmlError(f"tensor {name[:60]!r} has another shape or dtype in {shown_shard} than in the "
                                     "index; the store is corrupt")
            self._shards[shard], self._shards_path[shard] = shard_file, shard_path

    def _check_sizes(self, graphs: dict, manifest_path: Path) -> None:
        """Every graph and case computed on the meta device must give the outputs it declares, within
        the memory budget (:func:`tapml.meta_sizes.check_graph_sizes`); TapmlError naming the node or case."""
        from tapml.meta_sizes import check_graph_sizes, memory_budget
        try:
            memory_budget()
        except ValueError as e:
            raise TapmlError(str(e)) from None
        for what, graph in [*((f"{kind} graph", g) for kind, g in graphs.items()),
                            *((f"case {c['id'][:60]!r}", self.case_graph(c)) for c in self.cases)]:
            try:
                check_graph_sizes(graph)
            except ValueError as e:
                raise TapmlError(f"{manifest_path}: {what}: {e}; carve the model again") from None

    @property
    def model(self) -> str:
        return self.manifest["model"]

    @property
    def dtype(self) -> str:
        """The dtype the model was carved in (``--dtype``): ``float32`` (also for stores older
        than the ``dtype`` field), ``float16`` or ``bfloat16``."""
        return self.manifest.get("dtype", "float32")

    @property
    def quantize(self) -> str | None:
        """The ``--quantize`` scheme the model's linears were packed in, or None."""
        return self.manifest.get("quantize")

    @property
    def quantized_ops(self) -> str:
        """``whole`` (each quantized linear one op) or ``expand`` (carved as its float chain)."""
        return self.manifest.get("quantized_ops", "whole")

    def shard_files(self) -> dict[str, Path]:
        """Every shard the index names -> the file it was opened from (inside the store)."""
        return dict(self._shards_path)

    def case(self, case_id: str) -> dict:
        return self._by_id[case_id]

    def tensor(self, name: str) -> torch.Tensor:
        """Load one tensor by name. A large tensor is memory-mapped from its shard (copy-on-write:
        changing it never reaches the file), a small one read; an alias is its stored tensor, or
        a contiguous copy of the view of it that the index records."""
        info = self.tensor_index.get(name)
        if info is None:
            raise TapmlError(f"tensor {name!r} is not in store {self.path}")
        if "alias" not in info:
            return self._stored(name, info)
        base = self._stored(info["alias"], self.tensor_index[info["alias"]])
        view = info.get("view")
        if view is None:
            return base
        return torch.as_strided(base, info["shape"], view["stride"], base.storage_offset() + view["offset"]).contiguous()

    def _stored(self, name: str, info: dict) -> torch.Tensor:
        from safetensors import SafetensorError
        shard = info["shard"]
        try:
            if _meta(info).nbytes < MMAP_MIN_BYTES:
                return _as_stored(self._shards[shard].get_tensor(name).clone(), info)
            # A handle of its own: tensors of one handle share its copy-on-write mapping, so a
            # change to one read would show in the next read of the same tensor.
            return _as_stored(_open_shard(self._shards_path[shard], repr(shard[:80])).get_tensor(name), info)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise TapmlError(f"reading {name[:60]!r} from {shard[:80]} failed ({str(e)[:200]}); "
                             "the store is corrupt") from None

    def case_graph(self, case: dict) -> Graph:
        """The one-node graph of a case; its inputs are the case's stored input tensors."""
        node = Node(name=case["node"], op=case["op"], args=case["args"], kwargs=case["kwargs"],
                    outputs=[_meta(m) for m in case["output_meta"]], multi=case["multi"],
                    module=case["module"])
        inputs = [(name, _meta(self.tensor_index[name])) for name in case["inputs"]]
        return Graph(inputs=inputs, nodes=[node], outputs=node.output_refs)

    def case_inputs(self, case: dict) -> list[torch.Tensor]:
        return [self.tensor(n) for n in case["inputs"]]

    def case_outputs(self, case: dict) -> list[torch.Tensor]:
        return [self.tensor(n) for n in case["outputs"]]

    def program_inputs(self, kind: str = "prefill") -> dict[str, torch.Tensor]:
        """Every input of the model graph (parameters, buffers, constants, user inputs) by name.
        In a generation store ``kind="decode"`` gives the decode graph's: the cache as it was
        before the prefill, the inputs of step 1."""
        if kind == "prefill":
            entries = self.manifest["program_inputs"]
        else:
            self.step_graph(kind)
            entries = self.manifest["generation"]["decode"]["program_inputs"]
        return {name: self.tensor(info["tensor"]) for name, info in entries.items()}

    @property
    def is_generation(self) -> bool:
        """Whether the store holds a generation (:func:`tapml.carving.generation.carve_generation`)."""
        return "generation" in self.manifest

    def _generation(self) -> dict:
        if not self.is_generation:
            raise TapmlError(f"store {self.path} holds no generation; carve one with "
                             "`tapml carve MODEL --generate N`")
        return self.manifest["generation"]

    def step_graph(self, kind: str) -> Graph:
        """The ``"prefill"`` or ``"decode"`` graph of a generation, with its ``state`` (the cache
        buffers: input name -> output ref); run one step with :func:`tapml.graph.step`."""
        self._generation()
        if kind not in GRAPH_KINDS:
            raise TapmlError(f"a generation has graphs {', '.join(GRAPH_KINDS)}, not {str(kind)[:40]!r}")
        return self._step_graphs[kind]

    @property
    def steps(self) -> list[dict]:
        """The generation's steps: ``{"step", "kind", "inputs", "logits", "token"}`` each."""
        return self._generation()["steps"]

    def _step(self, step: int) -> dict:
        steps = self.steps
        if type(step) is not int or not 0 <= step < len(steps):
            raise TapmlError(f"the generation has steps 0 to {len(steps) - 1}, not {step!r}")
        return steps[step]

    def step_inputs(self, step: int) -> dict[str, torch.Tensor]:
        """The per-step inputs of step ``step`` (``input_ids``, ``cache_position``) by graph input
        name; parameters and the cache come from :meth:`program_inputs` and the previous step."""
        return {name: self.tensor(tensor) for name, tensor in self._step(step)["inputs"].items()}

    def step_logits(self, step: int) -> torch.Tensor:
        """The reference's logits of the last position at step ``step`` (``[vocab]``)."""
        return self.tensor(self._step(step)["logits"])

    @property
    def reference_tokens(self) -> list[int]:
        """The reference's greedy tokens: the ``tokens`` generated ids (step k's argmax, k < tokens)."""
        return list(self._generation()["reference_tokens"])

    def model_outputs(self) -> dict[str, torch.Tensor]:
        """The reference's outputs of the whole model, by graph output ref."""
        return {ref: self.tensor(name) for ref, name in self.manifest["model_outputs"].items()}


def _as_stored(t: torch.Tensor, info: dict) -> torch.Tensor:
    """A shard's tensor as the index says it is: complex32 from its float16 pairs."""
    return torch.view_as_complex(t) if info["dtype"] in STORED_AS_PAIRS else t


__all__ = ["CarveStore", "CarveStoreWriter"]
