"""The control connection's rpyc service (:func:`make_service`): the ``exposed_*`` methods a
client calls (hello, supports, compile, load, run, read, free...), each taking and returning
plain values (str, bytes, int, None), every request parsed and held to the server's
:class:`~tapml.remote.limits.ServerLimits` before it reaches the device; a failure is answered
as ``{"error": {kind, message}}``, never raised to the client.
"""

from __future__ import annotations

import hashlib
import json

from tapml.errors import DeviceLost, PlatformError, Unsupported
from tapml.remote.announcement import SERVICE_NAME
from tapml.remote.connection import ConnectionState, NotHeld, parse_run_request
from tapml.remote.device import Device, DeviceBusy
from tapml.remote.limits import LimitExceeded, check_graph, check_node, check_ops_json, check_program, parse_request


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _error(kind: str, message: str) -> str:
    return json.dumps({"error": {"kind": kind, "message": message}})


def _error_of(e: BaseException) -> str:
    if isinstance(e, Unsupported):
        return _error("unsupported", str(e))
    if isinstance(e, DeviceBusy):
        return _error("device-busy", str(e))
    if isinstance(e, DeviceLost):
        return _error("device-lost", str(e))
    if isinstance(e, PlatformError):
        return _error("platform", str(e))
    return _error("platform", f"{type(e).__name__}: {e}")


def _str(value, name: str) -> str:
    # rpyc would hand us a netref for anything that is not a plain value; never touch those.
    if type(value) is not str:
        raise TypeError(f"{name} must be a str")
    return value


