"""The oracle harness of ggml_lite, modelled on ggml's tests/test-backend-ops.cpp (test mode).

A *case* (one `Case` subclass per op, like ggml's `test_case` structs) builds a small graph around
one op, initialises its tensors as ggml does (uniform [-1, 1]; quantized, F16 and BF16 tensors
filled by quantizing random floats), and computes the expected result with an *independent* numpy
reference written from ggml's semantics (ggml-notes §3), not by calling ggml_lite's kernels.
The result of the tested compute is then judged as test-backend-ops judges it: NaN never allowed,
infinities (and ±FLT_MAX) must match in sign, NMSE = Σ(a−b)²/Σa² (a = tested output) at most the
op's limit (1e-7 default, 5e-4 MUL_MAT, 1e-6 SOFT_MAX, the CPY rules); sentinel tensors between the
case's tensors must come back byte-identical, and so must every input.

What differs from test-backend-ops, and why:
- the reference is numpy, not the CPU backend: ggml compares two backends, ggml_lite's CPU backend
  *is* the thing under test. Quantized values are decoded with the `gguf` package's numpy
  dequantizers, F16 with numpy, BF16 by bit shifting. Only where `gguf` has no quantizer (Q4_K,
  Q6_K as a CPY destination) does the reference quantize with ggml_lite.types' reference
  quantizers, which tests/test_types.py checks byte-for-byte against real ggml.
- only the output node is compared (the cases here are one op plus views, so that is the node
  test-backend-ops compares too).
- where both sides hold the same infinity, ggml's NMSE becomes NaN and passes whatever the finite
  entries hold; here the NMSE is taken over the finite entries, so diag_mask_inf is really judged.
- every input tensor's bytes must be unchanged after compute (a stronger sentinel).
- the random numbers are seeded per case (crc32 of its name), so a failure repeats.
- ggml runs every node on all the plan's threads; ggml_lite's compute layer gives a node under
  MIN_WORK_PER_NODE one thread, which would leave the kernels' thread splits untested on these
  small cases, so the default hook sets the plan's min_work_per_node to 0 (see cpu_compute).

Hooks: a compute hook is compute(gf, ctx) -> Status. cpu_compute(n) (graph_plan + graph_compute,
the default), cpu_compute_with_ctx(n) (work buffer from the context: build with extra_mem), and
for the backend API (test-backend-ops' own setting):
    eval_case(case, backend_compute(backend), no_alloc=True, alloc=backend_alloc(backend),
              supports=backend_supports(backend))
or step by step: built = build_case(case, no_alloc=True); built.buffer = <allocate>;
verdict = eval_built(built, compute); free_built(built).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as GQ
from gguf import quants as gguf_quants

import ggml_lite as ggml
from ggml_lite import Type

SENTINEL_SIZE = 1024                 # floats per sentinel, as test_case::sentinel_size
FLT_MAX = np.float32(np.finfo(np.float32).max)

# The types ggml_lite implements, in the roles test-backend-ops gives them.
ALL_TYPES = (Type.F32, Type.F16, Type.BF16, Type.Q4_0, Type.Q4_1, Type.Q8_0, Type.Q4_K, Type.Q6_K)
BASE_TYPES = (Type.F32, Type.F16, Type.Q8_0, Type.Q4_0, Type.Q4_1, Type.Q4_K)
OTHER_TYPES = (Type.Q4_1, Type.Q8_0, Type.Q6_K, Type.BF16)
VEC_DOT_TYPE = {Type.F32: Type.F32, Type.F16: Type.F16, Type.BF16: Type.BF16, Type.Q4_0: Type.Q8_0,
                Type.Q4_1: Type.Q8_1, Type.Q8_0: Type.Q8_0, Type.Q4_K: Type.Q8_K, Type.Q6_K: Type.Q8_K}

_GGUF = {Type.Q4_0: GQ.Q4_0, Type.Q4_1: GQ.Q4_1, Type.Q8_0: GQ.Q8_0, Type.Q4_K: GQ.Q4_K,
         Type.Q6_K: GQ.Q6_K}
_INT_DTYPES = {Type.I8: np.int8, Type.I16: np.int16, Type.I32: np.int32, Type.I64: np.int64}


def tname(t) -> str:
    return ggml.type_name(t)


# ---------------------------------------------------------------------------------------------
# Number formats, written here from their definitions (ggml-notes §2.1), not taken from ggml_lite
# ---------------------------------------------------------------------------------------------

def bf16_bits(x) -> np.ndarray:
    """fp32 -> bf16 bits: round to nearest even; NaN -> quiet NaN (ggml_compute_fp32_to_bf16)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 64, rne).astype(np.uint16)


def bf16_to_f32(bits) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to(type, x) -> np.ndarray:
    """Values as a tensor of `type` would hold them (float32 first, as ggml's kernels compute in f32)."""
    x32 = np.asarray(x, np.float64).astype(np.float32)
    if type == Type.F32:
        return x32
    if type == Type.F16:
        return x32.astype(np.float16).astype(np.float32)
    if type == Type.BF16:
        return bf16_to_f32(bf16_bits(x32))
    if ggml.is_quantized(type):
        return quantize_roundtrip(type, x32)
    if type in _INT_DTYPES:
        return np.asarray(x)
    raise NotImplementedError(tname(type))


def decode_rows(type, rows: np.ndarray, ne0: int) -> np.ndarray:
    """uint8 rows of a quantized type -> float32 (nrows, ne0), by gguf's numpy dequantizers."""
    rows = np.ascontiguousarray(rows).reshape(-1, ggml.row_size(type, ne0))
    return gguf_quants.dequantize(rows, _GGUF[type]).astype(np.float32).reshape(-1, ne0)


def quantize_roundtrip(type, x) -> np.ndarray:
    """x (..., ne0) float32 -> what a `type` tensor holding x reads back as (the reference for CPY)."""
    x = np.ascontiguousarray(x, np.float32)
    ne0 = x.shape[-1]
    rows = x.reshape(-1, ne0)
    if type in (Type.Q4_0, Type.Q4_1, Type.Q8_0):
        q = gguf_quants.quantize(rows, _GGUF[type])
    else:   # gguf has no K-quant quantizer: ggml's reference quantizer as ggml_lite.types writes it
        q = ggml.quantize_chunk(type, rows)
    return decode_rows(type, q, ne0).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# Tensor bytes in and out (context pool or any backend buffer)
# ---------------------------------------------------------------------------------------------

def _root(t):
    return t.view_src if t.view_src is not None else t


def read_raw(root) -> np.ndarray:
    """A copy of the bytes of a root (non-view, contiguous) tensor."""
    n = ggml.nbytes(root)
    if root.buffer is not None:
        return ggml.backend_tensor_get(root, offset=0, size=n)
    return np.ascontiguousarray(root.numpy()).reshape(-1).view(np.uint8).copy()


def write_raw(root, raw: np.ndarray) -> None:
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    assert raw.size == ggml.nbytes(root), (raw.size, ggml.nbytes(root))
    if root.buffer is not None:
        ggml.backend_tensor_set(root, raw)
    else:
        root.numpy().reshape(-1).view(np.uint8)[:] = raw


def tensor_values(t, raw=None) -> np.ndarray:
    """The logical values of t, shaped (ne3, ne2, ne1, ne0), read through its strides as
    test-backend-ops' tensor_to_float does: float32 for float and quantized types, ints for ints."""
    raw = read_raw(_root(t)) if raw is None else raw
    offs = t.view_offs if t.view_src is not None else 0
    ne3, ne2, ne1, ne0 = t.ne[3], t.ne[2], t.ne[1], t.ne[0]
    if ggml.is_quantized(t.type):
        assert t.nb[0] == ggml.type_size(t.type), "quantized rows must be dense"
        rb = ggml.row_size(t.type, ne0)
        rows = np.ndarray((ne3, ne2, ne1, rb), np.uint8, raw, offs, (t.nb[3], t.nb[2], t.nb[1], 1))
        return decode_rows(t.type, rows, ne0).reshape(ne3, ne2, ne1, ne0)
    dtype = {Type.F32: np.float32, Type.F16: np.float16, Type.BF16: np.uint16}.get(t.type)
    dtype = dtype or _INT_DTYPES[t.type]
    a = np.ndarray((ne3, ne2, ne1, ne0), dtype, raw, offs, (t.nb[3], t.nb[2], t.nb[1], t.nb[0]))
    if t.type == Type.BF16:
        return bf16_to_f32(a)
    if t.type == Type.F16:
        return a.astype(np.float32)
    return a.copy()


def init_tensor_uniform(t, rng, lo=-1.0, hi=1.0) -> None:
    """test-backend-ops' init_tensor_uniform: uniform floats; quantized/F16/BF16 by quantizing them
    (ggml_quantize_chunk); integer tensors get random integers (ggml writes float bit patterns)."""
    n = ggml.nelements(t)
    if t.type in _INT_DTYPES:
        info = np.iinfo(_INT_DTYPES[t.type])
        bound = min(info.max, 1 << 24)        # exact as float32, so NMSE on ints is meaningful
        data = rng.integers(-bound, bound, n).astype(_INT_DTYPES[t.type])
        write_raw(t, data)
        return
    data = rng.uniform(lo, hi, n).astype(np.float32)
    if t.type == Type.F32:
        write_raw(t, data)
    else:
        write_raw(t, ggml.quantize_chunk(t.type, data.reshape(-1, t.ne[0])))


