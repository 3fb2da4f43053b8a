"""ProgramCache: LRU by count and bytes, eviction callbacks, thread safety."""

import threading

from tapml.platforms.program_cache import ProgramCache


def test_least_recently_used_goes_first():
    evicted = []
    cache = ProgramCache(max_entries=2, on_evict=lambda k, v: evicted.append(k))
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)
    assert "b" not in cache and "a" in cache and "c" in cache
    assert evicted == ["b"]
    assert cache.keys() == ["a", "c"]


def test_bytes_bound_keeps_the_newest_entry():
    cache = ProgramCache(max_entries=100, max_bytes=10)
    cache.put("a", "x", nbytes=6)
    cache.put("b", "y", nbytes=6)
    assert cache.keys() == ["b"] and cache.nbytes == 6
    cache.put("huge", "z", nbytes=50)  # larger than the bound on its own: kept, everything else dropped
    assert cache.keys() == ["huge"] and cache.nbytes == 50


def test_replacing_a_key_releases_the_old_value_and_pop_does_not():
    evicted = []
    cache = ProgramCache(max_entries=4, on_evict=lambda k, v: evicted.append((k, v)))
    cache.put("a", 1, nbytes=3)
    cache.put("a", 2, nbytes=5)
    assert evicted == [("a", 1)] and cache.nbytes == 5 and cache.get("a") == 2
    assert cache.pop("a") == 2 and evicted == [("a", 1)] and len(cache) == 0 and cache.nbytes == 0


def test_get_or_put_makes_once_and_counts_hits():
    made = []
    cache = ProgramCache(max_entries=4)
    for _ in range(3):
        assert cache.get_or_put("k", lambda: made.append(1) or "v", size=len) == "v"
    assert made == [1] and cache.hits == 2 and cache.misses == 1 and cache.nbytes == 1


def test_environment_sets_the_default_limits(monkeypatch):
    monkeypatch.setenv("TAPML_PROGRAM_CACHE", "3")
    monkeypatch.setenv("TAPML_PROGRAM_CACHE_MIB", "2")
    cache = ProgramCache()
    assert cache.max_entries == 3 and cache.max_bytes == 2 << 20
    monkeypatch.setenv("TAPML_PROGRAM_CACHE", "not a number")
    assert ProgramCache().max_entries == 1024


def test_concurrent_puts_stay_within_the_bound():
    cache = ProgramCache(max_entries=50, max_bytes=1000)

    def work(t):
        for i in range(500):
            cache.put(f"{t}-{i}", i, nbytes=7)
            cache.get(f"{t}-{i // 2}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(cache) <= 50 and cache.nbytes == 7 * len(cache) <= 1000
