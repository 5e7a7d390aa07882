"""The CPU kernels (book/05_cpu_kernels.ipynb) against independent numpy references.

Shapes are test-backend-ops' defaults (ggml-notes §10), written in ggml's ne order and reversed
into numpy shapes. Every kernel runs with nth = 1..4 "threads" played one after the other; the
partition tests run each thread alone on a NaN-filled output and check that the shares are
disjoint, cover everything, and are the rows ggml gives that thread. The quantized dots are
checked against gguf's numpy dequantizers (an implementation independent of ggml_lite's) and
small numpy decoders of the activation formats written here.
"""
import math
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
from numba import njit

from ggml_lite.backends.cpu.binary_ops import forward_add, forward_div, forward_mul, forward_sub
from ggml_lite.backends.cpu.common import get_thread_range
from ggml_lite.backends.cpu.cpy import forward_dup, forward_get_rows
from ggml_lite.backends.cpu.ops import (forward_concat, forward_diag_mask_inf, forward_mean, forward_norm,
                                        forward_repeat, forward_rms_norm, forward_rope, forward_scale,
                                        forward_soft_max, forward_sum, forward_sum_rows)
from ggml_lite.backends.cpu.quants import quantize_row_q8_0
from ggml_lite.backends.cpu.unary_ops import (forward_gelu, forward_glu, forward_silu, forward_swiglu,
                                              forward_unary)
from ggml_lite.backends.cpu import simd as S
from ggml_lite.backends.cpu import unary_ops
from ggml_lite.backends.cpu import vec as V
import ggml_lite as ggml
from ggml_lite.core import GGMLError
from ggml_lite.ops import UnaryOp
from ggml_lite.types import Type, fp32_to_bf16_array, quantize_chunk, row_size

RNG = np.random.default_rng(1234)
NTH = (1, 2, 3, 4)
F16 = np.float16


def U(*ne, lo=-1.0, hi=1.0):
    return RNG.uniform(lo, hi, ne[::-1]).astype(np.float32)


def nmse(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(((got - ref) ** 2).sum() / (ref ** 2).sum())


def bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


OUT = "<out>"   # where the output goes in an argument list


def run_threads(kernel, args, out, nth, **kw):
    for ith in range(nth):
        kernel(*[out if a is OUT else a for a in args], ith=ith, nth=nth, **kw)
    return out


def assert_close(kernel, args, like, ref, limit=1e-7, **kw):
    """args has OUT where the output goes; like gives the output's shape and dtype."""
    for nth in NTH:
        out = run_threads(kernel, args, np.full(like.shape, np.nan, like.dtype), nth, **kw)
        assert not np.isnan(out.astype(np.float32)).any(), (kernel.__name__, nth)
        err = nmse(out, ref)
        assert err <= limit, (kernel.__name__, nth, err)


# --- partitions --------------------------------------------------------------------------------

@pytest.mark.parametrize("nr", [0, 1, 5, 10, 17])
@pytest.mark.parametrize("nth", [1, 2, 3, 4, 7])
def test_get_thread_range_covers_rows_once(nr, nth):
    ranges = [get_thread_range(nr, ith, nth) for ith in range(nth)]
    rows = [r for a, b in ranges for r in range(a, b)]
    assert rows == list(range(nr))
    dr = -(-nr // nth)
    for ith, (a, b) in enumerate(ranges):
        assert (a, b) == (min(dr * ith, nr), min(dr * ith + dr, nr))


def block_owner(nrows, nth):
    dr = -(-nrows // nth)
    return np.arange(nrows) // dr if dr else np.zeros(0, int)


ROW_OPS = {
    # name: (call(src, out, ith, nth), pattern): pattern "block" over all rows, "strided" per matrix
    "add": (lambda x, o, i, n: forward_add(x, x[:, :, :1], o, i, n), "block"),
    "scale": (lambda x, o, i, n: forward_scale(x, o, 3.0, 0.0, i, n), "block"),
    "silu": (lambda x, o, i, n: forward_silu(x, o, i, n), "block"),
    "gelu": (lambda x, o, i, n: forward_gelu(x, o, i, n), "block"),
    "relu": (lambda x, o, i, n: forward_unary(x, o, UnaryOp.RELU, i, n), "block"),
    "gelu_quick": (lambda x, o, i, n: forward_unary(x, o, UnaryOp.GELU_QUICK, i, n), "block"),
    "rope": (lambda x, o, i, n: forward_rope(x, np.arange(x.shape[1], dtype=np.int32), o, 4, 0, ith=i, nth=n), "block"),
    "rms_norm": (lambda x, o, i, n: forward_rms_norm(x, o, 1e-6, i, n), "strided"),
    "norm": (lambda x, o, i, n: forward_norm(x, o, 1e-6, i, n), "strided"),
    "soft_max": (lambda x, o, i, n: forward_soft_max(x, None, o, 1.0, 0.0, i, n), "strided"),
    "diag_mask_inf": (lambda x, o, i, n: forward_diag_mask_inf(x, o, 2, i, n), "strided"),
}


@pytest.mark.parametrize("name", sorted(ROW_OPS))
@pytest.mark.parametrize("nth", NTH)
def test_each_thread_writes_exactly_its_rows(name, nth):
    call, pattern = ROW_OPS[name]
    x = U(8, 5, 3, 2)
    ne3, ne2, ne1 = x.shape[:3]
    rows = np.arange(ne3 * ne2 * ne1).reshape(ne3, ne2, ne1)
    expect = block_owner(rows.size, nth)[rows] if pattern == "block" else rows % ne1 % nth
    written = np.zeros(rows.shape, bool)
    for ith in range(nth):
        out = np.full_like(x, np.nan)
        call(x, out, ith, nth)
        mine = ~np.isnan(out).all(axis=3)
        assert (~np.isnan(out[mine])).all(), "a row is written whole or not at all"
        assert np.array_equal(mine, expect == ith), (name, ith)
        assert not (written & mine).any()
        written |= mine
    assert written.all()


@pytest.mark.parametrize("nth", NTH)
def test_thread_zero_only_ops(nth):
    x = U(10, 5, 4, 3)
    for ith in range(1, nth):
        for kernel, out in ((forward_sum, np.full((1, 1, 1, 1), np.nan, np.float32)),
                            (forward_sum_rows, np.full((3, 4, 5, 1), np.nan, np.float32)),
                            (forward_mean, np.full((3, 4, 5, 1), np.nan, np.float32)),
                            (forward_repeat, np.full((3, 4, 10, 20), np.nan, np.float32))):
            kernel(x if kernel is not forward_repeat else x[:1, :1], out, ith, nth)
            assert np.isnan(out).all()


@pytest.mark.parametrize("nth", NTH)
def test_get_rows_concat_dup_partitions_are_disjoint_and_complete(nth):
    cases = [
        (lambda o, i, n: forward_get_rows(U(16, 5, 3, 2)[:, :, :, :], np.tile(np.arange(4, dtype=np.int32), (1, 2, 3, 1)), o, i, n),
         (2, 3, 4, 16)),
        (lambda o, i, n: forward_concat(A5, B5, o, 2, i, n), (5, 8, 5, 10)),
        (lambda o, i, n: forward_dup(X10.transpose(0, 1, 3, 2), o, i, n), (1, 10, 10, 10)),
    ]
    for call, shape in cases:
        written = np.zeros(shape, int)
        for ith in range(nth):
            out = np.full(shape, np.nan, np.float32)
            call(out, ith, nth)
            written += ~np.isnan(out)
        assert (written == 1).all()


A5, B5, X10 = U(10, 5, 5, 5), U(10, 5, 3, 5), U(10, 10, 10, 1)


# --- binary ops, broadcasting, types ----------------------------------------------------------

BROADCAST = [((10, 10, 1, 1), (10, 5, 1, 1)),      # test-backend-ops: nr [1,2,1,1]
             ((10, 10, 1, 1), (10, 10, 1, 1)),
             ((16, 10, 10, 10), (16, 1, 1, 1)),
             ((16, 10, 10, 10), (1, 10, 1, 1)),
             ((16, 10, 10, 10), (1, 1, 10, 10)),
             ((16, 10, 10, 10), (8, 5, 2, 5)),
             ((7, 3, 2, 2), (1, 1, 1, 1))]


@pytest.mark.parametrize("ne_a,ne_b", BROADCAST)
def test_binary_ops_broadcast_by_modulo(ne_a, ne_b):
    a, b = U(*ne_a), U(*ne_b, lo=0.5, hi=1.5)
    reps = tuple(n // m for n, m in zip(a.shape, b.shape))
    bb = np.tile(b, reps).astype(np.float64)
    for kernel, op in ((forward_add, np.add), (forward_sub, np.subtract),
                       (forward_mul, np.multiply), (forward_div, np.divide)):
        assert_close(kernel, (a, b, OUT), a, op(a.astype(np.float64), bb))


def test_binary_ops_on_a_strided_view():
    big = U(20, 6, 4, 1)
    a = big[:, ::2, :, ::2]                            # every other row and element
    b = U(10, 1, 1, 1)
    assert_close(forward_add, (a, b, OUT), np.empty(a.shape, np.float32), a.astype(np.float64) + b)


@pytest.mark.parametrize("types", [("f16", "f16", "f16"), ("bf16", "bf16", "bf16"), ("f16", "f32", "f16"),
                                   ("f16", "f32", "f32"), ("bf16", "f32", "bf16"), ("bf16", "f32", "f32")])
def test_binary_type_triples(types):
    a32, b32 = U(32, 4, 2, 1), U(32, 1, 1, 1)
    store = {"f32": lambda v: v, "f16": lambda v: v.astype(F16), "bf16": fp32_to_bf16_array}
    value = {"f32": lambda v: v, "f16": lambda v: v.astype(np.float32), "bf16": bf16_values}
    ta, tb, td = types
    a, b = store[ta](a32), store[tb](b32)
    out = np.zeros(a.shape, {"f32": np.float32, "f16": F16, "bf16": np.uint16}[td])
    forward_mul(a, b, out)
    exact = value[ta](a).astype(np.float64) * value[tb](b).astype(np.float64)
    ref = value[td](store[td](exact.astype(np.float32)))
    assert np.array_equal(value[td](out), ref)


def test_binary_rejects_bad_types_and_shapes():
    with pytest.raises(GGMLError, match="unsupported types"):
        forward_add(U(4, 1, 1, 1), U(4, 1, 1, 1).astype(F16), np.zeros((1, 1, 1, 4), np.float32))
    with pytest.raises(GGMLError, match="cannot be repeated"):
        forward_add(U(10, 1, 1, 1), U(3, 1, 1, 1), np.zeros((1, 1, 1, 10), np.float32))


def test_div_by_zero_gives_inf_like_c():
    out = np.zeros((1, 1, 1, 2), np.float32)
    forward_div(np.array([[[[1.0, -1.0]]]], np.float32), np.zeros((1, 1, 1, 1), np.float32), out)
    assert out.ravel().tolist() == [np.inf, -np.inf]


# --- unary, glu, scale, norms -------------------------------------------------------------------

def test_scale_and_scale_bias():
    x = U(10, 10, 10, 10)
    assert_close(forward_scale, (x, OUT, 2.0), x, 2.0 * x.astype(np.float64))
    assert_close(forward_scale, (x, OUT, 2.0, -0.25), x, 2.0 * x.astype(np.float64) - 0.25)


def test_silu_f32_and_f16():
    x = U(128, 2, 2, 2, lo=-6, hi=6)
    xd = x.astype(np.float64)
    assert_close(forward_silu, (x, OUT), x, xd / (1 + np.exp(-xd)))
    h = x.astype(F16)
    hd = h.astype(np.float64)
    assert_close(forward_silu, (h, OUT), h, hd / (1 + np.exp(-hd)), limit=1e-6)


def gelu64(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * x * (1 + 0.044715 * x * x)))


def test_gelu_has_fp16_precision_like_ggml():
    x = U(128, 2, 2, 2, lo=-12, hi=12)
    out = np.empty_like(x)
    forward_gelu(x, out)
    inside = np.abs(x) < 10
    # below -10: 0, above 10: x itself
    assert (out[x <= -10] == 0).all() and np.array_equal(out[x >= 10], x[x >= 10])
    # inside: ggml's float32 formula at fp16(x), rounded to fp16 (the table's entry), give or take
    # one fp16 ulp; tanhf as libm gives it (correctly rounded: double tanh rounded to float32, not
    # numpy's float32 tanh, whose last bit depends on the CPU)
    h = x[inside].astype(F16).astype(np.float32)
    f32 = np.float32
    z = f32(0.7978845608028654) * h * (f32(1) + f32(0.044715) * h * h)
    want = (f32(0.5) * h * (f32(1) + np.tanh(z.astype(np.float64)).astype(f32))).astype(F16)
    got = out[inside].astype(F16)
    assert np.array_equal(got.astype(np.float32), out[inside])          # the result is an fp16 value
    ulps = np.abs(got.view(np.int16).astype(int) - want.view(np.int16).astype(int))
    assert ulps.max() <= 1 and (ulps == 0).mean() > 0.99
    assert nmse(out, gelu64(x)) < 1e-6


def test_gelu_f16_reads_the_table_by_bits():
    h = U(128, 2, 1, 1, lo=-5, hi=5).astype(F16)
    out = np.empty_like(h)
    forward_gelu(h, out)
    assert nmse(out, gelu64(h)) < 1e-6
    big = np.array([[[[-12.0, 12.0]]]], F16)             # no thresholds for F16: the table's entries
    forward_gelu(big, out[:1, :1, :1, :2])
    assert out[0, 0, 0, :2].tolist() == [0.0, 12.0]


def test_swiglu_split_fused_and_swapped():
    g, v = U(10, 5, 4, 3), U(10, 5, 4, 3)
    gd, vd = g.astype(np.float64), v.astype(np.float64)
    silu = lambda t: t / (1 + np.exp(-t))
    assert_close(forward_swiglu, (g, v, OUT), g, silu(gd) * vd)
    gv = np.concatenate([g, v], axis=3)
    assert_close(forward_swiglu, (gv, None, OUT), g, silu(gd) * vd)
    assert_close(forward_swiglu, (gv, None, OUT, True), g, silu(vd) * gd)


def test_swiglu_fused_odd_rows_leave_the_last_element_unread():
    # test-backend-ops' ne_a [5, 7, 11, 13]: dst rows of nc = 5 // 2 = 2; gate [0, 2), value [2, 4)
    x = np.random.default_rng(7).uniform(-1, 1, (13, 11, 7, 5)).astype(np.float32)
    x[..., 4] = np.nan                                  # never read, or the output would hold NaN
    xd = x.astype(np.float64)
    silu = lambda t: t / (1 + np.exp(-t))
    like = np.empty((13, 11, 7, 2), np.float32)
    assert_close(forward_swiglu, (x, None, OUT), like, silu(xd[..., :2]) * xd[..., 2:4])
    assert_close(forward_swiglu, (x, None, OUT, True), like, silu(xd[..., 2:4]) * xd[..., :2])
    h = x.astype(F16)
    out = np.empty(like.shape, F16)
    forward_swiglu(h, None, out)
    assert not np.isnan(out.astype(np.float32)).any()
    with pytest.raises(GGMLError, match="do not fit"):          # nc must be ne00 / 2, rounded down
        forward_swiglu(x, None, np.empty((13, 11, 7, 3), np.float32))


# ggml's function of every unary op, in float64 numpy (unary-ops.cpp, vec.h)
UNARY_REF = {
    "ABS": np.abs, "SGN": np.sign, "NEG": np.negative, "STEP": lambda x: (x > 0) * 1.0,
    "TANH": np.tanh, "ELU": lambda x: np.where(x > 0, x, np.expm1(x)), "RELU": lambda x: np.maximum(x, 0),
    "SIGMOID": lambda x: 1 / (1 + np.exp(-x)), "GELU": gelu64,
    "GELU_QUICK": lambda x: x / (1 + np.exp(-1.702 * x)), "SILU": lambda x: x / (1 + np.exp(-x)),
    "HARDSWISH": lambda x: x * np.clip((x + 3) / 6, 0, 1), "HARDSIGMOID": lambda x: np.clip((x + 3) / 6, 0, 1),
    "EXP": np.exp, "EXPM1": np.expm1, "SOFTPLUS": lambda x: np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))),
    "GELU_ERF": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
    "FLOOR": np.floor, "CEIL": np.ceil, "TRUNC": np.trunc,
    "ROUND": lambda x: np.copysign(np.floor(np.abs(x) + 0.5), x),
}
OPS_CPP = ("GELU", "GELU_QUICK", "GELU_ERF", "SILU")        # F32 and F16 only in ggml


