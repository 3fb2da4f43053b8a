"""ProgramCache: the one least-recently-used cache of compiled and prepared programs.

Every runtime keeps programs by content key (a compiled KernelProgram, its device pipelines
and resident buffers, a server's programs for its clients). They all use this class, bounded by
a count and by bytes, so that a long-running server or migration cannot grow without limit.
The limits come from ``TAPML_PROGRAM_CACHE`` (entries, default 1024) and
``TAPML_PROGRAM_CACHE_MIB`` (default 1024) unless a caller passes its own.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Callable

DEFAULT_ENTRIES = 1024
DEFAULT_MIB = 1024


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        n = int(value)
    except ValueError:
        return default
    return n if n > 0 else default


def default_limits() -> tuple[int, int]:
    """``(entries, bytes)`` from the environment, or the defaults."""
    return _env_int("TAPML_PROGRAM_CACHE", DEFAULT_ENTRIES), _env_int("TAPML_PROGRAM_CACHE_MIB", DEFAULT_MIB) << 20


class ProgramCache:
    """A thread-safe LRU map ``key -> value`` bounded by ``max_entries`` and ``max_bytes``.

    ``on_evict(key, value)`` is called (outside the lock) for each entry that is dropped, so a
    runtime can release device memory. Example::

        cache = ProgramCache(max_entries=2)
        cache.put("a", 1); cache.put("b", 2); cache.get("a"); cache.put("c", 3)
        "b" in cache   # False: the least recently used entry went first
    """

    def __init__(self, max_entries: int | None = None, max_bytes: int | None = None,
                 on_evict: Callable[[str, Any], None] | None = None):
        entries, nbytes = default_limits()
        self.max_entries = max_entries or entries
        self.max_bytes = max_bytes or nbytes
        self.on_evict = on_evict
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    @property
    def nbytes(self) -> int:
        """Bytes held, as the sizes given to :meth:`put` add up."""
        return self._bytes

    def get(self, key: str, default=None):
        """The value of ``key`` (marked as just used), or ``default``."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return default
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: str, value, nbytes: int = 0) -> None:
        """Keep ``value`` under ``key`` (``nbytes``: what it holds), dropping the least recently
        used entries until both limits hold again. The newest entry is always kept."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[key] = (value, max(0, int(nbytes)))
            self._bytes += max(0, int(nbytes))
            evicted = []
            while len(self._items) > 1 and (len(self._items) > self.max_entries or self._bytes > self.max_bytes):
                k, (v, n) = self._items.popitem(last=False)
                self._bytes -= n
                evicted.append((k, v))
        if old is not None and old[0] is not value:
            evicted.insert(0, (key, old[0]))
        for k, v in evicted:
            if self.on_evict is not None:
                self.on_evict(k, v)

    def get_or_put(self, key: str, make: Callable[[], Any], size: Callable[[Any], int] | None = None):
        """The value of ``key``, made by ``make()`` (and kept) when it is not cached."""
        value = self.get(key, _MISSING)
        if value is _MISSING:
            value = make()
            self.put(key, value, size(value) if size else 0)
        return value

    def pop(self, key: str, default=None):
        """Remove ``key`` without calling ``on_evict``; returns its value or ``default``."""
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                return default
            self._bytes -= item[1]
            return item[0]

    def clear(self) -> None:
        """Drop every entry, calling ``on_evict`` for each."""
        with self._lock:
            items, self._items, self._bytes = list(self._items.items()), OrderedDict(), 0
        for k, (v, _) in items:
            if self.on_evict is not None:
                self.on_evict(k, v)

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._items)

    def values(self) -> list:
        """Values from least to most recently used."""
        with self._lock:
            return [v for v, _ in self._items.values()]


_MISSING = object()

__all__ = ["ProgramCache", "default_limits"]
