"""Numpy references for the nodes of tests/differential_graphs.py specs, and test-backend-ops'
limits for them.

`reference(entry, srcs)` computes one node from the logical values of its sources (float32 or
int32 arrays shaped (ne3, ne2, ne1, ne0); None for an absent source), written from ggml's
semantics (ggml-notes §3, ggml 0.15.3 src/ggml-cpu/vec.h for the GELU tables), not from
ggml_lite's kernels. The result is what a tensor of the node's type holds (rounded to F16 / BF16,
or quantized and read back for a CPY into a quantized type).

Shared pieces come from tests/backend_ops_cases.py (the one-op oracle harness): the number
formats, ROPE and ALiBi references, the comparison (NaN, inf and NMSE rules) and the reading of
a tensor's values through its strides.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

import backend_ops_cases as B
from ggml_lite import Type

SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)
GELU_COEF_A = np.float32(0.044715)
GELU_QUICK_COEF = np.float32(-1.702)


def _f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def _f32_of(f64_fn, x):
    """A float32 function as a correctly rounded libm gives it: computed in float64, rounded
    once (numpy's own float32 tanh / exp differ by CPU in the last place)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return f64_fn(np.asarray(x, np.float32).astype(np.float64)).astype(np.float32)


def _table(fn):
    """ggml's fp16 tables (ggml_cpu_init): entry i = fp16(fn(the fp16 value with bits i))."""
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return _f16(fn(x))


def gelu_f32(x):
    """ggml_gelu_f32: float32 arithmetic, tanhf."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        arg = SQRT_2_OVER_PI * x * (np.float32(1) + GELU_COEF_A * x * x)
        return np.float32(0.5) * x * (np.float32(1) + _f32_of(np.tanh, arg))


def gelu_quick_f32(x):
    """ggml_gelu_quick_f32: x * (1 / (1 + expf(-1.702 x)))."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return x * (np.float32(1) / (np.float32(1) + _f32_of(np.exp, GELU_QUICK_COEF * x)))


GELU_TABLE = _table(gelu_f32)
GELU_QUICK_TABLE = _table(gelu_quick_f32)


def _lookup(table, x):
    return table[np.asarray(x, np.float32).astype(np.float16).view(np.uint16)]


def gelu_table(x):
    """ggml's CPU GELU (GGML_GELU_FP16): 0 at x <= -10, x at x >= 10, else the fp16 table entry
    at fp16(x)."""
    x = np.asarray(x, np.float32)
    return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, _lookup(GELU_TABLE, x)))


def gelu_quick_table(x):
    """ggml's CPU GELU_QUICK (GGML_GELU_QUICK_FP16): the fp16 table for every x."""
    return _lookup(GELU_QUICK_TABLE, x)


_erf64 = np.vectorize(math.erf, otypes=[np.float64])
_F = np.float32


def _erf(x):
    """erff: the correctly rounded float32 of erf."""
    return _erf64(np.asarray(x, np.float64)).astype(np.float32)


def _exp(x):
    return _f32_of(np.exp, x)


def _silu(x):
    return x / (_F(1) + _exp(-x))


def _hard(x):
    return np.minimum(_F(1), np.maximum(_F(0), (x + _F(3)) / _F(6)))


def _gelu_erf(x):
    return _F(0.5) * x * (_F(1) + _erf(x * SQRT_2_INV))


SQRT_2_INV = _F(0.70710678118654752440084436210484)

# ggml's CPU unary functions (src/ggml-cpu/vec.h, unary-ops.cpp), in float32 as ggml computes
# them, so that results that underflow or overflow in float32 do so here too.
UNARY = {
    "ABS": np.abs,
    "SGN": np.sign,
    "NEG": np.negative,
    "STEP": lambda x: (x > 0).astype(np.float32),
    "TANH": lambda x: _f32_of(np.tanh, x),
    "ELU": lambda x: np.where(x > 0, x, _f32_of(np.expm1, np.minimum(x, _F(0)))),
    "RELU": lambda x: np.maximum(x, _F(0)),
    "SIGMOID": lambda x: _F(1) / (_F(1) + _exp(-x)),
    "GELU": gelu_table,
    "GELU_QUICK": gelu_quick_table,
    "SILU": _silu,
    "HARDSWISH": lambda x: x * _hard(x),
    "HARDSIGMOID": _hard,
    "EXP": _exp,
    "EXPM1": lambda x: _exp(x) - _F(1),                   # op_expm1: expf(x) - 1.0f, not expm1f
    "SOFTPLUS": lambda x: np.where(x > _F(20), x, _f32_of(np.log, _F(1) + _exp(np.minimum(x, _F(20))))),
    "GELU_ERF": _gelu_erf,
    "FLOOR": np.floor,
    "CEIL": np.ceil,
    "ROUND": lambda x: np.copysign(np.floor(np.abs(x.astype(np.float64)) + 0.5), x).astype(np.float32),  # roundf
    "TRUNC": np.trunc,
}


