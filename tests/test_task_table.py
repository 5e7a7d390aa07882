"""The compiled loop's task table (chapter 92): each task function compiled when a graph first
needs it, for its kind (and its type where the kernel depends on one), cached on its own; the
line that announces a first compilation; the cache's staleness check wherever numba keeps it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from ggml_lite.backends.cpu import program as P
from ggml_lite.backends.cpu import tasks as T
from ggml_lite.types import Type

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh process with an empty numba cache: what a graph compiles is what numba's
# dispatchers hold afterwards (a dispatcher loaded from a cache would list nothing new).
PROBE = r"""
import io, json, sys
import numpy as np

class Terminal(io.StringIO):
    def isatty(self):
        return True

err, sys.stderr = sys.stderr, Terminal()
import ggml_lite as ggml
from ggml_lite.backends.cpu import quants as Q, tasks as T, vec as V

def seen():
    return dict(keys=sorted(map(list, T.TASK_FUNCTIONS)),
                chunks_q=[str(s[0]) for s in V._mm_chunks_q.signatures],
                q8_0=len(Q.quantize_row_q8_0.signatures),
                q8_K=len(Q.quantize_row_q8_K_ref.signatures),
                any_quantize=len(Q.quantize_row.signatures),
                any_dequantize=len(Q.dequantize_row.signatures),
                any_from_float=len(Q.from_float_row.signatures),
                stderr=sys.stderr.getvalue())

