"""ggml_lite.types against the references: the `gguf` package's numpy quantizers, real ggml's
reference quantizers (fixtures in tests/data/quant_ref.npz, made by tests/ggml_ref/quant_ref.py),
and the error bounds the chapter derives."""
import threading
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import njit

import ggml_lite as ggml
from ggml_lite import GGMLError, Type
from ggml_lite import types as T

gguf = pytest.importorskip("gguf")
from gguf import quants as gq  # noqa: E402
from gguf import GGMLQuantizationType as GT  # noqa: E402

DATA = Path(__file__).parent / "data" / "quant_ref.npz"
QUANTIZED = [Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0, Type.Q8_1, Type.Q2_K,
             Type.Q3_K, Type.Q4_K, Type.Q5_K, Type.Q6_K, Type.Q8_K]
NEW_TYPES = [Type.Q5_0, Type.Q5_1, Type.Q2_K, Type.Q3_K, Type.Q5_K]
K_QUANTS = [Type.Q2_K, Type.Q3_K, Type.Q4_K, Type.Q5_K, Type.Q6_K]
GGUF_QUANTIZES = [Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0, Type.F16, Type.BF16]
GGUF_DEQUANTIZES = [Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0, Type.Q2_K, Type.Q3_K,
                    Type.Q4_K, Type.Q5_K, Type.Q6_K, Type.F16, Type.BF16]


def gguf_quantize(x, t):
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gq.quantize(x, GT(int(t))).view(np.uint8).reshape(x.shape[0], -1)


def gguf_dequantize(data, t):
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gq.dequantize(data, GT(int(t)))


