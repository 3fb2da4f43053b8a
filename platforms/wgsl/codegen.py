"""WGSL code generation core: lazy values, the kernel builder and the program builder.

A tensor value inside a program being compiled is a :class:`Value`: something that can
write the WGSL expression of its element at a multi-index. A :class:`BufferView` reads a
device buffer through shape/strides/offset (so view, permute, expand, slice, select are
free); a :class:`Remap` re-indexes another value (reshape of a computed value); a
:class:`Compute` is an elementwise expression of other values (chains of those fuse into
one kernel). Kernels (reductions, matmul, convolution, copies) *materialize* values into
buffers; the :class:`ProgramBuilder` decides when (graph outputs, values used more than
once, inputs of kernels that need plain strided buffers).

Index arithmetic is i32 in elements: a tensor may exceed 2**31 bytes (held in several
buffers, below) but must stay under 2**31 elements; shapes are baked into the shader, so a
shader is specialized to its shapes and cached by content hash.

A buffer larger than the device's ``max-storage-buffer-binding-size`` is *split*: a kernel
binds it through several windows (byte ranges of at most that size, at offsets that are
multiples of the device's ``min-storage-buffer-offset-alignment``) and reads and writes it through a generated
accessor function that picks the window (:class:`Binding`). A tensor larger than the device's
``max-buffer-size`` is compiled the same way, as one logical buffer and its windows; when the
program is finished (:meth:`ProgramBuilder.into_parts`) that buffer is replaced by *parts*,
ordinary buffers ``NAME.p0``, ``NAME.p1``, ... of at most ``max-buffer-size`` bytes, each a whole
number of windows, and every window binding is moved onto the part that holds it. The program
records which tensor its parts make up (``KernelProgram.parts``); ``Platform.run`` splits and
joins the tensors, so runtimes only see ordinary buffers. No op is unsupported for size alone
as long as a kernel's windows fit the bindings it may have.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Callable, Sequence

import numpy as np

from tapml.judging.compare import INT64_OUTSIDE_I32
from tapml.errors import PlatformError, Unsupported
from tapml.graph import TensorMeta
from tapml.platforms.base import MAX_OFFSET_ALIGNMENT, BufferSpec, Kernel, KernelProgram, SplitTensor

WORKGROUP = 64
#: On a CPU adapter (``caps["cpu_adapter"]``: lavapipe, llvmpipe, SwiftShader) a workgroup barrier
#: switches every SIMD group of the workgroup, and a barrier tree that adds a row across lanes costs
#: more than a short row: there one lane takes a whole row (a GEMV's column group, a norm's row),
#: ``LANE_GROUP`` lanes a workgroup along x (the axis llvmpipe packs into SIMD groups). A row of at
#: most ``LANE_ROW_K`` elements whose squares every lane needs is added by each lane alone.
LANE_GROUP, LANE_ROW_K = 32, 128
#: A computed one-row operand of at most this cost is computed by the kernels that read it (a GEMV,
#: a norm's squares) instead of written first: each reader recomputes its elements, which costs less
#: than a kernel of its own (a decode step's embedding row, SiLU(gate) x up).
LAZY_ROW_COST = 24
#: A product of at most ``GEMV_ROWS`` rows and ``GEMV_ROWS_MACS`` multiply-adds runs as a GEMV:
#: one workgroup per row and block of columns, each weight read once per row. A short prompt
#: through a small model then takes one kernel for its norm, its products sharing a row (q, k and v;
#: gate and up) and its SiLU x up, where the tiled kernel took one for each; on a CPU adapter a
#: dispatch costs more than such a product. Past these sizes the tiled kernel, which reads each
#: weight once per tile of rows, is faster.
GEMV_ROWS, GEMV_ROWS_MACS = 32, 1 << 21


class ForcedSetting:
    """A compile choice that tests, probes and the tuner can force inside a block, whatever the
    device would get (a matmul's tiles, a GEMV's shape, a fold's form). ``value`` is None unless
    forced. Every setting is part of a compiled program's cache key (:func:`forced_state`): the same
    graph compiled under another forced choice is another program."""

    #: Every setting made, in the order the modules made them.
    made: list["ForcedSetting"] = []

    def __init__(self, name: str, choices: Sequence | None = None, prepare: Callable | None = None):
        self.name, self.choices, self.prepare = name, tuple(choices or ()), prepare
        self.value = None
        ForcedSetting.made.append(self)

    @contextlib.contextmanager
    def forced(self, value):
        """Compile with ``value`` inside the block; the previous value comes back after it."""
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.name} is {' or '.join(map(repr, self.choices))}, not {value!r}")
        old, self.value = self.value, (self.prepare(value) if self.prepare else value)
        try:
            yield
        finally:
            self.value = old


def forced_state() -> list:
    """The forced compile settings now in force, by name (part of a compiled program's cache key)."""
    return [[s.name, s.value] for s in ForcedSetting.made]


def gemv_rows(M: int, K: int, N: int) -> bool:
    """Whether an ``M`` by ``K`` by ``N`` product runs as a GEMV (see ``GEMV_ROWS``); several rows
    need 16 columns or more (fewer leave a GEMV's lanes idle)."""
    return M == 1 or (M <= GEMV_ROWS and N >= 16 and M * K * N <= GEMV_ROWS_MACS)


def slow_wide_compiles(caps: dict | None) -> bool:
    """Whether the device compiles wide unrolled kernels slowly, so lowerings keep narrow forms:
    llvmpipe's GLSL path (``caps["backend"] == "gl"``) took 37-42 s to compile a d = 64 attention
    kernel's vec4 loops and 3.3 s a GEMV of 8 rows by 8 columns a lane, where Vulkan took 0.2 and
    0.14 s (benchmarks/NOTES.md). A backend-name rule: a probe of compile time per device would be
    the better depth."""
    return (caps or {}).get("backend") == "gl"


MAX_GROUPS = 65535
#: The most loop iterations a kernel tapml emits runs in one invocation over data of any
#: length: a longer reduction, scan or convolution sum is split across invocations and
#: finished by further passes (platforms/wgsl/folds.py). Devices may end an invocation's
#: loops past a budget of their own (lavapipe and llvmpipe: 65 535 iterations, all loops
#: together, without an error), measured by ``Platform.loop_cap``.
LOOP_BUDGET = 4096
#: Elements one invocation folds in the first pass of a split reduction or scan: small enough
#: that a long row spreads over many invocations, large enough that few passes follow.
CHUNK = 1024

FLOATS = ("float32", "float16", "bfloat16")
#: The compiler's name for an int64 tensor held in two 32-bit words (``i64`` storage, the
#: ``tap_i64`` expression type: ``vec2<u32>`` of the low and high word, two's complement):
#: a tensor whose values do not all fit in i32 (platforms/wgsl/int64.py decides which).
#: It never leaves the compiler: programs and buffers say ``int64``.
WIDE = "int64w"
#: The WGSL type of a two-word int64 (an ``alias`` every kernel that uses it declares).
I64 = "tap_i64"
#: uint64 (where torch computes on it): always two words, ``u64`` storage (torch's own bytes), the
#: ``tap_u64`` expression type (``vec2<u32>``, read as unsigned; the two-word arithmetic is shared)
U64 = "tap_u64"
#: complex64: a pair of float32 (real, imaginary), ``c64`` storage (torch's own bytes), the
#: ``tap_c64`` expression type (``vec2<f32>``); platforms/wgsl/complex.py
COMPLEX = "complex64"
C64 = "tap_c64"
#: complex32: a pair of float16 in one u32 word (``c32`` storage, torch's own bytes), computed as
#: ``tap_c64`` and rounded to float16 per part at each op, as torch computes it
COMPLEX32 = "complex32"
INTS = ("int64", "int32", "int16", "int8", "uint8")
#: torch dtype -> WGSL storage type. float16 is ``f16`` on devices with shader-f16 and packed
#: (``f16p``) elsewhere; see :meth:`ProgramBuilder.storage`.
STORAGE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16p", "bool": "u32", **{d: "i32" for d in INTS},
           WIDE: "i64", COMPLEX: "c64", "uint64": "u64", COMPLEX32: "c32"}
#: Storage types holding two 16-bit floats per u32 word (element i in word i / 2, low half
#: first): float16 without shader-f16 (``f16p``, read with unpack2x16float) and bfloat16
#: (``bf16p``, the high half of an f32 bit pattern). Arithmetic is f32; stores round to
#: nearest even (tap_f16_bits, tap_bf16_bits) and write their half with atomicAnd/atomicOr,
#: since the other half of the word belongs to another thread.
PACKED = ("f16p", "bf16p")
ITEMSIZE = {"f32": 4, "f16": 2, "f16p": 2, "bf16p": 2, "i32": 4, "u32": 4, "i64": 8, "c64": 8, "u64": 8, "c32": 4}
#: Bytes of one element of a binding's WGSL array type.
ELEM_BYTES = {"f32": 4, "i32": 4, "u32": 4, "f16": 2, "vec4<f32>": 16, "vec4<f16>": 8, "atomic<u32>": 4, "atomic<i32>": 4, I64: 8, C64: 8, U64: 8}
#: Window offsets are multiples of the device's min-storage-buffer-offset-alignment (never less
#: than one vec4); WebGPU's largest when the device does not say.
WINDOW_ALIGN = MAX_OFFSET_ALIGNMENT
#: Index arithmetic is i32 in elements: no tensor may have this many elements or more.
MAX_ELEMENTS = 2 ** 31


def ctype(dtype: str) -> str:
    """Type a value of torch dtype ``dtype`` has in expressions: f32 (also for float16,
    which is computed in f32 and rounded at each op), i32 or bool."""
    if dtype in FLOATS:
        return "f32"
    if dtype == "bool":
        return "bool"
    if dtype in INTS:
        return "i32"
    if dtype == WIDE:
        return I64
    if dtype == "uint64":
        return U64
    if dtype in (COMPLEX, COMPLEX32):
        return C64
    raise Unsupported(f"dtype {dtype} has no WGSL lowering")


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``: ``(3, 4)`` -> ``(4, 1)``."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


# WGSL rejects constant expressions that evaluate to Inf or NaN (Chrome's compiler enforces it),
# so special values go through a runtime function call: tap_bits_f32 in helpers.py.
_F32_SPECIAL = {math.inf: "0x7f800000u", -math.inf: "0xff800000u"}


def lit(v, ty: str) -> str:
    """A WGSL literal of value ``v`` in expression type ``ty``."""
    if ty == "bool":
        return "true" if v else "false"
    if ty == "i32":
        if isinstance(v, float) and not v.is_integer():
            raise Unsupported(f"value {v} is not an integer")
        v = int(v)
        if not -2**31 <= v < 2**31:
            raise Unsupported(f"{INT64_OUTSIDE_I32}: int64 value {v} does not fit in i32")
        return f"i32({v})" if v != -2**31 else "i32(-2147483647 - 1)"
    if ty == "u32":
        return f"{int(v)}u"
    if ty == C64:
        v = complex(v)
        return f"{C64}({lit(v.real, 'f32')}, {lit(v.imag, 'f32')})"
    if ty in (I64, U64):  # two words: an int64, or a uint64 (up to 2**64 - 1)
        if isinstance(v, float) and not v.is_integer():
            raise Unsupported(f"value {v} is not an integer")
        v = int(v)
        if not -2**63 <= v < 2**64:
            raise Unsupported(f"value {v} does not fit in 64 bits")
        v &= 2**64 - 1
        return f"{ty}({v & 0xffffffff}u, {v >> 32}u)"
    v = float(v)
    if math.isnan(v):
        return "tap_bits_f32(0x7fc00000u)"
    f = float(np.float32(v)) if abs(v) <= 3.4028234663852886e38 else v
    if math.isinf(f):
        return f"tap_bits_f32({_F32_SPECIAL[f]})"
    s = repr(f)
    if "e" not in s and "." not in s:
        s += ".0"
    return f"f32({s})"


def cast(expr: str, src: str, dst: str) -> str:
    """Convert an expression between expression types (f32, i32, bool)."""
    if src == dst:
        return expr
    if C64 in (src, dst):
        if src == C64:  # torch keeps the real part
            return f"any(({expr}) != {C64}(0.0, 0.0))" if dst == "bool" else cast(f"({expr}).x", "f32", dst)
        return f"{C64}({cast(expr, src, 'f32')}, 0.0)"
    if I64 in (src, dst) or U64 in (src, dst):
        from tapml.platforms.wgsl.int64 import cast_wide
        return cast_wide(expr, src, dst)
    if dst == "bool" and src == "f32":  # NaN is true; drivers may compile != as an ordered compare
        return f"((bitcast<u32>({expr}) & 0x7fffffffu) != 0u)"
    if dst == "bool":
        return f"({expr} != {lit(0, src)})"
    return f"{dst}({expr})"


_I64_ARITH = {"+": "tap_i64_add", "-": "tap_i64_sub", "*": "tap_i64_mul"}


def arith(op: str, a: str, b: str, ty: str) -> str:
    """``a op b`` (``op`` one of ``+ - *``) of expression type ``ty``: two-word int64 through its
    helpers (a kernel pulls them in by name), wrapping as torch's int64 does."""
    if ty in (I64, U64):  # the same bits either way
        return f"{_I64_ARITH[op]}({a}, {b})"
    return f"({a} {op} {b})"


def less(a: str, b: str, ty: str) -> str:
    """``a < b`` of expression type ``ty`` (two-word int64 compared as signed)."""
    return f"tap_i64_lt({a}, {b})" if ty == I64 else f"tap_u64_lt({a}, {b})" if ty == U64 else f"({a} < {b})"


def equal(a: str, b: str, ty: str) -> str:
    """``a == b`` of expression type ``ty`` as one bool (two-word values: both words)."""
    return f"all({a} == {b})" if ty in (I64, C64, U64) else f"({a} == {b})"


def extreme_lit(ty: str, greatest: bool) -> str:
    """The greatest (or least) value of integer expression type ``ty``: a max's (min's) identity."""
    if ty == I64:
        return lit(2**63 - 1 if greatest else -2**63, I64)
    if ty == U64:
        return lit(2**64 - 1 if greatest else 0, U64)
    return "2147483647" if greatest else "i32(-2147483647 - 1)"


def elem_type(storage: str) -> str:
    """The WGSL array element type a buffer of ``storage`` is bound as (u32 for packed ones)."""
    return "u32" if storage in PACKED or storage == "c32" else {"i64": I64, "c64": C64, "u64": U64}.get(storage, storage)


def window_bytes(max_binding_size: int, align: int = WINDOW_ALIGN) -> int:
    """Size of the windows a split buffer is bound through on a device with that binding limit
    and offset alignment."""
    align = max(16, align)
    return max(align, max_binding_size // align * align)


def windows(size: int, max_binding_size: int, align: int = WINDOW_ALIGN) -> list[tuple[int, int]]:
    """``(offset, size)`` byte windows covering a buffer of ``size`` bytes: the whole buffer when
    it fits the binding limit, else consecutive windows of :func:`window_bytes`."""
    if size <= max_binding_size:
        return [(0, size)]
    w = window_bytes(max_binding_size, align)
    return [(o, min(w, size - o)) for o in range(0, size, w)]


class Binding:
    """How a kernel names a buffer it binds: ``b[i]`` is the WGSL expression of element ``i``
    (an i32 expression) of its array. A buffer bound whole is ``name[i]``; a split one is a call
    of the accessor function that reads the right window (:meth:`KernelBuilder.bind`)."""

    def __init__(self, name: str, split: bool = False, per_window: int = 0, offset: int = 0):
        self.name, self.split = name, split
        self.per_window = per_window  # a split buffer's elements per window
        self.offset = offset  # the first element of a window read directly (:meth:`window`)

    def __getitem__(self, index: str) -> str:
        if self.split:
            return f"{self.name}({index})"
        return f"{self.name}[({index}) - {self.offset}]" if self.offset else f"{self.name}[{index}]"

    def window(self, j: int) -> "Binding":
        """Window ``j`` of a split buffer, read directly: indices stay the buffer's own, and an
        index outside the window is the caller's error. A kernel that knows which window a
        stretch of its reads falls in (uniformly, per workgroup) reads it without the accessor's
        per-element choice, which a CPU adapter pays as a masked load of every window."""
        return Binding(f"{self.name}_w{j}", offset=self.per_window * j)

    def __str__(self) -> str:
        return self.name


def load_at(b: Binding, index: str, storage: str, ty: str) -> str:
    """Expression of type ``ty`` reading element ``index`` (an i32 expression) of the buffer
    bound as ``b``, of storage type ``storage`` (packed types included)."""
    if storage == "f16p":
        return cast(f"unpack2x16float({b[f'({index}) >> 1u']})[({index}) & 1]", "f32", ty)
    if storage == "bf16p":
        word = b[f"({index}) >> 1u"]
        return cast(f"bitcast<f32>(({word} >> (u32(({index}) & 1) * 16u)) << 16u)", "f32", ty)
    return load(b[index], storage, ty)


def vec4_ok(v: "BufferView", axis: int, size: int) -> bool:
    """Whether 4 consecutive elements along ``axis`` (of ``size``) of ``v`` can be one aligned vec4
    load. On CPU adapters each load is a loop over the SIMD lanes, so one vec4 load costs far less
    than four scalar ones."""
    others = [s for i, s in enumerate(v.strides) if i != axis and v.shape[i] > 1]
    return (v.strides[axis] == 1 and size % 4 == 0 and v.offset % 4 == 0 and all(s % 4 == 0 for s in others)
            and v.buf.dtype in ("f32", "f16"))


def vec4_f32(e: str, dt: str) -> str:
    """A vec4 load ``e`` of storage type ``dt`` as a vec4<f32>."""
    return e if dt == "f32" else f"vec4<f32>({e})"


def quarter(index: str) -> str:
    """The vec4 index of element ``index`` (an i32 expression, a multiple of 4 where it is read):
    ``index >> 2``. Not ``index / 4``: a signed division by 4 is a shift plus a sign correction in
    every lane, and on a CPU adapter, where it sits in the address of every load, it cost a GEMV
    a fifth of its time (benchmarks/NOTES.md). The two agree on every index that is not negative."""
    return f"({index}) >> 2u"


def vec4_read(k, v: "Value", idx: list[str], axis: int) -> str:
    """:meth:`Value.read4` of ``v`` as one ``vec4<f32>`` expression."""
    return f"vec4<f32>({', '.join(cast(e, v.ty, 'f32') for e in v.read4(k, idx, axis))})"


def load(raw: str, storage: str, ty: str) -> str:
    """Expression of type ``ty`` reading ``raw``, an element of a ``storage`` buffer (not packed)."""
    if storage == "u32":
        return cast(f"({raw} != 0u)", "bool", ty)
    if storage == "c32":
        return cast(f"{C64}(unpack2x16float({raw}))", C64, ty)
    if storage == "f16":
        return cast(f"f32({raw})", "f32", ty)
    return cast(raw, elem_type(storage), ty)


def store(expr: str, ty: str, storage: str) -> str:
    """``expr`` (of type ``ty``) converted for writing into a ``storage`` buffer."""
    if storage == "u32":
        return f"select(0u, 1u, {cast(expr, ty, 'bool')})"
    if storage == "c32":
        return f"tap_c32_bits({cast(expr, ty, C64)})"
    if storage == "f16":
        return f"f16({cast(expr, ty, 'f32')})"
    return cast(expr, ty, elem_type(storage))


def index_sum(idx: Sequence[str], strides: Sequence[int], offset: int = 0) -> str:
    """Linear element index ``offset + sum(idx[d] * strides[d])`` as a WGSL expression."""
    terms = [str(offset)] if offset else []
    for i, s in zip(idx, strides):
        if s == 0 or i == "0":
            continue
        terms.append(i if s == 1 else f"{i} * {s}")
    return " + ".join(terms) if terms else "0"


# --- values ------------------------------------------------------------------------------

class Value:
    """A lazily indexed tensor value: ``read(k, idx)`` is its element at ``idx`` as a WGSL
    expression of type ``ctype(dtype)``; ``cost`` > 0 means reading it computes something."""

    shape: tuple[int, ...]
    dtype: str
    cost: int = 0

    @property
    def ty(self) -> str:
        return ctype(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self, k: "KernelBuilder", idx: list[str]) -> str:
        raise NotImplementedError

    def bufs(self) -> frozenset:
        return frozenset()

    def reshaped(self, shape) -> "Value | None":
        """This value as ``shape`` (same elements in the same order) where it keeps its own kind
        (see :class:`tapml.platforms.wgsl.norms.NormedRow`); None: a reshape remaps it."""
        return None

    def written(self, pb: "ProgramBuilder") -> "BufferView | None":
        """The buffer this value is written to where it has a kernel of its own that
        :meth:`ProgramBuilder.plain` should use instead of a copy; None otherwise."""
        return None

    def read4(self, k: "KernelBuilder", idx: list[str], axis: int) -> list[str]:
        """The elements at ``idx`` and the three after it along ``axis`` (``idx[axis]`` a multiple
        of 4, ``shape[axis]`` too): a buffer read contiguously along ``axis`` is one vec4 load."""
        return [self.read(k, _shifted(k, idx, axis, c)) for c in range(4)]


class BufferView(Value):
    """A strided window on a device buffer."""

    def __init__(self, buf: BufferSpec, shape, strides, offset: int, dtype: str):
        self.buf, self.shape, self.strides = buf, tuple(shape), tuple(strides)
        self.offset, self.dtype = int(offset), dtype

    @classmethod
    def whole(cls, buf: BufferSpec, meta: TensorMeta) -> "BufferView":
        return cls(buf, meta.shape, contiguous_strides(meta.shape), 0, meta.dtype)

    @property
    def contiguous(self) -> bool:
        live = [(st, sz) for st, sz in zip(self.strides, self.shape) if sz != 1]
        return all(st == c for (st, sz), c in zip(live, contiguous_strides([sz for _, sz in live])))

    @property
    def is_whole(self) -> bool:
        return self.contiguous and self.offset == 0 and self.buf.meta is not None and \
            self.numel == self.buf.meta.numel

    def read(self, k, idx):
        if self.numel == 0 or self.buf.size == 0:
            # no element can be read, so the read sits in code that never runs (a loop over
            # zero elements); binding it would bind an empty buffer, which WebGPU cannot create
            return lit(0, self.ty)
        b = k.bind(self.buf)
        index = index_sum(idx, self.strides, self.offset)
        raw = f"{b.name}[{index}]"
        if self.buf.dtype in PACKED or b.split:
            index = k.let(index, "i32")
        return k.let(load_at(b, index, self.buf.dtype, self.ty), self.ty, key=raw)

    def read4(self, k, idx, axis):
        if not (axis < len(self.shape) == len(idx) and self.numel and self.buf.dtype == self.ty == "f32"
                and vec4_ok(self, axis, self.shape[axis])):
            return super().read4(k, idx, axis)
        b = k.bind(self.buf, elem="vec4<f32>")
        four = k.let(b[quarter(index_sum(idx, self.strides, self.offset))], "vec4<f32>")
        return [f"{four}.{c}" for c in "xyzw"]

    def bufs(self):
        return frozenset([self.buf.name])


class Remap(Value):
    """``src`` read at ``fn(k, idx)``: reshapes and views of computed values. ``in_order``: the
    elements are ``src``'s in the same row-major order (a reshape). ``axes``: the axes whose index
    ``fn`` passes unchanged to an axis of ``src`` of the same size (a permute's, or a reshape's
    dims that no merge or split touches), by axis."""

    def __init__(self, src: Value, shape, fn: Callable, in_order: bool = False, axes: dict[int, int] | None = None):
        self.src, self.shape, self.fn, self.dtype = src, tuple(shape), fn, src.dtype
        self.cost, self.in_order, self.axes = src.cost, in_order, dict(axes or {})

    def read(self, k, idx):
        return self.src.read(k, self.fn(k, idx))

    def read4(self, k, idx, axis):
        # four elements in order, from a multiple of 4, stay in one row of a source whose rows are
        # multiples of 4 long
        if self.in_order and axis == len(self.shape) - 1 and self.src.shape and self.src.shape[-1] % 4 == 0:
            return self.src.read4(k, self.fn(k, idx), len(self.src.shape) - 1)
        if axis in self.axes:  # the four are four neighbours along the source's axis
            return self.src.read4(k, self.fn(k, idx), self.axes[axis])
        return super().read4(k, idx, axis)

    def bufs(self):
        return self.src.bufs()


class Compute(Value):
    """Elementwise: ``fn(k, exprs, idx)`` combines the inputs' elements (read at the same
    index; inputs are already broadcast to ``shape``) into this value's element."""

    def __init__(self, shape, dtype: str, inputs: Sequence[Value], fn: Callable, cost: int = 1):
        self.shape, self.dtype, self.inputs, self.fn = tuple(shape), dtype, list(inputs), fn
        self.cost = cost + sum(v.cost for v in self.inputs)
        self._bufs = frozenset().union(*(v.bufs() for v in self.inputs))

    def read(self, k, idx):
        exprs = [v.read(k, idx) for v in self.inputs]
        e = round_low(k, self.fn(k, exprs, idx), self.dtype)
        return k.let(e, self.ty)

    def read4(self, k, idx, axis):
        if type(self).read is not Compute.read:  # a subclass that reads its inputs itself (Custom)
            return Value.read4(self, k, idx, axis)
        # an input of another shape (a scalar, a broadcast) is read an element at a time
        fours = [v.read4(k, idx, axis) if tuple(v.shape) == self.shape else Value.read4(v, k, idx, axis)
                 for v in self.inputs]
        return [k.let(round_low(k, self.fn(k, [f[c] for f in fours], _shifted(k, idx, axis, c)), self.dtype), self.ty)
                for c in range(4)]

    def bufs(self):
        return self._bufs


def _shifted(k: "KernelBuilder", idx: list[str], axis: int, c: int) -> list[str]:
    """``idx`` with ``c`` added along ``axis``."""
    return [k.let(f"{i} + {c}", "i32") if d == axis and c else i for d, i in enumerate(idx)]


def round_low(k: "KernelBuilder", e: str, dtype: str) -> str:
    """``e`` (an f32 expression) rounded to ``dtype`` when that is float16 or bfloat16, as torch
    rounds every low-precision op's result (kept in f32)."""
    if dtype == "float16":
        return f"f32(f16({e}))" if k.program.storage(dtype) == "f16" else f"{k.need('tap_round_f16')}({e})"
    if dtype == "bfloat16":
        return f"{k.need('tap_round_bf16')}({e})"
    if dtype == COMPLEX32:
        return f"{k.need('tap_round_c32')}({e})"
    return e


# --- kernels -----------------------------------------------------------------------------

class KernelBuilder:
    """Collects bindings, helper functions and body lines of one compute shader."""

    def __init__(self, program: "ProgramBuilder", name: str):
        self.program, self.name = program, name
        # (buffer, element type, window) -> (WGSL name, buffer, access, (offset, size) or None)
        self.bindings: dict[tuple[str, str, int], tuple[str, BufferSpec, str, tuple[int, int] | None]] = {}
        self.helpers: dict[str, str] = {}
        self.partial_floats = 0  # size of the workgroup array ``partial`` (combine_lanes): its largest tree
        self.lines: list[str] = []
        self.scopes: list[dict] = [{}]
        self.counter = 0
        self.trips: list[int] = []  # trip count of each open scope (1 for a block that is not a loop)
        self.iterations: int | None = 0  # loop iterations per invocation, None once a loop's count is unknown
        self.counted_loops = 0

    def bind(self, buf: BufferSpec, access: str = "read", elem: str | None = None) -> Binding:
        """Bind ``buf`` (as an array of ``elem``, its storage type's by default) and return how
        the kernel names it. A buffer over the binding limit is bound as several windows and
        read through an accessor function ``buf_NAME(i)`` (writes: :meth:`write`)."""
        plain = elem_type(buf.dtype)
        elem = elem or plain
        suffix = "" if elem == plain else "_at" if elem.startswith("atomic") else "_v4"
        name = f"buf_{buf.name}{suffix}"
        parts = self.program.windows(buf.size)
        for j, window in enumerate(parts):
            key = (buf.name, elem, j)
            if key not in self.bindings:
                part = name if len(parts) == 1 else f"{name}_w{j}"
                self.bindings[key] = (part, buf, access, None if len(parts) == 1 else window)
            elif access == "read_write":
                self.bindings[key] = (*self.bindings[key][:2], access, self.bindings[key][3])
        if len(parts) == 1:
            return Binding(name)
        per = parts[0][1] // ELEM_BYTES[elem]  # elements per window (the last may hold fewer)

        def by_window(stmt: str) -> str:
            """A body running ``stmt`` ({w}: the window's binding, {j}: the index in it) on
            the window that holds element ``i``."""
            lines = [f"  if (i < {per * (j + 1)}) {{ " + stmt.format(w=f"{name}_w{j}", j=f"i - {per * j}") + " }"
                     for j in range(len(parts) - 1)]
            last = len(parts) - 1
            return "\n".join([*lines, "  " + stmt.format(w=f"{name}_w{last}", j=f"i - {per * last}")])

        if elem.startswith("atomic"):  # a packed half-word store: clear its half, then set it
            setter = (f"fn {name}_set(i: i32, clear: u32, bits: u32)",
                      "atomicAnd(&{w}[{j}], clear); atomicOr(&{w}[{j}], bits); return;")
        else:
            self.helpers.setdefault(name, f"fn {name}(i: i32) -> {elem} {{\n" + by_window("return {w}[{j}];") + "\n}")
            setter = (f"fn {name}_set(i: i32, v: {elem})", "{w}[{j}] = v; return;")
        if access == "read_write":
            self.helpers.setdefault(f"{name}_set", setter[0] + " {\n" + by_window(setter[1]) + "\n}")
        return Binding(name, split=True, per_window=per)

    def write(self, buf: BufferSpec, index: str, expr: str, ty: str) -> None:
        """Emit the store of ``expr`` (of expression type ``ty``) into element ``index`` (an i32
        expression) of ``buf``, converting to its storage type (see :data:`PACKED`)."""
        if buf.dtype not in PACKED:
            b = self.bind(buf, "read_write")
            value = store(expr, ty, buf.dtype)
            self.emit(f"{b.name}_set({index}, {value});" if b.split else f"{b[index]} = {value};")
            return
        b = self.bind(buf, "read_write", elem="atomic<u32>")
        bits = self.need("tap_f16_bits" if buf.dtype == "f16p" else "tap_bf16_bits")
        i = self.let(index, "i32")
        self.open("")
        self.emit(f"let word: i32 = {i} >> 1u;")
        self.emit(f"let shift: u32 = u32({i} & 1) * 16u;")
        value = f"{bits}({cast(expr, ty, 'f32')}) << shift"
        if b.split:
            self.emit(f"{b.name}_set(word, ~(0xffffu << shift), {value});")
        else:
            self.emit(f"atomicAnd(&{b['word']}, ~(0xffffu << shift));")
            self.emit(f"atomicOr(&{b['word']}, {value});")
        self.close()

    def fresh(self, prefix: str = "t") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def emit(self, line: str) -> None:
        self.lines.append("  " * len(self.scopes) + line)

    def let(self, expr: str, ty: str, key: str | None = None) -> str:
        """Bind ``expr`` to a new name (memoized per scope, so equal reads are shared)."""
        key = key or expr
        for scope in reversed(self.scopes):
            if key in scope:
                return scope[key]
        if expr.isidentifier():
            return expr
        name = self.fresh()
        self.emit(f"let {name}: {ty} = {expr};")
        self.scopes[-1][key] = name
        return name

    def var(self, ty: str, init: str, prefix: str = "v") -> str:
        name = self.fresh(prefix)
        self.emit(f"var {name}: {ty} = {init};")
        return name

    def open(self, header: str, trips: int | None = None) -> None:
        """Open a block (``if``, ``for``, ...). A loop's ``trips`` (the most times it runs) is
        counted into :attr:`iterations`; a loop given none makes the kernel's count unknown."""
        self.emit(header + " {")
        self.scopes.append({})
        is_loop = header.lstrip().startswith(("for", "loop", "while"))
        if is_loop:
            self.counted_loops += 1
            if trips is None:
                self.iterations = None
            elif self.iterations is not None:
                self.iterations += math.prod(self.trips) * max(int(trips), 0)
        self.trips.append(max(int(trips), 1) if is_loop and trips is not None else 1)

    def close(self) -> None:
        self.scopes.pop()
        self.trips.pop()
        self.emit("}")

    def loop(self, var: str, count: int | str) -> None:
        """Open ``for var in [0, count)`` (an int count is counted into :attr:`iterations`)."""
        self.open(f"for (var {var}: i32 = 0; {var} < {count}; {var} = {var} + 1)",
                  count if isinstance(count, int) else None)

    def need(self, helper: str) -> str:
        from tapml.platforms.wgsl.helpers import HELPERS
        for dep in HELPERS[helper][0]:
            self.need(dep)
        self.helpers.setdefault(helper, HELPERS[helper][1])
        return helper

    def unravel(self, linear: str, shape: Sequence[int]) -> list[str]:
        """Per-dimension indices of a row-major linear index."""
        idx = []
        strides = contiguous_strides(shape)
        for d, (size, st) in enumerate(zip(shape, strides)):
            if size == 1:
                idx.append("0")
                continue
            e = linear if st == 1 else f"({linear} / {st})"
            if d > 0 and any(s != 1 for s in shape[:d]):
                e = f"({e} % {size})"
            idx.append(self.let(e, "i32"))
        return idx

    def finish(self, threads: int, workgroup: tuple[int, int, int] | None = None,
               groups: tuple[int, int, int] | None = None, group_ids: bool = False) -> Kernel:
        """Wrap the body: with ``threads`` (1-D kernels) the body sees ``n`` (the thread's
        linear index, < threads) on a 2-D grid when one dimension is not enough. ``group_ids``:
        the body also sees ``lid`` (its lane in the workgroup) and ``wid`` (the workgroup's id)."""
        if groups is None:
            wg = WORKGROUP
            total = max(1, -(-threads // wg))
            gx = min(total, MAX_GROUPS)
            gy = -(-total // gx)
            if gy > MAX_GROUPS:
                raise Unsupported(f"{threads} threads need more than {MAX_GROUPS}x{MAX_GROUPS} workgroups")
            groups = (gx, gy, 1)
            workgroup = (wg, 1, 1)
            pre = [f"  let n: i32 = i32(gid.y) * {gx * wg} + i32(gid.x);",
                   f"  if (n >= {threads}) {{ return; }}"]
        else:
            pre = []
        for g in groups:
            if g > MAX_GROUPS:
                raise Unsupported(f"dispatch of {groups} workgroups exceeds {MAX_GROUPS} per dimension")
        body = "\n".join(pre + self.lines)
        if "tap_bits_f32(" in body:  # literals of Inf and NaN (see lit) call it
            self.need("tap_bits_f32")
        if "tap_c32_bits(" in body:  # complex32 stores (see store) call it
            self.need("tap_c32_bits")
        if I64 in body or U64 in body:
            from tapml.platforms.wgsl.int64 import helpers_called
            for helper in helpers_called(body):
                self.need(helper)
        if C64 in body:
            from tapml.platforms.wgsl.complex import helpers_called as complex_helpers
            for helper in complex_helpers(body):
                self.need(helper)
        header = [f"@group(0) @binding({i}) var<storage, {access}> {name}: array<{elem}>;"
                  for i, ((_, elem, _), (name, _, access, _)) in enumerate(self.bindings.items())]
        header.extend(self.helpers.values())
        if I64 in body or any(I64 in h for h in header):
            header.insert(0, f"alias {I64} = vec2<u32>;")
        if re.search(rf"\b{U64}\b", body) or any(re.search(rf"\b{U64}\b", h) for h in header):
            header.insert(0, f"alias {U64} = vec2<u32>;")
        if C64 in body or any(C64 in h for h in header):
            header.insert(0, f"alias {C64} = vec2<f32>;")
        if re.search(r"\bf16\b", body) or any(re.search(r"\bf16\b", key[1]) for key in self.bindings):
            header.insert(0, "enable f16;")
        src = "\n".join(header) + "\n\n" + \
            f"@compute @workgroup_size({', '.join(map(str, workgroup))})\n" + \
            f"fn main({MAIN_WITH_GROUP_IDS if group_ids else MAIN}) {{\n" + \
            body + "\n}\n"
        limit = self.program.max_bindings
        if len(self.bindings) > limit:
            raise Unsupported(f"kernel {self.name} binds {len(self.bindings)} storage buffers; "
                              f"the device allows {limit} (max-storage-buffers-per-shader-stage)")
        # a loop written into the body without open() is one the count does not know
        loops = sum(len(re.findall(r"(?:^|[;{]\s*)(?:for\s*\(|loop\s*\{|while\b)", line.strip()))
                    for line in self.lines)
        iterations = self.iterations if loops <= self.counted_loops else None
        kernel = Kernel(name=self.name, wgsl=src, bindings=[(b.name, acc, *(window or ())) for _, b, acc, window
                                                            in self.bindings.values()],
                        workgroups=tuple(int(g) for g in groups), loop_iterations=iterations)
        if pre and not re.search(r"workgroupBarrier|var<workgroup>|subgroup", src):
            self.program.one_dimensional[id(kernel)] = (self, threads, iterations)
        return kernel

    def accesses(self) -> tuple[set[str], set[str]]:
        """The buffers this kernel reads and the ones it writes, by name."""
        reads, writes = set(), set()
        for _, buf, access, _ in self.bindings.values():
            (writes if access == "read_write" else reads).add(buf.name)
        return reads, writes


# --- program -----------------------------------------------------------------------------

#: a merged dispatch takes at most this many kernels' bodies, of at most this many lines in all, so
#: that no shader grows past what a compiler (Tint, lavapipe's LLVM) builds quickly
MAX_MERGED_BODIES, MAX_MERGED_LINES = 8, 400


class ProgramBuilder:
    """Buffers and kernels of one KernelProgram, with the device's limits."""

    def __init__(self, caps: dict):
        self.caps = caps or {}
        limits = self.caps.get("limits") or {}
        self.features = set(self.caps.get("features") or [])
        self.max_bindings = int(limits.get("max-storage-buffers-per-shader-stage", 8))
        self.max_buffer_size = int(limits.get("max-buffer-size", 256 << 20))
        # a binding never spans more than a buffer: parts of a tensor over max-buffer-size are
        # whole numbers of windows, so windows are at most max-buffer-size too
        self.max_binding_size = min(int(limits.get("max-storage-buffer-binding-size", 128 << 20)),
                                    self.max_buffer_size)
        self.window_align = int(limits.get("min-storage-buffer-offset-alignment", WINDOW_ALIGN))
        self.buffers: list[BufferSpec] = []
        self.sizes: dict[str, int] = {}  # buffer name -> bytes
        self.kernels: list[Kernel] = []
        self.names: dict[str, int] = {}
        # id of a finished 1-D kernel -> (its builder, threads, loop iterations): what merge_independent joins
        self.one_dimensional: dict[int, tuple] = {}
        # values computed once per program and read by several kernels (attention's chunk flags)
        self.memo: dict = {}

    def storage(self, dtype: str) -> str:
        """The WGSL storage type of torch dtype ``dtype`` on this device (Unsupported if none)."""
        storage = STORAGE.get(dtype)
        if storage is None:
            raise Unsupported(f"dtype {dtype} has no WGSL storage type")
        if storage == "f16" and "shader-f16" not in self.features:
            return "f16p"
        return storage

    def buffer(self, role: str, meta: TensorMeta, hint: str = "t") -> BufferSpec:
        storage = self.storage(meta.dtype)
        nbytes = meta.numel * ITEMSIZE[storage]
        size = -(-nbytes // 4) * 4  # WebGPU buffer sizes are multiples of 4
        if meta.numel >= MAX_ELEMENTS:
            raise Unsupported(f"a {meta.dtype} tensor of shape {list(meta.shape)} has {meta.numel} elements; WGSL "
                              f"kernels index elements with i32, so a tensor must have fewer than 2**31")
        if size > self.max_buffer_size and self.part_bytes() == 0:
            raise Unsupported(f"a {meta.dtype} tensor of shape {list(meta.shape)} needs {size} bytes, over the "
                              f"device's max-buffer-size of {self.max_buffer_size}, and cannot be split across "
                              f"buffers: one binding window ({window_bytes(self.max_binding_size, self.window_align)} "
                              "bytes, a multiple of min-storage-buffer-offset-alignment) is larger than a buffer")
        buf = BufferSpec(name=f"{hint[0]}{len(self.buffers)}", dtype=storage, size=size, role=role, meta=meta)
        self.buffers.append(buf)
        self.sizes[buf.name] = size
        return buf

    def kernel(self, name: str) -> KernelBuilder:
        n = self.names[name] = self.names.get(name, -1) + 1
        return KernelBuilder(self, f"{name}_{n}")

    def add(self, kernel: Kernel) -> None:
        self.kernels.append(kernel)

    def merge_independent(self) -> None:
        """Run neighbouring one-dimensional kernels that share no written buffer (neither writes
        what the other reads or writes) as one dispatch: its invocations are the first kernel's,
        then the second's, each running its own body. On CPU adapters a dispatch costs more than a
        small kernel's work (a decode step's cache puts and scalar outputs); a kernel with
        workgroup memory or barriers, or one past the device's bindings, keeps its own."""
        merged: list[Kernel] = []
        run: list[tuple] = []  # (builder, threads, iterations, kernel) of the kernels in the current run
        reads: set[str] = set()
        writes: set[str] = set()
        keys: set = set()
        lines = 0

        def flush():
            nonlocal lines
            if run:
                merged.append(run[0][3] if len(run) == 1 else self._merged(run))
            for held in (run, reads, writes, keys):
                held.clear()
            lines = 0

        for kernel in self.kernels:
            info = self.one_dimensional.get(id(kernel))
            if info is None:
                flush()
                merged.append(kernel)
                continue
            builder = info[0]
            its_reads, its_writes = builder.accesses()
            if run and (its_writes & (reads | writes) or its_reads & writes or
                        len(keys | set(builder.bindings)) > self.max_bindings or len(run) >= MAX_MERGED_BODIES or
                        lines + len(builder.lines) > MAX_MERGED_LINES):
                flush()
            run.append((*info, kernel))
            reads |= its_reads
            writes |= its_writes
            keys |= set(builder.bindings)
            lines += len(builder.lines)
        flush()
        self.kernels = merged

    def _merged(self, run: list[tuple]) -> Kernel:
        k = KernelBuilder(self, "+".join(r[0].name for r in run))
        start = 0
        for i, (builder, threads, iterations, _) in enumerate(run):
            k.bindings.update(builder.bindings)
            k.helpers.update(builder.helpers)
            if i == 0:
                k.lines.append(f"  if (n < {threads}) {{")
            else:
                k.lines.append("  } else {" if i == len(run) - 1 else f"  }} else if (n < {start + threads}) {{")
                k.lines.append(f"  let n: i32 = n - {start};")  # the body's own index, as in its own kernel
            k.lines.extend(builder.lines)
            k.counted_loops += builder.counted_loops
            start += threads
        k.lines.append("  }")
        counts = [r[2] for r in run]
        k.iterations = None if None in counts else max(counts)
        return k.finish(start)

    def materialize(self, value: Value, out: BufferSpec | None = None, name: str = "copy") -> BufferView:
        """Write ``value`` contiguously into ``out`` (a new temp buffer by default)."""
        meta = TensorMeta(tuple(value.shape), value.dtype)
        if out is None:
            out = self.buffer("temp", meta)
        if value.numel == 0:
            return BufferView.whole(out, meta)
        k = self.kernel("fused" if value.cost > 0 else name)
        idx = k.unravel("n", value.shape)
        e = value.read(k, idx)
        k.write(out, "n", e, value.ty)
        self.add(k.finish(value.numel))
        return BufferView.whole(out, meta)

    def plain(self, value: Value) -> BufferView:
        """The value as a strided buffer (materializing computed values)."""
        if isinstance(value, BufferView):
            return value
        return value.written(self) or self.materialize(value)

    def bindings_of(self, names) -> int:
        """How many bindings a kernel needs to read the buffers ``names`` (a split one needs one per window)."""
        return sum(len(self.windows(self.sizes.get(n, 0))) for n in names)

    def windows(self, size: int) -> list[tuple[int, int]]:
        """The byte windows a kernel binds a buffer of ``size`` bytes through (one: all of it)."""
        return windows(size, self.max_binding_size, self.window_align)

    def part_bytes(self) -> int:
        """Bytes of each part (the last may be smaller) of a buffer over max-buffer-size: the most
        whole windows that fit one buffer, so that no window straddles two parts (0: not even one)."""
        window = window_bytes(self.max_binding_size, self.window_align)
        return self.max_buffer_size // window * window

    def into_parts(self, program: KernelProgram) -> KernelProgram:
        """``program`` (built here) with every buffer over max-buffer-size replaced by its parts:
        buffers ``NAME.pK`` of :meth:`part_bytes` bytes (1-D metas of their elements) in the same
        role, the window bindings of the buffer moved onto the part that holds them, and the
        tensor recorded in ``parts`` (:class:`~tapml.platforms.base.SplitTensor`). The program
        itself when nothing is that large."""
        split = {b.name: b for b in program.buffers if b.size > self.max_buffer_size}
        if not split:
            return program
        step = self.part_bytes()
        buffers, tensors, pieces = [], [], {}
        for b in program.buffers:
            if b.name not in split:
                buffers.append(b)
                continue
            per = step // ITEMSIZE[b.dtype]  # elements per part
            names = []
            for k, start in enumerate(range(0, b.meta.numel, per)):
                count = min(per, b.meta.numel - start)
                size = -(-count * ITEMSIZE[b.dtype] // 4) * 4
                data = None if b.data is None else b.data[k * step:k * step + size]
                buffers.append(BufferSpec(name=f"{b.name}.p{k}", dtype=b.dtype, size=size, role=b.role,
                                          meta=TensorMeta((count,), b.meta.dtype), data=data))
                names.append((buffers[-1].name, start, count))
            tensors.append(SplitTensor(name=b.name, role=b.role, meta=b.meta, parts=names))
            pieces[b.name] = [n for n, _, _ in names]
        kernels = []
        for kern in program.kernels:
            bindings = []
            for binding in kern.bindings:
                if binding[0] not in split:
                    bindings.append(binding)
                    continue
                name, access, *window = binding
                k = window[0] // step if window else -1
                if not window or window[0] + window[1] > (k + 1) * step:
                    raise PlatformError(f"kernel {kern.name} binds {'all of' if not window else 'a window across parts of'} "
                                        f"buffer {name}, which is over max-buffer-size")
                bindings.append((pieces[name][k], access, window[0] - k * step, window[1]))
            kernels.append(Kernel(name=kern.name, wgsl=kern.wgsl, bindings=bindings, workgroups=kern.workgroups,
                                  entry=kern.entry, loop_iterations=kern.loop_iterations))
        specs = {b.name: b for b in buffers}

        def expand(names: list[str], metas: list[TensorMeta]) -> tuple[list[str], list[TensorMeta]]:
            out_names, out_metas = [], []
            for n, m in zip(names, metas):
                out_names.extend(pieces.get(n, [n]))
                out_metas.extend([specs[p].meta for p in pieces[n]] if n in pieces else [m])
            return out_names, out_metas

        inputs, input_meta = expand(program.inputs, program.input_meta)
        outputs, output_meta = expand(program.outputs, program.output_meta)
        return KernelProgram(kind=program.kind, inputs=inputs, outputs=outputs, buffers=buffers, kernels=kernels,
                             graph=program.graph, input_meta=input_meta, output_meta=output_meta, parts=tensors)

    def fit(self, values: list[Value], reserved: int) -> list[Value]:
        """Materialize computed inputs until a kernel reading ``values`` and binding
        ``reserved`` more buffers stays within the binding limit."""
        values = list(values)
        while self.bindings_of(frozenset().union(*(v.bufs() for v in values))) + reserved > self.max_bindings:
            i = max(range(len(values)), key=lambda j: len(values[j].bufs()))
            if isinstance(values[i], BufferView) or len(values[i].bufs()) < 2:
                raise Unsupported(f"a kernel would bind more than {self.max_bindings} storage buffers (the device's "
                                  "max-storage-buffers-per-shader-stage; a buffer over max-storage-buffer-binding-size "
                                  "takes one binding per window)")
            values[i] = self.materialize(values[i])
        return values


class Custom(Compute):
    """A value whose element is computed by ``fn(k, idx)``, which reads ``inputs`` itself
    (gathers, padding, pooling windows of computed values)."""

    def read(self, k, idx):
        return k.let(self.fn(k, idx), self.ty)


#: ``main``'s parameters: the invocation's global id, and with :meth:`finish`'s ``group_ids`` its
#: lane in the workgroup and the workgroup's id.
MAIN = "@builtin(global_invocation_id) gid: vec3<u32>"
MAIN_WITH_GROUP_IDS = MAIN + ", @builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>"


def combine_lanes(k: Compute, lanes: int, lane: str, slot: str, values: list[str],
                  combine: Callable[[int, str, str], str] = lambda e, a, b: f"{a} + {b}") -> list[str]:
    """``values`` (f32 expressions) of ``lanes`` neighbouring lanes combined in workgroup memory, as
    a barrier tree: ``slot`` is this lane's index among the workgroup's lanes (its partner ``step``
    lanes on is ``slot + step``), ``combine(e, a, b)`` joins element ``e`` of two lanes (a sum by
    default). Returns the combined elements as the first lane of the ``lanes`` reads them. The
    barriers sit outside any branch: call it at the kernel's top level."""
    n = len(values)
    k.partial_floats = max(k.partial_floats, WORKGROUP * n)
    k.helpers["partial"] = f"var<workgroup> partial: array<f32, {k.partial_floats}>;"
    base = k.let(f"({slot}) * {n}", "i32")
    for e, v in enumerate(values):
        k.emit(f"partial[{base} + {e}] = {v};")
    step = lanes // 2
    while step:
        k.emit("workgroupBarrier();")
        k.open(f"if ({lane} < {step})")
        for e in range(n):
            joined = combine(e, f"partial[{base} + {e}]", f"partial[{base} + {step * n + e}]")
            k.emit(f"partial[{base} + {e}] = {joined};")
        k.close()
        step //= 2
    k.emit("workgroupBarrier();")
    return [f"partial[{base} + {e}]" for e in range(n)]
