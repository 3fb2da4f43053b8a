"""CarveStore: a directory of carved test cases (``manifest.json`` + safetensors shards).

Written incrementally by :class:`CarveStoreWriter` (tensors are flushed to a new shard every
``shard_bytes``, so a store never sits whole in memory) and read lazily by :class:`CarveStore`,
which validates the manifest and every shard header on open. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from tapml.errors import TapmlError
from tapml.graph import Graph, Node, TensorMeta, torch_dtype

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_REQUIRED = ("format_version", "model", "torch_version", "reference_device", "seed", "nodes", "cases",
             "graph_inputs", "graph_outputs", "tensors")


def write_json_atomic(path: Path, data) -> None:
    """Write JSON to a temp file, fsync, rename: readers see the old or the new file, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


#: safetensors dtype codes of the torch dtypes a store holds.
_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "complex64": "C64"}
#: Bytes reserved for a shard's safetensors header; a shard closes early when its header would not fit.
HEADER_RESERVE = 64 << 10


class CarveStoreWriter:
    """Streams tensors into safetensors shards and writes the manifest at the end.

    Each tensor's bytes go to the open shard file the moment it is put (no copy is kept, so a
    later in-place change cannot reach the store and memory stays flat); the shard's header is
    written into space reserved at its start (padded with spaces, as the format allows) when
    the shard reaches ``shard_bytes`` or the writer closes.
    """

    def __init__(self, path: str | Path, shard_bytes: int = 64 << 20):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "shards").mkdir(exist_ok=True)
        self.shard_bytes = shard_bytes
        self.tensors: dict[str, dict] = {}
        self._pending: dict[str, dict] = {}
        self._pending_bytes = 0
        self._header_bytes = 2
        self._file = None
        self._shard = 0
        self.bytes_written = 0
        self.peak_pending_bytes = 0

    def put(self, name: str, tensor: torch.Tensor) -> str:
        """Write a tensor under ``name`` into the open shard; returns the name."""
        if name in self.tensors or name in self._pending:
            raise ValueError(f"tensor {name!r} written twice")
        t = tensor.detach().to("cpu").contiguous()
        meta = TensorMeta.of(t)
        code = _ST_DTYPES.get(meta.dtype)
        if code is None:
            raise ValueError(f"tensor {name!r}: a store cannot hold dtype {meta.dtype}")
        nbytes = t.numel() * t.element_size()
        entry = {"dtype": code, "shape": list(meta.shape), "data_offsets": [self._pending_bytes, self._pending_bytes + nbytes]}
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
        if self._pending_bytes >= self.shard_bytes:
            self.flush()
        return name

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
            self.tensors[name] = {"shard": shard, "shape": entry["shape"],
                                  "dtype": next(k for k, v in _ST_DTYPES.items() if v == entry["dtype"])}
        self.bytes_written += self._pending_bytes
        self._shard += 1
        self._pending, self._pending_bytes, self._header_bytes = {}, 0, 2

    def close(self, manifest: dict) -> None:
        """Flush the last shard and write ``manifest.json`` (with the tensor index) atomically."""
        self.flush()
        write_json_atomic(self.path / MANIFEST, {"format_version": FORMAT_VERSION, **manifest,
                                                 "tensors": self.tensors})