# ---------------------------------------------------------------------------------------------
# The comparison (test-backend-ops' callback + nmse)
# ---------------------------------------------------------------------------------------------

def nmse(a: np.ndarray, b: np.ndarray) -> float:
    """mse(a, b) / mse(a, 0) as ggml's nmse(): float differences and squares, double sums.
    0/0 (both all zero) is NaN, which passes any limit, as in C."""
    a = np.asarray(a, np.float32).ravel()
    b = np.asarray(b, np.float32).ravel()
    with np.errstate(over="ignore"):          # squares past FLT_MAX are inf, silently, as in C
        d = a - b
        num = float(np.sum((d * d).astype(np.float64)))
        den = float(np.sum((a * a).astype(np.float64)))
    if den == 0.0:
        return math.nan if num == 0.0 else math.inf
    return num / den


def _isinf_or_max(x):
    return np.isinf(x) | (x == FLT_MAX) | (x == -FLT_MAX)


@dataclass
class Verdict:
    ok: bool
    nmse: float = math.nan
    message: str = ""
    supported: bool = True                   # False: the backend declined an op (ggml skips those)

    def __str__(self):
        return ("OK" if self.ok else "FAIL") + (f" (NMSE = {self.nmse:.3e})" if not math.isnan(self.nmse) else "") + \
            (f": {self.message}" if self.message else "")


def compare(got, ref, max_err: float, what: str = "") -> Verdict:
    """Judge the tested output `got` against the reference `ref` (same logical shape)."""
    a = np.asarray(got, np.float32).ravel()
    b = np.asarray(ref, np.float32).ravel()
    if a.shape != b.shape:
        return Verdict(False, message=f"[{what}] {a.size} values, reference has {b.size}")
    bad = np.flatnonzero(np.isnan(a) | np.isnan(b))
    if bad.size:
        i = bad[0]
        return Verdict(False, message=f"[{what}] NaN at index {i} (got={a[i]} ref={b[i]}), {bad.size} in all")
    ia, ib = _isinf_or_max(a), _isinf_or_max(b)
    bad = np.flatnonzero(ia != ib)
    if bad.size:
        i = bad[0]
        return Verdict(False, message=f"[{what}] inf mismatch at index {i}: got={a[i]} ref={b[i]}")
    both = ia & ib
    bad = np.flatnonzero(both & (np.signbit(a) != np.signbit(b)))
    if bad.size:
        i = bad[0]
        return Verdict(False, message=f"[{what}] inf sign mismatch at index {i}: got={a[i]} ref={b[i]}")
    err = nmse(a[~both], b[~both])
    if err > max_err:
        return Verdict(False, err, f"[{what}] NMSE = {err:.9f} > {max_err:.9f}")
    return Verdict(True, err)


# ---------------------------------------------------------------------------------------------
# Building a case's graph
# ---------------------------------------------------------------------------------------------

class Builder:
    """What a case's build_graph gets: the context, and ggml_new_tensor wrappers that put a
    sentinel tensor after every tensor they make (test_case's hijacked ggml_new_tensor)."""

    def __init__(self, ctx, sentinels: bool):
        self.ctx = ctx
        self.use_sentinels = sentinels
        self.sentinels = []

    def add_sentinel(self):
        if self.use_sentinels:
            s = ggml.new_tensor_1d(self.ctx, Type.F32, SENTINEL_SIZE)
            ggml.set_name(s, f"sent_{len(self.sentinels)}")
            self.sentinels.append(s)

    def new_tensor(self, type, ne, name):
        ne = list(ne) + [1] * (4 - len(ne))
        t = ggml.new_tensor(self.ctx, type, 4, ne)
        ggml.set_name(t, name)
        self.add_sentinel()
        return t


@dataclass
class Built:
    case: "Case"
    ctx: object
    gf: object
    out: object
    sentinels: list
    buffer: object = None                    # a backend buffer that holds the tensors (no_alloc)
    keep: list = field(default_factory=list)


def _measure(case) -> int:
    """Pool bytes the case needs in an allocated context (a dry build in a no_alloc context)."""
    ctx = ggml.init(mem_size=ggml.tensor_overhead() * 512 + ggml.graph_overhead(), no_alloc=True)
    try:
        b = Builder(ctx, sentinels=True)
        b.add_sentinel()
        case.build_graph(b)
        b.add_sentinel()
        tensors = list(ctx)
        data = sum(ggml.nbytes_pad(t) for t in tensors if t.view_src is None)
        return data + (len(tensors) + 4) * ggml.tensor_overhead() + ggml.graph_overhead() + 4096
    finally:
        ggml.free(ctx)


def build_case(case, no_alloc: bool = False, sentinels: bool = True, extra_mem: int = 0) -> Built:
    """The case's graph in a fresh context: allocated (tensors live in the context's pool), or
    no_alloc (descriptors only; place them with ggml.backend_alloc_ctx_tensors or an allocator,
    put the buffer in built.buffer, then call eval_built). extra_mem: spare pool bytes, e.g. for
    the work buffer graph_compute_with_ctx takes from the context."""
    if no_alloc:
        mem = ggml.tensor_overhead() * 512 + ggml.graph_overhead() + extra_mem
    else:
        mem = _measure(case) + extra_mem
    ctx = ggml.init(mem_size=mem, no_alloc=no_alloc)
    gf = ggml.new_graph(ctx)
    b = Builder(ctx, sentinels)
    b.add_sentinel()                         # pre-graph sentinel
    out = case.build_graph(b)
    b.add_sentinel()                         # post-graph sentinel
    ggml.build_forward_expand(gf, out)
    return Built(case, ctx, gf, out, b.sentinels)


def free_built(built: Built) -> None:
    if built.buffer is not None:
        ggml.backend_buffer_free(built.buffer)
        built.buffer = None
    ggml.free(built.ctx)


def case_seed(case) -> int:
    return zlib.crc32(case.name().encode())


Compute = Callable[[object, object], object]     # compute(gf, ctx) -> Status


def cpu_compute(n_threads: int, every_thread: bool = True, trace: list = None) -> Compute:
    """The default hook: ggml.graph_plan + ggml.graph_compute with n_threads, work buffer ours.

    every_thread: ggml runs every node on all the plan's threads; ggml_lite's compute layer gives
    a node below MIN_WORK_PER_NODE one thread. The cases are small, so by default the plan's
    min_work_per_node is 0, and the thread partitions of every kernel really are exercised.
    trace: a list that receives the plan's (ith, node, t0, t1) records."""
    def compute(gf, ctx):
        plan = ggml.graph_plan(gf, n_threads)
        plan.work_data = np.zeros(max(int(plan.work_size), 0), np.uint8)
        plan.trace = trace
        if every_thread:
            plan.min_work_per_node = 0
        return ggml.graph_compute(gf, plan)
    compute.__name__ = f"cpu_compute_{n_threads}"
    return compute


def eval_built(built: Built, compute: Compute, rng=None) -> Verdict:
    """Initialise, take the reference, compute, judge (test_case::eval for one backend)."""
    case, out = built.case, built.out
    rng = np.random.default_rng(case_seed(case)) if rng is None else rng
    case.initialize_tensors(built, rng)
    srcs = [tensor_values(s) if s is not None else None for s in out.src]
    ref = case.reference(srcs, out)
    out_root = _root(out)
    roots = [t for t in built.ctx if t.view_src is None and t is not out_root]
    before = [read_raw(t) for t in roots]
    status = compute(built.gf, built.ctx)
    if status is not None and status != ggml.Status.SUCCESS:
        return Verdict(False, message=f"compute returned {status!r}")
    for t, raw in zip(roots, before):
        if not np.array_equal(read_raw(t), raw):
            kind = "sentinel" if t.name.startswith("sent_") else "input"
            return Verdict(False, message=f"{kind} mismatch: '{t.name}' was written")
    return compare(tensor_values(out), ref, case.max_nmse_err(), case.op)


def cpu_compute_with_ctx(n_threads: int) -> Compute:
    """ggml.graph_compute_with_ctx: the work buffer comes from the case's context (build the case
    with extra_mem for it)."""
    return lambda gf, ctx: ggml.graph_compute_with_ctx(ctx, gf, n_threads)


# Hooks for the backend API (test-backend-ops' own setting): tensors in the backend's buffer,
# the graph computed by ggml.backend_graph_compute, cases skipped where supports_op says no.

def backend_compute(backend) -> Compute:
    return lambda gf, ctx: ggml.backend_graph_compute(backend, gf)


def backend_alloc(backend):
    return lambda ctx: ggml.backend_alloc_ctx_tensors(ctx, backend)