def same_floats(a, b):
    """Bit-identical, except that any NaN equals any NaN (which NaN comes out of NaN*x is the
    FPU's business, not the format's)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a)
    return a.shape == b.shape and np.array_equal(nan, np.isnan(b)) and \
        np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan])


def make_rows(rng, nrows, n, scale, kind):
    x = rng.standard_normal((nrows, n)) * scale
    if kind == "ties":        # multiples of a power of two: many exact .5 products
        x = np.round(x * 4 / scale) * scale / 4
    elif kind == "uniform":
        x = rng.uniform(-scale, scale, (nrows, n))
    elif kind == "ints":
        x = rng.integers(-16, 16, (nrows, n)).astype(np.float64)
    elif kind == "offset":
        x = x + 3 * scale
    x = x.astype(np.float32)
    x[0, : min(n, 64)] = 0                        # an all-zero block at the start of row 0
    if nrows > 1:
        x[-1] = 0                                 # an all-zero row
    return x


# --- the enum and the traits ---------------------------------------------------------------

def test_type_ids_are_ggmls():
    for t in Type:
        assert int(t) == int(GT[t.name]), t
    assert [int(Type[n]) for n in ("F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q8_1", "Q4_K", "Q6_K", "Q8_K",
                                   "I8", "I16", "I32", "BF16")] == [0, 1, 2, 3, 8, 9, 12, 14, 15, 24, 25, 26, 30]
    assert [int(Type[n]) for n in ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K")] == [6, 7, 10, 11, 13]


def test_sizes_match_gguf():
    for t in Type:
        if t == Type.Q8_1:   # gguf's table still says 40 (d and s as float32); ggml's block is 36
            assert (ggml.blck_size(t), ggml.type_size(t)) == (32, 36)
            continue
        assert (ggml.blck_size(t), ggml.type_size(t)) == gguf.GGML_QUANT_SIZES[GT(int(t))], t
        tr = ggml.get_type_traits(t)
        assert (tr.blck_size, tr.type_size, tr.is_quantized) == (ggml.blck_size(t), ggml.type_size(t), ggml.is_quantized(t))
    assert [ggml.type_name(t) for t in (Type.F32, Type.Q4_K, Type.BF16)] == ["f32", "q4_K", "bf16"]
    assert ggml.row_size(Type.Q4_0, 4096) == 2304 and ggml.row_size(Type.Q6_K, 512) == 420
    assert ggml.row_size(Type.F16, 3) == 6
    # ggml-common.h's static_asserts: the five block sizes, and bits per weight
    sizes = {Type.Q5_0: (32, 22), Type.Q5_1: (32, 24), Type.Q2_K: (256, 84),
             Type.Q3_K: (256, 110), Type.Q5_K: (256, 176)}
    assert {t: (ggml.blck_size(t), ggml.type_size(t)) for t in sizes} == sizes
    assert [8 * ggml.type_size(t) / ggml.blck_size(t) for t in sizes] == [5.5, 6, 2.625, 3.4375, 5.5]


def test_vec_dot_pairing():
    want = {Type.Q4_0: Type.Q8_0, Type.Q4_1: Type.Q8_1, Type.Q8_0: Type.Q8_0, Type.Q4_K: Type.Q8_K,
            Type.Q6_K: Type.Q8_K, Type.F16: Type.F16, Type.BF16: Type.BF16, Type.F32: Type.F32,
            # ggml-cpu.c's type_traits_cpu
            Type.Q5_0: Type.Q8_0, Type.Q5_1: Type.Q8_1, Type.Q2_K: Type.Q8_K, Type.Q3_K: Type.Q8_K,
            Type.Q5_K: Type.Q8_K}
    for t, v in want.items():
        assert ggml.get_type_traits(t).vec_dot_type == v
    assert ggml.get_type_traits(Type.Q8_K).vec_dot_type is None
    assert ggml.get_type_traits(Type.I32).from_float is None


def test_traits_rows_agree_with_quantize_chunk():
    x = make_rows(np.random.default_rng(0), 3, 512, 1.0, "normal")
    for t in QUANTIZED + [Type.F16, Type.BF16, Type.F32]:
        tr = ggml.get_type_traits(t)
        q = ggml.quantize_chunk(t, x)
        assert np.array_equal(tr.from_float(x[1]), q[1])
        assert same_floats(tr.to_float(q[1], 512), ggml.types.dequantize_rows(t, q, 512)[1])


# --- fp16 and bf16 ---------------------------------------------------------------------------

def test_fp16_to_fp32_all_halves():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert same_floats(ggml.half.fp16_to_fp32_array(h), h.view(np.float16).astype(np.float32))
    assert np.array_equal(ggml.half.fp16_to_fp32_array(h).view(np.uint32)[~np.isnan(h.view(np.float16))],
                          h.view(np.float16).astype(np.float32).view(np.uint32)[~np.isnan(h.view(np.float16))])


def fp32_bit_patterns(rng):
    """Random float32 bit patterns, plus every half's rounding neighbourhood (just below, at and
    just above the midpoints between consecutive halves), NaNs with payloads, infs, subnormals."""
    r = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    h = np.arange(0, 0x7C00, dtype=np.uint32).astype(np.uint16)
    f = h.view(np.float16).astype(np.float32).astype(np.float64)
    nxt = np.append(f[1:], 65520.0)
    mid = ((f + nxt) / 2).astype(np.float32).view(np.uint32)
    near = np.concatenate([mid - 1, mid, mid + 1])
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFFFFFFF,
                        0x7F802000, 0x00000001, 0x33000000, 0x33000001, 0x387FFFFF, 0x38800000,
                        0x477FEFFF, 0x477FF000], dtype=np.uint32)
    bits = np.concatenate([r, near, near | 0x80000000, special])
    return bits.view(np.float32)


def test_fp32_to_fp16_matches_numpy():
    x = fp32_bit_patterns(np.random.default_rng(1))
    with np.errstate(all="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    got = ggml.half.fp32_to_fp16_array(x).view(np.uint16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(x.view(np.uint32)[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


def test_bf16_matches_gguf_and_ggml_rule():
    x = fp32_bit_patterns(np.random.default_rng(2))
    got = ggml.half.fp32_to_bf16_array(x)
    assert np.array_equal(got.view(np.uint8), gguf_quantize(x.reshape(1, -1), Type.BF16).reshape(-1))
    u = x.view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rule = np.where(nan, (u >> 16) | 64, (u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    assert np.array_equal(got, rule)
    assert np.isnan(ggml.half.bf16_to_fp32_array(got[nan])).all()
    back = ggml.half.bf16_to_fp32_array(got)
    assert same_floats(back, gguf_dequantize(got.view(np.uint8), Type.BF16))
    assert ggml.bf16_to_fp32(ggml.fp32_to_bf16(np.float32(1.00390625))) == 1.0   # a tie, to even


def test_scalar_half_functions():
    assert ggml.fp32_to_fp16(np.float32(1.0)) == 0x3C00
    assert ggml.fp32_to_fp16(np.float32(65520.0)) == 0x7C00          # rounds past 65504
    assert ggml.fp32_to_fp16(np.float32(-2.0 ** -25)) == 0x8000      # a tie to even: -0
    assert ggml.fp16_to_fp32(0x0001) == np.float32(2.0 ** -24)
    assert ggml.bf16_to_fp32(0x3F80) == 1.0


# --- byte identity with gguf -----------------------------------------------------------------

SHAPES = [(1, 256), (3, 512), (8, 1024), (2, 4096)]
SCALES = [1e-30, 1e-6, 1.0, 1e3, 7e4, 1e30]


@pytest.mark.parametrize("t", GGUF_QUANTIZES, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["normal", "ties", "uniform", "ints", "offset"])
def test_quantize_matches_gguf(t, kind):
    rng = np.random.default_rng(zlib.crc32(f"{t.name}/{kind}".encode()))
    for shape in SHAPES:
        for scale in SCALES:
            x = make_rows(rng, *shape, scale, kind)
            assert np.array_equal(ggml.quantize_chunk(t, x), gguf_quantize(x, t)), (shape, scale)


@pytest.mark.parametrize("t", GGUF_DEQUANTIZES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(t):
    rng = np.random.default_rng(int(t))
    for shape in SHAPES:
        for scale in SCALES:
            for kind in ("normal", "ties", "offset"):
                q = ggml.quantize_chunk(t, make_rows(rng, *shape, scale, kind))
                assert same_floats(ggml.types.dequantize_rows(t, q, shape[1]), gguf_dequantize(q, t)), (shape, scale, kind)


@pytest.mark.parametrize("t", GGUF_DEQUANTIZES, ids=lambda t: t.name)
def test_dequantize_random_bytes_matches_gguf(t):
    """Any bytes are a valid block: the dequantizers must agree on all of them, not only on what
    our own quantizer writes (out-of-range scales, inf and NaN scales included)."""
    rng = np.random.default_rng(100 + int(t))
    n = 8 * ggml.blck_size(t) if ggml.is_quantized(t) else 1024
    data = rng.integers(0, 256, (64, ggml.row_size(t, n)), dtype=np.uint8)
    assert same_floats(ggml.types.dequantize_rows(t, data, n), gguf_dequantize(data, t))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), nrows=st.integers(1, 6), nblocks=st.integers(1, 9),
       log_scale=st.floats(-37, 37), kind=st.sampled_from(["normal", "ties", "uniform", "ints", "offset"]),
       t=st.sampled_from(GGUF_QUANTIZES))
def test_quantize_matches_gguf_property(seed, nrows, nblocks, log_scale, kind, t):
    x = make_rows(np.random.default_rng(seed), nrows, 32 * nblocks, 10.0 ** log_scale, kind)
    q = ggml.quantize_chunk(t, x)
    assert np.array_equal(q, gguf_quantize(x, t))
    assert same_floats(ggml.types.dequantize_rows(t, q, x.shape[1]), gguf_dequantize(q, t))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), nrows=st.integers(1, 3), nblocks=st.integers(1, 3),
       log_scale=st.floats(-30, 30), kind=st.sampled_from(["normal", "ties", "uniform", "offset"]),
       t=st.sampled_from([Type.Q4_K, Type.Q6_K]))
def test_k_quants_dequantize_matches_gguf_property(seed, nrows, nblocks, log_scale, kind, t):
    x = make_rows(np.random.default_rng(seed), nrows, 256 * nblocks, 10.0 ** log_scale, kind)
    q = ggml.quantize_chunk(t, x)
    assert same_floats(ggml.types.dequantize_rows(t, q, x.shape[1]), gguf_dequantize(q, t))


# --- byte identity with real ggml (fixtures) -------------------------------------------------

def ref_cases():
    ref = np.load(DATA)
    for key in sorted(ref.files):
        name, kind = key.split("/")
        if name != "x":
            yield pytest.param(name, kind, id=key)


@pytest.mark.parametrize("name,kind", list(ref_cases()))
def test_quantize_matches_real_ggml(name, kind):
    ref = np.load(DATA)
    t = next(t for t in Type if ggml.type_name(t) == name)
    x, want = ref[f"x/{kind}"], ref[f"{name}/{kind}"]
    got = ggml.quantize_chunk(t, x)
    rows = np.flatnonzero((got != want).any(axis=1))
    assert rows.size == 0, f"{name}/{kind}: rows {rows.tolist()} differ from ggml's bytes"


# --- round-trip bounds (derived in the chapter) ----------------------------------------------

def blocks_of(t, q, nb):
    return q.reshape(-1, ggml.type_size(t))[:, :nb]


def fp16(b):
    return b.copy().view(np.float16).astype(np.float32).reshape(-1)


@pytest.mark.parametrize("t", [Type.Q8_0, Type.Q8_1, Type.Q4_0], ids=lambda t: t.name)
def test_round_trip_bound_32_blocks(t):
    """|x - x'| <= d/2 + |q|max * r for Q8_0/Q8_1, where r = max(d*2**-11, 2**-25) bounds the fp16
    rounding of d (the codes use the unrounded d, the values the fp16 one); Q4_0 loses the top
    level on the side opposite the max: <= |d| + 8*r."""
    rng = np.random.default_rng(7)
    for scale in (1e-3, 1.0, 100.0):
        x = make_rows(rng, 16, 1024, scale, "normal")
        xb = x.reshape(-1, 32)
        err = np.abs(xb - ggml.types.dequantize_rows(t, ggml.quantize_chunk(t, x), 1024).reshape(-1, 32))
        amax = np.abs(xb).max(axis=1, keepdims=True)
        d = amax / 8 if t == Type.Q4_0 else amax / 127
        r = np.maximum(d * 2.0**-11, 2.0**-25)
        bound = d + 8 * r if t == Type.Q4_0 else d / 2 + 127 * r
        assert (err <= bound * (1 + 1e-6) + 1e-30).all()


def test_q8_1_sum_field():
    x = make_rows(np.random.default_rng(8), 4, 512, 1.0, "normal")
    b = ggml.quantize_chunk(Type.Q8_1, x).reshape(-1, 36)
    d, s = fp16(b[:, :2]), fp16(b[:, 2:4])
    qsum = b[:, 4:].view(np.int8).astype(np.int64).sum(axis=1)
    assert np.allclose(s, qsum * d, rtol=2.0**-10, atol=0)     # s = fp16(d * sum q), d unrounded
    assert np.array_equal(b[:, 4:], ggml.quantize_chunk(Type.Q8_0, x).reshape(-1, 34)[:, 2:])


def test_q8_K_bound_and_bsums():
    x = make_rows(np.random.default_rng(9), 8, 1024, 3.0, "normal")
    q = ggml.quantize_chunk(Type.Q8_K, x)
    b = q.reshape(-1, 292)
    d = b[:, :4].copy().view(np.float32).reshape(-1, 1)
    qs = b[:, 4:260].view(np.int8).astype(np.int64)
    assert np.array_equal(b[:, 260:].copy().view(np.int16), qs.reshape(-1, 16, 16).sum(axis=2))
    err = np.abs(x.reshape(-1, 256) - ggml.types.dequantize_rows(Type.Q8_K, q, 1024).reshape(-1, 256))
    assert (err <= np.abs(d) / 2 * (1 + 2.0**-20) + 1e-30).all()
    assert (np.abs(qs).max(axis=1)[np.abs(d[:, 0]) > 0] == 127).all()


def q4_K_grid(b):
    """(nblocks, 8, 16) levels d*sc*q - dmin*m of each sub-block, from the stored bytes."""
    d, dmin = fp16(b[:, 0:2])[:, None], fp16(b[:, 2:4])[:, None]
    s = b[:, 4:16].astype(np.int64)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    dd = (d * sc.astype(np.float32)).astype(np.float32)
    dm = (dmin * m.astype(np.float32)).astype(np.float32)
    return dd[:, :, None] * np.arange(16, dtype=np.float32) - dm[:, :, None], dd


def q6_K_grid(b):
    d = fp16(b[:, 208:210])[:, None]
    dd = (d * b[:, 192:208].view(np.int8).astype(np.float32)).astype(np.float32)
    return dd[:, :, None] * np.arange(-32, 32, dtype=np.float32), dd


@pytest.mark.parametrize("t", [Type.Q4_K, Type.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["normal", "uniform", "offset", "ties"])
def test_k_quant_picks_nearest_stored_level(t, kind):
    """The second pass re-quantizes with the *stored* (rounded) scales: every value whose sub-block
    scale is nonzero lands on the nearest level of the grid that the bytes describe."""
    rng = np.random.default_rng(10)
    x = make_rows(rng, 6, 1024, 2.0, kind)
    q = ggml.quantize_chunk(t, x)
    b = q.reshape(-1, ggml.type_size(t))
    grid, dd = q4_K_grid(b) if t == Type.Q4_K else q6_K_grid(b)
    sub = grid.shape[1]
    xs = x.reshape(len(b), sub, -1)
    got = ggml.types.dequantize_rows(t, q, 1024).reshape(xs.shape)
    best = np.abs(xs[..., None] - grid[:, :, None, :]).min(axis=-1)
    live = (dd != 0)[:, :, None] & np.ones_like(xs, bool)
    err = np.abs(xs - got)
    assert (err[live] <= best[live] * (1 + 1e-5) + 1e-6 * np.abs(xs[live])).all()
    step = np.abs(dd)[:, :, None] * np.ones_like(xs)
    inside = live & (xs >= grid.min(axis=-1)[..., None]) & (xs <= grid.max(axis=-1)[..., None])
    assert (err[inside] <= step[inside] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("t,limit", [(Type.Q4_0, 0.090), (Type.Q4_1, 0.082), (Type.Q4_K, 0.075),
                                     (Type.Q6_K, 0.019), (Type.Q8_0, 0.0058), (Type.Q8_K, 0.0075)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_gaussian_rms_error(t, limit):
    """On N(0,1) weights, the rms error the chapter derives (step/sqrt(12)), with a small margin."""
    x = np.random.default_rng(11).standard_normal((64, 4096)).astype(np.float32)
    err = x - ggml.types.dequantize_rows(t, ggml.quantize_chunk(t, x), 4096)
    assert np.sqrt(np.mean(err.astype(np.float64) ** 2)) < limit


# --- bad input --------------------------------------------------------------------------------

def test_bad_inputs_raise_with_numbers():
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(GGMLError, match=r"float64"):
        ggml.quantize_chunk(Type.Q4_0, x.astype(np.float64))
    with pytest.raises(GGMLError, match=r"100 elements .* q4_0 block size 32"):
        ggml.quantize_chunk(Type.Q4_0, np.zeros((2, 100), np.float32))
    with pytest.raises(GGMLError, match=r"q4_K block size 256"):
        ggml.row_size(Type.Q4_K, 1000)
    y = x.copy()
    y[1, 5] = np.nan
    y[1, 9] = np.inf
    with pytest.raises(GGMLError, match=r"2 of 128 are NaN or inf, the first at index \(1, 5\)"):
        ggml.quantize_chunk(Type.Q8_0, y)
    assert np.isnan(ggml.types.dequantize_rows(Type.F16, ggml.quantize_chunk(Type.F16, y), 64)[1, 5])
    with pytest.raises(GGMLError, match=r"unknown ggml type 4"):   # Q4_2, removed from ggml
        ggml.type_size(4)
    with pytest.raises(GGMLError, match=r"i32 has no float conversion"):
        ggml.quantize_chunk(Type.I32, x)
    q = ggml.quantize_chunk(Type.Q4_0, x)
    with pytest.raises(GGMLError, match=r"64 elements per row take 36 bytes, but the data has shape \(2, 35\)"):
        ggml.types.dequantize_rows(Type.Q4_0, q[:, :35], 64)
    with pytest.raises(GGMLError, match=r"70 bytes are not a whole number of rows of 36 bytes"):
        ggml.types.dequantize_rows(Type.Q4_0, q.reshape(-1)[:70], 64)
    with pytest.raises(GGMLError, match=r"uint8"):
        ggml.types.dequantize_rows(Type.Q4_0, q.astype(np.int16), 64)
    with pytest.raises(GGMLError, match=r"64 elements of q4_0 need 36 bytes, got 20"):
        ggml.get_type_traits(Type.Q4_0).to_float(q[0, :20], 64)
    with pytest.raises(GGMLError, match=r"one row"):
        ggml.get_type_traits(Type.Q4_0).from_float(x)


# --- the row functions are kernels: nogil, no allocation -------------------------------------

@njit
def _call_rows(f, x, y, reps):
    for _ in range(reps):
        f(x, y)


def test_row_functions_run_in_threads():
    x = np.random.default_rng(12).standard_normal(1 << 16).astype(np.float32)
    for t in QUANTIZED:
        tr = ggml.get_type_traits(t)
        whole = ggml.quantize_chunk(t, x)
        halves = np.zeros_like(whole)
        h = len(whole) // 2
        jobs = [threading.Thread(target=tr.from_float_row, args=(x[: x.size // 2], halves[:h])),
                threading.Thread(target=tr.from_float_row, args=(x[x.size // 2:], halves[h:]))]
        for j in jobs:
            j.start()
        for j in jobs:
            j.join()
        assert np.array_equal(halves, whole), t.name


def test_row_functions_do_not_allocate():
    code = r"""
import numpy as np, ggml_lite as ggml
from numba import njit
from numba.core.runtime import rtsys
@njit
def loop(f, x, y, reps):
    for _ in range(reps):
        f(x, y)
x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
for t in ggml.Type:
    tr = ggml.get_type_traits(t)
    if tr.from_float_row is None:
        continue
    y = np.zeros(ggml.row_size(t, 1024), np.uint8)
    if not tr.is_quantized:
        y = y.view(np.uint16)
    z = np.zeros(1024, np.float32)
    loop(tr.from_float_row, x, y, 1); loop(tr.to_float_row, y, z, 1)
    counts = []
    for reps in (1, 50):
        s0 = rtsys.get_allocation_stats()
        loop(tr.from_float_row, x, y, reps); loop(tr.to_float_row, y, z, reps)
        counts.append(rtsys.get_allocation_stats().alloc - s0.alloc)
    assert counts[0] == counts[1], (t.name, counts)
print("ok")
"""
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_NRT_STATS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
