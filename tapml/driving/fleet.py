"""A fleet run: every model's carved cases on every device of a ``registry://`` pool.

Each device gets its own thread and works through the models in the order given (models are
queued, devices run side by side), so every model ends with one Verdict JSON per device: the
cells of a models x devices matrix (:func:`tapml.reports.data.fleet_document`). A device that
goes away is retried (a remote platform reconnects by itself); after ``max_failures``
consecutive losses it drops out of the run with its reason, and the cases it had left are
``error`` verdicts saying so: every case of every model has exactly one verdict on every
device, and the run finishes on the devices that remain.

Example::

    with DevicePool("registry://127.0.0.1:18811") as pool:
        result = run_fleet([("zoo:mlp", CarveStore("stores/mlp"))], pool)
    result["runs"]["zoo:mlp"]["remote://127.0.0.1:18861"]["summary"]
    fleet_document(**result)["matrix"]      # tapml.reports.data: a row per model, a column per device
"""

from __future__ import annotations

import threading
from typing import Callable

from tapml.judging.compare import Tolerances
from tapml.errors import DeviceLost
from tapml.driving.replay import device_info, replay_case
from tapml.judging.verdict import CaseVerdict, VerdictDocument

#: Consecutive DeviceLost failures after which a device leaves a fleet run.
MAX_FAILURES = 3


def lost_verdict(case: dict, message: str) -> CaseVerdict:
    """The ``error`` verdict of a case a device could not run because it went away."""
    return CaseVerdict(id=case["id"], op=case["op"], node=case["node"], module=case["module"],
                       instances=case.get("instances", 1), status="error", message=message)


class DeviceRun:
    """One device's share of a fleet run: runs cases on its platform until it has lost the
    device ``max_failures`` times in a row, then answers every further case with an ``error``
    verdict naming the reason (:attr:`dropped`)."""

    def __init__(self, target: str, platform, tolerances: Tolerances, max_failures: int = MAX_FAILURES):
        self.target, self.platform, self.tolerances = target, platform, tolerances
        self.max_failures = max_failures
        self.dropped: str | None = None
        self.served = 0
        try:
            self.device = device_info(platform)
        except DeviceLost as e:
            self.device = {"adapter": "unknown", "backend": "unknown", "features": [], "limits": {}, "error": str(e)}

    def run(self, store, case: dict) -> CaseVerdict:
        """The verdict of ``case`` on this device (DeviceLost is never raised)."""
        if self.dropped is not None:
            return lost_verdict(case, f"error: not run: {self.target} dropped out of the fleet run: {self.dropped}")
        for attempt in range(self.max_failures):
            try:
                verdict = replay_case(self.platform, store, case, self.tolerances)
                self.served += 1
                return verdict
            except DeviceLost as e:
                last = e
        self.dropped = f"{self.max_failures} consecutive failures, the last: {last}"
        return lost_verdict(case, f"error: {last} ({self.target} dropped out of the fleet run)")


def run_fleet(models: list[tuple[str, object]], pool, *, tolerances: Tolerances | None = None,
              max_failures: int = MAX_FAILURES,
              on_case: Callable[[str, str, dict], None] | None = None) -> dict:
    """Run every case of every model on every device of ``pool``.

    ``models``: ``(label, CarveStore)`` pairs, labels unique (the matrix's rows). ``pool``: a
    :class:`tapml.remote.pool.DevicePool` (its live ``devices`` when the run starts are the
    columns). ``on_case(model, target, verdict_json)`` is called from the device threads after
    each case. An error other than a lost device (a bug) is raised once every thread has stopped.

    Returns ``{"runs": {model: {device target: Verdict JSON}}, "devices": [{"target", "adapter",
    "backend", "platform", "served", "status"}], "left_out": {target: reason}}`` (``status``:
    ``ok`` or why the device dropped out; ``left_out``: servers announced but not live when the
    run began): the arguments of :func:`tapml.reports.data.fleet_document`."""
    tolerances = tolerances or Tolerances()
    devices = list(pool.devices)
    left_out = dict(pool.removed)  # announced, but not live when the run started
    runs = [DeviceRun(d.target, d.platform, tolerances, max_failures) for d in devices]
    results: dict[str, dict[str, dict]] = {label: {} for label, _ in models}
    lock = threading.Lock()
    failures: list[BaseException] = []

    def drive(device: DeviceRun) -> None:
        try:
            for label, store in models:
                verdicts = []
                for case in store.cases:
                    v = device.run(store, case)
                    verdicts.append(v)
                    if on_case:
                        on_case(label, device.target, v.to_json())
                doc = VerdictDocument(target=device.target, device=device.device, model=store.model,
                                      tolerances=tolerances.to_json(), cases=verdicts).to_json()
                with lock:
                    results[label][device.target] = doc
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            failures.append(e)

    threads = [threading.Thread(target=drive, args=(d,), name=f"fleet {d.target}", daemon=True) for d in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    for device, run in zip(devices, runs):
        if run.dropped is not None:
            pool.remove(device, run.dropped)
    platforms = {d.get("target"): d.get("platform") for d in pool.describe()}
    described = [{"target": d.target, "adapter": d.device.get("adapter") or "", "backend": d.device.get("backend") or "",
                "platform": str(platforms.get(d.target) or ""), "served": d.served,
                "status": "ok" if d.dropped is None else f"dropped: {d.dropped}"} for d in runs]
    return {"runs": results, "devices": described, "left_out": left_out}


__all__ = ["run_fleet", "DeviceRun", "lost_verdict", "MAX_FAILURES"]
