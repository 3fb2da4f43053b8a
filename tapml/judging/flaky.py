"""Run-to-run variation: is a kernel deterministic, and if not, which elements vary and how.

:class:`RunToRun` compares the outputs of repeated runs of one program with the first run's,
bit for bit (so an element that is poison, i.e. never written, in some runs and not in others
varies too), and keeps, per output, a mask of the elements that ever differed. Its
:meth:`~RunToRun.report` describes them for a ``flaky`` verdict: how many runs differed, a
text map of the varied elements and their pattern (:func:`classify`).

Example::

    r2r = RunToRun(platform.run(program, inputs))
    for _ in range(4):
        r2r.add(platform.run(program, inputs))
    r2r.report()   # None when every run was identical to the first, else the message text
"""

from __future__ import annotations

import numpy as np
import torch

#: The text map of varied elements is at most this many rows by columns of cells.
MAP_ROWS, MAP_COLS = 32, 64
#: Tile edges (rows and columns) :func:`classify` tries, largest area first.
TILE_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _elements(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a (numel, itemsize) uint8 array: elements compared bit for bit."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().reshape(flat.numel(), t.element_size())


def _plane(mask: np.ndarray) -> np.ndarray:
    """The last two dims of an element mask (rows x columns); leading dims are or-ed together."""
    if mask.ndim == 0:
        return mask.reshape(1, 1)
    if mask.ndim == 1:
        return mask.reshape(1, -1)
    return mask.reshape(-1, *mask.shape[-2:]).any(axis=0)


def text_map(mask: np.ndarray, rows: int = MAP_ROWS, cols: int = MAP_COLS) -> list[str]:
    """The 2-D ``mask`` (True: varied) as lines of ``.`` (same) and ``#`` (varied), downsampled
    to at most ``rows`` x ``cols`` cells: a cell is ``#`` when any element it covers varied."""
    r, c = mask.shape
    if r == 0 or c == 0:
        return []
    row_starts = (np.arange(min(r, rows)) * r) // min(r, rows)
    col_starts = (np.arange(min(c, cols)) * c) // min(c, cols)
    cells = np.logical_or.reduceat(np.logical_or.reduceat(mask, row_starts, axis=0), col_starts, axis=1)
    return ["".join("#" if v else "." for v in line) for line in cells]


def classify(mask: np.ndarray) -> str:
    """The pattern of the varied elements of a 2-D mask: ``all elements``, ``whole rows (k of
    R)``, ``whole columns (k of C)``, ``tiles of WxH`` (W columns by H rows, aligned, the
    largest such tile that every varied element's tile is entirely varied in) or ``scattered``."""
    r, c = mask.shape
    varied = int(mask.sum())
    if varied == 0:
        return "none"
    if varied == mask.size:
        return "all elements"
    rows, cols = mask.any(axis=1), mask.any(axis=0)
    if c > 1 and mask[rows].all():
        return f"whole rows ({int(rows.sum())} of {r})"
    if r > 1 and mask[:, cols].all():
        return f"whole columns ({int(cols.sum())} of {c})"
    best = None
    for h in (e for e in TILE_EDGES if e <= r):
        for w in (e for e in TILE_EDGES if e <= c):
            if h * w == 1 or (best and h * w <= best[0] * best[1]):
                continue
            tiles = _tiles(mask, h, w)
            if tiles is not None:
                best = (h, w, tiles)
    if best:
        h, w, (hit, total) = best
        return f"tiles of {w}x{h} ({hit} of {total} tiles)"
    return "scattered"


def _tiles(mask: np.ndarray, h: int, w: int) -> tuple[int, int] | None:
    """(varied tiles, tiles) when every aligned h x w tile is wholly varied or not at all (edge
    tiles judged on the elements they have), else None."""
    r, c = mask.shape
    pr, pc = -(-r // h) * h, -(-c // w) * w
    have = np.zeros((pr, pc), bool)
    have[:r, :c] = True
    m = np.zeros((pr, pc), bool)
    m[:r, :c] = mask
    any_varied = m.reshape(pr // h, h, pc // w, w).any(axis=(1, 3))
    all_varied = (m | ~have).reshape(pr // h, h, pc // w, w).all(axis=(1, 3))
    if (any_varied != all_varied).any():
        return None
    return int(any_varied.sum()), any_varied.size


class RunToRun:
    """The outputs of repeated runs of one program against those of its first run.

    ``first``: the first run's outputs; :meth:`add` each further run's. ``names`` label the
    outputs in the report (default ``output 0``, ``output 1``...)."""

    def __init__(self, first: list[torch.Tensor], names: list[str] | None = None):
        self.first = [_elements(t).copy() for t in first]
        self.shapes = [tuple(t.shape) for t in first]
        self.names = names or [f"output {i}" for i in range(len(first))]
        self.varied = [np.zeros(len(e), bool) for e in self.first]
        self.runs = 1
        self.differed = 0

    def add(self, outputs: list[torch.Tensor]) -> bool:
        """Compare one more run's outputs with the first run's; True when they differ."""
        self.runs += 1
        differs = False
        for i, t in enumerate(outputs):
            now = _elements(t)
            if now.shape != self.first[i].shape:
                self.varied[i][:] = True
                differs = True
                continue
            changed = (now != self.first[i]).any(axis=1)
            if changed.any():
                self.varied[i] |= changed
                differs = True
        self.differed += differs
        return differs

    @property
    def fraction(self) -> float:
        """Share of the runs after the first whose outputs differed from the first's."""
        return self.differed / (self.runs - 1) if self.runs > 1 else 0.0

    def outputs(self) -> list[dict]:
        """Per output that varied: ``{"name", "shape", "varied", "numel", "pattern", "map"}``."""
        out = []
        for name, shape, varied in zip(self.names, self.shapes, self.varied):
            if not varied.any():
                continue
            plane = _plane(varied.reshape(shape))
            out.append({"name": name, "shape": shape, "varied": int(varied.sum()), "numel": len(varied),
                        "pattern": classify(plane), "map": text_map(plane)})
        return out

    def report(self) -> str | None:
        """None when every run matched the first bit for bit; else the ``flaky`` verdict's
        message: the runs that differed, then per varied output its pattern and text map."""
        if not self.differed:
            return None
        lines = [f"outputs varied run to run: {self.differed} of {self.runs - 1} repeat runs differed "
                 f"from run 1 ({self.fraction:.0%})"]
        for o in self.outputs():
            dims = "x".join(map(str, o["shape"])) or "scalar"
            plane = "x".join(str(n) for n in (o["shape"][-2:] if len(o["shape"]) >= 2 else (1, *o["shape"][-1:])))
            cells = f"{len(o['map'])}x{len(o['map'][0]) if o['map'] else 0}"
            lines.append(f"{o['name']} [{dims}]: {o['varied']} of {o['numel']} elements varied "
                         f"({o['varied'] / o['numel']:.1%}), pattern: {o['pattern']}")
            lines.append(f"map of the last two dims ({plane} in {cells} cells; '#' varied, '.' same):")
            lines.extend(o["map"])
        return "\n".join(lines)


__all__ = ["RunToRun", "classify", "text_map", "MAP_ROWS", "MAP_COLS"]