def backend_supports(backend):
    """supports(built) -> bool: every tensor of the case supported by the backend (as test-backend-ops
    asks before it allocates)."""
    return lambda built: all(ggml.backend_supports_op(backend, t) for t in built.ctx)


def eval_case(case, compute: Compute, no_alloc: bool = False, alloc=None, supports=None,
              extra_mem: int = 0) -> Verdict:
    """Build, (alloc), run and judge one case. alloc(ctx) -> buffer for no_alloc contexts;
    supports(built) -> bool, False gives Verdict(ok=True, supported=False) without computing."""
    built = build_case(case, no_alloc=no_alloc, extra_mem=extra_mem)
    try:
        if supports is not None and not supports(built):
            return Verdict(True, message="not supported", supported=False)
        if no_alloc:
            built.buffer = alloc(built.ctx)
            if built.buffer is None:
                return Verdict(False, message="failed to allocate tensors")
        return eval_built(built, compute)
    finally:
        free_built(built)


# ---------------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------------

def _fmt(v):
    if isinstance(v, Type):
        return tname(v)
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    return str(v)


class Case:
    """test_case: build_graph, initialize_tensors, max_nmse_err, vars; plus the numpy reference."""
    op = "NONE"
    init_range = (-1.0, 1.0)

    def params(self) -> dict:
        return {}

    def name(self) -> str:
        return f"{self.op}(" + ",".join(f"{k}={_fmt(v)}" for k, v in self.params().items()) + ")"

    __str__ = name

    def max_nmse_err(self) -> float:
        return 1e-7

    def build_graph(self, b: Builder):
        raise NotImplementedError

    def initialize_tensors(self, built: Built, rng) -> None:
        for t in built.ctx:
            if t.view_src is None:
                init_tensor_uniform(t, rng, *self.init_range)

    def reference(self, srcs, out) -> np.ndarray:
        raise NotImplementedError


def _view_of_bigger(b, type, ne, grow, name):
    """A non-contiguous view with shape ne of a bigger tensor (ne[i] * grow[i]), as test-backend-ops'
    `v` cases make them."""
    big = b.new_tensor(type, [n * g for n, g in zip(ne, grow)], name)
    v = ggml.view_4d(b.ctx, big, *ne, big.nb[1], big.nb[2], big.nb[3], 0)
    ggml.set_name(v, f"view_of_{name}")
    return v


def _tile_to(x, shape):
    return np.tile(x, [s // n for s, n in zip(shape, x.shape)])


# --- UNARY / GLU ------------------------------------------------------------------------------

def _silu(x):
    return x / (1.0 + np.exp(-x))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def _gelu_quick(x):
    return x / (1.0 + np.exp(-1.702 * x))


def _gelu_quick_fp16_table(x):
    """ggml's CPU GELU_QUICK (GGML_GELU_QUICK_FP16): fp16(gelu_quick(fp16(x))), for every x."""
    return _gelu_quick(x.astype(np.float16).astype(np.float64)).astype(np.float16).astype(np.float64)


_erf = np.vectorize(math.erf, otypes=[np.float64])
_hard = lambda x: np.clip((x + 3.0) / 6.0, 0.0, 1.0)

# test_unary's ops (every ggml_unary_op but XIELU): (constructor, float64 reference of ggml's function)
_UNARY = {
    "ABS": (None, np.abs),
    "SGN": (None, np.sign),
    "NEG": (None, np.negative),
    "STEP": (None, lambda x: (x > 0).astype(np.float64)),
    "TANH": (None, np.tanh),
    "ELU": (None, lambda x: np.where(x > 0, x, np.expm1(x))),
    "RELU": (ggml.relu, lambda x: np.maximum(x, 0.0)),
    "SIGMOID": (None, lambda x: 1.0 / (1.0 + np.exp(-x))),
    "GELU": (ggml.gelu, _gelu_tanh),
    "GELU_QUICK": (None, _gelu_quick_fp16_table),
    "SILU": (ggml.silu, _silu),
    "HARDSWISH": (None, lambda x: x * _hard(x)),
    "HARDSIGMOID": (None, _hard),
    "EXP": (None, np.exp),
    "EXPM1": (None, np.expm1),
    "SOFTPLUS": (None, lambda x: np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))),
    "GELU_ERF": (ggml.gelu_erf, lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))),
    "FLOOR": (None, np.floor),
    "CEIL": (None, np.ceil),
    "ROUND": (None, lambda x: np.copysign(np.floor(np.abs(x) + 0.5), x)),      # roundf: halves away from 0
    "TRUNC": (None, np.trunc),
}


class TestUnary(Case):
    """test_unary: values in [-150, 150] (GELU NaN hunting). ggml's CPU GELU reads an fp16 table
    for |x| < 10, so it has fp16 precision there; the exact tanh formula is the reference and the
    NMSE limit absorbs the table's rounding (checked by test_gelu_fp16_table_within_limit).
    GELU_QUICK reads its table for every x: there the reference is ggml's table itself,
    fp16(gelu_quick(fp16(x))), because the exact formula is only about 2x inside the limit
    (test_gelu_quick_fp16_table_is_the_reference). Ops without a shorthand go through ggml.unary."""
    init_range = (-150.0, 150.0)

    def __init__(self, fn, type=Type.F32, ne=(128, 2, 2, 2), v=0):
        self.fn, self.type, self.ne, self.v = fn, type, list(ne), v
        self.op = fn

    def params(self):
        return dict(type=self.type, ne_a=self.ne, v=self.v)

    def build_graph(self, b):
        a = _view_of_bigger(b, self.type, self.ne, [3, 1, 1, 1], "a") if self.v else \
            b.new_tensor(self.type, self.ne, "a")
        make = _UNARY[self.fn][0]
        return make(b.ctx, a) if make else ggml.unary(b.ctx, a, ggml.UnaryOp[self.fn])

    def reference(self, srcs, out):
        with np.errstate(over="ignore"):                  # exp(150) is inf in float32, as in ggml
            return round_to(self.type, _UNARY[self.fn][1](srcs[0].astype(np.float64)))


class TestSwigluSplit(Case):
    """test_glu_split(SWIGLU): silu(a) * b."""
    op = "SWIGLU"
    init_range = (-150.0, 150.0)

    def __init__(self, type=Type.F32, ne=(128, 2, 2, 2), v=0):
        self.type, self.ne, self.v = type, list(ne), v

    def params(self):
        return dict(type=self.type, ne_a=self.ne, v=self.v, split=1)

    def build_graph(self, b):
        if self.v:
            a = _view_of_bigger(b, self.type, self.ne, [3, 1, 1, 1], "a")
            c = _view_of_bigger(b, self.type, self.ne, [3, 1, 1, 1], "b")
        else:
            a, c = b.new_tensor(self.type, self.ne, "a"), b.new_tensor(self.type, self.ne, "b")
        return ggml.swiglu_split(b.ctx, a, c)

    def reference(self, srcs, out):
        a, g = srcs[0].astype(np.float64), srcs[1].astype(np.float64)
        return round_to(self.type, _silu(a) * g)


class TestSwiglu(Case):
    """test_glu(SWIGLU): one tensor, gate = first half of each row, value = second half
    (swapped exchanges them); the result has ne0 / 2."""
    op = "SWIGLU"
    init_range = (-150.0, 150.0)

    def __init__(self, type=Type.F32, ne=(128, 2, 2, 2), v=0, swapped=False):
        self.type, self.ne, self.v, self.swapped = type, list(ne), v, swapped

    def params(self):
        return dict(type=self.type, ne_a=self.ne, v=self.v, swapped=self.swapped)

    def build_graph(self, b):
        a = _view_of_bigger(b, self.type, self.ne, [3, 1, 1, 1], "a") if self.v else \
            b.new_tensor(self.type, self.ne, "a")
        return ggml.glu(b.ctx, a, ggml.GluOp.SWIGLU, self.swapped)

    def reference(self, srcs, out):
        x = srcs[0].astype(np.float64)
        nc = self.ne[0] // 2
        gate, val = x[..., :nc], x[..., nc:2 * nc]
        if self.swapped:
            gate, val = val, gate
        return round_to(self.type, _silu(gate) * val)


def _gelu_fp16_table(x, thresholds):
    """ggml's CPU GELU through its fp16 table: fp16(gelu(fp16(x))); with thresholds (F32 input),
    x <= -10 gives 0 and x >= 10 gives x, as ggml_vec_gelu_f32 / ggml_vec_geglu_f32."""
    t = _gelu_tanh(x.astype(np.float16).astype(np.float64)).astype(np.float16).astype(np.float64)
    return np.where(x <= -10, 0.0, np.where(x >= 10, x, t)) if thresholds else t