def test_unary_ids_are_ggmls():
    assert set(UNARY_REF) == {u.name for u in UnaryOp} - {"XIELU", "COUNT"}
    for u in UnaryOp:
        if u != UnaryOp.COUNT:
            assert getattr(unary_ops, "_" + u.name) == int(u), u


@pytest.mark.parametrize("name", sorted(UNARY_REF))
def test_unary_op_f32_f16_bf16(name):
    u, f = UnaryOp[name], UNARY_REF[name]
    x = np.random.default_rng(u).uniform(-10, 10, (2, 2, 8, 64)).astype(np.float32)   # exp(10) fits in F16
    x[0, 0, 0, :5] = [0.0, -0.5, 0.5, 2.5, -3.5]          # ties for ROUND, 0 for SGN and STEP
    if name == "SOFTPLUS":
        x[0, 0, 0, 5:8] = [19.5, 20.0, 25.0]              # either side of its threshold
    limit = 1e-5 if name in ("GELU", "GELU_QUICK") else 1e-12     # the fp16 tables: fp16 precision
    assert_close(forward_unary, (x, OUT, u), x, f(x.astype(np.float64)), limit=limit)
    h = x.astype(F16)                                   # F16: ggml's function of the fp16 values, rounded
    assert_close(forward_unary, (h, OUT, u), h, f(h.astype(np.float64)).astype(F16), limit=1e-6)
    if name in OPS_CPP:
        with pytest.raises(GGMLError, match="not supported"):
            forward_unary(fp32_to_bf16_array(x), np.empty(x.shape, np.uint16), u)
        return
    b = fp32_to_bf16_array(x)                           # BF16 in and out, and F16/BF16 in, F32 out
    want = f(bf16_values(b).astype(np.float64))
    for nth in NTH:
        out = run_threads(forward_unary, (b, OUT, u), np.full(b.shape, 0xFFFF, np.uint16), nth)
        assert nmse(bf16_values(out), bf16_values(fp32_to_bf16_array(want.astype(np.float32)))) <= 1e-4
    assert_close(forward_unary, (b, OUT, u), x, want, limit=1e-12)
    assert_close(forward_unary, (h, OUT, u), x, f(h.astype(np.float64)), limit=1e-12)


def test_unary_exact_cases():
    def run(name, values, dtype=np.float32):
        x = np.array(values, dtype).reshape(1, 1, 1, -1)
        out = np.full(x.shape, np.nan, dtype)
        forward_unary(x, out, UnaryOp[name])
        return out.ravel().tolist()
    # roundf: halves away from zero, and a float32 just below one half stays below
    big = float(np.float32(1e30))
    assert run("ROUND", [0.5, -0.5, 1.5, 2.5, -2.5, 0.49999997, big]) == [1, -1, 2, 3, -3, 0, big]
    assert run("ROUND", [0.5, 2.5, -2.5], F16) == [1, 3, -3]
    assert run("SGN", [-3.0, 0.0, 2.0]) == [-1, 0, 1] and run("STEP", [-1.0, 0.0, 1.0]) == [0, 0, 1]
    # EXPM1 is expf(x) - 1 in ggml: the digits of a tiny x are lost, unlike expm1f
    assert run("EXPM1", [1e-8]) == [0.0] and run("EXP", [100.0]) == [math.inf]
    # SOFTPLUS: x itself above 20, logf(1 + expf(x)) up to 20
    assert run("SOFTPLUS", [21.0, 100.0]) == [21.0, 100.0]
    assert run("SOFTPLUS", [20.0])[0] == pytest.approx(20.0, abs=1e-6)
    assert run("HARDSIGMOID", [-4.0, 0.0, 4.0]) == [0, 0.5, 1] and run("HARDSWISH", [-4.0, 4.0]) == [0, 4]
    assert run("RELU", [-150.0, 150.0]) == [0, 150] and run("ELU", [-150.0]) == [-1]


def test_gelu_quick_has_fp16_precision_like_ggml():
    x = U(128, 2, 2, 2, lo=-150, hi=150)
    out = np.empty_like(x)
    forward_unary(x, out, UnaryOp.GELU_QUICK)
    assert np.array_equal(out.astype(F16).astype(np.float32), out)      # every result an fp16 value
    h = x.astype(F16).astype(np.float32)                # the table: ggml_gelu_quick_f32 at fp16(x), rounded
    f32 = np.float32
    with np.errstate(over="ignore"):
        want = (h * (f32(1) / (f32(1) + np.exp((f32(-1.702) * h).astype(np.float64)).astype(f32)))).astype(F16)
    ulps = np.abs(out.astype(F16).view(np.int16).astype(int) - want.view(np.int16).astype(int))
    assert ulps.max() <= 1 and (ulps == 0).mean() > 0.99
    hx = x.astype(F16)                                  # F16: the table by the input's bits
    ho = np.empty_like(hx)
    forward_unary(hx, ho, UnaryOp.GELU_QUICK)
    assert np.array_equal(ho, out.astype(F16))


def test_gelu_erf_is_computed_not_looked_up():
    x = U(128, 2, 2, 2, lo=-6, hi=6)
    out = np.empty_like(x)
    forward_unary(x, out, UnaryOp.GELU_ERF)
    assert nmse(out, UNARY_REF["GELU_ERF"](x.astype(np.float64))) < 1e-13
    assert not np.array_equal(out.astype(F16).astype(np.float32), out)


def test_unary_rejects_what_ggml_rejects():
    x = U(8, 2, 1, 1)
    with pytest.raises(GGMLError, match="XIELU has no CPU kernel"):
        forward_unary(x, np.empty_like(x), UnaryOp.XIELU)
    with pytest.raises(GGMLError, match="not supported"):          # F32 in, F16 out: not a pair of ggml's
        forward_unary(x, np.empty(x.shape, F16), UnaryOp.RELU)
    with pytest.raises(GGMLError, match="not supported"):          # F16 in, F32 out: not for ops.cpp's four
        forward_unary(x.astype(F16), np.empty_like(x), UnaryOp.SILU)
    with pytest.raises(GGMLError, match="not supported"):
        forward_unary(x, np.empty((1, 1, 2, 4), np.float32), UnaryOp.TANH)


def test_rms_norm_and_norm():
    x = U(64, 5, 4, 3)
    xd = x.astype(np.float64)
    assert_close(forward_rms_norm, (x, OUT, 1e-6), x, xd / np.sqrt((xd ** 2).mean(3, keepdims=True) + 1e-6))
    assert_close(forward_norm, (x, OUT, 1e-6), x,
                 (xd - xd.mean(3, keepdims=True)) / np.sqrt(xd.var(3, keepdims=True) + 1e-6))
    long = U(4096, 3, 1, 1, lo=10, hi=11)               # a long row far from zero
    out = np.empty_like(long)
    forward_norm(long, out, 1e-5)
    ld = long.astype(np.float64)
    assert nmse(out, (ld - ld.mean(3, keepdims=True)) / np.sqrt(ld.var(3, keepdims=True) + 1e-5)) < 1e-7
    with pytest.raises(GGMLError, match="eps"):
        forward_rms_norm(x, np.empty_like(x), -1.0)


