"""ggml's AVX2 exponential and soft_max row, compiled from ggml 0.15.3's own code, as a fixture.

Writes tests/data/vexpf_ref.npz (for tests/test_cpu_kernels.py): ggml_v_expf (src/ggml-cpu/vec.h,
the __m256 version, copied verbatim below) on 4096 inputs (uniform over the float range where
exp is finite or underflows, the edges of its slow paths at |n| = 126 and 192, +-inf, NaN), and
ggml_vec_soft_max_f32's AVX2 path (src/ggml-cpu/vec.cpp) with ggml_compute_forward_soft_max_f32's
steps around it (copy, scale, add the mask, max, the sum, scale by 1/sum) on masked rows of 256,
40 and 13 values; ggml_vec_swiglu_f32's AVX2 path (ggml_v_silu of vec.h eight at a time, the
last n % 8 with ggml_silu_f32) on rows of 2053 gates and values. Needs gcc with -mavx2 -mfma (the build ggml_lite follows). Regenerate:

    PYTHONPATH=. .venv/bin/python tests/ggml_ref/vexpf_ref.py
"""
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

GGML_V_EXPF = r"""
inline static __m256 ggml_v_expf(__m256 x) {
  const __m256 r = _mm256_set1_ps(0x1.8p23f);
  const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
  const __m256 n = _mm256_sub_ps(z, r);
  const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
  const __m256 k = _mm256_castsi256_ps(
      _mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
  const __m256i c = _mm256_castps_si256(
      _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n),
                    _mm256_set1_ps(126), _CMP_GT_OQ));
  const __m256 u = _mm256_mul_ps(b, b);
  const __m256 j = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b,
                                                                   _mm256_set1_ps(0x1.573e2ep-5f)), u,
                                                   _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b,
                                                                   _mm256_set1_ps(0x1.fffdb6p-2f))),
                                   u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
  if (!_mm256_movemask_ps(_mm256_castsi256_ps(c)))
    return _mm256_fmadd_ps(j, k, k);
  const __m256i g = _mm256_and_si256(
      _mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
      _mm256_set1_epi32(0x82000000u));
  const __m256 s1 =
      _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000u)));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
  const __m256i d = _mm256_castps_si256(
      _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n),
                    _mm256_set1_ps(192), _CMP_GT_OQ));
  return _mm256_or_ps(
      _mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
      _mm256_andnot_ps(
          _mm256_castsi256_ps(d),
          _mm256_or_ps(
              _mm256_and_ps(_mm256_castsi256_ps(c),
                            _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
              _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)))));
}
"""

MAIN = r"""
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
typedef double ggml_float;
GGML_V_EXPF
static ggml_float ggml_vec_soft_max_f32(const int n, float * y, const float * x, float max) {
    int i = 0;
    ggml_float sum = 0;
    for (; i + 7 < n; i += 8) {
        __m256 val = ggml_v_expf(_mm256_sub_ps(_mm256_loadu_ps(x + i),
                                               _mm256_set1_ps(max)));
        _mm256_storeu_ps(y + i, val);
        __m128 val2 = _mm_add_ps(_mm256_extractf128_ps(val, 1),
                                 _mm256_castps256_ps128(val));
        val2 = _mm_add_ps(val2, _mm_movehl_ps(val2, val2));
        val2 = _mm_add_ss(val2, _mm_movehdup_ps(val2));
        sum += (ggml_float)_mm_cvtss_f32(val2);
    }
    for (; i < n; ++i) {
        float val = expf(x[i] - max);
        sum += (ggml_float)val;
        y[i] = val;
    }
    return sum;
}
inline static __m256 ggml_v_silu(__m256 x) {
    const __m256 one = _mm256_set1_ps(1);
    const __m256 zero = _mm256_setzero_ps();
    const __m256 neg_x = _mm256_sub_ps(zero, x);
    const __m256 exp_neg_x = ggml_v_expf(neg_x);
    const __m256 one_plus_exp_neg_x = _mm256_add_ps(one, exp_neg_x);
    return _mm256_div_ps(x, one_plus_exp_neg_x);
}
inline static float ggml_silu_f32(float x) {
    return x/(1.0f + expf(-x));
}
static void ggml_vec_swiglu_f32(const int n, float * y, const float * x, const float * g) {
    int i = 0;
    for (; i + 7 < n; i += 8) {
        _mm256_storeu_ps(y + i, _mm256_mul_ps(ggml_v_silu(_mm256_loadu_ps(x + i)), _mm256_loadu_ps(g + i)));
    }
    for (; i < n; ++i) {
        y[i] = ggml_silu_f32(x[i]) * g[i];
    }
}
int main(int argc, char ** argv) {
    const char * mode = argv[1];
    FILE * in = fopen(argv[2], "rb"), * out = fopen(argv[3], "wb");
    if (mode[0] == 'e') {                       /* ggml_v_expf, 8 at a time */
        float x[8], y[8];
        while (fread(x, 4, 8, in) == 8) {
            _mm256_storeu_ps(y, ggml_v_expf(_mm256_loadu_ps(x)));
            fwrite(y, 4, 8, out);
        }
    } else if (mode[0] == 'g') {                /* swiglu: n, then the gates and the values */
        int n = atoi(argv[4]);
        float * x = malloc(4 * n), * g = malloc(4 * n), * y = malloc(4 * n);
        fread(x, 4, n, in);
        fread(g, 4, n, in);
        ggml_vec_swiglu_f32(n, y, x, g);
        fwrite(y, 4, n, out);
    } else {                                    /* soft_max rows: n, scale, then x and mask rows */
        int n = atoi(argv[4]), rows = atoi(argv[5]);
        float scale = (float)atof(argv[6]);
        float * x = malloc(4 * n), * m = malloc(4 * n), * wp = malloc(4 * n), * dp = malloc(4 * n);
        for (int r = 0; r < rows; r++) {
            fread(x, 4, n, in);
            fread(m, 4, n, in);
            for (int i = 0; i < n; i++) wp[i] = x[i];           /* ggml_vec_cpy_f32 */
            for (int i = 0; i < n; i++) wp[i] *= scale;         /* ggml_vec_scale_f32 */
            for (int i = 0; i < n; i++) wp[i] += 1.0f * m[i];   /* slope 1 */
            float max = -INFINITY;
            for (int i = 0; i < n; i++) max = fmaxf(max, wp[i]); /* ggml_vec_max_f32 */
            ggml_float sum = ggml_vec_soft_max_f32(n, dp, wp, max);
            sum = 1.0 / sum;
            for (int i = 0; i < n; i++) dp[i] *= (float)sum;     /* ggml_vec_scale_f32 */
            fwrite(dp, 4, n, out);
        }
    }
    fclose(out);
    return 0;
}
""".replace("GGML_V_EXPF", GGML_V_EXPF)