class TestGlu(Case):
    """test_glu / test_glu_split / test_swiglu_oai for the GLU kinds other than SWIGLU (which
    TestSwiglu and TestSwigluSplit cover): act(gate) * value, fused (ne0 / 2, swapped exchanges the
    halves) or split. Gates and values in [-12, 12], across GEGLU's table thresholds at ±10 and
    SWIGLU_OAI's limit. GEGLU and GEGLU_QUICK are judged against ggml's fp16 tables (as GELU_QUICK
    in TestUnary); SWIGLU_OAI has alpha and limit in op_params[2], [3] (ggml_swiglu_oai)."""
    init_range = (-12.0, 12.0)

    def __init__(self, kind, type=Type.F32, ne=(128, 2, 2, 2), v=0, swapped=False, split=False,
                 alpha=1.702, limit=7.0):
        self.kind, self.type, self.ne, self.v = kind, type, list(ne), v
        self.swapped, self.split, self.alpha, self.limit = swapped, split, alpha, limit
        self.op = kind

    def params(self):
        p = dict(type=self.type, ne_a=self.ne, v=self.v)
        p.update(split=1) if self.split else p.update(swapped=self.swapped)
        if self.kind == "SWIGLU_OAI":
            p.update(alpha=self.alpha, limit=self.limit)
        return p

    def build_graph(self, b):
        def operand(name):
            return _view_of_bigger(b, self.type, self.ne, [3, 1, 1, 1], name) if self.v else                 b.new_tensor(self.type, self.ne, name)
        a = operand("a")
        kind = ggml.GluOp[self.kind]
        out = ggml.glu_split(b.ctx, a, operand("b"), kind) if self.split else             ggml.glu(b.ctx, a, kind, self.swapped)
        if self.kind == "SWIGLU_OAI":                      # ggml_swiglu_oai's two parameters
            ggml.tensor.set_op_params_f32(out, 2, self.alpha)
            ggml.tensor.set_op_params_f32(out, 3, self.limit)
        return out

    def reference(self, srcs, out):
        x = srcs[0].astype(np.float64)
        if self.split:
            gate, val = x, srcs[1].astype(np.float64)
        else:
            nc = self.ne[0] // 2
            gate, val = x[..., :nc], x[..., nc:2 * nc]
            if self.swapped:
                gate, val = val, gate
        f32 = self.type == Type.F32
        if self.kind == "REGLU":
            y = np.maximum(gate, 0.0) * val
        elif self.kind == "GEGLU":
            y = _gelu_fp16_table(gate, thresholds=f32) * val
        elif self.kind == "GEGLU_ERF":
            y = 0.5 * gate * (1.0 + _erf(gate / math.sqrt(2.0))) * val
        elif self.kind == "GEGLU_QUICK":
            y = _gelu_quick_fp16_table(gate) * val
        else:                                              # SWIGLU_OAI
            g = np.minimum(gate, self.limit)
            y = g / (1.0 + np.exp(-self.alpha * g)) * (np.clip(val, -self.limit, self.limit) + 1.0)
        return round_to(self.type, y)


# --- GET_ROWS ---------------------------------------------------------------------------------