def _geglu(x, g):
    return np.where(x >= 10, x * g, gelu_table(x) * g)


def _swiglu_oai(x, g, alpha, limit):
    """ggml_compute_forward_swiglu_oai_f32: x clipped above at limit, g clamped to [-limit,
    limit], x / (1 + exp(-alpha x)) * (g + 1)."""
    x = np.minimum(x, _F(limit))
    y = np.clip(g, _F(-limit), _F(limit))
    return x / (_F(1) + _exp(_F(alpha) * -x)) * (y + _F(1))


GLU = {   # (gate x, value g) -> y, as ggml_vec_*glu_f32
    "REGLU": lambda x, g: np.where(x > 0, x * g, _F(0)),
    "GEGLU": _geglu,
    "SWIGLU": lambda x, g: _silu(x) * g,
    "GEGLU_ERF": lambda x, g: _gelu_erf(x) * g,
    "GEGLU_QUICK": lambda x, g: gelu_quick_table(x) * g,
}


def q8_0_cpu_roundtrip(x) -> np.ndarray:
    """What ggml's x86 CPU backend stores for F32 -> Q8_0 (quantize_row_q8_0 in
    src/ggml-cpu/arch/x86/quants.c, the AVX path every x86-64 build with AVX takes), read back:
    q = round-half-even(x * (127 / amax)), d = fp16(amax / 127). (ggml's reference quantizer,
    which gguf copies, rounds halves away from zero and multiplies by 1 / d: on values with
    ties, such as bf16 data, the two differ in several codes.)"""
    x = np.ascontiguousarray(x, np.float32)
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        idd = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * idd)
    return (q * _f16(d)).astype(np.float32).reshape(x.shape)


_BIN = {"ADD": np.add, "SUB": np.subtract, "MUL": np.multiply, "DIV": np.divide}


