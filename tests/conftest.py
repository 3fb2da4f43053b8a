"""Shared fixtures: carved stores of zoo models, made once per test process."""

import os
import warnings

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
warnings.filterwarnings("ignore", category=FutureWarning)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under `pytest -n N` the workers already use every core: torch's intra-op pool (one thread per
    # core in every worker and every command it starts) only oversubscribes them. One thread: 12% less
    # wall time (benchmarks/NOTES.md). An OMP_NUM_THREADS set by whoever runs the tests is kept.
    threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)


@pytest.fixture(scope="session")
def carved(tmp_path_factory):
    """``carved("zoo:mlp")`` -> path of a store carved from that spec (cached per session)."""
    from tapml.carving import carve
    cache = {}

    def get(spec: str, **kwargs):
        key = (spec, tuple(sorted(kwargs.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(spec.replace(":", "_").replace("/", "_"))
            carve(spec, path / "store", **kwargs)
            cache[key] = path / "store"
        return cache[key]

    return get


@pytest.fixture(scope="session")
def mlp(carved):
    """The CarveStore of zoo:mlp: the smallest real model, for tests about everything but the model."""
    from tapml.carving import CarveStore
    return CarveStore(carved("zoo:mlp"))


@pytest.fixture(scope="session")
def gen_store(tmp_path_factory):
    """A zoo:tiny-llama generation store (prompt 5, 2 decode steps), carved once per test process."""
    from tapml.carving.generation import carve_generation
    path = tmp_path_factory.mktemp("gen") / "store"
    carve_generation("zoo:tiny-llama", path, tokens=2, prompt_len=5)
    return path


@pytest.fixture
def figure(record_property):
    """``figure("fuzz inputs tried", 400)``: a number printed in the run's summary (works under xdist)."""
    return lambda name, value: record_property(f"figure:{name}", value)


def pytest_terminal_summary(terminalreporter):
    figures = [(name[7:], value) for reports in terminalreporter.stats.values() for r in reports
               if getattr(r, "when", None) == "call"
               for name, value in getattr(r, "user_properties", []) if str(name).startswith("figure:")]
    if figures:
        terminalreporter.section("tapml figures")
        for name, value in figures:
            terminalreporter.line(f"{name}: {value}")


def pytest_collection_modifyitems(config, items):
    """The slow tier first, the rest in file order: xdist hands work out in collection order, so a
    long end-to-end test that starts last (the README walk: ~4-11 min) is the run's whole tail."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` that finishes after a worker crashes.

    pytest-xdist 3.8's group scheduler puts a dead worker's whole workload back on the queue,
    finished groups and the test it died on included, and hands a replacement worker a single test,
    which a worker never starts until a second one arrives: the run then waits forever at its end
    (pytest-xdist#1323, #1327, #1378; one crashed lavapipe worker held CI past its 90 minutes). This
    scheduler requeues only the unfinished tests of the dead worker, never the one it died on (that
    one is already reported failed), and keeps two tests or a shutdown queued on every worker.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class CrashSafeLoadGroupScheduling(LoadGroupScheduling):
        def remove_node(self, node):
            workload = self.assigned_work.pop(node)
            pending = [unit for unit in workload.values() if not all(unit.values())]
            if not pending:
                return None
            crashitem = next(nodeid for unit in pending for nodeid, done in unit.items() if not done)
            requeue = {}
            for scope, unit in workload.items():
                unit.pop(crashitem, None)
                if unit and not all(unit.values()):
                    requeue[scope] = {nodeid: False for nodeid, done in unit.items() if not done}
            self.workqueue.update(requeue)
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

        def _reschedule(self, node):
            super()._reschedule(node)
            while not node.shutting_down and node in self.assigned_work and \
                    self._pending_of(self.assigned_work[node]) < 2:
                if not self.workqueue:
                    node.shutdown()
                    break
                self._assign_work_unit(node)

    return CrashSafeLoadGroupScheduling(config, log)