class TestGetRows(Case):
    """test_get_rows: in = [n, m, b], rows = I32 [r, b] (a view of the first r/2 when v)."""
    op = "GET_ROWS"

    def __init__(self, type=Type.F32, n=10, m=5, r=3, b=1, v=False):
        self.type, self.n, self.m, self.r, self.b, self.v = type, n, m, r, b, v

    def params(self):
        return dict(type=self.type, n=self.n, m=self.m, r=self.r, b=self.b, v=self.v)

    def build_graph(self, b):
        a = b.new_tensor(self.type, [self.n, self.m, self.b], "in")
        rows = b.new_tensor(Type.I32, [self.r, self.b], "rows")
        if self.v:
            rows = ggml.view_2d(b.ctx, rows, self.r // 2, self.b, rows.nb[1], 0)
            ggml.set_name(rows, "view_of_rows")
        return ggml.get_rows(b.ctx, a, rows)

    def initialize_tensors(self, built, rng):
        for t in built.ctx:
            if t.view_src is not None:
                continue
            if t.type == Type.I32 and t.name == "rows":
                write_raw(t, rng.integers(0, self.m, ggml.nelements(t)).astype(np.int32))
            else:
                init_tensor_uniform(t, rng)

    def reference(self, srcs, out):
        a, idx = srcs[0], srcs[1]                         # a: (a3, a2, m, n); idx: (1, b2, b1, r)
        _, b2, b1, r = idx.shape
        res = np.empty((b2, b1, r, a.shape[3]), a.dtype)
        for i12 in range(b2):
            for i11 in range(b1):
                res[i12, i11] = a[i12, i11, idx[0, i12, i11]]
        return res


# --- SET_ROWS ---------------------------------------------------------------------------------

class TestSetRows(Case):
    """test_set_rows: the F32 rows src [ne0, r, ne2*nr2, ne3*nr3] into dst [ne0, ne1, ne2*nr2, ne3*nr3]
    at row_idxs [r, ne2, ne3] (broadcast over dst's dims 2 and 3), each slice of indices a shuffled
    subset of the rows (init_set_rows_row_ids); views of the first r/2 rows and indices when v.
    Limits: the one-code-off estimate for Q4_0, Q4_1 and Q8_0 destinations, 1e-7 otherwise."""
    op = "SET_ROWS"

    def __init__(self, type=Type.F32, type_idx=Type.I64, ne=(256, 5, 1, 3), nr23=(1, 1), r=1, v=False):
        self.type, self.type_idx, self.ne, self.nr23, self.r, self.v = type, type_idx, list(ne), list(nr23), r, v

    def params(self):
        return dict(type=self.type, type_idx=self.type_idx, ne=self.ne, nr23=self.nr23, r=self.r, v=self.v)

    def max_nmse_err(self):
        if self.type not in (Type.Q4_0, Type.Q4_1, Type.Q8_0):
            return 1e-7
        e = 1.0 / 8.0 / (8.0 if self.type == Type.Q8_0 else 1.0)
        ne, (n2, n3) = self.ne, self.nr23
        return e * e / (0.25 * ne[0] * self.r * ne[2] * n2 * ne[3] * n3)

    def build_graph(self, b):
        ne, (n2, n3) = self.ne, self.nr23
        dst = b.new_tensor(self.type, [ne[0], ne[1], ne[2] * n2, ne[3] * n3], "dst")
        src = b.new_tensor(Type.F32, [ne[0], self.r, ne[2] * n2, ne[3] * n3], "src")
        idx = b.new_tensor(self.type_idx, [self.r, ne[2], ne[3]], "row_idxs")
        if self.v:
            src = ggml.view_4d(b.ctx, src, ne[0], self.r // 2, ne[2] * n2, ne[3] * n3, src.nb[1], src.nb[2], src.nb[3], 0)
            idx = ggml.view_3d(b.ctx, idx, self.r // 2, ne[2], ne[3], idx.nb[1], idx.nb[2], 0)
            ggml.set_name(idx, "view_of_rows")
        return ggml.set_rows(b.ctx, dst, src, idx)

    def initialize_tensors(self, built, rng):
        for t in built.ctx:
            if t.view_src is not None:
                continue
            if t.type == self.type_idx and t.name == "row_idxs":
                ids = [rng.permutation(self.ne[1])[:t.ne[0]] for _ in range(t.ne[1] * t.ne[2])]
                write_raw(t, np.concatenate(ids).astype(_INT_DTYPES[t.type]))
            else:
                init_tensor_uniform(t, rng)

    def reference(self, srcs, out):
        rows, idx, dst = srcs[:3]                          # (n3, n2, r, ne0), (1, ne3, ne2, r), (n3, n2, ne1, ne0)
        res = dst.copy()
        for i03 in range(rows.shape[0]):
            for i02 in range(rows.shape[1]):
                for i in range(rows.shape[2]):        # each row converted as dst's from_float does
                    res[i03, i02, idx[0, i03 % idx.shape[1], i02 % idx.shape[2], i]] = round_to(self.type, rows[i03, i02, i])
        return res


# --- CPY / CONT -------------------------------------------------------------------------------

class TestCpy(Case):
    """test_cpy: src (optionally permuted) copied into a dst of another type (optionally a permuted
    view). Values in [-150, 150]. Limits: 0 for equal types, the one-code-off estimate for Q4_0,
    Q4_1, Q8_0 destinations, 1e-6 otherwise."""
    op = "CPY"
    init_range = (-150.0, 150.0)

    def __init__(self, type_src=Type.F32, type_dst=Type.F32, ne=(10, 10, 10, 1),
                 permute_src=(0, 0, 0, 0), permute_dst=(0, 0, 0, 0)):
        self.type_src, self.type_dst, self.ne = type_src, type_dst, list(ne)
        self.permute_src, self.permute_dst = list(permute_src), list(permute_dst)

    def params(self):
        return dict(type_src=self.type_src, type_dst=self.type_dst, ne=self.ne,
                    permute_src=self.permute_src, permute_dst=self.permute_dst)

    def max_nmse_err(self):
        if self.type_src == self.type_dst:
            return 0.0
        if self.type_dst in (Type.Q4_0, Type.Q4_1, Type.Q8_0):
            e = 1.0 / 8.0 * 150.0
            if self.type_dst == Type.Q8_0:
                e /= 8.0
            return e * e / (150.0 * 150.0 * 0.25 * float(np.prod(self.ne)))
        return 1e-6

    def build_graph(self, b):
        src = b.new_tensor(self.type_src, self.ne, "src")
        if any(self.permute_src):
            src = ggml.permute(b.ctx, src, *self.permute_src)
            ggml.set_name(src, "src_permuted")
        dst = b.new_tensor(self.type_dst, src.ne, "dst")
        if any(self.permute_dst):
            dst = ggml.permute(b.ctx, dst, *self.permute_dst)
            ggml.set_name(dst, "dst_permuted")
        return ggml.cpy(b.ctx, src, dst)

    def reference(self, srcs, out):
        # elements in the logical row-major order of src, laid into dst's logical order
        vals = np.ascontiguousarray(srcs[0]).reshape(out.ne[3], out.ne[2], out.ne[1], out.ne[0])
        if self.type_src == self.type_dst:        # a byte copy: re-quantizing Q6_K would move codes
            return vals
        if self.type_dst == Type.Q8_0:            # the CPU's from_float: x86's quantize_row_q8_0
            import differential_refs
            return differential_refs.q8_0_cpu_roundtrip(vals)
        return round_to(self.type_dst, vals)


class TestCont(Case):
    """test_cont: cont(transpose(src))."""
    op = "CONT"

    def __init__(self, type=Type.F32, ne=(10, 10, 10, 1)):
        self.type, self.ne = type, list(ne)

    def params(self):
        return dict(type=self.type, ne=self.ne)

    def build_graph(self, b):
        src = b.new_tensor(self.type, self.ne, "src")
        src = ggml.transpose(b.ctx, src)
        ggml.set_name(src, "src_transposed")
        return ggml.cont(b.ctx, src)

    def reference(self, srcs, out):
        return srcs[0]


# --- ADD SUB MUL DIV --------------------------------------------------------------------------

_BIN = {"ADD": (ggml.add, np.add), "SUB": (ggml.sub, np.subtract),
        "MUL": (ggml.mul, np.multiply), "DIV": (ggml.div, np.divide)}


class TestBinBcast(Case):
    """test_bin_bcast: a = ne * nr, b = ne, out = a op b with b broadcast by modulo.
    MUL and DIV draw from [0.9, 1.1] (numerical issues around zero)."""

    def __init__(self, op, type=Type.F32, ne=(10, 10, 1, 1), nr=(1, 2, 1, 1), type_b=None):
        self.op, self.type, self.ne, self.nr = op, type, list(ne), list(nr)
        self.type_b = type if type_b is None else type_b
        self.init_range = (0.9, 1.1) if op in ("MUL", "DIV") else (-1.0, 1.0)

    def params(self):
        p = dict(type=self.type, ne=self.ne, nr=self.nr)
        if self.type_b != self.type:
            p["type_b"] = self.type_b
        return p

    def build_graph(self, b):
        a = b.new_tensor(self.type, [n * r for n, r in zip(self.ne, self.nr)], "a")
        c = b.new_tensor(self.type_b, self.ne, "b")
        return _BIN[self.op][0](b.ctx, a, c)

    def reference(self, srcs, out):
        a = srcs[0].astype(np.float32)
        bb = _tile_to(srcs[1].astype(np.float32), a.shape)
        return round_to(self.type, _BIN[self.op][1](a, bb))        # float32 arithmetic, as ggml


class TestScale(Case):
    op = "SCALE"

    def __init__(self, type=Type.F32, ne=(10, 10, 10, 10), scale=2.0):
        self.type, self.ne, self.scale = type, list(ne), scale

    def params(self):
        return dict(type=self.type, ne=self.ne, scale=self.scale)

    def build_graph(self, b):
        return ggml.scale(b.ctx, b.new_tensor(self.type, self.ne, "a"), self.scale)

    def reference(self, srcs, out):
        return round_to(self.type, srcs[0].astype(np.float32) * np.float32(self.scale))


# --- NORM / RMS_NORM --------------------------------------------------------------------------

class TestNorm(Case):
    """test_norm / test_rms_norm: [64, 5, 4, 3], optionally a non-contiguous half-size view."""

    def __init__(self, op, type=Type.F32, ne=(64, 5, 4, 3), v=False, eps=1e-6):
        self.op, self.type, self.ne, self.v, self.eps = op, type, list(ne), v, eps
        self.init_range = (-10.0, 10.0) if op == "RMS_NORM" else (-1.0, 1.0)

    def params(self):
        return dict(type=self.type, ne=self.ne, v=self.v, eps=self.eps)

    def build_graph(self, b):
        a = b.new_tensor(self.type, self.ne, "a")
        if self.v:
            a = ggml.view_4d(b.ctx, a, *[n // 2 for n in self.ne], a.nb[1], a.nb[2], a.nb[3], 0)
            ggml.set_name(a, "view of a")
        fn = ggml.rms_norm if self.op == "RMS_NORM" else ggml.norm
        return fn(b.ctx, a, self.eps)

    def reference(self, srcs, out):
        x = srcs[0].astype(np.float64)
        eps = float(np.float32(self.eps))
        if self.op == "RMS_NORM":
            return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        xc = x - np.mean(x, axis=-1, keepdims=True)
        return xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps)


# --- MUL_MAT ----------------------------------------------------------------------------------

class TestMulMat(Case):
    """test_mul_mat: a = [k, m, bs0, bs1], b = [k, n, bs0*nr0, bs1*nr1], out = mul_mat(a, b);
    per: made in permuted order and permuted back; v: a and b are views of rows twice as long."""
    op = "MUL_MAT"

    def __init__(self, type_a=Type.F32, type_b=Type.F32, m=32, n=32, k=32, bs=(10, 10), nr=(2, 2),
                 per=(0, 1, 2, 3), v=False):
        self.type_a, self.type_b, self.m, self.n, self.k = type_a, type_b, m, n, k
        self.bs, self.nr, self.per, self.v = list(bs), list(nr), list(per), v

    def params(self):
        return dict(type_a=self.type_a, type_b=self.type_b, m=self.m, n=self.n, k=self.k,
                    bs=self.bs, nr=self.nr, per=self.per, v=self.v)

    def max_nmse_err(self):
        return 5e-4

    def build_graph(self, b):
        k, m, n, bs, nr, per = self.k, self.m, self.n, self.bs, self.nr, self.per
        ne_a = [k, m, bs[0], bs[1]]
        ne_b = [k, n, bs[0] * nr[0], bs[1] * nr[1]]
        if per != [0, 1, 2, 3]:
            a = b.new_tensor(self.type_a, [ne_a[p] for p in per], "a")
            c = b.new_tensor(self.type_b, [ne_b[p] for p in per], "b")
            a = ggml.permute(b.ctx, a, *per)
            c = ggml.permute(b.ctx, c, *per)
            ggml.set_name(a, "a_permuted")
            ggml.set_name(c, "b_permuted")
        elif self.v:
            a = _view_of_bigger(b, self.type_a, ne_a, [2, 1, 1, 1], "a")
            c = _view_of_bigger(b, self.type_b, ne_b, [2, 1, 1, 1], "b")
        else:
            a = b.new_tensor(self.type_a, ne_a, "a")
            c = b.new_tensor(self.type_b, ne_b, "b")
        return ggml.mul_mat(b.ctx, a, c)

    def reference(self, srcs, out):
        a, c = srcs[0].astype(np.float64), srcs[1].astype(np.float64)
        r3, r2 = c.shape[0] // a.shape[0], c.shape[1] // a.shape[1]
        a = np.repeat(np.repeat(a, r3, axis=0), r2, axis=1)      # i02 = i12 / r2: integer division
        return np.einsum("xyik,xyjk->xyji", a, c)                # dst = b · aᵀ per 2-D slice


# --- SOFT_MAX ---------------------------------------------------------------------------------

def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    if max_bias <= 0.0:
        return np.ones(n_head)
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_head_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_head_log2)
    h = np.arange(n_head)
    return np.where(h < n_head_log2, m0 ** (h + 1), m1 ** (2 * (h - n_head_log2) + 1))


class TestSoftMax(Case):
    """test_soft_max: soft_max_ext(a, mask, scale, max_bias); mask [ne0, ne1 (+pad), ne2/…, ne3/…]."""
    op = "SOFT_MAX"

    def __init__(self, type=Type.F32, ne=(10, 5, 4, 3), mask=False, m_prec=Type.F32, scale=1.0,
                 max_bias=0.0, mask_ne23=(1, 1), mask_pad=0):
        self.type, self.ne, self.mask, self.m_prec = type, list(ne), mask, m_prec
        self.scale, self.max_bias = scale, max_bias
        self.mask_ne23, self.mask_pad = list(mask_ne23), mask_pad

    def params(self):
        p = dict(type=self.type, ne=self.ne, mask=self.mask, m_prec=self.m_prec, scale=self.scale,
                 max_bias=self.max_bias)
        if self.mask_ne23 != [1, 1] or self.mask_pad:
            p.update(mask_ne23=self.mask_ne23, mask_pad=self.mask_pad)
        return p

    def max_nmse_err(self):
        return 1e-6

    def build_graph(self, b):
        a = b.new_tensor(self.type, self.ne, "a")
        mask = None
        if self.mask:
            mask = b.new_tensor(self.m_prec, [self.ne[0], self.ne[1] + self.mask_pad, *self.mask_ne23],
                                "mask")
        return ggml.soft_max_ext(b.ctx, a, mask, self.scale, self.max_bias)

    def reference(self, srcs, out):
        x = srcs[0].astype(np.float64)
        w = x * float(np.float32(self.scale))
        if srcs[1] is not None:
            mask = srcs[1][:, :, : x.shape[2], :].astype(np.float64)
            mask = _tile_to(mask, x.shape)               # mask[i01, i02 % ne12, i03 % ne13]
            slope = alibi_slopes(x.shape[1], self.max_bias).astype(np.float32).astype(np.float64)
            w = w + slope[None, :, None, None] * mask
        w = np.exp(w - w.max(axis=-1, keepdims=True))
        return w / w.sum(axis=-1, keepdims=True)


# --- ROPE -------------------------------------------------------------------------------------

def rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    """ggml_rope_yarn_corr_dims in float32 (n_ctx_orig = 0 gives [0, -inf], as in C)."""
    f = np.float32
    with np.errstate(divide="ignore", invalid="ignore"):
        def corr_dim(n_rot):
            return f(n_dims) * np.log(f(n_ctx_orig) / (f(n_rot) * f(2) * f(math.pi))) / (f(2) * np.log(f(freq_base)))
        start = np.floor(corr_dim(beta_fast))
        end = np.ceil(corr_dim(beta_slow))
    low = f(0) if f(0) > start else start                 # MAX(0, start), C's macro (NaN passes)
    high = f(n_dims - 1) if f(n_dims - 1) < end else end  # MIN(n_dims - 1, end)
    return f(low), f(high)


def rope_reference(x, pos, ff, n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor,
                   attn_factor, beta_fast, beta_slow):
    """ggml's rope (NORMAL or NEOX) with YaRN, from the notes: theta built by repeated float32
    multiplication from the position, frequency factors divide theta, rope_yarn mixes and scales.
    x: (ne3, ne2, ne1, ne0) values; pos: (ne2,) positions; ff: (n_dims/2,) or None."""
    f = np.float32
    theta_scale = f(np.power(f(freq_base), f(-2.0) / f(n_dims)))
    low, high = rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    fs, ef = f(freq_scale), f(ext_factor)
    mscale = f(attn_factor)
    if ef != 0:
        mscale = f(mscale * (f(1) + f(0.1) * np.log(f(1) / fs)))
    y = x.astype(np.float64).copy()
    theta = pos.astype(np.float32)                       # theta_base = p, per token
    half = n_dims // 2
    for kk in range(half):
        i0 = 2 * kk
        theta_extrap = theta / f(ff[kk]) if ff is not None else theta
        theta_interp = fs * theta_extrap
        th = theta_interp
        if ef != 0:
            ramp_y = (f(i0 // 2) - low) / max(f(0.001), f(high - low))
            ramp_mix = f(1 - min(f(1), max(f(0), ramp_y))) * ef
            th = theta_interp * (f(1) - ramp_mix) + theta_extrap * ramp_mix
        c = (np.cos(th.astype(np.float32)) * mscale).astype(np.float64)[None, :, None]
        s = (np.sin(th.astype(np.float32)) * mscale).astype(np.float64)[None, :, None]
        i_a, i_b = (kk, kk + half) if mode == ggml.ROPE_TYPE_NEOX else (i0, i0 + 1)
        x0, x1 = x[..., i_a].astype(np.float64), x[..., i_b].astype(np.float64)
        y[..., i_a] = x0 * c - x1 * s
        y[..., i_b] = x0 * s + x1 * c
        theta = (theta * theta_scale).astype(np.float32)
    return y


class TestRope(Case):
    """test_rope (forward): a = [head_dim, n_head, n_tokens, 1] (a view of a bigger tensor when v),
    positions in [0, n_ctx), freq factors in [0.9, 1.1]; freq_base 10000, beta_fast = beta_slow = 1
    and n_ctx_orig = 0 as test-backend-ops has them, unless given."""
    op = "ROPE"

    def __init__(self, type=Type.F32, ne=(10, 5, 3, 1), n_dims=10, mode=0, n_ctx=512, fs=1.0,
                 ef=0.0, af=0.0, ff=False, v=0, n_ctx_orig=0, beta_fast=1.0, beta_slow=1.0):
        self.type, self.ne, self.n_dims, self.mode, self.n_ctx = type, list(ne), n_dims, mode, n_ctx
        self.fs, self.ef, self.af, self.ff, self.v = fs, ef, af, ff, v
        self.n_ctx_orig, self.beta_fast, self.beta_slow = n_ctx_orig, beta_fast, beta_slow

    def params(self):
        p = dict(type=self.type, ne_a=self.ne, n_dims=self.n_dims, mode=self.mode, n_ctx=self.n_ctx,
                 fs=self.fs, ef=self.ef, af=self.af, ff=self.ff, v=self.v)
        if self.n_ctx_orig:
            p.update(n_ctx_orig=self.n_ctx_orig, beta_fast=self.beta_fast, beta_slow=self.beta_slow)
        return p

    def build_graph(self, b):
        a = _view_of_bigger(b, self.type, self.ne, [2, 4, 3, 1], "a") if self.v & 1 else \
            b.new_tensor(self.type, self.ne, "a")
        pos = b.new_tensor(Type.I32, [self.ne[2]], "pos")
        freq = b.new_tensor(Type.F32, [self.n_dims // 2], "freq") if self.ff else None
        return ggml.rope_ext(b.ctx, a, pos, freq, self.n_dims, self.mode, self.n_ctx_orig, 10000.0,
                             self.fs, self.ef, self.af, self.beta_fast, self.beta_slow)

    def initialize_tensors(self, built, rng):
        for t in built.ctx:
            if t.view_src is not None:
                continue
            if t.name == "pos":
                write_raw(t, rng.integers(0, self.n_ctx, ggml.nelements(t)).astype(np.int32))
            elif t.name == "freq":
                init_tensor_uniform(t, rng, 0.9, 1.1)
            else:
                init_tensor_uniform(t, rng)

    def reference(self, srcs, out):
        ff = srcs[2].ravel() if srcs[2] is not None else None
        y = rope_reference(srcs[0], srcs[1].ravel(), ff, self.n_dims, self.mode, self.n_ctx_orig,
                           10000.0, self.fs, self.ef, self.af, self.beta_fast, self.beta_slow)
        return round_to(self.type, y)


# --- DIAG_MASK_INF, CONCAT, SUM, SUM_ROWS, MEAN, REPEAT --------------------------------------

class TestDiagMaskInf(Case):
    op = "DIAG_MASK_INF"

    def __init__(self, type=Type.F32, ne=(10, 10, 3, 2), n_past=5):
        self.type, self.ne, self.n_past = type, list(ne), n_past

    def params(self):
        return dict(type=self.type, ne=self.ne, n_past=self.n_past)

    def build_graph(self, b):
        return ggml.diag_mask_inf(b.ctx, b.new_tensor(self.type, self.ne, "a"), self.n_past)

    def reference(self, srcs, out):
        y = srcs[0].copy()
        i1 = np.arange(y.shape[2])[:, None]
        i0 = np.arange(y.shape[3])[None, :]
        y[..., i0 > self.n_past + i1] = -np.inf
        return y


class TestConcat(Case):
    """test_concat: a = ne_a, b = ne_a with ne_b_d along dim; v bit 0/1: a/b non-contiguous views."""
    op = "CONCAT"

    def __init__(self, type=Type.F32, ne_a=(10, 5, 5, 5), ne_b_d=5, dim=2, v=0):
        self.type, self.ne_a, self.ne_b_d, self.dim, self.v = type, list(ne_a), ne_b_d, dim, v

    def params(self):
        return dict(type=self.type, ne_a=self.ne_a, ne_b_d=self.ne_b_d, dim=self.dim, v=self.v)

    def build_graph(self, b):
        ne_b = list(self.ne_a)
        ne_b[self.dim] = self.ne_b_d
        a = _view_of_bigger(b, self.type, self.ne_a, [2, 4, 3, 1], "a") if self.v & 1 else \
            b.new_tensor(self.type, self.ne_a, "a")
        c = _view_of_bigger(b, self.type, ne_b, [3, 2, 4, 1], "b") if self.v & 2 else \
            b.new_tensor(self.type, ne_b, "b")
        return ggml.concat(b.ctx, a, c, self.dim)

    def reference(self, srcs, out):
        return np.concatenate([srcs[0], srcs[1]], axis=3 - self.dim)


class TestReduce(Case):
    """test_sum / test_sum_rows / test_mean: [10, 5, 4, 3] by default."""

    def __init__(self, op, type=Type.F32, ne=(10, 5, 4, 3)):
        self.op, self.type, self.ne = op, type, list(ne)

    def params(self):
        return dict(type=self.type, ne=self.ne)

    def build_graph(self, b):
        fn = {"SUM": ggml.sum, "SUM_ROWS": ggml.sum_rows, "MEAN": ggml.mean}[self.op]
        return fn(b.ctx, b.new_tensor(self.type, self.ne, "a"))

    def reference(self, srcs, out):
        x = srcs[0].astype(np.float64)
        if self.op == "SUM":
            y = np.array(x.sum()).reshape(1, 1, 1, 1)
        elif self.op == "SUM_ROWS":
            y = x.sum(axis=-1, keepdims=True)
        else:
            y = x.mean(axis=-1, keepdims=True)
        return round_to(out.type, y)


class TestRepeat(Case):
    """test_repeat: src = ne tiled nr times into target = ne * nr."""
    op = "REPEAT"

    def __init__(self, type=Type.F32, ne=(10, 5, 4, 3), nr=(2, 2, 2, 2)):
        self.type, self.ne, self.nr = type, list(ne), list(nr)

    def params(self):
        return dict(type=self.type, ne=self.ne, nr=self.nr)

    def build_graph(self, b):
        target = b.new_tensor(self.type, [n * r for n, r in zip(self.ne, self.nr)], "target")
        src = b.new_tensor(self.type, self.ne, "src")
        return ggml.repeat(b.ctx, src, target)

    def reference(self, srcs, out):
        return _tile_to(srcs[0], (out.ne[3], out.ne[2], out.ne[1], out.ne[0]))


# ---------------------------------------------------------------------------------------------
# The case list (make_test_cases_eval), trimmed to what ggml_lite implements and to a few minutes
# ---------------------------------------------------------------------------------------------

def _mul_mat_cases():
    cases = []
    f32 = Type.F32
    for ta in ALL_TYPES:                                  # the vector kernels, n = 1..9
        for n in range(1, 10):
            cases.append(TestMulMat(ta, f32, 16, n, 256, (1, 1), (1, 1)))
    bcast = [((1, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 1), (1, 2)), ((3, 1), (1, 1)),
             ((3, 1), (2, 1)), ((3, 2), (1, 1)), ((3, 2), (2, 1)), ((3, 2), (1, 2)),
             ((3, 2), (2, 2))]
    perms = [(0, 2, 1, 3), (0, 1, 3, 2), (0, 3, 2, 1)]
    for ta in BASE_TYPES:
        # the CPU backend takes src1 in F32 or in the vec_dot_type; other pairs are not supported
        for tb in (f32, Type.F16):
            if tb != f32 and tb != VEC_DOT_TYPE[ta]:
                continue
            ks = [256] + ([4] if ggml.blck_size(ta) == 1 else [])
            for k in ks:
                for n in (1, 16):
                    for bs, nr in bcast:
                        cases.append(TestMulMat(ta, tb, 16, n, k, bs, nr))
                cases.append(TestMulMat(ta, tb, 16, 4, k, (3, 2), (2, 2)))
                for n in (1, 8, 16):
                    for per in perms:
                        cases.append(TestMulMat(ta, tb, 16, n, k, (2, 3), (1, 1), per))
                cases.append(TestMulMat(ta, tb, 16, 4, k, (2, 3), (1, 1), (0, 3, 2, 1)))
            for n in (1, 8, 16):                          # large k
                cases.append(TestMulMat(ta, tb, 16, n, 1024, (3, 2), (1, 1)))
    for ta in OTHER_TYPES:
        if ggml.blck_size(ta) != 256:
            cases.append(TestMulMat(ta, f32, 16, 1, ggml.blck_size(ta), (1, 1), (1, 1)))
        cases.append(TestMulMat(ta, f32, 16, 1, 256, (1, 1), (1, 1)))
    for n in (1, 8, 16):                                  # BF16 permuted, given explicitly
        for per in perms:
            cases.append(TestMulMat(Type.BF16, f32, 16, n, 256, (2, 3), (1, 1), per))
    # odd shapes (F16 weights, batched attention-like products)
    f16 = Type.F16
    cases += [TestMulMat(f16, f32, 64, 2, 128, (8, 1), (1, 1)),
              TestMulMat(f16, f32, 83, 2, 128, (8, 1), (4, 1)),
              TestMulMat(f16, f32, 64, 2, 64, (8, 1), (4, 1)),
              TestMulMat(f16, f32, 83, 2, 64, (8, 1), (4, 1)),
              TestMulMat(f16, f32, 64, 45, 128, (8, 1), (4, 1)),
              TestMulMat(f16, f32, 128, 45, 64, (8, 1), (4, 1)),
              TestMulMat(f16, f32, 1056, 1, 193, (1, 1), (4, 1), (0, 2, 1, 3)),
              TestMulMat(f16, f32, 1056, 1, 67, (1, 1), (4, 1), (0, 2, 1, 3))]
    for bs in (1, 2, 4, 8):                               # permuted / non-contiguous views
        for nr in (1, 4):
            for dm, dk in ((0, 0), (1, 1)):
                for ta in (f16, Type.BF16, f32):
                    cases.append(TestMulMat(ta, f32, 1056 + dm, 1, 128 + dk, (bs, 1), (nr, 1), (0, 2, 1, 3)))
                    cases.append(TestMulMat(ta, f32, 128 + dm, 1, 1056 + dk, (bs, 1), (nr, 1), (0, 1, 2, 3), v=True))
    for ta in ALL_TYPES:                                  # views with quantized rows, m = 1 vectors
        cases.append(TestMulMat(ta, f32, 16, 8, 256, (2, 1), (2, 1), v=True))
        cases.append(TestMulMat(ta, f32, 1, 64, 256, (1, 1), (1, 1)))
    for n in (1, 7, 8, 9, 16, 128, 512):                  # m = 1, big k
        cases.append(TestMulMat(f32, f32, 1, n, 2048, (1, 1), (1, 1)))
    cases += [TestMulMat(f32, f32, 64, 77, 77, (12, 1), (1, 1)),
              TestMulMat(f16, f32, 64, 77, 77, (12, 1), (1, 1)),
              TestMulMat(f32, f32, 16, 8, 256, (1536, 1), (1, 1)),     # large batch
              TestMulMat(Type.Q4_0, f32, 16, 8, 256, (1536, 1), (1, 1)),
              TestMulMat(Type.Q4_0, f32, 576, 512, 576, (1, 1), (1, 1)),
              TestMulMat(Type.Q4_0, f32, 1, 2048, 8192, (1, 1), (1, 1)),
              TestMulMat(Type.Q8_0, f32, 6, 4096, 5120, (1, 1), (1, 1)),
              TestMulMat(Type.Q4_0, f32, 2880, 32, 2880, (1, 1), (1, 1)),
              TestMulMat(Type.Q8_0, f32, 2880, 32, 2880, (1, 1), (1, 1))]
    return cases


def make_test_cases():
    cases = []
    for type in (Type.F16, Type.F32):                     # unary, glu
        for v in (0, 1):
            for fn in _UNARY:
                cases.append(TestUnary(fn, type, (128, 2, 2, 2), v))
                cases.append(TestUnary(fn, type, (5, 7, 11, 13), v))
            for ne in ((128, 2, 2, 2), (5, 7, 11, 13)):
                for swapped in (False, True):
                    cases.append(TestSwiglu(type, ne, v, swapped))
                cases.append(TestSwigluSplit(type, ne, v))
                for kind in ("REGLU", "GEGLU", "SWIGLU_OAI", "GEGLU_ERF", "GEGLU_QUICK"):
                    if kind == "SWIGLU_OAI" and type != Type.F32:
                        continue                          # ggml's CPU: F32 only
                    for swapped in (False, True):
                        cases.append(TestGlu(kind, type, ne, v, swapped))
                    cases.append(TestGlu(kind, type, ne, v, split=True))

    cases.append(TestGetRows(Type.F32, 1, 8, 2, 1, False))
    for type in ALL_TYPES + (Type.I32,):
        for b in (1, 7):
            for v in (False, True):
                cases.append(TestGetRows(type, 256, 5, 4, b, v))

    cases.append(TestSetRows(Type.F32, Type.I64, (1, 8, 1, 3), (1, 1), 2))
    cases.append(TestSetRows(Type.F32, Type.I32, (1, 8, 1, 3), (1, 1), 2))
    cases.append(TestSetRows(Type.Q8_0, Type.I32, (256, 5, 1, 3), (1, 1), 1))
    for type in ALL_TYPES:                                # test-backend-ops' set_rows loop (F32 rows)
        for b in (1, 7):
            for v in (False, True):
                cases.append(TestSetRows(type, Type.I64, (256, 5, b, 3), (1, 1), 1, v))
                cases.append(TestSetRows(type, Type.I64, (256, 11, 1, b), (2, 3), 7, v))
                cases.append(TestSetRows(type, Type.I64, (3 * ggml.blck_size(type), 3, b, 1), (2, 3), 2, v))
                if ggml.blck_size(type) == 1:
                    cases.append(TestSetRows(type, Type.I64, (31, 3, b, 1), (2, 3), 2, v))
                    cases.append(TestSetRows(type, Type.I64, (33, 5, 1, b), (2, 3), 1, v))

    for type in ALL_TYPES:                                # same-type copies
        nk = ggml.blck_size(type)
        for k in (1, 2, 3):
            cases.append(TestCpy(type, type, (k * nk, 2, 3, 4)))
            cases.append(TestCpy(type, type, (k * nk, 2, 3, 4), (0, 2, 1, 3)))
            cases.append(TestCpy(type, type, (k * nk, 2, 3, 4), (0, 3, 1, 2), (0, 2, 1, 3)))
    for ts in (Type.F16, Type.BF16, Type.F32):
        for td in ALL_TYPES:
            cases.append(TestCpy(ts, td, (256, 4, 4, 4)))
            cases.append(TestCpy(ts, td, (256, 2, 3, 4), (0, 2, 1, 3)))      # cpy by rows
    for ts in ALL_TYPES:
        cases.append(TestCpy(ts, Type.F32, (256, 4, 4, 4)))
        cases.append(TestCpy(ts, Type.F32, (256, 2, 3, 4), (0, 2, 1, 3)))
    for ts in (Type.F16, Type.F32):
        for td in (Type.F16, Type.F32):
            cases.append(TestCpy(ts, td, (256, 2, 3, 4), (1, 0, 2, 3)))      # not contiguous
    cases.append(TestCont())
    for type in (Type.F32, Type.F16, Type.BF16):
        for ne in ((2, 1, 1, 1), (2, 1, 3, 5), (2, 3, 5, 7)):
            cases.append(TestCont(type, ne))

    shapes = [((1, 1, 8, 1), (1, 1, 1, 1)), ((1, 1, 1, 1), (32, 1, 1, 1)),
              ((1, 1, 320, 320), (1, 1, 1, 1)), ((10, 5, 1, 1), (1, 1, 1, 1)),
              ((10, 5, 4, 1), (1, 1, 1, 1)), ((10, 5, 4, 3), (1, 1, 1, 1)),
              ((10, 5, 4, 3), (2, 1, 1, 1)), ((10, 5, 4, 3), (1, 2, 1, 1)),
              ((10, 5, 4, 3), (1, 1, 2, 1)), ((10, 5, 4, 3), (1, 1, 1, 2)),
              ((10, 5, 4, 3), (1, 1, 2, 2)), ((10, 5, 4, 3), (1, 2, 2, 2)),
              ((10, 5, 4, 3), (2, 2, 2, 2)),
              # stable diffusion
              ((1280, 1, 1, 1), (1, 1, 1, 1)), ((1280, 1, 1, 1), (1, 16, 16, 1)),
              ((1280, 16, 16, 1), (1, 1, 1, 1)), ((1280, 1, 1, 1), (1, 256, 1, 1)),
              ((1, 1, 1280, 1), (16, 16, 1, 1)), ((16, 16, 1280, 1), (1, 1, 1, 1)),
              ((1, 1, 1920, 1), (16, 16, 1, 1)), ((1, 1, 2560, 1), (16, 16, 1, 1)),
              ((1, 1, 1280, 1), (32, 32, 1, 1)), ((1, 1, 1920, 1), (32, 32, 1, 1)),
              ((1, 1, 640, 1), (32, 32, 1, 1)), ((5120, 1, 1, 1), (1, 256, 1, 1)),
              ((640, 1, 1, 1), (1, 1, 1, 1))]
    for type in (Type.F16, Type.F32):
        for ne, nr in shapes:
            for op in ("ADD", "SUB", "MUL", "DIV"):
                cases.append(TestBinBcast(op, type, ne, nr))
    for op in ("ADD", "MUL"):                              # mixed types ggml supports
        cases.append(TestBinBcast(op, Type.F16, (10, 5, 4, 3), (2, 1, 1, 2), type_b=Type.F32))
        cases.append(TestBinBcast(op, Type.BF16, (10, 5, 4, 3), (1, 2, 1, 1)))
    cases.append(TestScale())
    cases.append(TestScale(Type.F32, (64, 5, 4, 3), 0.25))

    for eps in (0.0, 1e-6, 1e-4, 1e-1):
        for v in (False, True):
            cases.append(TestNorm("NORM", Type.F32, (64, 5, 4, 3), v, eps))
            cases.append(TestNorm("RMS_NORM", Type.F32, (64, 5, 4, 3), v, eps))

    cases += _mul_mat_cases()

    for ne in ((10, 10, 1, 1), (10, 10, 3, 1), (10, 10, 3, 2)):
        cases.append(TestDiagMaskInf(Type.F32, ne, 5))

    for mask in (False, True):
        for max_bias in (0.0, 8.0):
            if not mask and max_bias > 0:
                continue
            for scale in (1.0, 0.1):
                for ne0, ne1 in ((16, 16), (16, 1024), (1024, 16), (1024, 1024)):
                    for m_prec in ((Type.F32, Type.F16) if mask else (Type.F32,)):
                        cases.append(TestSoftMax(Type.F32, (ne0, ne1, 1, 1), mask, m_prec, scale, max_bias))
                        cases.append(TestSoftMax(Type.F32, (ne0 - 1, ne1 - 1, 1, 1), mask, m_prec, scale, max_bias))
    cases += [TestSoftMax(Type.F32, (16, 2, 32, 1), True, Type.F32, 0.1, 0.0),
              TestSoftMax(Type.F32, (16, 2, 32, 1), True, Type.F16, 0.1, 0.0),
              TestSoftMax(Type.F32, (16, 2, 32, 1), False, Type.F32, 0.1, 0.0),
              TestSoftMax(Type.F32, (32, 2, 32, 1), True, Type.F32, 0.1, 0.0),
              TestSoftMax(Type.F32, (32, 2, 32, 1), True, Type.F16, 0.1, 0.0),
              TestSoftMax(Type.F32, (32, 2, 32, 1), True, Type.F32, 0.1, 8.0),
              TestSoftMax(Type.F32, (32, 2, 32, 1), True, Type.F16, 0.1, 8.0),
              # masks broadcast over heads and sequences, with padded rows (newer ggml cases)
              TestSoftMax(Type.F32, (16, 8, 4, 3), True, Type.F32, 0.5, 0.0, (2, 1), 3),
              TestSoftMax(Type.F32, (16, 8, 6, 2), True, Type.F16, 1.0, 4.0, (3, 2), 1),
              TestSoftMax(Type.F32, (10, 5, 4, 3))]

    first = True
    for v in (0, 1):
        for fs in (1.0, 1.4245):
            for ef in (0.0, 0.7465):
                for af in (1.0, 1.4245):
                    for type in (Type.F32, Type.F16):
                        for ff in (False, True):
                            cases.append(TestRope(type, (128, 32, 2, 1), 128, 0, 512, fs, ef, af, ff, v))
                            if first:
                                for ne, nd, mode in (((128, 40, 2, 1), 128, 0), ((128, 52, 2, 1), 128, 0),
                                                     ((128, 64, 2, 1), 128, 0), ((64, 1, 2, 1), 64, 2),
                                                     ((64, 71, 2, 1), 64, 2), ((64, 8, 2, 1), 64, 2),
                                                     ((80, 32, 2, 1), 20, 2), ((80, 32, 2, 1), 32, 2)):
                                    cases.append(TestRope(type, ne, nd, mode, 512, fs, ef, af, ff, v))
                            cases.append(TestRope(type, (64, 128, 2, 1), 64, 2, 512, fs, ef, af, ff, v))
                    first = False
    for mode in (0, 2):                                   # YaRN with a real context (ramp inside)
        for type in (Type.F32, Type.F16):
            for ff in (False, True):
                cases.append(TestRope(type, (128, 8, 5, 1), 128, mode, 512, 0.25, 1.0, 1.0, ff, 0,
                                      n_ctx_orig=4096, beta_fast=32.0, beta_slow=1.0))
    cases.append(TestRope(Type.F32, (128, 8, 5, 1), 96, 0, 512, 0.5, 0.5, 1.0, False, 0,
                          n_ctx_orig=2048, beta_fast=32.0, beta_slow=1.0))

    for v in (0, 1, 2, 3):
        for dim in (0, 1, 2, 3):
            cases.append(TestConcat(Type.F32, (11, 12, 13, 14), 7, dim, v))
            cases.append(TestConcat(Type.I32, (11, 12, 13, 14), 7, dim, v))

    cases += [TestReduce("SUM"), TestReduce("SUM_ROWS"), TestReduce("MEAN"),
              TestReduce("SUM_ROWS", Type.F32, (256, 33, 3, 1)),
              TestReduce("MEAN", Type.F32, (256, 256, 3, 1))]

    for ne3 in (1, 3):
        for nr in ((1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)):
            cases.append(TestRepeat(Type.F32, (10, 5, 4, ne3), nr))
        cases.append(TestRepeat(Type.I32, (10, 5, 4, ne3), (2, 1, 1, 1)))
        cases.append(TestRepeat(Type.I16, (10, 5, 4, ne3), (1, 1, 1, 2)))
    unique = {}                                           # ggml's list repeats a few cpy cases
    for c in cases:
        unique.setdefault(c.name(), c)
    return list(unique.values())
