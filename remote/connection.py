"""One client's connection as the server holds it: the tensors waiting in its slots (uploads
over the bulk connection, outputs waiting to be downloaded), the inputs it may name as ``held``
and the outputs its runs kept on the device, each bounded per connection
(:class:`ConnectionState`); and the checked shape of a run request (:func:`parse_run_request`).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time

from typing import Annotated, Literal

from pydantic import Field

from tapml.errors import PlatformError
from tapml.remote.limits import MAX_SLOTS, LimitExceeded
from tapml.schema import ClosedSchema, Count, Int, validate

OUTPUT_SLOTS = 1 << 62  # server-assigned slot ids; clients use ids below this
MAX_RESIDENT = 4096  # outputs one connection may keep on the device at once


class NotHeld(Exception):
    """A run names a tensor this connection does not hold; ``kind`` is ``unknown-input`` (the
    client sends it again) or ``unknown-resident`` (a kept output that is gone)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ConnectionState:
    """Server-side state of one client's control connection: tensors waiting in slots, its bulk
    sockets, the id that binds them, and what it keeps between runs: the last input tensors of
    each program it ran (an unmodified input is named, not sent again: weights cross once) and
    the outputs its runs kept on the device (resident tensors, by id). Both are bounded by
    ``max_bytes`` (the server's --max-buffer-mib) and freed with the connection."""

    def __init__(self, max_bytes: int = 4096 << 20):
        from tapml.platforms.program_cache import ProgramCache
        self.id = os.urandom(16)
        self.slots: dict[int, object] = {}
        self.max_bytes = max_bytes
        self.held = ProgramCache(max_bytes=max_bytes)  # program key -> its last inputs (None: resident)
        self.resident: dict[int, object] = {}  # id -> the platform's ResidentTensor
        self.resident_of: dict[tuple[str, int], int] = {}  # (program key, output) -> id
        self._resident_ids = itertools.count(1)
        self.cond = threading.Condition()
        self.error: str | None = None
        self.sockets: list[socket.socket] = []
        self._out = itertools.count(OUTPUT_SLOTS)
        self.closed = False
        self.slot_bytes = 0  # bytes of the tensors in slots, and of uploads admitted but still arriving

    def reserve(self, nbytes: int, what: str = "an upload") -> None:
        """Admit ``nbytes`` more into this connection's slots, before they are read or made;
        LimitExceeded past ``max_bytes`` or :data:`MAX_SLOTS` tensors."""
        with self.cond:
            if len(self.slots) >= MAX_SLOTS or self.slot_bytes + nbytes > self.max_bytes:
                raise LimitExceeded(f"{what} of {nbytes} bytes: this connection already holds {len(self.slots)} tensors "
                                    f"({self.slot_bytes} bytes) that were not run or downloaded; this server allows "
                                    f"{MAX_SLOTS} and {self.max_bytes} bytes per connection (tapml serve --max-buffer-mib)")
            self.slot_bytes += nbytes

    def release(self, nbytes: int) -> None:
        with self.cond:
            self.slot_bytes -= nbytes

    def pop(self, slot: int):
        """Remove and return the tensor of ``slot`` (None when empty); the caller holds ``cond``."""
        tensor = self.slots.pop(slot, None)
        if tensor is not None:
            self.slot_bytes -= tensor.numel() * tensor.element_size()
        return tensor

    def put(self, slot: int, tensor) -> None:
        """Fill ``slot`` with an upload whose bytes were :meth:`reserve`d."""
        with self.cond:
            self.pop(slot)
            self.slots[slot] = tensor
            self.cond.notify_all()

    def take(self, slots: list[int], timeout: float) -> list:
        """Remove and return the tensors of ``slots``, waiting for uploads still in flight."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(s in self.slots for s in slots):
                if self.error or self.closed:
                    raise PlatformError(f"input upload failed: {self.error or 'session closed'}")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [s for s in slots if s not in self.slots]
                    raise PlatformError(f"inputs {missing} did not arrive within {timeout:g}s")
                self.cond.wait(left)
            return [self.pop(s) for s in slots]

    def store(self, tensor, what: str = "an output", reserved: bool = False) -> int:
        """Put a tensor made on the server in a fresh slot; LimitExceeded when this connection
        holds too much already (:meth:`reserve`; ``reserved``: its bytes were reserved before it was made)."""
        if not reserved:
            self.reserve(tensor.numel() * tensor.element_size(), what)
        slot = next(self._out)
        with self.cond:
            self.slots[slot] = tensor
        return slot

    def fail(self, message: str) -> None:
        with self.cond:
            self.error = message
            self.cond.notify_all()

    def run_args(self, key: str, items: list, tensors: list, count: int) -> list:
        """A run's inputs: ``items`` (slot, ``"held"`` or ``{"resident": id}``) resolved to the
        tensors that arrived in the slots, the ones held from the last run, or resident tensors."""
        if len(items) != count:
            raise ValueError(f"program takes {count} inputs, the run names {len(items)}")
        held = self.held.get(key) or []
        sent = iter(tensors)
        args = []
        for pos, item in enumerate(items):
            if type(item) is int:
                args.append(next(sent))
            elif item == "held":
                if pos >= len(held) or held[pos] is None:
                    raise NotHeld("unknown-input", f"input {pos} of program {key[:12]} is not held for this "
                                                   "connection; send it")
                args.append(held[pos])
            else:
                handle = self.resident.get(item["resident"])
                if handle is None:
                    raise NotHeld("unknown-resident", f"resident tensor {item['resident']} is not held for this "
                                                      "connection (the run that kept it failed, or a later run of "
                                                      "its program replaced it); run the generation again from "
                                                      "its first step")
                args.append(handle)
        return args

    def check_keep(self, program, keep: list[int]) -> None:
        """LimitExceeded when keeping ``keep`` of ``program`` would hold more than ``max_bytes``
        or :data:`MAX_RESIDENT` outputs for this connection (its earlier ones are replaced)."""
        replaced = {self.resident_of.get((program.key, i)) for i in range(len(program.outputs))}
        others = [h for rid, h in self.resident.items() if rid not in replaced]
        nbytes = sum(h.nbytes for h in others) + sum(program.output_meta[i].nbytes for i in keep)
        if len(others) + len(keep) > MAX_RESIDENT or nbytes > self.max_bytes:
            raise LimitExceeded(f"keeping {len(others) + len(keep)} tensors ({nbytes} bytes) on the device for one "
                                f"connection; this server allows {MAX_RESIDENT} and {self.max_bytes} bytes "
                                "(tapml serve --max-buffer-mib)")

    def after_run(self, program, args: list, keep: list[int], outputs: list) -> list[list[int]]:
        """Record a run: its inputs are held, its kept outputs get ids (``[[position, id]]``);
        the earlier kept outputs of the program are stale now and dropped."""
        from tapml.platforms.base import ResidentTensor
        host = [None if isinstance(a, ResidentTensor) else a for a in args]
        self.held.put(program.key, host, sum(t.numel() * t.element_size() for t in host if t is not None))
        self.forget_kept(program.key, len(program.outputs))
        ids = []
        for i in keep:
            rid = next(self._resident_ids)
            self.resident[rid] = outputs[i]
            self.resident_of[(program.key, i)] = rid
            ids.append([i, rid])
        return ids

    def forget_kept(self, key: str, count: int) -> None:
        for i in range(count):
            rid = self.resident_of.pop((key, i), None)
            if rid is not None:
                self.resident.pop(rid, None)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.slots.clear()
            self.slot_bytes = 0
            self.cond.notify_all()
        self.held.clear()
        self.resident.clear()
        self.resident_of.clear()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class ResidentInputJSON(ClosedSchema):
    """An input of a run that is a tensor a run of this connection kept on the device."""

    resident: Int


class RunRequestJSON(ClosedSchema):
    """A run request (see ``exposed_run``): each input is a client slot id, ``"held"`` or
    ``{"resident": id}``; ``keep`` lists output positions to keep on the device."""

    inputs: list[Annotated[Count, Field(lt=OUTPUT_SLOTS)] | Literal["held"] | ResidentInputJSON]
    keep: list[Count] = []


def parse_run_request(request) -> tuple[list, list[int]]:
    """``(inputs, keep)`` of a run request (a bare list is its inputs), read through
    :class:`RunRequestJSON`; ValueError naming the field otherwise, or when ``keep`` repeats a
    position."""
    run = validate(RunRequestJSON, {"inputs": request} if isinstance(request, list) else request, "run")
    if len(set(run.keep)) != len(run.keep):
        raise ValueError("run.keep repeats an output position; list each once")
    return [x.model_dump() if isinstance(x, ResidentInputJSON) else x for x in run.inputs], sorted(run.keep)
