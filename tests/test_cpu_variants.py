"""The CPU variants (chapter 07d): ggml's scores, the choice, forcing one, and that two
variants compute within ggml's limits of each other without sharing compiled code. The
products run in fresh processes (tests/cpu_variant_probe.py): a process compiles for one
variant."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ggml_lite.backends.cpu import variants as V
from ggml_lite.core import GGMLError

ROOT = Path(__file__).resolve().parent.parent
EPYC = {"sse4.2", "avx", "f16c", "fma", "avx2", "bmi2"}
AVX512 = {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}
XEON_SKX = EPYC | AVX512
XEON_ICX = XEON_SKX | {"avx512vbmi", "avx512vnni"}
# numba told to compile for an AVX2 machine (as the Makefile's test-avx2 does)
AVX2_TARGET = {"NUMBA_CPU_NAME": "haswell",
               "NUMBA_CPU_FEATURES": "+avx,+avx2,+bmi2,+f16c,+fma,+sse4.2,-avx512f"}


def test_scores_are_cpu_feats():
    """ggml_backend_cpu_x86_score: 1 + the option bits, 0 when one is missing."""
    want = {"x64": 1, "sse42": 1 + 4, "sandybridge": 1 + 4 + 16,
            "haswell": 1 + 1 + 2 + 4 + 8 + 16 + 32,
            "skylakex": 64 + 128, "icelake": 64 + 128 + 256 + 1024}
    assert {v: V.cpu_variant_score(v, XEON_ICX) for v in V.CPU_VARIANTS} == want
    assert V.cpu_variant_score("skylakex", EPYC) == 0
    assert V.cpu_variant_score("icelake", XEON_SKX) == 0
    assert V.cpu_variant_score("skylakex", XEON_SKX - {"avx512dq"}) == 0
    assert [V.cpu_variant_best(c) for c in (set(), {"sse4.2"}, EPYC, XEON_SKX, XEON_ICX)] \
        == ["x64", "sse42", "haswell", "skylakex", "icelake"]


def test_refusals_name_what_is_missing():
    with pytest.raises(GGMLError, match=r"icelake: this CPU lacks avx512vbmi, avx512vnni"):
        V.cpu_variant_check("icelake", XEON_SKX)
    with pytest.raises(GGMLError, match=r"unknown CPU variant 'zen9'.*x64, sse42"):
        V.cpu_variant_check("zen9", XEON_ICX)
    V.cpu_variant_check("haswell", XEON_ICX)


def test_this_process_runs_the_best_variant():
    from ggml_lite.backends.cpu import backend, simd
    if os.environ.get(V.CPU_VARIANT_ENV):
        pytest.skip(f"{V.CPU_VARIANT_ENV} is set")
    best = V.cpu_variant_best(V.cpu_features())
    assert V.cpu_variant() == simd.CPU_VARIANT == best
    assert backend.ggml_backend_score() == V.cpu_variant_score(best, V.cpu_features()) > 0
    assert simd.AVX2 == ("AVX2" in V.CPU_VARIANTS[best])


def _run(code_or_args, env_extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("NUMBA_CPU") and k != V.CPU_VARIANT_ENV}
    env.update(env_extra, PYTHONPATH=str(ROOT), PYTHONHASHSEED="0")
    return subprocess.run([sys.executable, *code_or_args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1500)


def test_forcing_a_variant_the_cpu_lacks_is_refused():
    """On a (pretended) AVX2 machine, forcing icelake fails when the kernels load."""
    r = _run(["-c", "import ggml_lite.backends.cpu.backend"],
             {**AVX2_TARGET, V.CPU_VARIANT_ENV: "icelake"})
    assert r.returncode != 0
    assert ("GGMLError: CPU variant icelake: this CPU lacks avx512f, avx512cd, avx512vl, "
            "avx512dq, avx512bw, avx512vbmi, avx512vnni") in r.stderr


def _probe(tmp_path, variant, extra=None):
    out = tmp_path / f"{variant}.npz"
    r = _run(["tests/cpu_variant_probe.py", str(out)],
             {**(extra or {}), V.CPU_VARIANT_ENV: variant})
    assert r.returncode == 0, r.stderr[-3000:]
    d = dict(np.load(out))
    return json.loads(str(d.pop("info"))), d


def _nmse(a, b):
    return float(np.sum((a.astype(np.float64) - b) ** 2) / np.sum(b.astype(np.float64) ** 2))


def test_forced_variants_agree_and_keep_their_own_code(tmp_path):
    """x64 (SSE2), and the best variant of this CPU: each runs its own machine code
    (its own cache entries, the instructions of its level), and their products agree
    within test-backend-ops' mul_mat limit (NMSE 5e-4). Not in the same bits: without
    FMA a multiply-add is rounded twice (ggml's x64 build sums in another order too)."""
    best = V.cpu_variant_best(V.cpu_features())
    lo, lo_res = _probe(tmp_path, "x64")
    hi, hi_res = _probe(tmp_path, best)
    assert (lo["variant"], lo["score"]) == ("x64", 1)
    assert (hi["variant"], hi["score"]) == (best, V.cpu_variant_score(best, V.cpu_features()))
    assert lo["key_target"] == "" and not (lo["ymm"] or lo["zmm"] or lo["avx2"])
    assert hi["key_target"] == V._numba_target(best)[1]
    assert {lo["key_target"], hi["key_target"]} <= set(hi["index_targets"])
    assert hi["avx2"] == hi["ymm"] == ("AVX2" in V.CPU_VARIANTS[best])
    assert hi["vpdpbusd"] == hi["avx512_vnni"] == ("AVX512_VNNI" in V.CPU_VARIANTS[best])
    for name, ref in lo_res.items():
        assert _nmse(hi_res[name], ref) < 5e-4, name
    if "Q4_0_repack" in hi_res:
        assert _nmse(hi_res["Q4_0_repack"], lo_res["Q4_0"]) < 5e-4


@pytest.mark.skipif("avx512vnni" not in V.cpu_features() or "avx512vl" not in V.cpu_features(),
                    reason="the CPU has no AVX512-VNNI: the icelake and haswell kernels "
                    "cannot be compared here")
def test_haswell_and_icelake_in_the_same_bits(tmp_path):
    """ggml 0.15.3's Q8_0 and Q4_0 dots with AVX512-VNNI (256-bit vpdpbusd) give the
    bits of its AVX2 ones; the repacked Q4_0 GEMM too; and the tiled K-quant kernel
    (vpdpbusd against vpmaddubsw + vpmaddwd, both exact; the AVX2 epilogue on both)."""
    _, has = _probe(tmp_path, "haswell")
    ice_info, ice = _probe(tmp_path, "icelake")
    assert ice_info["vpdpbusd"]
    for name in has:
        if name.startswith(("Q8_0", "Q4_0", "Q4_K", "Q6_K")):
            assert np.array_equal(has[name], ice[name]), name
