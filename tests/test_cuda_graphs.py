"""CUDA graphs on the emulated device (GGML_LITE_CUDA_EMU=1): a graph computed again unchanged is
captured once and replayed (the launches recorded with their arguments, then issued again in order
without the walk over the nodes), as ggml-cuda decides it (warm-up, properties compared, cuBLAS
not capturable, GGML_CUDA_DISABLE_GRAPHS). Over 40 decode steps of a llama test model the replayed
logits are the eager ones, bit for bit. Needs a C++ compiler (g++), no GPU."""
import os
from pathlib import Path

import numpy as np
import pytest

import ggml_lite as ggml
from ggml_lite import Type
from ggml_lite.backends.cuda import emu
from ggml_lite.backends.cuda import graphs
from ggml_lite.tensor import set_op_params_f32

pytestmark = pytest.mark.skipif(emu.emu_compiler() is None, reason="no C++ compiler (g++ or $CXX) for the emulated device")
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def cuda():
    saved = {k: os.environ.get(k) for k in (emu.EMU_ENV, graphs.GRAPHS_ENV, graphs.FUSION_ENV)}
    os.environ[emu.EMU_ENV] = "1"
    for k in (graphs.GRAPHS_ENV, graphs.FUSION_ENV):
        os.environ.pop(k, None)
    try:
        yield ggml.backend_cuda_init(0)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _reset(backend):
    backend.graph_stats.update(eager=0, captures=0, replays=0, incompatible=0, capture_failed=0)