def _tile_to(x, shape):
    return np.tile(x, [s // n for s, n in zip(shape, x.shape)])


def _out_shape(entry):
    ne = entry["ne"]
    return (ne[3], ne[2], ne[1], ne[0])


def reference(entry, srcs) -> np.ndarray:
    """The values node `entry` of a spec should hold, given its sources' values."""
    op, p, typ = entry["op"], entry.get("p", {}), Type[entry["type"]]
    a = srcs[0]
    if op in _BIN:
        bb = _tile_to(srcs[1].astype(np.float32), a.shape)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            return B.round_to(typ, _BIN[op](a.astype(np.float32), bb))       # float32, as ggml
    if op == "MUL_MAT":
        w, x = a.astype(np.float64), srcs[1].astype(np.float64)
        r3, r2 = x.shape[0] // w.shape[0], x.shape[1] // w.shape[1]
        w = np.repeat(np.repeat(w, r3, axis=0), r2, axis=1)    # i02 = i12 / r2: integer division
        return np.einsum("xyik,xyjk->xyji", w, x)
    if op == "SCALE":
        return a.astype(np.float32) * np.float32(p["s"]) + np.float32(p["b"])
    if op in ("RMS_NORM", "NORM"):
        x = a.astype(np.float64)
        eps = float(np.float32(p["eps"]))
        if op == "RMS_NORM":
            return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        # ggml's norm_f32: the double sum stored as a float, mean = sum/ne00 in float, x - mean in
        # float; only the squares are summed in double. On a constant row the float mean can miss
        # x by an ulp, and ggml's output is that residual times 1/sqrt(eps), not 0: so is this one.
        x32 = a.astype(np.float32)
        mean = x.sum(axis=-1, keepdims=True).astype(np.float32) / np.float32(x.shape[-1])
        xc = (x32 - mean).astype(np.float64)
        return xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps)
    if op == "DIAG_MASK_INF":
        y = a.astype(np.float32).copy()
        i1 = np.arange(y.shape[2])[:, None]
        i0 = np.arange(y.shape[3])[None, :]
        y[..., i0 > p["n_past"] + i1] = -np.inf
        return y
    if op == "SOFT_MAX":
        x = a.astype(np.float64)
        w = x * float(np.float32(p["scale"]))
        if srcs[1] is not None:
            mask = _tile_to(srcs[1][:, :, : x.shape[2], :].astype(np.float64), x.shape)
            slope = B.alibi_slopes(x.shape[1], p["max_bias"]).astype(np.float32).astype(np.float64)
            w = w + slope[None, :, None, None] * mask
        with np.errstate(invalid="ignore"):
            w = np.exp(w - w.max(axis=-1, keepdims=True))
        return w / w.sum(axis=-1, keepdims=True)
    if op == "ROPE":
        ff = srcs[2].ravel() if srcs[2] is not None else None
        y = B.rope_reference(a, srcs[1].ravel(), ff, p["n_dims"], p["mode"], p["n_ctx_orig"], p["freq_base"],
                             p["freq_scale"], p["ext_factor"], p["attn_factor"], p["beta_fast"], p["beta_slow"])
        return B.round_to(typ, y)
    if op == "GET_ROWS":
        idx = srcs[1]                                       # (1, b2, b1, r)
        _, b2, b1, r = idx.shape
        out = np.empty((b2, b1, r, a.shape[3]), np.float32)
        for i12 in range(b2):
            for i11 in range(b1):
                out[i12, i11] = a[i12, i11, idx[0, i12, i11]]
        return out
    if op in ("CPY", "CONT"):
        vals = np.ascontiguousarray(a).reshape(_out_shape(entry))   # a's logical row-major order
        src_type = entry.get("src_type")
        if op == "CONT" or src_type == entry["type"]:
            return vals
        if entry["type"] == "Q8_0":
            return q8_0_cpu_roundtrip(vals)
        return B.round_to(typ, vals)
    if op == "UNARY":
        with np.errstate(over="ignore", invalid="ignore"):
            return B.round_to(typ, UNARY[p["kind"]](a.astype(np.float32)))
    if op == "GLU":
        if srcs[1] is None:
            nc = a.shape[3] // 2
            x, g = a[..., :nc], a[..., nc:2 * nc]
            if p["swapped"]:
                x, g = g, x
        else:
            x, g = a, srcs[1]
        with np.errstate(over="ignore", invalid="ignore"):
            if p["kind"] == "SWIGLU_OAI":
                return _swiglu_oai(x.astype(np.float32), g.astype(np.float32), p["alpha"], p["limit"])
            return B.round_to(typ, GLU[p["kind"]](x.astype(np.float32), g.astype(np.float32)))
    if op == "CONCAT":
        return np.concatenate([a, srcs[1]], axis=3 - p["dim"])
    if op in ("SUM_ROWS", "MEAN", "SUM"):
        x = a.astype(np.float64)
        if op == "SUM":
            return B.round_to(typ, np.array(x.sum()).reshape(1, 1, 1, 1))
        y = x.sum(axis=-1, keepdims=True) if op == "SUM_ROWS" else x.mean(axis=-1, keepdims=True)
        return B.round_to(typ, y)
    if op == "REPEAT":
        return _tile_to(a, _out_shape(entry))
    raise NotImplementedError(op)


def max_nmse_err(entry) -> float:
    """test-backend-ops' limit for the node (ggml-notes §10)."""
    op = entry["op"]
    if op == "MUL_MAT":
        return 5e-4
    if op == "SOFT_MAX":
        return 1e-6
    if op == "CPY":
        src_type, dst = entry["src_type"], entry["type"]
        if src_type == dst:
            return 0.0
        if dst in ("Q4_0", "Q4_1", "Q8_0"):
            e = 1.0 / 8.0 * 150.0
            if dst == "Q8_0":
                e /= 8.0
            return e * e / (150.0 * 150.0 * 0.25 * float(np.prod(entry["ne"])))
        return 1e-6
    return 1e-7


def values_from_raw(type_name, ne, nb, raw, offs) -> np.ndarray:
    """The logical values of a tensor (type, ne, nb) at byte `offs` of its root's bytes `raw`."""
    t = SimpleNamespace(type=Type[type_name], ne=list(ne), nb=list(nb), view_src=object(), view_offs=offs)
    return B.tensor_values(t, np.ascontiguousarray(raw).reshape(-1).view(np.uint8))
