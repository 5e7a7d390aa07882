"""Fixture generator: run real ggml's reference quantizers on fixed inputs.

Writes tests/data/quant_ref.npz, which tests/test_types.py compares ggml_lite against byte for byte
(Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, Q8_1 have no quantizer in the `gguf` package). Needs ggml-python (real ggml,
built from source), which the tests themselves do not need:

    python -m venv /tmp/ggmlpy && /tmp/ggmlpy/bin/pip install ggml-python numpy
    /tmp/ggmlpy/bin/python tests/ggml_ref/quant_ref.py

Inputs are generated here with a fixed seed and stored next to the outputs, so the test never
regenerates them.
"""
import ctypes
from pathlib import Path

import numpy as np
import ggml

OUT = Path(__file__).resolve().parent.parent / "data" / "quant_ref.npz"
TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 8, "q8_1": 9, "q4_K": 12, "q6_K": 14, "q8_K": 15,
         "q5_0": 6, "q5_1": 7, "q2_K": 10, "q3_K": 11, "q5_K": 13}
QK = {"q4_0": 32, "q4_1": 32, "q8_0": 32, "q8_1": 32, "q4_K": 256, "q6_K": 256, "q8_K": 256,
      "q5_0": 32, "q5_1": 32, "q2_K": 256, "q3_K": 256, "q5_K": 256}


def inputs() -> dict[str, np.ndarray]:
    """Rows of 512 values (two K super-blocks, sixteen 32-blocks) of many kinds."""
    rng = np.random.default_rng(20260821)
    n = 512
    rows = {
        "normal": rng.standard_normal((8, n)),
        "uniform": rng.uniform(-1, 1, (8, n)),
        "positive": rng.uniform(0.5, 2.0, (4, n)),           # Q4_K: min clipped to 0
        "negative": -rng.uniform(0.5, 2.0, (4, n)),
        "heavy_tail": rng.standard_t(2, (8, n)),
        "outliers": rng.standard_normal((4, n)) * np.where(rng.random((4, n)) < 0.01, 50, 1),
        "ties": np.round(rng.standard_normal((4, n)) * 4) / 4,    # many exact halves
        "small_ints": rng.integers(-8, 8, (4, n)).astype(np.float64),
        "tiny": rng.standard_normal((4, n)) * 1e-6,
        "huge": rng.standard_normal((4, n)) * 1e4,
        "overflowing": rng.standard_normal((4, n)) * 1e12,   # x**2 sums overflow in Q6_K's search
        "near_float_min": rng.standard_normal((4, n)) * 1e-38,  # 1/d overflows to inf
        "beyond_fp16": rng.standard_normal((4, n)) * 1e6,      # fp16 scales overflow
        "mixed_scales": rng.standard_normal((4, n)) * np.repeat(10.0 ** rng.integers(-4, 3, (4, n // 16)), 16, axis=1),
        "constant": np.full((2, n), 0.75),
        "zeros": np.zeros((2, n)),
        "sparse": rng.standard_normal((4, n)) * (rng.random((4, n)) < 0.05),
    }
    z = rows["mixed_scales"].copy()
    z[:, :16] = 0                                            # a zero Q6_K sub-block inside a live block
    z[:, 256:288] = 0                                        # a zero Q4_K sub-block
    rows["zero_subblocks"] = z
    rows.update(edge_rows(n))
    return {k: v.astype(np.float32) for k, v in rows.items()}


def edge_rows(n: int) -> dict[str, np.ndarray]:
    """More edge cases, from their own generator so that the rows above stay as they were."""
    rng = np.random.default_rng(20261206)
    one = rng.standard_normal((4, n))
    one[np.arange(4), rng.integers(0, n, 4)] = [80.0, -80.0, 1e3, -3e-2]   # one outlier a row
    lone = np.zeros((4, n))
    lone[np.arange(4), rng.integers(0, n, 4)] = [1.0, -2.5, 1e-3, 7.0]     # one nonzero a row
    near_eps = rng.standard_normal((4, n)) * np.array([[1e-16], [2e-15], [1e-14], [1e-12]])
    return {
        "one_outlier": one,
        "lone_value": lone,
        "near_group_eps": near_eps,                # around GROUP_MAX_EPS = 1e-15
        "negative_constant": np.full((2, n), -0.75),
        "tiny_positive": rng.uniform(1e-7, 2e-7, (2, n)),
        "ramp": np.tile(np.linspace(-3, 5, n), (2, 1)),
        "sign_alternating": rng.uniform(0.5, 1.5, (4, n)) * np.where(np.arange(n) % 2, 1, -1),
    }


LIB = Path(ggml.__file__).parent / "lib"
BASE = ctypes.CDLL(str(LIB / "libggml-base.so"))    # the *_ref row quantizers
CPU = ctypes.CDLL(str(LIB / "libggml-cpu.so"))      # the CPU backend's (SIMD) activation quantizers


def row_fn(lib, symbol):
    f = getattr(lib, symbol)
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    f.restype = None
    return f


def quantize(name: str, x: np.ndarray, cpu: bool = False) -> np.ndarray:
    """ggml_quantize_chunk (no imatrix), or quantize_row_<t>_ref for q8_1/q8_K, which
    ggml_quantize_chunk does not take; cpu=True: the CPU backend's quantize_row_<t> instead."""
    t = TYPES[name]
    nrows, n = x.shape
    rs = n // QK[name] * ggml.ggml_type_size(t)
    out = np.zeros((nrows, rs), np.uint8)
    src = np.ascontiguousarray(x)
    if cpu or name in ("q8_1", "q8_K"):
        f = row_fn(CPU, f"quantize_row_{name}") if cpu else row_fn(BASE, f"quantize_row_{name}_ref")
        for r in range(nrows):
            f(src[r].ctypes.data, out[r].ctypes.data, n)
    else:
        ggml.ggml_quantize_chunk(t, src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                 out.ctypes.data_as(ctypes.c_void_p), 0, nrows, n, None)
    return out


def main() -> None:
    data = {}
    for kind, x in inputs().items():
        data[f"x/{kind}"] = x
        for name in TYPES:
            data[f"{name}/{kind}"] = quantize(name, x)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(data)} arrays)")


if __name__ == "__main__":
    main()