def make_service(device: Device):
    """The rpyc Service class for ``device``: one instance (and ConnectionState) per connection."""
    import rpyc

    from tapml.graph import Graph, Node, TensorMeta
    from tapml.platforms.base import KernelProgram

    class DeviceService(rpyc.Service):
        ALIASES = [SERVICE_NAME]  # serve() adds the announcement once the caps are known

        def on_connect(self, conn):
            self.session = ConnectionState(device.limits.max_buffer_bytes)
            device.sessions[self.session.id] = self.session

        def on_disconnect(self, conn):
            device.sessions.pop(self.session.id, None)
            self.session.close()

        def exposed_hello(self) -> str:
            """Protocol version, platform spec, caps, size limit and the bulk session id (JSON)."""
            try:
                return json.dumps(device.info(self.session))
            except Exception as e:  # noqa: BLE001 - the client reports it
                return _error_of(e)

        def exposed_stats(self) -> str:
            """Counters (JSON): programs compiled, programs cached, runs, open sessions, device
            workers restarted (after a timeout or a crash)."""
            return json.dumps({"compiled": device.compiled, "cached": len(device.programs), "runs": device.runs,
                               "sessions": len(device.sessions),
                               "worker_restarts": getattr(device.platform, "restarts", 0)})

        def exposed_ping(self) -> None:
            """Nothing: measures the round trip."""

        def exposed_supports(self, node_json) -> str:
            """Whether the platform can run the node (JSON): ``{"reason": null}`` when it can,
            ``{"reason": why}`` when it cannot, ``{"error": {kind, message}}`` when the device
            failed to answer (a fault, such as a worker that died: never a reason)."""
            try:
                raw = parse_request(_str(node_json, "node_json"), device.limits)
                check_node(raw if isinstance(raw, dict) else {})
                node = Node.from_json(raw)
            except (TypeError, ValueError, KeyError) as e:
                return json.dumps({"reason": f"malformed node: {e}"})
            except Unsupported as e:
                return json.dumps({"reason": str(e)})
            try:
                with device.exclusive():
                    return json.dumps({"reason": device.platform.supports(node) or None})
            except Unsupported as e:
                return json.dumps({"reason": str(e)})
            except Exception as e:  # noqa: BLE001 - the client reports it as an error, not a reason
                return _error_of(e)

        def exposed_compile(self, graph_json) -> str:
            """Compile a graph (JSON); returns ``{"key", "program"}`` or ``{"error": {kind, message}}``."""
            try:
                text = _str(graph_json, "graph_json")
                ghash = _hash(text)
                program = device.program(graph_hash=ghash)
                if program is not None:
                    return json.dumps({"key": program.key, "program": program.to_json()})
                raw = parse_request(text, device.limits)
                check_ops_json(raw)
                graph = Graph.from_json(raw)
                check_graph(graph, device.limits)
                with device.exclusive():
                    program = device.platform.compile(graph)
                    device.compiled += 1
                check_program(program, device.limits, device.program_kind)
                device.remember(program, ghash)
                return json.dumps({"key": program.key, "program": program.to_json()})
            except (TypeError, ValueError, KeyError) as e:
                return _error("usage", f"malformed graph: {type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001 - becomes the case's verdict
                return _error_of(e)

        def exposed_load(self, program_json) -> str:
            """Cache a program compiled elsewhere (JSON); returns ``{"key"}`` or an error."""
            try:
                raw = parse_request(_str(program_json, "program_json"), device.limits)
                check_ops_json(raw.get("graph") if isinstance(raw, dict) else None)
                program = KernelProgram.from_json(raw)
                check_program(program, device.limits, device.program_kind)
            except (TypeError, ValueError, KeyError, AttributeError) as e:
                return _error("usage", f"malformed program: {e}" if isinstance(e, ValueError)
                              else f"malformed program: {type(e).__name__}: {e}")
            except Unsupported as e:
                return _error_of(e)
            device.remember(program)
            return json.dumps({"key": program.key})

        def exposed_run(self, key, slots_json) -> str:
            """Run cached program ``key``. ``slots_json`` is a JSON list of input slots, or
            ``{"inputs": [...], "keep": [output positions]}`` whose inputs are each a slot, ``"held"``
            (the tensor this connection sent for that input of this program last time) or
            ``{"resident": id}`` (an output a run of this connection kept on the device). Returns
            ``{"outputs": [[slot | null, meta], ...], "resident": [[position, id], ...], "device_ms"}``
            (kept outputs have no slot) or an error."""
            from tapml.platforms.base import ResidentTensor
            try:
                key = _str(key, "key")
                items, keep = parse_run_request(parse_request(_str(slots_json, "slots_json"), device.limits))
            except (TypeError, ValueError, LimitExceeded) as e:
                return _error("usage", str(e))
            session = self.session
            try:
                tensors = session.take([s for s in items if type(s) is int], device.timeout)
            except PlatformError as e:
                return _error_of(e)
            program = device.program(key)
            if program is None:
                return _error("unknown-program", f"program {key} is not cached on this server")
            try:
                if any(i >= len(program.outputs) for i in keep):
                    raise ValueError(f"keep names outputs past the program's {len(program.outputs)}")
                args = session.run_args(key, items, tensors, len(program.inputs))
                session.check_keep(program, keep)
            except NotHeld as e:
                return _error(e.kind, str(e))
            except ValueError as e:
                return _error("usage", str(e))
            except Unsupported as e:
                return _error_of(e)
            resident = keep or any(isinstance(a, ResidentTensor) for a in args)
            try:
                with device.exclusive():
                    device.runs += 1
                    outputs = device.platform.run(program, args, keep=keep) if resident \
                        else device.platform.run(program, args)
                    ms = getattr(device.platform, "last_run_ms", None)
                    two_words = list(getattr(device.platform, "last_wide", ()) or ())
            except Exception as e:  # noqa: BLE001 - becomes the case's verdict
                # what the program held is unknown after a failed run: the client sends it all again
                session.held.pop(key)
                session.forget_kept(key, len(program.outputs))
                return _error("platform", str(e)) if isinstance(e, ValueError) else _error_of(e)
            ids = session.after_run(program, args, keep, outputs)
            reply = []
            try:
                for i, t in enumerate(outputs):
                    reply.append([None, program.output_meta[i].to_json()] if i in keep else
                                 [session.store(t), TensorMeta.of(t).to_json()])
            except LimitExceeded as e:  # the outputs stored so far go too: the client gets none of them
                with session.cond:
                    for slot, _ in reply:
                        if slot is not None:
                            session.pop(slot)
                return _error_of(e)
            return json.dumps({"outputs": reply, "resident": ids, "device_ms": ms, "int64_two_words": two_words})

        def exposed_read(self, resident_id) -> str:
            """Download a resident tensor (by the id a run gave it): ``{"outputs": [[slot, meta]]}``
            (fetch the slot over the bulk connection) or an error."""
            if type(resident_id) is not int:
                return _error("usage", "resident_id must be an int")
            handle = self.session.resident.get(resident_id)
            if handle is None:
                return _error("unknown-resident", f"resident tensor {resident_id} is not held for this connection")
            try:
                with device.exclusive():
                    t = device.platform.read(handle)
            except Exception as e:  # noqa: BLE001 - the client reports it
                return _error_of(e)
            try:
                return json.dumps({"outputs": [[self.session.store(t), TensorMeta.of(t).to_json()]]})
            except LimitExceeded as e:
                return _error_of(e)

        def exposed_free(self, slots_json) -> None:
            """Drop tensors the client will not download."""
            slots = parse_request(_str(slots_json, "slots_json"), device.limits)
            with self.session.cond:
                for s in slots if isinstance(slots, list) else []:
                    if type(s) is int:
                        self.session.pop(s)

        def exposed_bench_tensor(self, nbytes) -> int:
            """Create a float32 tensor of ``nbytes`` in a slot, for download benchmarks."""
            import torch
            if type(nbytes) is not int or not 0 < nbytes <= device.max_message or nbytes % 4:
                raise ValueError("nbytes must be a positive multiple of 4 within the message limit")
            self.session.reserve(nbytes, "a benchmark tensor")  # refused before it is made
            try:
                tensor = torch.ones(nbytes // 4, dtype=torch.float32)
            except BaseException:
                self.session.release(nbytes)
                raise
            return self.session.store(tensor, reserved=True)

    return DeviceService
