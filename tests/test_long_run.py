"""Long sessions: one device server serves the migration of every zoo model in turn, with its
memory measured at the start and the end; its program cache stays under its cap and the
sessions of finished clients are freed."""

import pytest
from support import rss_mib

ZOO = ("mlp", "cnn", "tiny-llama", "tiny-gpt2", "tiny-bert", "tiny-vit", "tiny-resnet")
MAX_RSS_GROWTH_MIB = 300


@pytest.mark.slow
def test_one_server_migrates_every_zoo_model_with_bounded_memory(carved, tmp_path, figure):
    from tapml.carving import CarveStore
    from tapml.driving.migrate import Migration
    from tapml.remote.client import RemotePlatform
    from tapml.platforms.program_cache import default_limits
    from tapml.remote.launcher import ServerProcess
    PROGRAM_CACHE = default_limits()[0]
    stores = {name: CarveStore(carved(f"zoo:{name}")) for name in ZOO}
    srv = ServerProcess(platform="reference", token="long-run")
    try:
        rss = {}
        for i, name in enumerate(ZOO):
            with RemotePlatform(srv.host, srv.port, token="long-run") as platform:
                state = Migration(stores[name], platform, srv.target, tmp_path / f"{name}.json").run()
                stats = platform.server_stats()
            assert state["complete"] and state["passed"], (name, state["culprits"][:2], state["end_to_end"])
            assert stats["cached"] <= PROGRAM_CACHE and stats["sessions"] == 1
            rss[name] = rss_mib(srv.proc.pid)
            if i == 0:
                first = rss[name]  # torch and the first model's programs are loaded by now
        with RemotePlatform(srv.host, srv.port, token="long-run") as platform:
            stats = platform.server_stats()
        assert stats["sessions"] == 1  # every earlier client's session (and its tensors) is gone
        assert srv.proc.poll() is None
    finally:
        srv.stop()
    growth = rss[ZOO[-1]] - first
    figure("device server RSS after the first / last of 7 zoo migrations (MiB)",
           f"{first:.0f} / {rss[ZOO[-1]]:.0f} (+{growth:.0f}); {stats['compiled']} programs compiled, "
           f"{stats['cached']} cached, {stats['runs']} runs")
    assert growth < MAX_RSS_GROWTH_MIB, rss


def test_program_cache_is_capped_and_evicts_the_oldest():
    from tapml.platforms.base import KernelProgram
    from tapml.platforms.reference import ReferencePlatform
    from tapml.remote.server import Device
    device = Device(ReferencePlatform(), "reference")
    PROGRAM_CACHE = device.programs.max_entries
    programs = [KernelProgram(kind="graph", inputs=[], outputs=[], graph={"n": i}) for i in range(PROGRAM_CACHE + 50)]
    for i, program in enumerate(programs):
        device.remember(program, graph_hash=f"g{i}")
    assert len(device.programs) == PROGRAM_CACHE
    assert programs[0].key not in device.programs and programs[-1].key in device.programs
    assert set(device.graph_keys.values()) <= set(device.programs.keys())


def test_program_cache_keeps_recently_used_programs():
    """A cache hit (a run of a program, a compile of a graph already compiled) makes the
    program the most recently used, so a program in steady use is never evicted."""
    from tapml.platforms.base import KernelProgram
    from tapml.platforms.reference import ReferencePlatform
    from tapml.remote.server import Device
    device = Device(ReferencePlatform(), "reference")
    PROGRAM_CACHE = device.programs.max_entries
    programs = [KernelProgram(kind="graph", inputs=[], outputs=[], graph={"n": i}) for i in range(PROGRAM_CACHE + 2)]
    for i, program in enumerate(programs[:PROGRAM_CACHE]):
        device.remember(program, graph_hash=f"g{i}")
    assert device.program(programs[0].key) is programs[0]
    assert device.program(graph_hash="g1") is programs[1]
    assert device.program("no such key") is None and device.program(graph_hash="no such graph") is None
    device.remember(programs[-2], graph_hash="new1")
    device.remember(programs[-1], graph_hash="new2")
    assert programs[0].key in device.programs and programs[1].key in device.programs
    assert programs[2].key not in device.programs and programs[3].key not in device.programs
    assert device.program(graph_hash="g2") is None