# --- soft_max -----------------------------------------------------------------------------------

def softmax64(x, mask, scale, max_bias):
    n_head = x.shape[1]
    slopes = np.ones(n_head)
    if max_bias > 0:
        l2 = 2 ** math.floor(math.log2(n_head))
        m0, m1 = 2 ** (-max_bias / l2), 2 ** (-max_bias / 2 / l2)
        slopes = np.array([m0 ** (h + 1) if h < l2 else m1 ** (2 * (h - l2) + 1) for h in range(n_head)])
    w = x.astype(np.float64) * scale
    if mask is not None:
        m = mask.astype(np.float64)[:, :, :x.shape[2], :]
        m = np.tile(m, (x.shape[0] // m.shape[0], x.shape[1] // m.shape[1], 1, 1))
        w = w + slopes[None, :, None, None] * m
    e = np.exp(w - w.max(3, keepdims=True))
    return e / e.sum(3, keepdims=True)


@pytest.mark.parametrize("mask_ne,mask_type,scale,max_bias", [
    (None, None, 1.0, 0.0), ((10, 5, 1, 1), np.float32, 0.5, 0.0), ((10, 5, 1, 1), F16, 1.0, 8.0),
    ((10, 7, 4, 3), np.float32, 0.125, 0.0), ((10, 5, 2, 1), F16, 2.0, 0.0), ((10, 5, 4, 1), np.float32, 1.0, 4.0)])
def test_soft_max(mask_ne, mask_type, scale, max_bias):
    x = U(10, 5, 4, 3)                                  # test-backend-ops: soft_max [10,5,4,3]
    mask = None if mask_ne is None else U(*mask_ne).astype(mask_type)
    if mask is not None:
        mask[..., 8:] = -np.inf
    assert_close(forward_soft_max, (x, mask, OUT, scale, max_bias), x, softmax64(x, mask, scale, max_bias), limit=1e-6)


def test_soft_max_alibi_needs_a_mask_and_mask_must_fit():
    x = U(10, 5, 4, 3)
    with pytest.raises(GGMLError, match="ALiBi"):
        forward_soft_max(x, None, np.empty_like(x), 1.0, 8.0)
    with pytest.raises(GGMLError, match="does not fit"):
        forward_soft_max(x, U(9, 5, 1, 1), np.empty_like(x))


# --- rope ---------------------------------------------------------------------------------------

def rope64(x, pos, n_dims, mode, ff=None, n_ctx_orig=0, base=10000.0, freq_scale=1.0, ext_factor=0.0,
           attn_factor=1.0, beta_fast=32.0, beta_slow=1.0):
    x = x.astype(np.float64)
    y = x.copy()

    def corr(n_rot):
        if not n_ctx_orig:
            return -math.inf
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(0.0, np.floor(corr(beta_fast))), min(n_dims - 1.0, np.ceil(corr(beta_slow)))
    k = np.arange(n_dims // 2)
    for i2, p in enumerate(pos):
        extrap = p * base ** (-2.0 * k / n_dims) / (ff[:n_dims // 2] if ff is not None else 1.0)
        theta, mscale = freq_scale * extrap, attn_factor
        if ext_factor:
            ramp = (1 - np.clip((k - low) / max(0.001, high - low), 0, 1)) * ext_factor
            theta = theta * (1 - ramp) + extrap * ramp
            mscale *= 1 + 0.1 * math.log(1 / freq_scale)
        c, s = np.cos(theta) * mscale, np.sin(theta) * mscale
        i, j = (2 * k, 2 * k + 1) if mode == 0 else (k, k + n_dims // 2)
        xv, yv = x[:, i2], y[:, i2]                     # (ne3, ne1, ne0) views of token i2
        x0, x1 = xv[..., i], xv[..., j]
        yv[..., i], yv[..., j] = x0 * c - x1 * s, x0 * s + x1 * c
    return y


@pytest.mark.parametrize("mode", [0, 2])
def test_rope_default_shape(mode):
    x = U(10, 5, 3, 1)                                  # test-backend-ops: rope [10,5,3,1], n_dims 10
    pos = np.array([0, 3, 1000], np.int32)
    assert_close(forward_rope, (x, pos, OUT, 10, mode), x, rope64(x, pos, 10, mode))


@pytest.mark.parametrize("mode", [0, 2])
def test_rope_partial_dims_freq_factors_yarn(mode):
    x, pos = U(64, 4, 5, 2), RNG.integers(0, 20000, 5).astype(np.int32)
    ff = RNG.uniform(1, 8, 32).astype(np.float32)
    kw = dict(n_ctx_orig=4096, freq_base=500000.0, freq_scale=0.125, ext_factor=1.0, attn_factor=0.9,
              beta_fast=32.0, beta_slow=1.0)
    ref = rope64(x, pos, 48, mode, ff, 4096, 500000.0, 0.125, 1.0, 0.9, 32.0, 1.0)
    assert_close(forward_rope, (x, pos, OUT, 48, mode, ff), x, ref, **kw)
    out = np.empty_like(x)
    forward_rope(x, pos, out, 48, mode, ff, **kw)
    assert np.array_equal(out[..., 48:], x[..., 48:])   # the dims past n_dims pass through


def test_rope_f16_and_theta_recurrence():
    x = U(128, 2, 3, 1).astype(F16)
    pos = np.array([5, 900, 8191], np.int32)
    out = np.empty_like(x)
    forward_rope(x, pos, out, 128, 2)
    assert nmse(out, rope64(x, pos, 128, 2)) < 1e-6
    # ggml's float32 theta recurrence, replayed in numpy float32, agrees closely with the kernel
    x32 = U(128, 1, 1, 1)
    out32 = np.empty_like(x32)
    forward_rope(x32, np.array([8191], np.int32), out32, 128, 2)
    theta, ts = np.float32(8191), np.float32(10000.0) ** (np.float32(-2.0) / np.float32(128))
    thetas = []
    for _ in range(64):
        thetas.append(theta)
        theta = np.float32(theta * ts)
    th = np.array(thetas, np.float64)
    x0, x1 = x32[0, 0, 0, :64].astype(np.float64), x32[0, 0, 0, 64:].astype(np.float64)
    replay = np.concatenate([x0 * np.cos(th) - x1 * np.sin(th), x0 * np.sin(th) + x1 * np.cos(th)])
    assert np.abs(out32.ravel() - replay).max() < 1e-5


def test_rope_errors():
    x = U(10, 5, 3, 1)
    with pytest.raises(GGMLError, match="mode"):
        forward_rope(x, np.zeros(3, np.int32), np.empty_like(x), 10, 8)
    with pytest.raises(GGMLError, match="pos"):
        forward_rope(x, np.zeros(2, np.int32), np.empty_like(x), 10, 0)
    with pytest.raises(GGMLError, match="n_dims"):
        forward_rope(x, np.zeros(3, np.int32), np.empty_like(x), 11, 0)


# --- diag_mask, concat, reductions, repeat ------------------------------------------------------

def test_diag_mask_inf_out_of_place_and_in_place():
    x = U(10, 10, 3, 2)
    ref = x.copy()
    i = np.arange(10)
    ref[..., i[None, :] > 5 + i[:, None]] = -np.inf
    for nth in NTH:
        out = run_threads(forward_diag_mask_inf, (x, OUT, 5), np.full_like(x, np.nan), nth)
        assert np.array_equal(out, ref)
        y = x.copy()
        run_threads(forward_diag_mask_inf, (y, OUT, 5), y, nth)
        assert np.array_equal(y, ref)


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_concat_every_dim(dim):
    a = U(10, 5, 5, 5)                                  # test-backend-ops: concat [10,5,5,5]
    ne_b = [10, 5, 5, 5]
    ne_b[dim] = 3
    b = U(*ne_b)
    ref = np.concatenate([a, b], axis=3 - dim)
    assert_close(forward_concat, (a, b, OUT, dim), ref, ref)
    h = np.empty(ref.shape, F16)
    forward_concat(a.astype(F16), b.astype(F16), h, dim)
    assert np.array_equal(h, ref.astype(F16))


@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.int8, np.uint16])   # I32, I16, I8, BF16 bits
@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_concat_moves_any_element_type(dtype, dim):
    # test-backend-ops' I32 case: ne_a [11, 12, 13, 14], 7 along dim
    rng = np.random.default_rng(dim)
    info = np.iinfo(dtype)
    ne_b = [11, 12, 13, 14]
    ne_b[dim] = 7
    a = rng.integers(info.min, info.max, (14, 13, 12, 11), endpoint=True).astype(dtype)
    b = rng.integers(info.min, info.max, ne_b[::-1], endpoint=True).astype(dtype)
    ref = np.concatenate([a, b], axis=3 - dim)
    for nth in NTH:
        out = run_threads(forward_concat, (a, b, OUT, dim), np.zeros(ref.shape, dtype), nth)
        assert np.array_equal(out, ref)


def test_concat_rejects_mixed_or_quantized_types():
    a = np.zeros((1, 1, 2, 4), np.int32)
    with pytest.raises(GGMLError, match="cannot be joined"):
        forward_concat(a, a.astype(np.float32), np.zeros((1, 1, 4, 4), np.int32), 1)
    q = np.zeros((1, 1, 2, 18), np.uint8)                       # Q4_0 rows: no concat of blocks
    with pytest.raises(GGMLError, match="cannot be joined"):
        forward_concat(q, q, np.zeros((1, 1, 4, 18), np.uint8), 1)


def test_sum_sum_rows_mean_repeat():
    x = U(10, 5, 4, 3)
    xd = x.astype(np.float64)
    assert_close(forward_sum, (x, OUT), np.empty((1, 1, 1, 1), np.float32), xd.sum().reshape(1, 1, 1, 1))
    assert_close(forward_sum_rows, (x, OUT), np.empty((3, 4, 5, 1), np.float32), xd.sum(3, keepdims=True))
    assert_close(forward_mean, (x, OUT), np.empty((3, 4, 5, 1), np.float32), xd.mean(3, keepdims=True))
    h = np.empty((1, 1, 1, 1), F16)
    forward_sum(x.astype(F16), h)
    assert abs(float(h[0, 0, 0, 0]) - x.astype(F16).astype(np.float64).sum()) < 1e-2
    a = U(10, 5, 1, 1)
    assert_close(forward_repeat, (a, OUT), np.empty((3, 4, 10, 20), np.float32), np.tile(a, (3, 4, 2, 2)))
    i32 = np.arange(6, dtype=np.int32).reshape(1, 1, 2, 3)
    o32 = np.empty((2, 1, 4, 6), np.int32)
    forward_repeat(i32, o32)
    assert np.array_equal(o32, np.tile(i32, (2, 1, 2, 2)))


# --- get_rows and dup -------------------------------------------------------------------------

QTYPES = [Type.Q4_0, Type.Q4_1, Type.Q8_0, Type.Q4_K, Type.Q6_K]
NEW_QTYPES = [Type.Q5_0, Type.Q5_1, Type.Q2_K, Type.Q3_K, Type.Q5_K]      # the dots in qdots.py
GGUF = {Type.Q4_0: gguf.GGMLQuantizationType.Q4_0, Type.Q4_1: gguf.GGMLQuantizationType.Q4_1,
        Type.Q8_0: gguf.GGMLQuantizationType.Q8_0, Type.Q4_K: gguf.GGMLQuantizationType.Q4_K,
        Type.Q6_K: gguf.GGMLQuantizationType.Q6_K}
GGUF.update({t: gguf.GGMLQuantizationType[t.name] for t in NEW_QTYPES})


def gguf_dequant(t, q, n):
    return gguf.quants.dequantize(q.reshape(-1, row_size(t, n)), GGUF[t]).reshape(q.shape[:-1] + (n,))


@pytest.mark.parametrize("t", [Type.F32, Type.F16, Type.BF16] + QTYPES + NEW_QTYPES)
def test_get_rows_every_type(t):
    n = 10 if t in (Type.F32, Type.F16, Type.BF16) else (32 if t in (Type.Q4_0, Type.Q4_1, Type.Q8_0) else 256)
    w = U(n, 5, 3, 1)                                   # test-backend-ops: n=10, m=5, r=3 (b=3 matrices)
    if t == Type.F32:
        a, values = w, w
    elif t == Type.F16:
        a, values = w.astype(F16), w.astype(F16).astype(np.float32)
    elif t == Type.BF16:
        a = fp32_to_bf16_array(w)
        values = bf16_values(a)
    else:
        a = quantize_chunk(t, w.reshape(-1, n)).reshape(1, 3, 5, -1)
        values = gguf_dequant(t, a, n)
    idx = RNG.integers(0, 5, (1, 1, 3, 4)).astype(np.int32)   # 4 indices per matrix
    ref = np.stack([values[0, i11][idx[0, 0, i11]] for i11 in range(3)])[None]
    assert_close(forward_get_rows, (a, idx, OUT), np.empty((1, 3, 4, n), np.float32), ref,
                 limit=0 if t != Type.Q4_K else 1e-12, src0_type=t)


def test_get_rows_index_out_of_range():
    with pytest.raises(GGMLError, match=r"row index -1 at src1\[2, 0, 0\] is out of range \[0, 5\)"):
        forward_get_rows(U(10, 5, 1, 1), np.array([[[[0, 1, -1]]]], np.int32), np.empty((1, 1, 3, 10), np.float32))


@pytest.mark.parametrize("nth", NTH)
def test_get_rows_i32_copies_rows_as_they_are(nth):
    # I32 rows, including bit patterns that are NaNs and denormals as floats, come back unchanged
    a = np.random.default_rng(8).integers(-2 ** 31, 2 ** 31, (2, 3, 5, 7), dtype=np.int64).astype(np.int32)
    a[0, 0, 0, :3] = [-1, 0x7F800001, 1]
    idx = np.random.default_rng(9).integers(0, 5, (1, 2, 3, 4)).astype(np.int32)
    out = run_threads(forward_get_rows, (a, idx, OUT), np.full((2, 3, 4, 7), 12345, np.int32), nth)
    want = np.stack([np.stack([a[i12, i11][idx[0, i12, i11]] for i11 in range(3)]) for i12 in range(2)])
    assert np.array_equal(out, want)
    forward_get_rows(a, idx, out, src0_type=Type.I32)
    assert np.array_equal(out, want)
    with pytest.raises(GGMLError, match="dst I32"):
        forward_get_rows(a, idx, np.empty((2, 3, 4, 7), np.float32))


@pytest.mark.parametrize("src_dt,dst_dt", [(np.float32, F16), (F16, np.float32), (np.float32, np.uint16),
                                           (np.uint16, np.float32), (F16, F16), (np.float32, np.float32)])
def test_dup_between_float_types_in_logical_order(src_dt, dst_dt):
    x = U(10, 10, 10, 1)                                # test-backend-ops: cpy [10,10,10,1]
    src = fp32_to_bf16_array(x) if src_dt == np.uint16 else x.astype(src_dt)
    val = bf16_values(src) if src_dt == np.uint16 else src.astype(np.float32)
    for view in (src, src.transpose(0, 1, 3, 2), src.transpose(0, 2, 1, 3)):
        vview = bf16_values(view) if src_dt == np.uint16 else view.astype(np.float32)
        for shape in (view.shape, (1, 1, 1, 1000), (1, 4, 5, 50)):
            for nth in NTH:
                out = np.zeros(shape, dst_dt)
                run_threads(forward_dup, (view, OUT), out, nth)
                flat = vview.reshape(-1)
                want = fp32_to_bf16_array(flat) if dst_dt == np.uint16 else flat.astype(dst_dt)
                assert np.array_equal(out.reshape(-1), want)
    del val


def _q8_0_x86(rows):
    """The bytes of ggml's x86 quantize_row_q8_0 (AVX path), in numpy: d = fp16(amax / 127),
    q = round-half-even(x * (127 / amax)) (the CPU's from_float for Q8_0; quantize_chunk rounds
    as the reference quantizer does)."""
    b = np.ascontiguousarray(rows, np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        idd = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    out = np.empty((b.shape[0], 34), np.uint8)
    out[:, :2] = (amax / np.float32(127)).astype(np.float16).view(np.uint8)
    out[:, 2:] = np.rint(b * idd).astype(np.int8).view(np.uint8)
    return out.reshape(rows.shape[0], -1)


def _from_float(t, rows):
    return _q8_0_x86(rows) if t == Type.Q8_0 else quantize_chunk(t, rows)


def test_cpu_q8_0_rounds_halves_to_even_as_ggmls_x86():
    """x * (127/amax) = 62.5 is a half: x86's ggml rounds it to 62 (even), roundf to 63."""
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2] = 1.0, 62.5 / 127, -62.5 / 127
    y = np.zeros(34, np.uint8)
    quantize_row_q8_0(x, y)
    assert np.array_equal(y, _q8_0_x86(x.reshape(1, -1)).reshape(-1))
    assert y[3].view(np.int8) == 62 and y[4].view(np.int8) == -62          # roundf would give 63, -63
    assert not np.array_equal(y, quantize_chunk(Type.Q8_0, x.reshape(1, -1)).reshape(-1))


@pytest.mark.parametrize("t", QTYPES + NEW_QTYPES)
def test_dup_to_and_from_quantized(t):
    n = 256
    x = U(n, 4, 3, 1)
    q = np.zeros((1, 3, 4, row_size(t, n)), np.uint8)
    for nth in NTH:
        q[:] = 0
        w = np.empty(n, np.float32)
        run_threads(forward_dup, (x, OUT), q, nth, dst_type=t, wdata=w)
        assert np.array_equal(q.reshape(12, -1), _from_float(t, x.reshape(12, n)))
        back = run_threads(forward_dup, (q, OUT), np.full_like(x, np.nan), nth, src0_type=t)
        assert np.array_equal(back, gguf_dequant(t, q, n)) if t != Type.Q4_K else nmse(back, gguf_dequant(t, q, n)) < 1e-12
    # F16 source, and a non-contiguous destination of whole blocks
    qh = np.zeros_like(q)
    forward_dup(x.astype(F16), qh, dst_type=t)
    assert np.array_equal(qh.reshape(12, -1), _from_float(t, x.astype(F16).astype(np.float32).reshape(12, n)))
    wide = np.full((1, 3, 4, 2 * n), np.nan, np.float32)
    forward_dup(q, wide[..., :n], src0_type=t)
    assert np.isnan(wide[..., n:]).all() and not np.isnan(wide[..., :n]).any()


def test_dup_same_type_quantized_copies_blocks():
    t = Type.Q8_0
    q = quantize_chunk(t, U(64, 6, 1, 1).reshape(6, 64)).reshape(1, 1, 6, -1)
    perm = q[:, :, ::-1]                                # rows reversed: not contiguous
    out = np.zeros((1, 1, 6, q.shape[3]), np.uint8)
    for nth in NTH:
        out[:] = 0
        run_threads(forward_dup, (perm, OUT), out, nth, src0_type=t, dst_type=t)
        assert np.array_equal(out, perm)
    flat = np.zeros(q.size, np.uint8).reshape(1, 1, 1, -1)
    run_threads(forward_dup, (q, OUT), flat, 3, src0_type=t, dst_type=t)
    assert np.array_equal(flat.ravel(), q.ravel())


def test_dup_errors():
    with pytest.raises(GGMLError, match="elements"):
        forward_dup(U(10, 1, 1, 1), np.zeros((1, 1, 1, 11), np.float32))
    with pytest.raises(GGMLError, match="not supported"):
        forward_dup(quantize_chunk(Type.Q8_0, U(32)).reshape(1, 1, 1, -1), np.zeros((1, 1, 1, 32), F16),
                      src0_type=Type.Q8_0)


# --- the dot products ---------------------------------------------------------------------------

def q8_0_values(b):
    blocks = b.reshape(-1, 34)
    return (blocks[:, 2:].view(np.int8).astype(np.float64) * blocks[:, :2].copy().view(F16).astype(np.float64)).ravel()


def q8_1_parts(b):
    blocks = b.reshape(-1, 36)
    d = blocks[:, :2].copy().view(F16).astype(np.float64).ravel()
    s = blocks[:, 2:4].copy().view(F16).astype(np.float64).ravel()
    return d, s, blocks[:, 4:].view(np.int8).astype(np.float64)


def q8_K_values(b):
    blocks = b.reshape(-1, 292)
    d = blocks[:, :4].copy().view(np.float32).astype(np.float64)
    q = blocks[:, 4:260].view(np.int8).astype(np.int64)
    bsums = blocks[:, 260:].copy().view(np.int16).astype(np.int64)
    assert np.array_equal(bsums, q.reshape(-1, 16, 16).sum(2)), "q8_K bsums are the sums of 16 codes"
    return (q * d).ravel()


def dot64(t, n, x, y):
    """An independent float64 dot: gguf's dequantizer for the weights, numpy for the activations."""
    if t == Type.Q4_1:
        xb = x.reshape(-1, 20)
        dx = xb[:, :2].copy().view(F16).astype(np.float64).ravel()
        mx = xb[:, 2:4].copy().view(F16).astype(np.float64).ravel()
        qx = np.concatenate([xb[:, 4:] & 15, xb[:, 4:] >> 4], axis=1).astype(np.float64)
        dy, sy, qy = q8_1_parts(y)
        return float(((qx * qy).sum(1) * dx * dy + mx * sy).sum())   # ggml uses y's stored s
    xv = gguf.quants.dequantize(x.reshape(1, -1), GGUF[t]).astype(np.float64).ravel()
    yv = q8_K_values(y) if t in (Type.Q4_K, Type.Q6_K) else q8_0_values(y)
    return float(np.dot(xv, yv))


@pytest.mark.parametrize("t", QTYPES)
@pytest.mark.parametrize("nblocks", [1, 3, 8])
def test_quantized_dots_against_gguf(t, nblocks):
    traits = V.get_type_traits_cpu(t)
    n = nblocks * (256 if t in (Type.Q4_K, Type.Q6_K) else 32)
    for scale in (1.0, 1e-3, 50.0):
        x = quantize_chunk(t, U(n) * scale)
        y = quantize_chunk(traits.vec_dot_type, U(n))
        got, ref = float(traits.vec_dot(n, x, y)), dot64(t, n, x, y)
        assert abs(got - ref) <= 2e-6 * np.abs(gguf.quants.dequantize(x.reshape(1, -1), GGUF[t])).sum() * 2, (got, ref)


def test_q4_0_q8_0_hand_built_blocks():
    q4 = np.arange(32) % 16
    q8 = np.arange(-16, 16)
    x = np.concatenate([np.array([F16(0.5)]).view(np.uint8), (q4[:16] | (q4[16:] << 4)).astype(np.uint8)])
    y = np.concatenate([np.array([F16(0.25)]).view(np.uint8), q8.astype(np.int8).view(np.uint8)])
    assert V.vec_dot_q4_0_q8_0(32, x, y) == np.dot(q4 - 8, q8) * 0.5 * 0.25 == 86.0
    # two blocks, the second with the extreme codes: -8*-128 everywhere
    x2 = np.concatenate([x, np.array([F16(1.0)]).view(np.uint8), np.zeros(16, np.uint8)])
    y2 = np.concatenate([y, np.array([F16(1.0)]).view(np.uint8), np.full(32, 0x80, np.uint8)])
    assert V.vec_dot_q4_0_q8_0(64, x2, y2) == 86.0 + 32 * 8 * 128


def _sign_trick_dot(x, y):
    """The integers of ggml's mul_sum_i8_pairs_float on x86 (AVX2 and AVX512-VNNI alike):
    |x| times y with x's sign, negated in int8 (so -(-128) wraps to -128)."""
    x, y = x.astype(np.int64), y.astype(np.int64)
    sy = (np.sign(x) * y + 128) % 256 - 128
    return int((np.abs(x) * sy).sum())


def test_q8_0_q8_0_as_ggml_x86_including_the_minus_128_corner():
    rng = np.random.default_rng(8)
    for codes in (np.full((2, 256), -128), rng.integers(-128, 128, (2, 256))):
        x, y = (np.zeros(34 * 8, np.uint8).reshape(8, 34) for _ in range(2))
        for b, c in ((x, codes[0]), (y, codes[1])):
            b[:, :2] = np.array([F16(1.0)]).view(np.uint8)
            b[:, 2:] = c.reshape(8, 32).astype(np.int8).view(np.uint8)
        exact = int((codes[0] * codes[1]).sum())
        want = _sign_trick_dot(codes[0], codes[1]) if S.AVX2 else exact
        assert V.vec_dot_q8_0_q8_0(256, x.ravel(), y.ravel()) == want
    # -128 times -128: ggml's AVX2 gives -128*128 per product, its scalar code +128*128
    assert _sign_trick_dot(np.full(4, -128), np.full(4, -128)) == -4 * 128 * 128


def test_q4_K_extremes_do_not_overflow():
    xk = np.zeros(144, np.uint8)
    xk[:2] = np.array([F16(1.0)]).view(np.uint8)
    xk[4:16] = [255, 255, 255, 255, 0, 0, 0, 0, 15, 15, 15, 15]      # every 6-bit scale 63, every min 0
    xk[16:] = 0xFF                                      # every code 15
    yk = np.zeros(292, np.uint8)
    yk[:4] = np.array([1.0], np.float32).view(np.uint8)
    yk[4:260] = 127
    yk[260:] = np.full(16, 16 * 127, np.int16).view(np.uint8)
    assert V.vec_dot_q4_K_q8_K(256, xk, yk) == 63 * 15 * 127 * 256


def test_q6_K_extremes_are_exact():
    # every code -32, every scale -128, every activation -128: each int32 lane reaches 2^24
    x = np.zeros(210, np.uint8)
    x[192:208] = 0x80                                   # int8 scales -128
    x[208:210] = np.array([F16(1.0)]).view(np.uint8)
    y = np.zeros(292, np.uint8)
    y[:4] = np.array([1.0], np.float32).view(np.uint8)
    y[4:260] = 0x80
    y[260:] = np.full(16, 16 * -128, np.int16).view(np.uint8)
    assert V.vec_dot_q6_K_q8_K(256, x, y) == -(32 * 128 * 128 * 256)


@njit(cache=False)
def _simd_probe(a, b, s):
    """Every Vec operation the kernels use, reduced to scalars that numpy can recompute."""
    va, vb = S.vload(a, 0, 32), S.vload(b, 0, 32)
    lo, hi = S.vload(a, 0, 16), S.vload(a, 16, 16)
    ones = S.vload(np.ones(32, np.uint8), 0, 32)
    acc = S.vzero(np.float32, 16)
    acc += S.vfloat(S.vdot(va, vb)) * s
    return (S.vsum(S.vdot(va, vb)),                                 # a unsigned
            S.vsum(S.vdot(S.vi8(va), vb)),                          # a signed
            S.vsum(S.vdot(va >> 3, ones)),                          # logical shift
            S.vsum(S.vdot(S.vi8(va) >> 3, ones)),                   # arithmetic shift
            S.vsum(S.vdot(((va & 15) | ((vb & 3) << 4)) - 40, ones)),  # wrapping byte arithmetic
            S.vsum(S.vdot(S.vcat(hi, lo), vb)),
            S.vsum(acc))


def test_simd_operations_against_numpy():
    rng = np.random.default_rng(7)
    for _ in range(20):
        a, b = rng.integers(0, 256, 32, dtype=np.uint8), rng.integers(0, 256, 32, dtype=np.uint8)
        s = np.float32(rng.uniform(-2, 2))
        ai, bi = a.astype(np.int64), b.view(np.int8).astype(np.int64)
        pairs = (a.astype(np.int32) * bi.astype(np.int32)).reshape(16, 2).sum(1)
        lanes = pairs.astype(np.float32) * s
        while lanes.size > 1:                           # vsum's order: upper half onto lower half
            lanes = lanes[:lanes.size // 2] + lanes[lanes.size // 2:]
        wrapped = (((a & 15) | ((b & 3) << 4)) - 40).astype(np.uint8).astype(np.int64)
        want = (int(ai @ bi), int(a.view(np.int8).astype(np.int64) @ bi), int((a >> 3).sum()),
                int((a.view(np.int8) >> 3).astype(np.int64).sum()), int(wrapped.sum()),
                int(np.concatenate([a[16:], a[:16]]).astype(np.int64) @ bi), lanes[0])
        assert _simd_probe(a, b, s) == want


@pytest.mark.parametrize("n", [1, 7, 64, 1000])
def test_float_dots(n):
    x, y = U(n), U(n)
    assert abs(V.vec_dot_f32(n, x, y) - np.dot(x.astype(np.float64), y)) < 1e-5
    xh, yh = x.astype(F16), y.astype(F16)
    assert abs(V.vec_dot_f16(n, xh.view(np.uint16), yh.view(np.uint16)) - np.dot(xh.astype(np.float64), yh)) < 1e-5
    xb, yb = fp32_to_bf16_array(x), fp32_to_bf16_array(y)
    assert abs(V.vec_dot_bf16(n, xb, yb) - np.dot(bf16_values(xb).astype(np.float64), bf16_values(yb))) < 1e-5


def test_traits_table():
    pairs = {Type.F32: Type.F32, Type.F16: Type.F16, Type.BF16: Type.BF16, Type.Q4_0: Type.Q8_0,
             Type.Q4_1: Type.Q8_1, Type.Q8_0: Type.Q8_0, Type.Q4_K: Type.Q8_K, Type.Q6_K: Type.Q8_K}
    for t, vdt in pairs.items():
        assert V.get_type_traits_cpu(t).vec_dot_type == vdt and V.get_type_traits_cpu(t).nrows == 1
    with pytest.raises(GGMLError, match="no CPU dot product"):
        V.get_type_traits_cpu(Type.Q8_K)


# --- mul_mat ------------------------------------------------------------------------------------

ALL = [Type.F32, Type.F16, Type.BF16] + QTYPES


def weights(t, ne):
    w = U(*ne)
    if t == Type.F32:
        return w, w
    if t == Type.F16:
        return w.astype(F16), w.astype(F16).astype(np.float32)
    if t == Type.BF16:
        b = fp32_to_bf16_array(w)
        return b, bf16_values(b)
    q = quantize_chunk(t, w.reshape(-1, ne[0])).reshape(w.shape[:3] + (-1,))
    return q, gguf_dequant(t, q, ne[0])


def mul_mat64(values, b):
    r3, r2 = b.shape[0] // values.shape[0], b.shape[1] // values.shape[1]
    w = np.repeat(np.repeat(values.astype(np.float64), r3, 0), r2, 1)
    return np.einsum("lkit,lkjt->lkji", w, b.astype(np.float64))


@pytest.mark.parametrize("t", ALL)
def test_mul_mat_all_types_n_1_to_9(t):
    a, values = weights(t, (256, 16, 1, 1))             # all_types x F32: m=16, k=256, n=1..9
    for n in range(1, 10):
        b = U(256, n, 1, 1)
        ref = mul_mat64(values, b)
        for nth in NTH:
            d = np.full((1, 1, n, 16), np.nan, np.float32)
            V.forward_mul_mat(t, a, b, d, nth=nth)
            assert not np.isnan(d).any() and nmse(d, ref) < 5e-4, (t, n, nth)


BS_NR = [((1, 1), (2, 1)), ((1, 1), (1, 2)), ((3, 1), (1, 1)), ((3, 1), (2, 1)), ((3, 2), (1, 1)),
         ((3, 2), (2, 1)), ((3, 2), (1, 2)), ((3, 2), (2, 2))]


@pytest.mark.parametrize("t", [Type.F32, Type.F16, Type.Q4_0, Type.Q8_0, Type.Q4_K])
@pytest.mark.parametrize("n", [1, 16])
def test_mul_mat_broadcast_bs_nr(t, n):
    for bs, nr in BS_NR:                                # base_types: m=16, k=256, n in {1, 16}
        a, values = weights(t, (256, 16, bs[0], bs[1]))
        b = U(256, n, bs[0] * nr[0], bs[1] * nr[1])
        ref = mul_mat64(values, b)
        for nth in (1, 3):
            d = np.full(b.shape[:3] + (16,), np.nan, np.float32)
            V.forward_mul_mat(t, a, b, d, nth=nth)
            assert nmse(d, ref) < 5e-4, (t, bs, nr, nth)


@pytest.mark.parametrize("t", [Type.F32, Type.F16, Type.BF16, Type.Q4_0, Type.Q8_0, Type.Q4_K])
@pytest.mark.parametrize("per", [(0, 2, 1, 3), (0, 1, 3, 2), (0, 3, 2, 1)])
def test_mul_mat_permuted_inputs(t, per):
    # test_mul_mat(per=...): a and b are created with permuted ne and ggml_permute'd back, so they
    # have the usual ne and permuted strides in dims 1..3 (dim 0, the rows, stays contiguous)
    ne_a, ne_b = (256, 16, 2, 3), (256, 8, 2, 3)
    order = [3 - per[3 - k] for k in range(4)]         # ggml_permute as a numpy transpose
    a_base, values_base = weights(t, tuple(ne_a[i] for i in per))
    a, values = a_base.transpose(order), values_base.transpose(order)
    b = U(*[ne_b[i] for i in per]).transpose(order)
    assert a.shape[:3] == (3, 2, 16) and b.shape == (3, 2, 8, 256)
    ref = mul_mat64(values, b)
    for nth in (1, 2, 4):
        d = np.full((3, 2, 8, 16), np.nan, np.float32)
        V.forward_mul_mat(t, a, b, d, nth=nth)
        assert nmse(d, ref) < 5e-4, (t, per, nth)


@pytest.mark.parametrize("t", QTYPES + [Type.F16, Type.BF16])
@pytest.mark.parametrize("nth", NTH)
def test_src1_conversion_split_by_blocks(t, nth):
    vdt = V.get_type_traits_cpu(t).vec_dot_type
    b = U(512, 3, 2, 1)
    rows = b.reshape(-1, 512)
    if vdt == Type.F16:
        want = rows.astype(F16).view(np.uint8).ravel()
    elif vdt == Type.BF16:
        want = fp32_to_bf16_array(rows).view(np.uint8).ravel()
    else:
        want = quantize_chunk(vdt, rows).ravel()
    rs, bs = row_size(vdt, 512), {Type.Q8_0: 32, Type.Q8_1: 32, Type.Q8_K: 256}.get(vdt, 1)
    ts, nblk = rs // (512 // bs), 512 // bs
    union = np.zeros(want.size, np.uint8)
    for ith in range(nth):
        w = np.full(want.size, 0xAB, np.uint8)
        V.forward_mul_mat_src1(t, b, w, ith, nth)
        k0, k1 = ith * nblk // nth, (ith + 1) * nblk // nth
        mine = np.zeros(want.size, bool)
        for r in range(rows.shape[0]):
            mine[r * rs + k0 * ts:r * rs + k1 * ts] = True
        assert np.array_equal(w[mine], want[mine]) and (w[~mine] == 0xAB).all()
        union[mine] = w[mine]
    assert np.array_equal(union, want)


def test_mul_mat_chunking_is_ggmls():
    assert V.mul_mat_chunks(4096, 1, 2) == (64, 1, 64, 1)      # vectors: chunks of 64
    assert V.mul_mat_chunks(4096, 32, 2) == (256, 2, 16, 16)
    assert V.mul_mat_chunks(16, 9, 3) == (3, 1, 6, 9)          # too few chunks: one per thread
    assert V.mul_mat_chunks(9, 16, 3) == (1, 3, 9, 6)
    for nr0, nr1, nth in [(64, 48, 3), (100, 7, 4), (5, 5, 4), (1, 1, 2)]:
        nc0, nc1, dr0, dr1 = V.mul_mat_chunks(nr0, nr1, nth)
        cover = np.zeros((nr0, nr1), int)
        for c in range(nc0 * nc1):
            i0a, i0b, i1a, i1b = V.mul_mat_chunk_rows(c, nr0, nr1, nc0, dr0, dr1)
            cover[i0a:i0b, i1a:i1b] += 1
        assert (cover == 1).all()


@pytest.mark.parametrize("t", [Type.F32, Type.Q4_0, Type.Q6_K])
def test_mul_mat_single_chunks_write_only_their_block(t):
    a, values = weights(t, (256, 40, 1, 1))
    b = U(256, 24, 1, 1)
    w = np.empty(V.mul_mat_wsize(t, b), np.uint8)
    V.forward_mul_mat_src1(t, b, w)
    d = np.full((1, 1, 24, 40), np.nan, np.float32)
    V.forward_mul_mat_chunk(t, a, b, d, w, 8, 21, 5, 13)
    block = np.zeros(d.shape, bool)
    block[0, 0, 5:13, 8:21] = True
    assert not np.isnan(d[block]).any() and np.isnan(d[~block]).all()
    assert nmse(d[block], mul_mat64(values, b)[block]) < 5e-4


@pytest.mark.parametrize("t", [Type.F32, Type.Q4_0, Type.Q8_0])
@pytest.mark.parametrize("nth", [2, 3, 4])
def test_mul_mat_chunk_loop_on_real_threads(t, nth):
    a, values = weights(t, (256, 96, 1, 1))
    b = U(256, 40, 1, 1)
    ref = mul_mat64(values, b)
    for _ in range(3):
        w = np.empty(V.mul_mat_wsize(t, b), np.uint8)
        d = np.full((1, 1, 40, 96), np.nan, np.float32)
        nchunk = np.prod(V.mul_mat_chunks(96, 40, nth)[:2])
        owner = np.full(nchunk, -1, np.int32)
        counter = np.array([nth], np.int64)
        barrier = threading.Barrier(nth)

        def worker(ith):
            V.forward_mul_mat_src1(t, b, w, ith, nth)
            barrier.wait()
            V.forward_mul_mat_chunks(t, a, b, d, w, counter, ith, nth, owner)
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(nth)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        assert (owner >= 0).all() and all(owner[i] == i for i in range(min(nth, nchunk)))
        assert not np.isnan(d).any() and nmse(d, ref) < 5e-4


def test_atomic_fetch_add_from_threads():
    from numba import njit

    @njit(nogil=True)
    def hammer(c, n):
        for _ in range(n):
            V.atomic_fetch_add(c, 0, 1)

    c = np.zeros(1, np.int64)
    hammer(c, 1)
    c[0] = 0
    ts = [threading.Thread(target=hammer, args=(c, 200000)) for _ in range(4)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    assert c[0] == 800000
    assert V.atomic_fetch_add(c, 0, 5) == 800000 and c[0] == 800005


def test_mul_mat_check_errors():
    a, b = U(256, 16, 1, 1), U(256, 4, 1, 1)
    with pytest.raises(GGMLError, match="do not give dst"):
        V.mul_mat_check(Type.F32, a, U(128, 4, 1, 1), np.empty((1, 1, 4, 16), np.float32))
    with pytest.raises(GGMLError, match="do not give dst"):
        V.mul_mat_check(Type.F32, U(256, 16, 2, 1), U(256, 4, 3, 1), np.empty((1, 3, 4, 16), np.float32))
    with pytest.raises(GGMLError, match="rows must be contiguous"):
        V.mul_mat_check(Type.F32, a, U(512, 4, 1, 1)[..., ::2], np.empty((1, 1, 4, 16), np.float32))
    with pytest.raises(GGMLError, match="neither transposed nor permuted"):
        V.mul_mat_check(Type.F32, a, b, np.empty((1, 1, 16, 4), np.float32).transpose(0, 1, 3, 2))
    with pytest.raises(GGMLError, match="work buffer"):
        V.forward_mul_mat_src1(Type.Q4_0, b, np.empty(10, np.uint8))


# --- GLU: every kind, fused, swapped and split, against real ggml ---------------------------

GLU_REF = np.load(Path(__file__).parent / "data" / "glu_ref.npz")
GLU_CASES = sorted({k.rsplit("/", 1)[0] for k in GLU_REF.files})


def _glu_values(a):
    return a.astype(np.float32) if a.dtype == np.float32 else a.view(np.float16).astype(np.float32)


@pytest.mark.parametrize("case", GLU_CASES)
@pytest.mark.parametrize("nth", [1, 3])
def test_glu_equals_ggml(case, nth):
    """tests/ggml_ref/glu_ref.py: ggml 0.15.3's CPU on inputs crossing GEGLU's ±10 and the OAI limit."""
    kind, tname, form = case.split("/")
    x, want = GLU_REF[f"{case}/x"], GLU_REF[f"{case}/out"]
    y = GLU_REF[f"{case}/y"] if form == "split" else None
    as_arr = (lambda a: a) if tname == "f32" else (lambda a: a.view(np.float16))
    out = np.full(want.shape, np.nan, np.float32 if tname == "f32" else np.float16)
    for ith in range(nth):
        forward_glu(as_arr(x), None if y is None else as_arr(y), out, ggml.GluOp[kind],
                      form == "swapped", 1.702, 7.0, ith, nth)
    got, ref = out.astype(np.float32), _glu_values(want)
    assert nmse(got, ref) <= 1e-6, (case, nmse(got, ref))
    if kind == "REGLU":
        assert np.array_equal(got, ref)              # one product, no libm: ggml's bits anywhere
    elif tname == "f16" or kind in ("GEGLU", "GEGLU_QUICK"):
        # fp16 tables and fp16 results: ggml's bits but for a rare one-ulp flip where a libm
        # (ggml's expf/tanhf, or this machine's) rounds the other way at an fp16 boundary
        assert (got != ref).mean() < 0.01, (case, int((got != ref).sum()))


def test_glu_fixture_has_every_kind_form_and_type():
    kinds = {c.split("/")[0] for c in GLU_CASES}
    assert kinds == {g.name for g in ggml.GluOp if g != ggml.GluOp.COUNT}
    assert {c for c in GLU_CASES if c.startswith("SWIGLU_OAI")} == {
        "SWIGLU_OAI/f32/fused", "SWIGLU_OAI/f32/swapped", "SWIGLU_OAI/f32/split"}
    assert len(GLU_CASES) == 5 * 2 * 3 + 3


def test_glu_refuses_types_ggml_does_not_compute():
    x = np.zeros((1, 1, 2, 8), np.float16)
    with pytest.raises(GGMLError, match="swiglu_oai.*one f32 type"):
        forward_glu(x, None, np.zeros((1, 1, 2, 4), np.float16), ggml.GluOp.SWIGLU_OAI)
    with pytest.raises(GGMLError, match="geglu.*do not fit"):
        forward_glu(x, None, np.zeros((1, 1, 2, 4), np.float32), ggml.GluOp.GEGLU)


MULMAT_REF = Path(__file__).parent / "data" / "llama_mulmat_ref.npz"      # tests/ggml_ref/llama_mulmat_ref.py
_PATHS = """
import os, sys, numpy as np
os.environ["GGML_CPU_TILED_MM"] = "0"
import ggml_lite.backends.cpu.simd as S
S.AVX512_VNNI = False
if sys.argv[1] == "ir":
    S.AVX2 = False
from ggml_lite.types import Type
from ggml_lite.backends.cpu.vec import forward_mul_mat
d = np.load(sys.argv[2])
for t in sys.argv[3:]:
    ref = d[t + "_out"]
    dst = np.zeros((1, 1) + ref.shape, np.float32)
    forward_mul_mat(Type[t], d[t].reshape(1, 1, ref.shape[1], -1), d["x"].reshape((1, 1) + d["x"].shape), dst)
    print(t, int((dst[0, 0] != ref).sum()))
"""
_QDOT_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]


@pytest.mark.parametrize("t", _QDOT_TYPES)
def test_quantized_dots_give_ggmls_bits(t, monkeypatch):
    """The quantized dots keep ggml's AVX2 lanes and float order: ggml 0.15.3's own mul_mat
    outputs (20 rows x 512, one thread), every one equal bit for bit. (0.15.3 has no tiled
    K-quant product: ggml's switch turns it off here.)"""
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    d = np.load(MULMAT_REF)
    ref = d[f"{t}_out"]
    dst = np.zeros((1, 1) + ref.shape, np.float32)
    V.forward_mul_mat(Type[t], d[t].reshape(1, 1, ref.shape[1], -1), d["x"].reshape((1, 1) + d["x"].shape), dst)
    assert np.array_equal(dst[0, 0].view(np.uint32), ref.view(np.uint32)), int((dst[0, 0] != ref).sum())


@pytest.mark.parametrize("path", ["avx2", "ir"])
def test_quantized_dots_same_bits_without_vnni_or_avx2(path, tmp_path):
    """vdot4 and vmaddubs without AVX512-VNNI (pmaddubsw + pmaddwd) and without AVX2 (plain IR),
    compiled afresh in a subprocess: the same bits as ggml's outputs."""
    import os
    import subprocess
    import sys
    if path == "avx2" and not S.AVX2:
        pytest.skip("the machine numba compiles for has no AVX2")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _PATHS, path, str(MULMAT_REF)] + _QDOT_TYPES, env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [w for t in _QDOT_TYPES for w in (t, "0")], out


def test_v_expf_and_soft_max_are_ggmls_avx2_bits():
    """ggml_v_expf (vec.h, __m256) and the soft_max row around ggml_vec_soft_max_f32's AVX2 path,
    compiled from ggml 0.15.3's code by tests/ggml_ref/vexpf_ref.py: the same bits, over inputs
    that take both slow paths (|n| > 126 and > 192), +-inf, NaN, and masked rows whose length is
    and is not a multiple of 8 (the last ones with the C library's expf)."""
    from numba import njit
    from ggml_lite.backends.cpu import ops as K
    from ggml_lite.backends.cpu import vexp as E
    ref = np.load(Path(__file__).parent / "data/vexpf_ref.npz")

    @njit
    def expf_all(x):
        y = np.empty_like(x)
        for i in range(x.size):
            y[i] = E.v_expf(x[i])
        return y
    got = expf_all(ref["expf_x"])
    assert np.array_equal(got.view(np.uint32), ref["expf_y"].view(np.uint32))

    @njit
    def expf8_all(x):
        y = np.empty_like(x)
        for i in range(0, x.size, 8):
            E.vput8(y, i, E.v_expf8(E.vrow8(x, i)))
        return y
    got8 = expf8_all(ref["expf_x"])                         # NaN in, NaN out: compare the bits elsewhere
    nan = np.isnan(ref["expf_y"])
    assert np.array_equal(np.isnan(got8), nan)
    assert np.array_equal(got8[~nan].view(np.uint32), ref["expf_y"][~nan].view(np.uint32))
    for n in (256, 40, 13):
        x, mask, y = ref[f"sm{n}_x"], ref[f"sm{n}_mask"], ref[f"sm{n}_y"]
        out = np.empty((1, 1, *x.shape), np.float32)
        K.forward_soft_max(x[None, None], mask[None, None], out, float(ref[f"sm{n}_scale"]), 0.0)
        assert np.array_equal(out[0, 0].view(np.uint32), y.view(np.uint32)), n


def test_silu_and_swiglu_are_ggmls_avx2_bits():
    """ggml_vec_swiglu_f32's AVX2 path (ggml_v_silu eight at a time, the last n % 8 with
    ggml_silu_f32), compiled from ggml 0.15.3's code by tests/ggml_ref/vexpf_ref.py: the same bits
    through the split and the fused glu, and silu's eights (the same ggml_v_silu) through forward_silu."""
    ref = np.load(Path(__file__).parent / "data/vexpf_ref.npz")
    x, g, want = ref["swiglu_x"], ref["swiglu_g"], ref["swiglu_y"]
    nan = np.isnan(want)

    def same(got):
        return np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan].view(np.uint32),
                                                                    want[~nan].view(np.uint32))
    n = x.size
    out = np.empty((1, 1, 1, n), np.float32)
    forward_swiglu(x.reshape(1, 1, 1, n), g.reshape(1, 1, 1, n), out)
    assert same(out.ravel())
    fused = np.concatenate([x, g]).reshape(1, 1, 1, 2 * n)
    forward_swiglu(fused, None, out)
    assert same(out.ravel())
    silu = np.empty((1, 1, 1, n), np.float32)
    forward_silu(x.reshape(1, 1, 1, n), silu)
    with np.errstate(all="ignore"):
        assert same(np.where(np.isnan(x), np.nan, silu.ravel() * g))


def test_fp16_by_the_hardware_is_the_reference_conversion_but_for_signalling_nans():
    """ggml-cpu converts float32 to fp16 with F16C on x86 (GGML_CPU_FP32_TO_FP16 is
    _cvtss_sh(x, 0), ggml_cpu_fp32_to_fp16 stores eight with _mm256_cvtps_ph): round to
    nearest even like fp32_to_fp16, which keeps a signalling NaN signalling where the
    hardware makes it quiet. Rows of any length convert as their elements do."""
    from numba import njit
    from ggml_lite.backends.cpu import common as CM
    from ggml_lite.backends.cpu import simd as S
    from ggml_lite.types import fp32_to_fp16_row
    if not S.F16C:
        pytest.skip("the machine numba compiles for has no F16C")
    rng = np.random.default_rng(7)
    edges = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x33000000, 0x33000001, 0x387FE000,
             0x387FF000, 0x38800000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x7F7FFFFF,
             0x7FC00000, 0xFFC00001, 0x7F800001, 0xFF802000, 0x7FA00000]
    bits = np.concatenate([np.array(edges, np.uint32), rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32),
                           (rng.integers(0x33000000, 0x47800000, 1 << 18, dtype=np.uint32)
                            | rng.integers(0, 2, 1 << 18, dtype=np.uint32) << 31)])
    x = bits.view(np.float32)

    @njit
    def hw(x):
        y = np.empty(x.size, np.uint16)
        for i in range(x.size):
            y[i] = S.half_bits(x[i])
        return y
    got, ref = hw(x), np.empty(x.size, np.uint16)
    fp32_to_fp16_row(x, ref)
    snan = ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x7FFFFF) != 0) & ((bits & 0x400000) == 0)
    assert snan.sum() > 100 and np.array_equal(got[~snan], ref[~snan])
    quiet = ((bits[snan] >> 16) & 0x8000) | 0x7E00 | ((bits[snan] >> 13) & 0x3FF)
    assert np.array_equal(got[snan], quiet.astype(np.uint16))   # made quiet, payload kept
    for n in range(0, 21):                              # eights, then one by one
        y = np.empty(n, np.uint16)
        CM.cpu_fp32_to_fp16(x[:n], y)
        assert np.array_equal(y, got[:n]), n