ctx = ggml.init(mem_size=32 << 20)
a, b = (ggml.new_tensor_1d(ctx, ggml.Type.F32, 1024) for _ in range(2))
a.numpy()[...], b.numpy()[...] = 1.0, 2.0
c = ggml.add(ctx, a, b)
gf = ggml.new_graph(ctx)
ggml.build_forward_expand(gf, c)
ggml.graph_compute_with_ctx(ctx, gf, 2)
assert float(c.numpy().reshape(-1)[0]) == 3.0
after_add = seen()
sys.stderr.truncate(0); sys.stderr.seek(0)
K, M = 256, 64
w = ggml.new_tensor_2d(ctx, ggml.Type.Q8_0, K, M)
x = ggml.new_tensor_1d(ctx, ggml.Type.F32, K)
blocks = np.zeros(M * K // 32, dtype=[("d", "<f2"), ("qs", "i1", 32)])
blocks["d"] = 0.5
blocks["qs"] = np.random.default_rng(0).integers(-127, 128, (M * K // 32, 32))
w.numpy().reshape(-1)[...] = blocks.view(np.uint8)
x.numpy()[...] = 2.0
y = ggml.mul_mat(ctx, w, x)
gf = ggml.new_graph(ctx)
ggml.build_forward_expand(gf, y)
ggml.graph_compute_with_ctx(ctx, gf, 2)
ref = blocks["qs"].astype(np.float64).reshape(M, K).sum(1)
ok = bool(np.allclose(y.numpy().reshape(-1), ref, rtol=1e-3, atol=1e-2))
after_matvec = seen()
# an F16 weight (src1 converted to F16) and a Q8_0 get_rows: still no switch over all types
w16 = ggml.new_tensor_2d(ctx, ggml.Type.F16, K, 8)
w16.numpy()[...] = np.float16(0.25)
idx = ggml.new_tensor_1d(ctx, ggml.Type.I32, 2)
idx.numpy()[...] = [3, 1]
y16, rows = ggml.mul_mat(ctx, w16, x), ggml.get_rows(ctx, w, idx)
gf = ggml.new_graph(ctx)
ggml.build_forward_expand(gf, y16)
ggml.build_forward_expand(gf, rows)
ggml.graph_compute_with_ctx(ctx, gf, 2)
ok16 = bool(np.allclose(y16.numpy(), 0.25 * 2.0 * K))
deq = blocks["qs"].reshape(M, K)[[3, 1]].astype(np.float32) * np.float32(0.5)
ok_rows = bool(np.array_equal(rows.numpy().reshape(2, K), deq))
more = seen()
# a soft_max with an F32 mask: its storage's task function only, and one row layout
from ggml_lite.backends.cpu import ops as K
s, mk = (ggml.new_tensor_2d(ctx, ggml.Type.F32, 32, 4) for _ in range(2))
s.numpy()[...], mk.numpy()[...] = 0.5, 0.0
sm = ggml.soft_max_ext(ctx, s, mk, 1.0, 0.0)
gf = ggml.new_graph(ctx)
ggml.build_forward_expand(gf, sm)
ggml.graph_compute_with_ctx(ctx, gf, 2)
soft_max = dict(keys=seen()["keys"], ok=bool(np.allclose(sm.numpy(), 1 / 32)),
                row_layouts=[str(sig[0]) for sig in K._soft_max_row.signatures])
print(json.dumps(dict(add=after_add, matvec=after_matvec, matvec_ok=ok, more=more,
                      f16_ok=ok16, rows_ok=ok_rows, soft_max=soft_max)), file=err)
"""


def _probe(cache_dir):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stderr.strip().splitlines()[-1])


def test_a_graph_compiles_only_the_task_functions_it_needs(tmp_path):
    cold = _probe(tmp_path)
    add, mv = cold["add"], cold["matvec"]
    # one add node: the binary kind's function, and nothing of mul_mat's
    assert add["keys"] == [[P.TASK_BINARY, 0]]
    assert add["chunks_q"] == [] and add["q8_0"] == 0
    assert "ggml_lite: compiling the CPU kernels this graph needs (binary); once per " \
           "machine" in add["stderr"]
    # a Q8_0 mat-vec: src1 to Q8_0 and Q8_0's chunk loop, keyed by the type; no other
    # type's quantizer (Q8_K's, of the K-quants), and not the switch over all types
    q8 = int(Type.Q8_0)
    assert mv["keys"] == [[P.TASK_BINARY, 0], [P.TASK_MUL_MAT_SRC1, [q8, 0]],
                          [P.TASK_MUL_MAT_Q, q8]]
    assert mv["chunks_q"] == [f"Literal[int]({q8})"]
    assert mv["q8_0"] >= 1 and mv["q8_K"] == 0
    assert mv["any_quantize"] == 0 and mv["any_dequantize"] == 0 and mv["any_from_float"] == 0
    assert "(mul_mat_src1 Q8_0, mul_mat_q Q8_0)" in mv["stderr"]
    assert cold["matvec_ok"]
    # src1 to F16 and the rows of a Q8_0 table: keyed by type, and still no switch over all
    # types (a literal whose function cannot be typed would fall back to it silently)
    more = cold["more"]
    assert [P.TASK_MUL_MAT_SRC1, [int(Type.F16), 0]] in more["keys"]
    assert [P.TASK_GET_ROWS, q8] in more["keys"]
    assert (more["any_quantize"], more["any_dequantize"], more["any_from_float"]) == (0, 0, 0)
    assert cold["f16_ok"] and cold["rows_ok"]
    # the float kinds are keyed by storage: an F32 mask compiles no F16 one; a row is
    # compiled for one layout (a strided row would be copied)
    sm = cold["soft_max"]
    assert [P.TASK_SOFT_MAX, P.ST_F32] in sm["keys"]
    assert [P.TASK_SOFT_MAX, P.ST_U16] not in sm["keys"] and sm["ok"]
    assert sm["row_layouts"] == ["array(float32, 1d, C)"]
    # the same process again: everything from the cache, and no announcement
    warm = _probe(tmp_path)
    assert warm["add"]["stderr"] == "" and warm["matvec"]["stderr"] == ""
    assert warm["matvec"]["keys"] == mv["keys"] and warm["matvec_ok"]


def _row(kind, *args):
    row = np.zeros(P.ROW_SIZE, np.int64)
    row[P.KIND] = kind
    row[P.ARG:P.ARG + len(args)] = args
    return row


def test_task_keys_and_the_fn_column():
    q4k = int(Type.Q4_K)
    assert T.task_key(_row(P.TASK_MUL_MAT_Q, q4k, 256)) == (P.TASK_MUL_MAT_Q, q4k)
    assert T.task_key(_row(P.TASK_MUL_MAT_SRC1, -1)) == (P.TASK_MUL_MAT_SRC1, (-1, 0))
    src1 = _row(P.TASK_MUL_MAT_SRC1, int(Type.F16))
    src1[P.STRIDED] = 6                     # src0 and src1 strided: only src1's bit counts
    assert T.task_key(src1) == (P.TASK_MUL_MAT_SRC1, (int(Type.F16), 4))
    add = _row(P.TASK_BINARY, 0)
    add[P.STRIDED] = 6
    assert T.task_key(add) == (P.TASK_BINARY, 1)          # strided views or contiguous
    assert T.task_key(_row(P.TASK_SET_ROWS, int(Type.F16), 1, P.ST_I64)) == (
        P.TASK_SET_ROWS, (int(Type.F16), P.ST_I64))
    assert T.task_key(_row(P.TASK_GET_ROWS, int(Type.F16), 1)) == (P.TASK_GET_ROWS,
                                                                    int(Type.F16))
    assert T.task_key(_row(P.TASK_SCALE, 7)) == (P.TASK_SCALE, 0)   # not keyed by type
    prog = np.stack([_row(P.TASK_PYTHON), _row(P.TASK_BINARY, 0),
                     _row(P.TASK_EXTRA, 12345)])
    T.with_task_functions(prog)
    assert prog[0, P.FN] == 0 and prog[2, P.FN] == 0     # a call back; 07c's own function
    assert prog[1, P.FN] == T.TASK_FUNCTIONS[(P.TASK_BINARY, 0)].address != 0


def test_storage_and_strides_key_the_float_kinds():
    f32, u16 = P.ST_F32, P.ST_U16
    assert T.task_key(_row(P.TASK_ROPE, 0, 0, 64, 2, u16)) == (P.TASK_ROPE, u16)
    assert T.task_key(_row(P.TASK_SOFT_MAX, 1, 1, u16)) == (P.TASK_SOFT_MAX, u16)
    assert T.task_key(_row(P.TASK_GLU, 2, 0, 0, 0, f32)) == (P.TASK_GLU, f32)
    assert T.task_key(_row(P.TASK_DUP, 0, 1, 0, 2)) == (P.TASK_DUP, 2)
    q5 = int(Type.Q5_0)                     # llamafile's sgemm: by the weight's type
    assert T.task_key(_row(P.TASK_SGEMM, 32, 32, 4, 0, 0, q5)) == (P.TASK_SGEMM, q5)
    mm = _row(P.TASK_MUL_MAT_F16, int(Type.F16), 64)
    mm[P.STRIDED] = 6
    assert T.task_key(mm) == (P.TASK_MUL_MAT_F16, 6)
    names = {(P.TASK_DUP, 2): "dup F16->F32", (P.TASK_SGEMM, q5): "sgemm Q5_0",
             (P.TASK_MUL_MAT_F16, 6): "mul_mat_f16 src0 strided src1 strided",
             (P.TASK_MUL_MAT_F32, 0): "mul_mat_f32", (P.TASK_ROPE, f32): "rope F32",
             (P.TASK_GET_ROWS, int(Type.Q8_0)): "get_rows Q8_0",
             (P.TASK_MUL_MAT_SRC1, (-1, 0)): "mul_mat_src1 -",
             (P.TASK_MUL_MAT_SRC1, (1, 4)): "mul_mat_src1 F16 strided",
             (P.TASK_SET_ROWS, (1, P.ST_I64)): "set_rows F16 (I64 rows)",
             (P.TASK_BINARY, 1): "binary strided", (P.TASK_SCALE, 0): "scale"}
    assert {key: T._task_name(key) for key in names} == names


def test_stale_cache_is_dropped_under_numba_cache_dir(tmp_path, monkeypatch):
    """Every cache file of the package goes when any of its sources changes (a caller's
    machine code holds its callees, from other files), in every folder of the package,
    and in IPython's numba_cache when the package is imported in a notebook."""
    import sys
    import IPython.paths
    from numba.core import config
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path / "numba"))
    ipython = tmp_path / "ipython"
    monkeypatch.setattr(IPython.paths, "get_ipython_cache_dir", lambda: str(ipython))
    monkeypatch.setitem(sys.modules, "IPython", sys.modules["IPython"])
    here = Path(P.__file__).resolve().parent
    cache, top = P._cache_dir(here), P._cache_dir(here.parents[1])
    assert cache.parent == tmp_path / "numba" and cache != top
    names = ["program.run_task-1.py311.nbi", "tasks.task_cfunc.locals.task-9.py311.1.nbc",
             "threadpool.threadpool_poll-3.py311.nbi", "vec._mm_chunks_q-4.py311.nbi"]
    folders = {cache: names, top: ["half.fp16_to_fp32-42.py311.nbi"],
               ipython / "numba_cache": ["123456.f-3.py311.nbi", "123456.f-3.py311.1.nbc"]}

    def fill():
        for folder, files in folders.items():
            folder.mkdir(parents=True, exist_ok=True)
            for n in files:
                (folder / n).write_text("x")

    def left():
        return {f: sorted(p.name for p in f.iterdir()) for f in folders}

    fill()
    P._drop_stale_cache()                       # no stamp yet: a change
    assert left() == {f: ["ggml_lite.deps"] for f in folders}
    fill()
    P._drop_stale_cache()                       # the same sources: nothing dropped
    assert left() == {f: sorted(["ggml_lite.deps"] + n) for f, n in folders.items()}
    (top / "ggml_lite.deps").write_text("another digest")
    P._drop_stale_cache()                       # a source changed (seen from one folder)
    assert left()[top] == ["ggml_lite.deps"]
    assert left()[cache] == sorted(["ggml_lite.deps"] + names)
    (top / "ggml_lite.deps").write_text("another digest")
    (cache / "ggml_lite.deps").write_text("another digest")
    (ipython / "numba_cache" / "ggml_lite.deps").write_text("another digest")
    P._drop_stale_cache()
    assert left()[cache] == left()[ipython / "numba_cache"] == ["ggml_lite.deps"]