SOFTMAX_ROWS = ((256, 12, 0.125), (40, 6, 1.0), (13, 5, 0.5))


def inputs():
    rng = np.random.default_rng(2026)
    ln2 = np.log(2.0)
    edges = [0.0, -0.0, 1e-30, -1e-30, np.inf, -np.inf, np.nan]
    for nn in (126, 127, 191, 192, 193):       # |n| around the slow paths' thresholds
        for s in (-1, 1):
            edges += [s * nn * ln2 + d for d in (-0.4, -0.01, 0.0, 0.01, 0.4)]
    x = np.concatenate([rng.uniform(-110, 90, 2048), rng.uniform(-20, 2, 1536), rng.standard_normal(400) * 150,
                        np.array(edges)]).astype(np.float32)
    return x[:4096] if x.size >= 4096 else np.concatenate([x, rng.uniform(-5, 5, 4096 - x.size).astype(np.float32)])


def main():
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "v.c").write_text(MAIN)
        subprocess.run(["gcc", "-O2", "-mavx2", "-mfma", "-o", str(tmp / "v"), str(tmp / "v.c"), "-lm"], check=True)
        x = inputs()
        x.tofile(tmp / "x.bin")
        subprocess.run([str(tmp / "v"), "e", str(tmp / "x.bin"), str(tmp / "y.bin")], check=True)
        out = {"expf_x": x, "expf_y": np.fromfile(tmp / "y.bin", np.float32)}
        rng = np.random.default_rng(7)
        for n, rows, scale in SOFTMAX_ROWS:
            xr = (rng.standard_normal((rows, n)) * 4).astype(np.float32)
            mr = np.zeros((rows, n), np.float32)
            for r in range(rows):
                mr[r, rng.integers(1, n + 1):] = -np.inf          # a causal mask's row: a prefix visible
            np.stack([xr, mr], axis=1).tofile(tmp / "s.bin")     # row by row: x, then its mask
            subprocess.run([str(tmp / "v"), "s", str(tmp / "s.bin"), str(tmp / "d.bin"), str(n), str(rows), repr(scale)],
                           check=True)
            out[f"sm{n}_x"], out[f"sm{n}_mask"] = xr, mr
            out[f"sm{n}_scale"] = np.float32(scale)
            out[f"sm{n}_y"] = np.fromfile(tmp / "d.bin", np.float32).reshape(rows, n)
        # swiglu: gates over silu's range and its edges (exp(-x) overflowing, +-inf, NaN)
        gx = np.concatenate([rng.standard_normal(1800) * 6, rng.uniform(-100, 100, 240),
                             np.array([0.0, -0.0, 88.7, -88.8, -90.0, 200.0, -200.0, np.inf, -np.inf, np.nan,
                                       1e-30, -1e-30, 3.0])]).astype(np.float32)
        gv = rng.standard_normal(gx.size).astype(np.float32)
        np.concatenate([gx, gv]).tofile(tmp / "g.bin")
        subprocess.run([str(tmp / "v"), "g", str(tmp / "g.bin"), str(tmp / "gy.bin"), str(gx.size)], check=True)
        out["swiglu_x"], out["swiglu_g"] = gx, gv
        out["swiglu_y"] = np.fromfile(tmp / "gy.bin", np.float32)
    path = ROOT / "tests/data/vexpf_ref.npz"
    np.savez_compressed(path, **out)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