def _check_shard(path: Path) -> dict:
    """Parse a safetensors header and check the file holds every byte it declares."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TapmlError(f"shard {path} is truncated (no header); carve the model again")
        (n,) = struct.unpack("<Q", head)
        if n > min(size, 100 << 20):
            raise TapmlError(f"shard {path} declares a {n}-byte header in a {size}-byte file; it is corrupt")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise TapmlError(f"shard {path} has an unreadable header; it is corrupt") from None
    if not isinstance(header, dict):
        raise TapmlError(f"shard {path} has an unreadable header; it is corrupt")
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise TapmlError(f"shard {path}: entry {key!r} has no valid data_offsets; it is corrupt") from None
    if 8 + n + end != size:
        raise TapmlError(f"shard {path} is {size} bytes but its header needs {8 + n + end}; "
                         "it is truncated or corrupt — carve the model again")
    return header


_CASE_FIELDS = {"id": str, "op": str, "node": str, "module": str, "args": list, "kwargs": dict, "multi": bool,
                "output_meta": list, "inputs": list, "outputs": list, "instances": int}


def _check_case(case) -> None:
    if not isinstance(case, dict):
        raise TypeError("a case is not an object")
    for key, kind in _CASE_FIELDS.items():
        if not isinstance(case.get(key), kind):
            raise TypeError(f"case {case.get('id', '?')!r}: field {key!r} is missing or not a {kind.__name__}")
    for m in case["output_meta"]:
        TensorMeta.from_json(m)


class CarveStore:
    """A carved store opened for reading. Raises TapmlError when it is missing or corrupt."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not self.path.is_dir():
            raise TapmlError(f"store {str(path)!r} does not exist; create it with `tapml carve MODEL -o {path}`")
        if not manifest_path.is_file():
            raise TapmlError(f"{path} is not a carve store (no {MANIFEST}); create it with `tapml carve`")
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TapmlError(f"{manifest_path} is not valid JSON ({e}); carve the model again") from None
        if not isinstance(self.manifest, dict):
            raise TapmlError(f"{manifest_path} is not a JSON object; carve the model again")
        missing = [k for k in _REQUIRED if k not in self.manifest]
        if missing:
            raise TapmlError(f"{manifest_path} lacks {', '.join(missing)}; carve the model again")
        if self.manifest["format_version"] != FORMAT_VERSION:
            raise TapmlError(f"{path} has store format {self.manifest['format_version']!r}; "
                             f"this tapml reads format {FORMAT_VERSION}")
        try:
            self.graph = Graph.from_json({"inputs": self.manifest["graph_inputs"], "nodes": self.manifest["nodes"],
                                          "outputs": self.manifest["graph_outputs"]})
            self.cases: list[dict] = list(self.manifest["cases"])
            self._by_id = {c["id"]: c for c in self.cases}
            self.tensor_index: dict[str, dict] = dict(self.manifest["tensors"])
            for name, info in self.tensor_index.items():
                if not (isinstance(info, dict) and isinstance(info.get("shard"), str)):
                    raise TypeError(f"tensor {name!r} has no shard")
                meta = TensorMeta.from_json(info)
                torch_dtype(meta.dtype)
            for c in self.cases:
                _check_case(c)
                for name in c["inputs"] + c["outputs"]:
                    if name not in self.tensor_index:
                        raise KeyError(f"case {c['id']} refers to tensor {name!r}, which is not in the index")
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise TapmlError(f"{manifest_path} is malformed ({type(e).__name__}: {e}); carve the model again") from None
        self._headers = {}
        for shard in sorted({info["shard"] for info in self.tensor_index.values()}):
            shard_path = (self.path / shard).resolve()
            if self.path.resolve() not in shard_path.parents:
                raise TapmlError(f"{manifest_path} points outside the store ({shard})")
            if not shard_path.is_file():
                raise TapmlError(f"store {path} is missing shard {shard}; carve the model again")
            self._headers[shard] = _check_shard(shard_path)
        for name, info in self.tensor_index.items():
            entry = self._headers[info["shard"]].get(name)
            if entry is None or list(entry.get("shape", [])) != list(info["shape"]):
                raise TapmlError(f"tensor {name!r} is missing from {info['shard']} or has another shape; "
                                 "the store is corrupt")
        self._open: dict[str, object] = {}

    @property
    def model(self) -> str:
        return self.manifest["model"]

    def case(self, case_id: str) -> dict:
        return self._by_id[case_id]

    def tensor(self, name: str) -> torch.Tensor:
        """Load one tensor by name (shards are memory-mapped lazily)."""
        from safetensors import SafetensorError, safe_open
        info = self.tensor_index.get(name)
        if info is None:
            raise TapmlError(f"tensor {name!r} is not in store {self.path}")
        shard = info["shard"]
        try:
            if shard not in self._open:
                self._open[shard] = safe_open(str(self.path / shard), framework="pt")
            return self._open[shard].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise TapmlError(f"reading {name!r} from {shard} failed ({e}); the store is corrupt") from None

    def case_graph(self, case: dict) -> Graph:
        """The one-node graph of a case; its inputs are the case's stored input tensors."""
        node = Node(name=case["node"], op=case["op"], args=case["args"], kwargs=case["kwargs"],
                    outputs=[TensorMeta.from_json(m) for m in case["output_meta"]], multi=case["multi"],
                    module=case["module"])
        inputs = [(name, TensorMeta.from_json(self.tensor_index[name])) for name in case["inputs"]]
        return Graph(inputs=inputs, nodes=[node], outputs=node.output_refs)

    def case_inputs(self, case: dict) -> list[torch.Tensor]:
        return [self.tensor(n) for n in case["inputs"]]

    def case_outputs(self, case: dict) -> list[torch.Tensor]:
        return [self.tensor(n) for n in case["outputs"]]

    def program_inputs(self) -> dict[str, torch.Tensor]:
        """Every input of the model graph (parameters, buffers, constants, user inputs) by name."""
        return {name: self.tensor(info["tensor"]) for name, info in self.manifest["program_inputs"].items()}

    def model_outputs(self) -> dict[str, torch.Tensor]:
        """The reference's outputs of the whole model, by graph output ref."""
        return {ref: self.tensor(name) for ref, name in self.manifest["model_outputs"].items()}


__all__ = ["CarveStore", "CarveStoreWriter", "write_json_atomic"]