class _Graph:
    """x (F32, 256 x n_cols) -> rms_norm * g -> Q8_0 product -> silu, in CUDA memory."""

    def __init__(self, backend, n_cols):
        self.ctx = ggml.init(mem_size=16 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
        c = self.ctx
        self.x = ggml.new_tensor_2d(c, Type.F32, 256, n_cols)
        g, w = ggml.new_tensor_1d(c, Type.F32, 256), ggml.new_tensor_2d(c, Type.Q8_0, 256, 256)
        self.out = ggml.silu(c, ggml.mul_mat(c, w, ggml.mul(c, ggml.rms_norm(c, self.x, 1e-5), g)))
        self.gf = ggml.new_graph(c)
        ggml.build_forward_expand(self.gf, self.out)
        self.buf = ggml.backend_alloc_ctx_tensors(c, backend)
        rng = np.random.default_rng(n_cols)
        ggml.backend_tensor_set(w, ggml.quantize_chunk(Type.Q8_0, rng.standard_normal((256, 256)).astype(np.float32)))
        ggml.backend_tensor_set(g, rng.uniform(0.5, 1.5, 256).astype(np.float32))
        self.backend, self.n_cols = backend, n_cols

    def __call__(self, seed):
        ggml.backend_tensor_set(self.x, np.random.default_rng(seed).standard_normal((self.n_cols, 256), np.float32))
        assert ggml.backend_graph_compute(self.backend, self.gf) == ggml.Status.SUCCESS
        return ggml.backend_tensor_get(self.out)

    def free(self):
        ggml.backend_buffer_free(self.buf)
        ggml.free(self.ctx)


def test_warm_up_capture_replay_and_a_change_captures_again(cuda, monkeypatch):
    _reset(cuda)
    a = _Graph(cuda, 1)
    try:
        outs = [a(s) for s in range(4)]
        assert cuda.graph_stats == dict(eager=1, captures=1, replays=3, incompatible=0, capture_failed=0)
        before = emu.EMU_STATS["launches"]
        a(9)
        assert emu.EMU_STATS["launches"] - before == 4      # norm+mul fused, quantize, mat-vec, silu
        # a changed node (here the norm's eps) resets the warm-up: eager once, then captured again
        set_op_params_f32(a.gf.nodes[0], 0, 1e-3)
        changed = [a(s) for s in range(3)]
        assert cuda.graph_stats == dict(eager=2, captures=2, replays=6, incompatible=0, capture_failed=0)
        monkeypatch.setenv(graphs.GRAPHS_ENV, "1")           # the switch, as ggml's: set at all
        off = [a(s) for s in range(3)]
        assert cuda.graph_stats == dict(eager=5, captures=2, replays=6, incompatible=0, capture_failed=0)
        monkeypatch.delenv(graphs.GRAPHS_ENV)
        set_op_params_f32(a.gf.nodes[0], 0, 1e-5)
        again = [a(s) for s in range(4)]
    finally:
        a.free()
    assert all(np.array_equal(x, y) for x, y in zip(outs, again))
    assert all(np.array_equal(x, y) for x, y in zip(changed, off))
    assert not np.array_equal(outs[0], changed[0])


def test_a_graph_with_a_cublas_product_runs_node_by_node(cuda):
    _reset(cuda)
    b = _Graph(cuda, 16)                                     # 16 columns: dequantize + cuBLAS
    try:
        for s in range(3):
            b(s)
    finally:
        b.free()
    assert cuda.graph_stats == dict(eager=3, captures=0, replays=0, incompatible=3, capture_failed=0)


def test_a_capture_that_fails_is_counted_and_the_graph_runs_node_by_node(cuda, monkeypatch):
    """Made compatible by force, the cuBLAS graph is captured: the emulated matmul refuses as cupy's
    cuBLAS calls do, the capture is dropped, and that graph runs node by node from then on."""
    _reset(cuda)
    monkeypatch.setattr(graphs, "cuda_graph_compatible", lambda cgraph: True)
    b = _Graph(cuda, 16)
    try:
        outs = [b(s) for s in range(4)]
        monkeypatch.setenv(graphs.GRAPHS_ENV, "1")
        off = [b(s) for s in range(4)]
    finally:
        b.free()
    assert cuda.graph_stats == dict(eager=8, captures=0, replays=0, incompatible=0, capture_failed=1)
    assert all(np.array_equal(x, y) for x, y in zip(outs, off))


def test_the_emulated_stream_records_while_capturing_and_refuses_cublas():
    cp = emu.emulated_cupy()
    stream = cp.cuda.Stream()
    src, dst = np.arange(8, dtype=np.float32), np.zeros(8, np.float32)
    stream.begin_capture()
    assert stream.is_capturing()
    cp.cuda.runtime.memcpyAsync(dst.ctypes.data, src.ctypes.data, 32, 3, stream.ptr)
    assert not dst.any()                                      # recorded, not run
    with pytest.raises(RuntimeError, match="cuBLAS"):
        cp.matmul(src.reshape(2, 4), src.reshape(4, 2))
    with pytest.raises(RuntimeError, match="capturing already"):
        stream.begin_capture()
    graph = stream.end_capture()
    assert not stream.is_capturing() and len(graph.records) == 1
    graph.launch(stream)
    assert np.array_equal(dst, src)


def test_fusion_switch_follows_atoi(monkeypatch):
    for value, off in (("1", True), ("0", False), ("", False), ("2x", True), ("x", False)):
        monkeypatch.setenv(graphs.FUSION_ENV, value)
        assert graphs.cuda_fusion_disabled() is off, value


def _decode(m, steps, prompt):
    m.kv.n_filled = 0
    logits = [m.eval(prompt, 0, logits_all=False)[-1]]
    for i in range(steps):
        tok = int(np.argmax(logits[-1]))
        logits.append(m.eval([tok], len(prompt) + i, logits_all=False)[-1])
    return np.array(logits)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_forty_decode_steps_replayed_equal_eager_bit_for_bit(cuda, name, monkeypatch):
    """The llama test model on CUDA (emulated) and the CPU under the scheduler: the prompt's graph
    has batched products (cuBLAS) and runs node by node; the first decode step warms up, the
    second is captured, the other 39 replay. With the llama graph rebuilt for every step
    (LLAMA_GRAPH_REUSE_DISABLE) the scheduler numbers each anew and the properties decide: each
    step replays the graph captured before. With the switch, no graph at all; the logits are the same bits each way."""
    from ggml_lite import llama
    cpu = ggml.backend_cpu_init()
    m = llama.load(DATA / f"llama_{name}.gguf", n_ctx=64, backends=[cuda, cpu], n_threads=1, progress=False)
    prompt = [1, 15, 27, 300, 8]
    try:
        _reset(cuda)
        replayed = _decode(m, 40, prompt)
        assert cuda.graph_stats == dict(eager=2, captures=1, replays=39, incompatible=1, capture_failed=0)
        monkeypatch.setenv(graphs.GRAPHS_ENV, "1")
        _reset(cuda)
        eager = _decode(m, 40, prompt)
        assert cuda.graph_stats == dict(eager=41, captures=0, replays=0, incompatible=0, capture_failed=0)
        monkeypatch.delenv(graphs.GRAPHS_ENV)
        m.graph_reuse = False                                 # llama_context's graph_reuse_disable
        _reset(cuda)
        builds = m.timings["n_graph_builds"]
        rebuilt = _decode(m, 40, prompt)
        assert m.timings["n_graph_builds"] - builds == 41
        # the graph captured in the first run is still there, and every rebuilt step matches it
        assert cuda.graph_stats == dict(eager=1, captures=0, replays=40, incompatible=1, capture_failed=0)
    finally:
        m.free()
    assert np.array_equal(replayed.view(np.uint32), eager.view(np.uint32))
    assert np.array_equal(rebuilt.view(np.uint32), eager.view(np.uint32))
    assert len(set(int(np.argmax(r)) for r in eager)) > 1      # the steps decode different tokens