def test_soft_max_row_max_is_ggmls_max_also_with_nans():
    """ggml_vec_max_f32 takes max = MAX(max, x[i]) (a > b ? a : b) from -inf, one by one. The
    eight-lane maxima give its number when no NaN is among the eights; with a NaN, where
    MAX's answer depends on the order, the row goes one by one."""
    from numba import njit
    from ggml_lite.backends.cpu import ops as K

    @njit
    def row_max(y):
        return K._row_max(y)

    def ggml_max(y):
        m = np.float32(-np.inf)
        for v in y:
            m = m if m > v else v
        return m
    rng = np.random.default_rng(3)
    for n in (1, 7, 8, 13, 16, 24, 37):
        for nan_at in [None] + sorted({0, n // 2, n - 1}):
            y = rng.standard_normal(n).astype(np.float32)
            y[rng.integers(0, n)] = -np.inf
            if nan_at is not None:
                y[nan_at] = np.nan
            want, got = ggml_max(y), row_max(y)
            assert (np.isnan(want) and np.isnan(got)) or want == got, (n, nan_at, want, got)


def _q8_0_x86_lanes(block):
    """ggml's AVX quantize_row_q8_0 for one block, instruction by instruction, in numpy:
    maxps(a, b) = a > b ? a : b (its second operand when either is a NaN), cvtps2dq (NaN
    -> INT32_MIN), the saturating packs."""
    mx = lambda a, b: np.where(a > b, a, b)                                   # noqa: E731
    v = [np.abs(block[8 * i:8 * i + 8]) for i in range(4)]
    m = mx(mx(mx(v[0], v[1]), v[2]), v[3])
    h = mx(m[4:], m[:4])                             # _mm_max_ps(upper half, lower half)
    h = mx(h[:2], h[2:])                             # _mm_max_ps(h, _mm_movehl_ps(h, h))
    amax = mx(h[0], h[1])                            # _mm_max_ss(h, _mm_movehdup_ps(h))
    d = np.float32(amax / np.float32(127))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        idd = np.float32(127) / amax if amax != 0 else np.float32(0)
        r = np.rint(block * np.float32(idd))
    codes = np.where(np.isnan(r) | (np.abs(r) >= 2.0 ** 31), -2 ** 31, r)
    codes = np.clip(codes, -128, 127).astype(np.int8)
    return np.concatenate([np.array([d], np.float16).view(np.uint8), codes.view(np.uint8)])


def test_q8_0_from_float_follows_x86_lanes_on_nan():
    """A NaN at each of the 32 places of a block: ggml's x86 quantizer carries it into amax
    (then d and every code are NaN's) from some lanes and drops it from others (maxps keeps
    its second operand); the bytes are the instruction-by-instruction emulation's."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal(32).astype(np.float32)
    kept = 0
    for j in range(32):
        block = base.copy()
        block[j] = np.nan
        y = np.zeros(34, np.uint8)
        quantize_row_q8_0(block, y)
        want = _q8_0_x86_lanes(block)
        assert np.array_equal(y, want), (j, y, want)
        kept += np.isnan(np.frombuffer(y[:2].tobytes(), np.float16)[0])
    assert 0 < kept < 32                             # both outcomes occur
# --- the dot products of Q5_0, Q5_1, Q2_K, Q3_K, Q5_K -------------------------------------------

from ggml_lite.backends.cpu import qdots as QD  # noqa: E402

# byte offsets of each block's fp16 fields (d, then m/dmin) and the block size
_NEW_DOTS = {Type.Q5_0: (QD.vec_dot_q5_0_q8_0, Type.Q8_0, 32, 22, (0,)),
             Type.Q5_1: (QD.vec_dot_q5_1_q8_1, Type.Q8_1, 32, 24, (0, 2)),
             Type.Q2_K: (QD.vec_dot_q2_K_q8_K, Type.Q8_K, 256, 84, (80, 82)),
             Type.Q3_K: (QD.vec_dot_q3_K_q8_K, Type.Q8_K, 256, 110, (108,)),
             Type.Q5_K: (QD.vec_dot_q5_K_q8_K, Type.Q8_K, 256, 176, (0, 2))}


def random_blocks(t, nblocks, rng, scale=1.0):
    """nblocks of type t with every code, scale and bit drawn at random (all byte patterns), and
    finite fp16 d (and m/dmin) fields in [-scale, scale]."""
    _, _, _, size, halves = _NEW_DOTS[t]
    b = rng.integers(0, 256, (nblocks, size)).astype(np.uint8)
    for o in halves:
        b[:, o:o + 2] = rng.uniform(-scale, scale, (nblocks, 1)).astype(F16).view(np.uint8)
    return b.ravel()


def new_dot64(t, n, x, y):
    """The float64 dot of gguf's dequantized weights (an implementation independent of ggml_lite)
    and numpy's decoding of the activations; Q5_1's offset m times y's stored s, as ggml."""
    if t == Type.Q5_1:
        xb = x.reshape(-1, 24)
        dx = xb[:, :2].copy().view(F16).astype(np.float64).ravel()
        mx = xb[:, 2:4].copy().view(F16).astype(np.float64).ravel()
        qh = xb[:, 4:8].copy().view(np.uint32)
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4
        qx = (np.concatenate([xb[:, 8:] & 15, xb[:, 8:] >> 4], axis=1) | hi).astype(np.float64)
        dy, sy, qy = q8_1_parts(y)
        return float(((qx * qy).sum(1) * dx * dy + mx * sy).sum())
    xv = gguf.quants.dequantize(x.reshape(1, -1), gguf.GGMLQuantizationType[t.name])
    yv = q8_0_values(y) if t == Type.Q5_0 else q8_K_values(y)
    return float(np.dot(xv.astype(np.float64).ravel(), yv))


@pytest.mark.parametrize("t", list(_NEW_DOTS))
@pytest.mark.parametrize("nblocks", [1, 3, 20])
def test_new_quantized_dots_against_gguf(t, nblocks):
    """Each new dot on random blocks (every bit pattern of codes, high bits and packed scales)
    against float64: within 1e-6 of the sum of the products' magnitudes."""
    dot, vdt, qk, _, _ = _NEW_DOTS[t]
    rng = np.random.default_rng(500 + nblocks)
    n = nblocks * qk
    for scale in (1.0, 1e-3, 50.0):
        x = random_blocks(t, nblocks, rng, scale)
        y = quantize_chunk(vdt, U(n))
        got, ref = float(dot(n, x, y)), new_dot64(t, n, x, y)
        xv = gguf.quants.dequantize(x.reshape(1, -1), gguf.GGMLQuantizationType[t.name]).ravel()
        bound = np.abs(xv.astype(np.float64)).sum() * np.abs(U(n)).max() + (
            0 if t != Type.Q5_1 else np.abs(x.reshape(-1, 24)[:, 2:4].copy().view(F16)).sum())
        assert abs(got - ref) <= 1e-6 * bound, (got, ref)


def _q5_0_block(d, codes):
    """One block_q5_0 of scale d with the 32 codes 0..31 (stand for code - 16)."""
    codes = np.asarray(codes, np.uint32)
    qh = np.array([(((codes >> 4) & 1) << np.arange(32, dtype=np.uint32)).sum()], np.uint32)
    qs = ((codes[:16] & 15) | ((codes[16:] & 15) << 4)).astype(np.uint8)
    return np.concatenate([np.array([F16(d)]).view(np.uint8), qh.view(np.uint8), qs])


def test_q5_0_hand_built_blocks_and_extremes():
    q8 = np.arange(-16, 16)
    y = np.concatenate([np.array([F16(0.25)]).view(np.uint8), q8.astype(np.int8).view(np.uint8)])
    codes = np.arange(32)
    assert QD.vec_dot_q5_0_q8_0(32, _q5_0_block(0.5, codes), y) == np.dot(codes - 16, q8) * 0.5 * 0.25
    # code 0 (-16) against -128 and code 31 (15) against 127, every element
    lo = _q5_0_block(1.0, np.zeros(32, int))
    hi = _q5_0_block(1.0, np.full(32, 31))
    ym = np.concatenate([np.array([F16(1.0)]).view(np.uint8), np.full(32, 0x80, np.uint8)])
    yp = np.concatenate([np.array([F16(1.0)]).view(np.uint8), np.full(32, 127, np.uint8)])
    assert QD.vec_dot_q5_0_q8_0(64, np.concatenate([lo, hi]), np.concatenate([ym, yp])) == \
        32 * 16 * 128 + 32 * 15 * 127


def test_q3_K_and_q5_K_extremes_are_exact():
    # Q3_K: every 6-bit scale 0 (stands for -32), every code 0 with its high bit clear (-4),
    # every activation -128: each product 32*4*-128, exact
    x = np.zeros(110, np.uint8)
    x[108:110] = np.array([F16(1.0)]).view(np.uint8)
    y = np.zeros(292, np.uint8)
    y[:4] = np.array([1.0], np.float32).view(np.uint8)
    y[4:260] = 0x80
    y[260:] = np.full(16, 16 * -128, np.int16).view(np.uint8)
    assert QD.vec_dot_q3_K_q8_K(256, x, y) == -(32 * 4 * 128 * 256)
    # Q5_K: every scale 63, min 0, code 31, activation 127
    xk = np.zeros(176, np.uint8)
    xk[:2] = np.array([F16(1.0)]).view(np.uint8)
    xk[4:16] = [255, 255, 255, 255, 0, 0, 0, 0, 15, 15, 15, 15]
    xk[16:] = 0xFF
    yk = np.zeros(292, np.uint8)
    yk[:4] = np.array([1.0], np.float32).view(np.uint8)
    yk[4:260] = 127
    yk[260:] = np.full(16, 16 * 127, np.int16).view(np.uint8)
    assert QD.vec_dot_q5_K_q8_K(256, xk, yk) == 63 * 31 * 127 * 256


TYPES_REF = Path(__file__).parent / "data" / "mulmat_types_ref.npz"      # tests/ggml_ref/mulmat_types_ref.py
_TYPES_REF_CASES = [(t, k) for t, ks in (("Q5_0", (256, 640)), ("Q5_1", (256, 640)), ("Q2_K", (256, 768)),
                                          ("Q3_K", (256, 768)), ("Q5_K", (256, 768))) for k in ks]


@pytest.mark.parametrize("t,k", _TYPES_REF_CASES)
def test_new_types_mul_mat_against_ggml(t, k, monkeypatch):
    """ggml 0.15.3's CPU mul_mat of 128 weight rows (quantized by ggml) times 1, 4 and 20 columns
    (tests/ggml_ref/mulmat_types_ref.py): ggml_lite's with 1 and 2 threads within mul_mat's NMSE
    limit, and, as the dots keep ggml's AVX2 lanes and float order, equal bit for bit (the tiled
    K-quant product, which 0.15.3 does not have, switched off as in ggml)."""
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    d = np.load(TYPES_REF)
    w, x = d[f"{t}_{k}_w"], d[f"{t}_{k}_x"]
    for m in (1, 4, 20):
        ref = d[f"{t}_{k}_out{m}"]
        for nth in (1, 2):
            dst = np.full((1, 1, m, w.shape[0]), np.nan, np.float32)
            V.forward_mul_mat(Type[t], w.reshape(1, 1, *w.shape), x[:m].reshape(1, 1, m, k), dst, nth=nth)
            assert nmse(dst[0, 0], ref) <= 5e-4
            assert np.array_equal(dst[0, 0].view(np.uint32), ref.view(np.uint32)), (m, nth, int((dst[0, 0] != ref).sum()))


_TYPES_PATHS = """
import os, sys, numpy as np
os.environ["GGML_CPU_TILED_MM"] = "0"
import ggml_lite.backends.cpu.simd as S
S.AVX512_VNNI = False
S.AVX2 = False
from ggml_lite.types import Type
from ggml_lite.backends.cpu.vec import forward_mul_mat
d = np.load(sys.argv[1])
for key in sys.argv[2:]:
    t, k = key.rsplit("_", 1)
    w, x, ref = d[key + "_w"], d[key + "_x"], d[key + "_out20"]
    dst = np.zeros((1, 1) + ref.shape, np.float32)
    forward_mul_mat(Type[t], w.reshape(1, 1, *w.shape), x.reshape(1, 1, *x.shape), dst)
    print(key, int((dst[0, 0] != ref).sum()))
"""


def test_new_types_same_bits_without_avx2(tmp_path):
    """The new dots compiled afresh without AVX2 (vdot4, vmaddubs and _bits32 in plain IR), in a
    subprocess: ggml's bits still."""
    import os
    import subprocess
    import sys
    keys = [f"{t}_{max(ks)}" for t, ks in (("Q5_0", (640,)), ("Q5_1", (640,)), ("Q2_K", (768,)),
                                            ("Q3_K", (768,)), ("Q5_K", (768,)))]
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _TYPES_PATHS, str(TYPES_REF)] + keys, env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [w for key in keys for w in (key, "0")], out


TILED_REF = Path(__file__).parent / "data" / "tiled_ref.npz"      # tests/ggml_ref/tiled_ref.py
_TILED_CASES = [f"{t}_{k}" for t in ("Q2_K", "Q3_K", "Q5_K") for k in (256, 768)] + ["Q4_K_256", "Q6_K_256"]


def _tiled_operands(key):
    t, k = key.rsplit("_", 1)
    if t in ("Q4_K", "Q6_K"):
        d = np.load(MULMAT_REF)
        return t, d[t], d["x"]
    d = np.load(TYPES_REF)
    return t, d[f"{key}_w"], d[f"{key}_x"]


@pytest.mark.parametrize("key", _TILED_CASES)
def test_tiled_k_quant_product_gives_ggmls_bits(key, monkeypatch):
    """ggml 0.25.3's tiled K-quant product (tests/ggml_ref/tiled_ref.py: llama-cpp-python 0.3.36's
    ggml, AVX2 build): 8 and 20 columns with 1 and 2 threads equal bit for bit; GGML_CPU_TILED_MM=0
    gives the dot products' bits instead (other bits, within the limit); GGML_CPU_TILED_MM_FORCE=1
    takes the tiled product for 4 columns."""
    ref = np.load(TILED_REF)
    t, w, x = _tiled_operands(key)
    a = w.reshape(1, 1, *w.shape)

    def run(m, nth=1):
        dst = np.full((1, 1, m, w.shape[0]), np.nan, np.float32)
        V.forward_mul_mat(Type[t], a, x[:m].reshape(1, 1, m, -1).copy(), dst, nth=nth)
        return dst[0, 0]
    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    monkeypatch.delenv("GGML_CPU_TILED_MM_FORCE", raising=False)
    for m in (8, 20):
        for nth in (1, 2):
            got = run(m, nth)
            assert np.array_equal(got.view(np.uint32), ref[f"{key}_out{m}"].view(np.uint32)), (m, nth)
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    off = run(8)
    assert not np.array_equal(off, ref[f"{key}_out8"]) and nmse(off, ref[f"{key}_out8"]) <= 5e-4
    monkeypatch.setenv("GGML_CPU_TILED_MM", "1")
    monkeypatch.setenv("GGML_CPU_TILED_MM_FORCE", "1")
    assert np.array_equal(run(4).view(np.uint32), ref[f"{key}_out4_forced"].view(np.uint32))


def test_tiled_product_is_chosen_as_ggml_chooses():
    """ggml_compute_forward_mul_mat_tiled's conditions: a K-quant weight, not in an extra buffer
    type, src1 of at least 8 rows; GGML_CPU_TILED_MM read as atoi (0 or not a number: off)."""
    from ggml_lite.backends.cpu.tiled import TILED, mul_mat_tiled_type
    import os
    old = {k: os.environ.pop(k, None) for k in ("GGML_CPU_TILED_MM", "GGML_CPU_TILED_MM_FORCE")}
    try:
        assert mul_mat_tiled_type(Type.Q6_K, 8) == int(Type.Q6_K) + TILED
        assert mul_mat_tiled_type(Type.Q6_K, 7) == int(Type.Q6_K)
        assert mul_mat_tiled_type(Type.Q6_K, 8, in_extra=True) == int(Type.Q6_K)
        assert mul_mat_tiled_type(Type.Q8_0, 64) == int(Type.Q8_0)
        for value, on in (("0", False), ("", False), ("off", False), ("2", True), (" 1", True)):
            os.environ["GGML_CPU_TILED_MM"] = value
            assert (mul_mat_tiled_type(Type.Q4_K, 20) != int(Type.Q4_K)) == on, value
    finally:
        for k, v in old.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


@pytest.mark.parametrize("t", ["F32", "F16"])
@pytest.mark.parametrize("shape", [(37, 100, 5), (21, 33, 17), (16, 64, 2), (130, 96, 33)])
@pytest.mark.parametrize("nth", [1, 2])
def test_float_mul_mat_grouped_rows_keep_one_row_bits(t, shape, nth):
    """The float products compute four rows by two columns at once (vec_dot_*_4x2);
    every result must keep the bits of the one-row, one-column kernel, whatever it was
    grouped with and however many threads ran."""
    from numba import njit
    from ggml_lite.backends.cpu.vec import vec_dot_f16, vec_dot_f32
    import ggml_lite as ggml

    def one_by_one(dot):
        @njit
        def products(n, a, b, o):
            for j in range(b.shape[0]):
                for r in range(a.shape[0]):
                    o[j, r] = dot(n, a[r], b[j])
        return products

    m, k, n = shape
    rng = np.random.default_rng(m * k + n)
    w = rng.standard_normal((m, k)).astype(np.float32)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ctx = ggml.init(mem_size=16 << 20)
    try:
        a = ggml.new_tensor_2d(ctx, ggml.Type[t], k, m)
        b = ggml.new_tensor_2d(ctx, ggml.Type.F32, k, n)
        out = ggml.mul_mat(ctx, a, b)
        gf = ggml.new_graph(ctx)
        ggml.build_forward_expand(gf, out)
        an = a.numpy()
        an[...] = (w if t == "F32" else w.astype(np.float16).view(an.dtype)).reshape(an.shape)
        b.numpy()[...] = x.reshape(b.numpy().shape)
        plan = ggml.graph_plan(gf, nth)
        plan.work_data = np.zeros(plan.work_size, np.uint8)
        ggml.graph_compute(gf, plan)
        got = out.numpy().reshape(n, m).copy()
    finally:
        ggml.free(ctx)
    want = np.zeros((n, m), np.float32)
    if t == "F32":
        one_by_one(vec_dot_f32)(k, w, x, want)
    else:   # src1 is converted to F16 first (vec_dot_type), as ggml does
        one_by_one(vec_dot_f16)(k, w.astype(np.float16).view(np.uint16),
                                x.astype(np.float16).view(np.uint16), want)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
