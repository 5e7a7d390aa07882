"""The CUDA backend on any machine: its kernel sources compile (nvcc to PTX for sm_90, and NVRTC
when cupy's is loadable), every launch passes the arguments its kernel declares, supports_op and
the buffer type's sizes follow their rules, and without cupy or a GPU the backend is reported
absent, never an import error. What needs a GPU is in bench/cuda_check.py."""
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import ggml_lite as ggml
from ggml_lite import GGMLError, Op, Type
from ggml_lite.backends.cuda import backend as cb
from ggml_lite.backends.cuda import kernels as ck

ROOT = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc")


def _cuda_here():
    return ggml.backends.cuda.backend.cuda_availability()[0]


# ---------------------------------------------------------------------------------------------
# The sources compile
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def ptx(tmp_path_factory):
    """{file: PTX text} of every kernel file, compiled once by nvcc for sm_90."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH: the CUDA sources cannot be compiled on this machine")
    out = tmp_path_factory.mktemp("ptx")
    texts = {}
    for f in ck.KERNEL_FILES:
        r = subprocess.run([NVCC, "--ptx", "-arch=sm_90", str(ck.KERNEL_DIR / f), "-o", str(out / (f + ".ptx"))],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"nvcc --ptx {f} failed:\n{r.stderr}"
        texts[f] = (out / (f + ".ptx")).read_text()
    return texts


def _entries(ptx_text):
    """{kernel name: ([param types], maxntid or None)} of the .entry functions in PTX."""
    found = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(([^)]*)\)([^{]*)\{", ptx_text):
        params = re.findall(r"\.param\s+\.(\w+)", m.group(2))
        ntid = re.search(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", m.group(3))
        found[m.group(1)] = (params, int(np.prod([int(g) for g in ntid.groups()])) if ntid else None)
    return found


@pytest.mark.parametrize("file", ck.KERNEL_FILES)
def test_every_kernel_file_compiles_to_ptx_for_sm_90(ptx, file):
    assert _entries(ptx[file]), f"{file} defines no kernel"


def test_every_kernel_file_compiles_with_nvrtc():
    """NVRTC is what cupy compiles with at run time (its branch of common.cuh, no CUDA headers)."""
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as e:
        pytest.skip(f"cupy's NVRTC is not loadable here ({type(e).__name__}: {e})")
    for f in ck.KERNEL_FILES:
        prog = nvrtc.createProgram((ck.KERNEL_DIR / f).read_text(), f, [], [])
        try:
            nvrtc.compileProgram(prog, [f"-I{ck.KERNEL_DIR}", "-arch=compute_90"])
        except Exception:
            pytest.fail(f"NVRTC cannot compile {f}:\n{nvrtc.getProgramLog(prog)}")


def test_the_sources_are_in_the_package_and_named_in_the_list():
    on_disk = sorted(p.name for p in ck.KERNEL_DIR.glob("*.cu"))
    assert on_disk == sorted(ck.KERNEL_FILES)
    assert (ck.KERNEL_DIR / "common.cuh").exists()


# ---------------------------------------------------------------------------------------------
# Every launch matches its kernel: name, argument count and sizes, block and grid limits
# ---------------------------------------------------------------------------------------------

_PTX_SIZE = {"u64": 8, "s64": 8, "b64": 8, "f64": 8, "u32": 4, "s32": 4, "b32": 4, "f32": 4}


class _FakeKernel:
    def __init__(self, ctx, file, name, params, maxntid):
        self.ctx, self.file, self.name, self.params, self.maxntid = ctx, file, name, params, maxntid

    def __call__(self, grid, block, args, shared_mem=0):
        where = f"{self.file}:{self.name}"
        assert len(args) == len(self.params), f"{where}: {len(args)} arguments, the kernel takes {len(self.params)}"
        for i, (a, p) in enumerate(zip(args, self.params)):
            assert a.nbytes == _PTX_SIZE[p], f"{where}: argument {i} is {a.dtype}, the kernel's is .{p}"
            assert (p == "f32") == (a.dtype == np.float32), f"{where}: argument {i} is {a.dtype}, the kernel's is .{p}"
        assert 1 <= len(grid) <= 3 and 1 <= len(block) <= 3
        assert all(g >= 1 for g in grid), f"{where}: empty grid {grid}"
        assert grid[0] < 2**31 and all(g <= 65535 for g in grid[1:]), f"{where}: grid {grid} beyond CUDA's limits"
        threads = int(np.prod(block))
        assert threads <= 1024 and block[0] <= 1024
        if self.maxntid is not None:
            assert threads <= self.maxntid, f"{where}: {threads} threads, __launch_bounds__ {self.maxntid}"
        self.ctx.launches.append((self.name, tuple(grid), tuple(block), args))


class FakeContext:
    """The backend's side of a launcher (kernel, pool_alloc) with kernels checked against the PTX."""
    device_id = 0

    def __init__(self, ptx):
        self.entries = {f: _entries(text) for f, text in ptx.items()}
        self.launches = []

    def kernel(self, file, name):
        assert name in self.entries[file], f"{file} has no kernel {name}"
        return _FakeKernel(self, file, name, *self.entries[file][name])

    def pool_alloc(self, size):
        assert size > 0
        return SimpleNamespace(data=SimpleNamespace(ptr=0x7f0000000000))


@pytest.fixture
def ctx():
    c = ggml.init(mem_size=256 * ggml.tensor_overhead(), no_alloc=True)
    yield c
    ggml.free(c)


def _launch(ptx, fn, *args):
    fake = FakeContext(ptx)
    fn(fake, *args)
    assert fake.launches, "no kernel was launched"
    return fake.launches


def test_launches_of_the_elementwise_kernels(ptx, ctx):
    a = ggml.new_tensor_4d(ctx, Type.F32, 64, 3, 2, 2)
    b = ggml.new_tensor_4d(ctx, Type.F32, 64, 1, 2, 1)
    for node in (ggml.add(ctx, a, b), ggml.sub(ctx, a, b), ggml.mul(ctx, a, b), ggml.div(ctx, a, b)):
        (name, grid, block, _), = _launch(ptx, ck.cuda_op_bin_bcast, node)
        assert grid[0] * block[0] >= ggml.nelements(node)
    _launch(ptx, ck.cuda_op_scale, ggml.scale_bias(ctx, a, 2.0, 1.0))
    h = ggml.new_tensor_2d(ctx, Type.F16, 64, 3)
    for x in (a, h):
        _launch(ptx, ck.cuda_op_unary, ggml.silu(ctx, x))
        _launch(ptx, ck.cuda_op_unary, ggml.gelu(ctx, x))
        _launch(ptx, ck.cuda_op_swiglu, ggml.swiglu(ctx, x))
        _launch(ptx, ck.cuda_op_swiglu, ggml.swiglu_split(ctx, x, x))


def test_launches_of_the_row_kernels(ptx, ctx):
    for ne0, threads in ((100, {Op.NORM: 32, Op.RMS_NORM: 256}), (4096, {Op.NORM: 1024, Op.RMS_NORM: 1024})):
        x = ggml.new_tensor_3d(ctx, Type.F32, ne0, 5, 2)
        for node in (ggml.norm(ctx, x, 1e-5), ggml.rms_norm(ctx, x, 1e-6)):
            (_, grid, block, _), = _launch(ptx, ck.cuda_op_norm, node)
            assert grid == (5, 2, 1) and block == (threads[node.op],)
    pos = ggml.new_tensor_1d(ctx, Type.I32, 7)
    ff = ggml.new_tensor_1d(ctx, Type.F32, 32)
    for type_ in (Type.F32, Type.F16):
        q = ggml.new_tensor_3d(ctx, type_, 128, 4, 7)
        for mode in (0, ggml.ROPE_TYPE_NEOX):
            node = ggml.rope_ext(ctx, q, pos, ff, 64, mode, 4096, 10000.0, 1.0, 0.5, 1.0, 32.0, 1.0)
            (name, grid, block, _), = _launch(ptx, ck.cuda_op_rope, node)
            assert name == f"rope_{'neox' if mode else 'norm'}_{ggml.type_name(type_)}"
            assert grid == (28, 1) and block == (1, 256)
    s = ggml.new_tensor_4d(ctx, Type.F32, 100, 6, 8, 2)
    for mtype in (Type.F32, Type.F16):
        mask = ggml.new_tensor_2d(ctx, mtype, 100, 6)
        (name, grid, block, _), = _launch(ptx, ck.cuda_op_soft_max, ggml.soft_max_ext(ctx, s, mask, 0.5, 8.0))
        assert name.endswith(ggml.type_name(mtype)) and grid == (6, 8, 2) and block == (128,)
    (_, _, block, _), = _launch(ptx, ck.cuda_op_soft_max, ggml.soft_max(ctx, ggml.new_tensor_1d(ctx, Type.F32, 5000)))
    assert block == (1024,)


def test_launches_of_get_rows_and_cpy(ptx, ctx):
    ids = ggml.new_tensor_2d(ctx, Type.I32, 5, 2)
    for type_ in ck.GET_ROWS_TYPES:
        src = ggml.new_tensor_3d(ctx, type_, 256, 10, 2)
        _launch(ptx, ck.cuda_op_get_rows, ggml.get_rows(ctx, src, ids))
    a = ggml.new_tensor_3d(ctx, Type.F32, 64, 6, 2)
    t = ggml.permute(ctx, a, 1, 0, 2, 3)
    for dst_type in (Type.F32, Type.F16, Type.BF16):
        _launch(ptx, ck.cuda_op_cpy, t, ggml.cont(ctx, ggml.cast(ctx, t, dst_type)))
        if dst_type != Type.F32:                        # F32 to F32, both contiguous, is one memcpy
            _launch(ptx, ck.cuda_op_cpy, ggml.cast(ctx, a, dst_type), ggml.cast(ctx, a, Type.F32))
    for q in (Type.Q8_0, Type.Q4_0):
        (name, grid, block, _), = _launch(ptx, ck.cuda_op_cpy, a, ggml.cast(ctx, a, q))
        assert name == f"cpy_f32_{ggml.type_name(q)}" and grid == (64 * 6 * 2 // 32,) and block == (1,)
        qt = ggml.new_tensor_3d(ctx, q, 64, 6, 2)
        _launch(ptx, ck.cuda_op_cpy, qt, ggml.cast(ctx, qt, Type.F32))
    i = ggml.new_tensor_2d(ctx, Type.I32, 8, 3)
    _launch(ptx, ck.cuda_op_cpy, ggml.transpose(ctx, i), ggml.cont(ctx, ggml.transpose(ctx, i)))


@pytest.mark.parametrize("type_", list(ck.MMVQ_TYPES))
def test_launches_of_the_mat_vec(ptx, ctx, type_):
    w = ggml.new_tensor_4d(ctx, type_, 512, 33, 2, 1)
    for ncols in range(1, 9):
        y = ggml.new_tensor_4d(ctx, Type.F32, 512, ncols, 4, 3)
        (q_name, q_grid, q_block, q_args), (name, grid, block, args) = _launch(ptx, ck.cuda_op_mul_mat, ggml.mul_mat(ctx, w, y))
        assert q_name == "quantize_q8_1" and q_grid == (2, ncols, 12) and q_block == (256,)
        assert name == f"mul_mat_vec_{ck.MMVQ_TYPES[type_]}_q8_1_{ncols}"
        assert grid == ((33 if ncols == 1 else 17), 4, 3) and block == (32, 4 if ncols <= 4 else 2)
        assert args[8] == 2 and args[12] == 3         # channel_ratio, sample_ratio: w broadcast over dims 2, 3


@pytest.mark.parametrize("type_", list(ck.DEQUANTIZE_TYPES))
def test_launches_of_the_dequantizers(ptx, ctx, type_):
    w = ggml.new_tensor_3d(ctx, type_, 512, 70000, 2)
    for f16 in (True, False):
        (name, grid, block, _), = _launch(ptx, ck.cuda_dequantize_into, w, 0x7f0000000000, f16)
        assert name == f"dequantize_{ck.DEQUANTIZE_TYPES[type_]}_{'f16' if f16 else 'f32'}"
        assert grid[1:] == (65535, 2)                   # rows beyond 65535 loop inside the kernel
        k_threads = ck.DEQUANTIZE_K_THREADS.get(type_)
        assert grid[0] == (2 if k_threads else 1) and block == ((k_threads or 256),)


# ---------------------------------------------------------------------------------------------
# The mat-vec's threads cover every quant of a row exactly once
# ---------------------------------------------------------------------------------------------

# ggml's qk (common.cuh's type traits), qi (ggml-common.h's QI*) and vdr (vecdotq.cuh's VDR_*_MMVQ)
_QK_QI_VDR = {Type.Q4_0: (32, 4, 2), Type.Q4_1: (32, 4, 2), Type.Q5_0: (32, 4, 2), Type.Q5_1: (32, 4, 2), Type.Q8_0: (32, 8, 2),
              Type.Q2_K: (256, 16, 1), Type.Q3_K: (256, 16, 1), Type.Q4_K: (256, 32, 2), Type.Q5_K: (256, 32, 2),
              Type.Q6_K: (256, 32, 1)}


def test_mat_vec_types_are_the_traits_table():
    assert set(ck.MMVQ_TYPES) == set(_QK_QI_VDR) == set(ck.DEQUANTIZE_TYPES)


@pytest.mark.parametrize("type_", list(ck.MMVQ_TYPES))
@pytest.mark.parametrize("ncols", [1, 5])
def test_mat_vec_threads_cover_each_block_word_once(type_, ncols):
    """mul_mat_vec_q's loop: thread tid starts at block tid / (qi/vdr), word vdr*(tid % (qi/vdr)),
    and steps by blocks_per_iter blocks; over a row of 3.5 iterations' worth of blocks every
    (block, word) pair must be visited by exactly one thread."""
    qk, qi, vdr = _QK_QI_VDR[type_]
    _, (warp, nwarps) = ck.mmvq_launch_dims(ncols, 1, 1, 1)
    blocks_per_iter = vdr * nwarps * warp // qi
    blocks_per_row = blocks_per_iter * 7 // 2
    seen = np.zeros((blocks_per_row, qi), int)
    for tid in range(nwarps * warp):
        for kbx in range(tid // (qi // vdr), blocks_per_row, blocks_per_iter):
            kqs = vdr * (tid % (qi // vdr))
            seen[kbx, kqs:kqs + vdr] += 1
    assert (seen == 1).all()


def test_mat_vec_launch_dims_follow_ggml_generic_table():
    for ncols in range(1, 9):
        grid, block = ck.mmvq_launch_dims(ncols, 4097, 3, 2)
        rows = 1 if ncols == 1 else 2
        assert block == (32, 4 if ncols <= 4 else 2)
        assert grid == (-(-4097 // rows), 3, 2)


# ---------------------------------------------------------------------------------------------
# supports_op says what the kernels compute (pure Python: no cupy, no GPU)
# ---------------------------------------------------------------------------------------------

def supports(node):
    return ggml.backends.cuda.backend.cuda_supports_op(node, 0)


def test_supports_elementwise_and_rows(ctx):
    f32 = ggml.new_tensor_3d(ctx, Type.F32, 64, 4, 2)
    f16 = ggml.new_tensor_3d(ctx, Type.F16, 64, 4, 2)
    row = ggml.new_tensor_1d(ctx, Type.F32, 64)
    assert supports(ggml.add(ctx, f32, row)) and supports(ggml.mul(ctx, f32, row))
    assert supports(ggml.div(ctx, ggml.permute(ctx, f32, 1, 0, 2, 3), ggml.new_tensor_1d(ctx, Type.F32, 4)))
    assert not supports(ggml.add(ctx, f16, ggml.new_tensor_1d(ctx, Type.F16, 64)))     # F32 only
    assert supports(ggml.scale(ctx, f32, 0.5)) and not supports(ggml.scale(ctx, f16, 0.5))
    for x in (f32, f16):
        assert supports(ggml.silu(ctx, x)) and supports(ggml.gelu(ctx, x)) and supports(ggml.swiglu(ctx, x))
        assert not supports(ggml.gelu_erf(ctx, x)) and not supports(ggml.relu(ctx, x))
    assert not supports(ggml.silu(ctx, ggml.view_2d(ctx, f32, 32, 4, f32.nb[1], 0)))      # rows with gaps
    assert supports(ggml.geglu_split(ctx, f32, f32)) and supports(ggml.geglu(ctx, f16))          # GELU tanh
    assert not supports(ggml.geglu_erf_split(ctx, f32, f32)) and not supports(ggml.reglu(ctx, f32))
    for op in (ggml.norm, ggml.rms_norm):
        assert supports(op(ctx, f32, 1e-5)) and not supports(op(ctx, f16, 1e-5))
        assert supports(op(ctx, ggml.view_2d(ctx, f32, 32, 4, f32.nb[1], 0), 1e-5))          # strided rows
    assert not supports(ggml.sum_rows(ctx, f32)) and not supports(ggml.concat(ctx, f32, f32, 0))


def test_supports_rope_softmax_get_rows(ctx):
    pos = ggml.new_tensor_1d(ctx, Type.I32, 2)
    ff = ggml.new_tensor_1d(ctx, Type.F32, 32)
    for type_ in (Type.F32, Type.F16):
        q = ggml.new_tensor_3d(ctx, type_, 64, 4, 2)
        for mode in (0, ggml.ROPE_TYPE_NEOX):
            assert supports(ggml.rope_ext(ctx, q, pos, ff, 64, mode, 0, 1e4, 1.0, 0.0, 1.0, 0.0, 0.0))
        assert not supports(ggml.rope_multi(ctx, ggml.new_tensor_3d(ctx, type_, 64, 4, 2),
                                            ggml.new_tensor_1d(ctx, Type.I32, 8), None, 64, [16, 16, 0, 0],
                                            ggml.ROPE_TYPE_MROPE, 0, 1e4, 1.0, 0.0, 1.0, 0.0, 0.0))
    s = ggml.new_tensor_3d(ctx, Type.F32, 10, 3, 4)
    for mtype in (Type.F32, Type.F16):
        assert supports(ggml.soft_max_ext(ctx, s, ggml.new_tensor_2d(ctx, mtype, 10, 3), 0.3, 8.0))
    sm = ggml.soft_max(ctx, s)
    ggml.soft_max_add_sinks(sm, ggml.new_tensor_1d(ctx, Type.F32, 4))
    assert supports(sm)
    ids = ggml.new_tensor_1d(ctx, Type.I32, 3)
    for type_ in ggml.Type:
        if type_ in (Type.Q8_1, Type.Q8_K, Type.I8, Type.I16):
            continue
        node = ggml.get_rows(ctx, ggml.new_tensor_2d(ctx, type_, 256, 5), ids)
        assert supports(node) == (type_ in (Type.F32, Type.F16, Type.BF16, Type.I32, Type.Q4_0, Type.Q4_1, Type.Q5_0,
                                            Type.Q5_1, Type.Q8_0)), type_


def test_supports_cpy_pairs(ctx):
    a = ggml.new_tensor_2d(ctx, Type.F32, 64, 4)
    floats = (Type.F32, Type.F16, Type.BF16)
    for t in floats:
        for u in floats:
            src = ggml.new_tensor_2d(ctx, t, 64, 4)
            assert supports(ggml.cpy(ctx, ggml.transpose(ctx, src), ggml.new_tensor_2d(ctx, u, 4, 64)))
    for q in (Type.Q8_0, Type.Q4_0):
        assert supports(ggml.cast(ctx, a, q))
        assert supports(ggml.cast(ctx, ggml.new_tensor_2d(ctx, q, 64, 4), Type.F32))
        assert not supports(ggml.cast(ctx, ggml.new_tensor_2d(ctx, q, 64, 4), Type.F16))
    a256 = ggml.new_tensor_2d(ctx, Type.F32, 256, 4)
    for q in (Type.Q4_1, Type.Q4_K, Type.Q6_K):
        assert not supports(ggml.cast(ctx, a256, q))
    q4k = ggml.new_tensor_2d(ctx, Type.Q4_K, 256, 4)
    assert supports(ggml.dup(ctx, q4k))                                   # same type, contiguous: memcpy
    big = ggml.new_tensor_2d(ctx, Type.Q4_K, 256, 8)
    assert not supports(ggml.cont(ctx, ggml.view_2d(ctx, big, 256, 4, 2 * big.nb[1], 0)))  # every other row
    i = ggml.new_tensor_2d(ctx, Type.I32, 8, 3)
    assert supports(ggml.cont(ctx, ggml.transpose(ctx, i)))
    assert not supports(ggml.cast(ctx, i, Type.F32))


def test_supports_mul_mat(ctx):
    y1 = ggml.new_tensor_2d(ctx, Type.F32, 256, 1)
    y64 = ggml.new_tensor_2d(ctx, Type.F32, 256, 64)
    claimed = (Type.F32, Type.F16, Type.Q4_0, Type.Q4_1, Type.Q5_0, Type.Q5_1, Type.Q8_0, Type.Q2_K, Type.Q3_K,
               Type.Q4_K, Type.Q5_K, Type.Q6_K)
    for type_ in ggml.Type:
        if type_ in (Type.Q8_1, Type.Q8_K):
            continue                                  # activations' formats, never weights
        w = ggml.new_tensor_2d(ctx, type_, 256, 32)
        for y in (y1, y64):
            assert supports(ggml.mul_mat(ctx, w, y)) == (type_ in claimed), (type_, y.ne[1])
    w16 = ggml.new_tensor_2d(ctx, Type.F16, 256, 32)
    assert not supports(ggml.mul_mat(ctx, w16, ggml.new_tensor_2d(ctx, Type.F16, 256, 4)))  # src1 F32 only
    a = ggml.new_tensor_3d(ctx, Type.F32, 256, 8, 4)
    assert supports(ggml.mul_mat(ctx, ggml.permute(ctx, a, 0, 2, 1, 3), ggml.permute(ctx, a, 0, 2, 1, 3)))
    cols = ggml.view_2d(ctx, ggml.new_tensor_2d(ctx, Type.F32, 512, 4), 256, 4, 2048, 4)   # rows off by 4 bytes
    assert supports(ggml.mul_mat(ctx, w16, cols))
    odd = ggml.view_2d(ctx, ggml.new_tensor_1d(ctx, Type.F32, 2000), 256, 2, 1022, 0)       # nb1 not 4-aligned
    assert not supports(ggml.mul_mat(ctx, w16, odd))


def test_supports_refuses_a_source_on_another_gpu(ctx):
    a = ggml.new_tensor_1d(ctx, Type.F32, 8)
    node = ggml.scale(ctx, a, 2.0)
    assert supports(node)
    a.buffer = SimpleNamespace(buft=ggml.backends.cuda.backend.CUDABufferType(None, 1))       # as if placed on CUDA1
    assert not ggml.backends.cuda.backend.cuda_supports_op(node, 0) and ggml.backends.cuda.backend.cuda_supports_op(node, 1)
    a.buffer = None


def test_view_ops_need_no_kernel(ctx):
    a = ggml.new_tensor_2d(ctx, Type.Q4_K, 256, 4)
    for node in (ggml.reshape_1d(ctx, a, 1024), ggml.view_1d(ctx, a, 256, 0), ggml.transpose(ctx, a),
                 ggml.permute(ctx, a, 1, 0, 2, 3)):
        assert supports(node)


def test_offload_batch_size_follows_ggml(ctx):
    w = ggml.new_tensor_2d(ctx, Type.Q4_0, 256, 32)
    for n, want in ((1, False), (31, False), (32, True), (64, True)):
        node = ggml.mul_mat(ctx, w, ggml.new_tensor_2d(ctx, Type.F32, 256, n))
        assert ggml.backends.cuda.backend.cuda_op_batch_size(node) == n and (ggml.backends.cuda.backend.cuda_op_batch_size(node) >= 32) == want
    assert ggml.backends.cuda.backend.cuda_op_batch_size(ggml.get_rows(ctx, w, ggml.new_tensor_1d(ctx, Type.I32, 100))) == 0
    q = ggml.new_tensor_3d(ctx, Type.F32, 64, 8, 40)
    assert ggml.backends.cuda.backend.cuda_op_batch_size(ggml.rope(ctx, q, ggml.new_tensor_1d(ctx, Type.I32, 40), 64, 0)) == 40
    assert ggml.backends.cuda.backend.cuda_op_batch_size(ggml.rms_norm(ctx, q, 1e-5)) == 8 * 40


# ---------------------------------------------------------------------------------------------
# The buffer type's sizes (no GPU needed to ask)
# ---------------------------------------------------------------------------------------------

def test_alloc_size_pads_the_last_row_of_quantized_tensors_to_512(ctx):
    buft = ggml.backends.cuda.backend.CUDABufferType(None, 0)
    assert buft.get_name() == "CUDA0" and buft.get_alignment() == 128 and not buft.is_host()
    cases = [(Type.Q4_0, 4096, 0), (Type.Q4_0, 4064, 18), (Type.Q8_0, 32, 15 * 34), (Type.Q4_K, 256, 144),
             (Type.Q6_K, 768, 210), (Type.F32, 100, 0), (Type.F16, 4064, 0), (Type.I32, 7, 0)]
    for type_, ne0, pad in cases:
        t = ggml.new_tensor_2d(ctx, type_, ne0, 3)
        assert ggml.backend_buft_get_alloc_size(buft, t) == ggml.nbytes(t) + pad, (type_, ne0)
    q = ggml.new_tensor_2d(ctx, Type.Q4_0, 4064, 3)
    v = ggml.view_2d(ctx, q, 4064, 2, q.nb[1], q.nb[1])                    # a view is sized the same way
    assert buft.get_alloc_size(v) == ggml.nbytes(v) + 18


def test_alloc_size_refuses_blocks_that_are_not_dense(ctx):
    q = ggml.new_tensor_2d(ctx, Type.Q8_0, 64, 4)
    q.nb = [q.nb[0] * 2] + list(q.nb[1:])
    with pytest.raises(GGMLError, match="nb\\[0\\] = 68, element size 34"):
        ggml.backends.cuda.backend.cuda_alloc_size(q)


def test_the_pinned_host_buffer_type_is_host_memory():
    buft = ggml.backends.cuda.backend.CUDAHostBufferType(None)
    assert buft.get_name() == "CUDA_Host" and buft.is_host() and buft.get_alignment() == ggml.backend_impl.TENSOR_ALIGNMENT


# ---------------------------------------------------------------------------------------------
# Without cupy or a GPU: reported absent, never an import error
# ---------------------------------------------------------------------------------------------

def test_importing_ggml_lite_does_not_import_cupy():
    code = "import sys, ggml_lite; print('cupy' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr


def test_only_the_cuda_backend_imports_cupy():
    for p in (ROOT / "ggml_lite").rglob("*.py"):
        if "cuda" not in p.relative_to(ROOT / "ggml_lite").parts[:2]:
            assert not re.search(r"(import|from)\s+cupy|import_module\(.cupy", p.read_text()), f"{p} imports cupy"
    text = (ck.KERNEL_DIR / "backend.py").read_text() + (ck.KERNEL_DIR / "kernels.py").read_text()
    assert re.findall(r"^\s*(?:import|from) cupy", text, re.M) == ["    import cupy"]   # only in import_cupy


@pytest.mark.skipif(_cuda_here(), reason="this machine has cupy and a CUDA device")
def test_score_is_zero_and_the_reason_is_logged(caplog):
    ok, why = ggml.backends.cuda.backend.cuda_availability()
    assert not ok and ("cupy is not installed" in why or "no CUDA device" in why)
    with caplog.at_level(logging.DEBUG, logger="ggml_lite"):
        assert cb.ggml_backend_score() == 0
    assert why in caplog.text
    assert ggml.backend_cuda_get_device_count() == 0
    with pytest.raises(GGMLError, match="the CUDA backend cannot run here"):
        ggml.backend_cuda_init(0)


@pytest.mark.skipif(_cuda_here(), reason="this machine has cupy and a CUDA device")
def test_load_all_skips_cuda_and_says_why(caplog):
    with caplog.at_level(logging.DEBUG, logger="ggml_lite"):
        ggml.backend_load_all()
    assert ggml.backend_reg_by_name("CUDA") is None and ggml.backend_reg_by_name("CPU") is not None
    assert "CUDA backend: not available" in caplog.text
    assert "ggml_lite.backends.cuda.backend is not supported on this system" in caplog.text


def test_a_launch_refuses_python_numbers():
    with pytest.raises(GGMLError, match="pass numpy scalars"):
        ck.cuda_launch(lambda *a, **k: None, (1,), (1,), (np.int32(1), 3))


# ---------------------------------------------------------------------------------------------
# The mat-vec's arithmetic, emulated on the CPU: quantize_q8_1 and each vec_dot transcribed from
# mmvq.cu (int32 words, dp4a, the blocks' scales), summed over the kernel's thread loop, must give
# the dot product of the dequantized row with the activations
# ---------------------------------------------------------------------------------------------

def _i32(b, i):
    return int.from_bytes(bytes(b[4 * i:4 * i + 4]), "little", signed=True)


def _lanes(x):
    return [((x >> (8 * k)) & 0xFF) - (256 if (x >> (8 * k)) & 0x80 else 0) for k in range(4)]


def _dp4a(a, b, c):
    return c + sum(p * q for p, q in zip(_lanes(a), _lanes(b)))


def _vsubss4(a, b):
    r = 0
    for k, (p, q) in enumerate(zip(_lanes(a), _lanes(b))):
        r |= (max(-128, min(127, p - q)) & 0xFF) << (8 * k)
    return r - (1 << 32) if r & 0x80000000 else r


def _f16(b, off):
    return float(np.frombuffer(bytes(b[off:off + 2]), np.float16)[0])


def _quantize_q8_1(y):
    """quantize.cu: per 32 values d = amax/127, q = roundf(x/d), s = the values' sum; d, s as F16."""
    blocks = []
    for blk in y.reshape(-1, 32).astype(np.float32):
        amax = np.float32(np.max(np.abs(blk)))
        d = amax / np.float32(127)
        q = np.zeros(32, np.int8) if amax == 0 else (np.sign(blk / d) * np.floor(np.abs(blk / d) + 0.5)).astype(np.int8)
        blocks.append((float(np.float16(d)), float(np.float16(blk.sum())), q.tobytes()))
    return blocks


def _vd_q4_0(row, y, yb, kbx, iqs):
    b = row[18 * kbx:18 * kbx + 18]
    d8, s8, q8 = y[yb]
    sumi = 0
    for i in range(2):
        v = _i32(b[2:], iqs + i)
        sumi = _dp4a(v & 0x0F0F0F0F, _i32(q8, iqs + i), sumi)
        sumi = _dp4a((v >> 4) & 0x0F0F0F0F, _i32(q8, iqs + i + 4), sumi)
    return _f16(b, 0) * (sumi * d8 - (8 * 2 / 4) * s8)


def _vd_q8_0(row, y, yb, kbx, iqs):
    b = row[34 * kbx:34 * kbx + 34]
    d8, _, q8 = y[yb]
    sumi = sum(_dp4a(_i32(b[2:], iqs + i), _i32(q8, iqs + i), 0) for i in range(2))
    return _f16(b, 0) * d8 * sumi


def _scale_min_k4_pair(packed, j):
    """mmvq.cu's scale_min_k4_pair: the scales and mins of sub-blocks 2j, 2j + 1 from the 12 bytes."""
    scales = [int.from_bytes(bytes(packed[2 * k:2 * k + 2]), "little") for k in range(6)]
    if j < 2:
        aux = [scales[j] & 0x3f3f, scales[j + 2] & 0x3f3f]
    else:
        aux = [((scales[j + 2] >> 0) & 0x0f0f) | ((scales[j - 2] & 0xc0c0) >> 2),
               ((scales[j + 2] >> 4) & 0x0f0f) | ((scales[j] & 0xc0c0) >> 2)]
    return [aux[0] & 0xFF, aux[0] >> 8], [aux[1] & 0xFF, aux[1] >> 8]


def _vd_q4_K(row, y, yb, kbx, iqs):
    b = row[144 * kbx:144 * kbx + 144]
    bq8 = 2 * ((iqs // 2) // 4)
    qs = b[16:]
    v0, v1 = _i32(qs, (16 * bq8 + 4 * ((iqs // 2) % 4)) // 4), _i32(qs, (16 * bq8 + 4 * ((iqs // 2) % 4)) // 4 + 4)
    sc, m = _scale_min_k4_pair(b[4:16], bq8 // 2)
    sumf_d = sumf_m = 0.0
    for i in range(2):
        d8, _, q8 = y[yb + bq8 + i]
        u0, u1 = _i32(q8, (iqs // 2) % 4), _i32(q8, (iqs // 2) % 4 + 4)
        dot1 = _dp4a((v1 >> (4 * i)) & 0x0F0F0F0F, u1, _dp4a((v0 >> (4 * i)) & 0x0F0F0F0F, u0, 0))
        dot2 = _dp4a(0x01010101, u1, _dp4a(0x01010101, u0, 0))
        sumf_d += d8 * (dot1 * sc[i])
        sumf_m += d8 * (dot2 * m[i])
    return _f16(b, 0) * sumf_d - _f16(b, 2) * sumf_m


def _vd_q6_K(row, y, yb, kbx, iqs):
    b = row[210 * kbx:210 * kbx + 210]
    ql, qh, scales = b[0:128], b[128:192], np.frombuffer(bytes(b[192:208]), np.int8)
    bq8 = 2 * 2 * (iqs // 16) + (iqs % 16) // 8
    scale_offset = 8 * (iqs // 16) + (iqs % 16) // 4
    vh_shift = 2 * ((iqs % 16) // 8)
    vl = _i32(ql, iqs)
    vh = _i32(qh, 8 * (iqs // 16) + iqs % 8) >> vh_shift
    sumf = 0.0
    for i in range(2):
        d8, _, q8 = y[yb + bq8 + 2 * i]
        vil = (vl >> (4 * i)) & 0x0F0F0F0F
        vih = ((vh >> (4 * i)) << 4) & 0x30303030
        vi = _vsubss4(vil | vih, 0x20202020)
        sumf += d8 * (_dp4a(vi, _i32(q8, iqs % 8), 0) * int(scales[scale_offset + 4 * i]))
    return _f16(b, 208) * sumf


def _q5_dp4a(vl, vh, u0, u1, sumi):
    vi0 = (vl & 0x0F0F0F0F) | ((vh << 4) & 0x10) | ((vh << 11) & 0x1000) | ((vh << 18) & 0x100000) \
        | ((vh << 25) & 0x10000000)
    vi1 = ((vl >> 4) & 0x0F0F0F0F) | ((vh >> 12) & 0x10) | ((vh >> 5) & 0x1000) | ((vh << 2) & 0x100000) \
        | ((vh << 9) & 0x10000000)
    return _dp4a(vi1, u1, _dp4a(vi0, u0, sumi))


def _vd_q5_0(row, y, yb, kbx, iqs):
    b = row[22 * kbx:22 * kbx + 22]
    d8, s8, q8 = y[yb]
    sumi = 0
    for i in range(2):
        sumi = _q5_dp4a(_i32(b[6:], iqs + i), _i32(b[2:6], 0) >> (4 * (iqs + i)), _i32(q8, iqs + i),
                        _i32(q8, iqs + i + 4), sumi)
    return _f16(b, 0) * (sumi * d8 - (16 * 2 // 4) * s8)


def _vd_q5_1(row, y, yb, kbx, iqs):
    b = row[24 * kbx:24 * kbx + 24]
    d8, s8, q8 = y[yb]
    sumi = 0
    for i in range(2):
        sumi = _q5_dp4a(_i32(b[8:], iqs + i), _i32(b[4:8], 0) >> (4 * (iqs + i)), _i32(q8, iqs + i),
                        _i32(q8, iqs + i + 4), sumi)
    return sumi * _f16(b, 0) * d8 + _f16(b, 2) * s8 / (4 // 2)



def _vd_q4_1(row, y, yb, kbx, iqs):
    b = row[20 * kbx:20 * kbx + 20]
    d8, s8, q8 = y[yb]
    sumi = 0
    for i in range(2):
        v = _i32(b[4:], iqs + i)
        sumi = _dp4a(v & 0x0F0F0F0F, _i32(q8, iqs + i), sumi)
        sumi = _dp4a((v >> 4) & 0x0F0F0F0F, _i32(q8, iqs + i + 4), sumi)
    return sumi * _f16(b, 0) * d8 + _f16(b, 2) * s8 / (4 // 2)


def _vd_q2_K(row, y, yb, kbx, iqs):
    b = row[84 * kbx:84 * kbx + 84]
    scales, qs = b[0:16], b[16:80]
    bq8, scale_offset = 4 * (iqs // 8), iqs - iqs % 8 + (iqs % 8) // 4
    v = _i32(qs, iqs)
    sumf_d = sumf_m = 0.0
    for i in range(4):
        d8, _, q8 = y[yb + bq8 + i]
        u = _i32(q8, iqs % 8)
        sc = int(scales[scale_offset + 2 * i])
        sumf_d += d8 * (_dp4a((v >> (2 * i)) & 0x03030303, u, 0) * (sc & 0xF))
        sumf_m += d8 * _dp4a((sc >> 4) * 0x01010101, u, 0)
    return _f16(b, 80) * sumf_d - _f16(b, 82) * sumf_m


def _vd_q3_K(row, y, yb, kbx, iqs):
    b = row[110 * kbx:110 * kbx + 110]
    hmask, qs, scales = b[0:32], b[32:96], b[96:108]
    bq8, scale_offset = 4 * (iqs // 8), iqs - iqs % 8 + (iqs % 8) // 4
    vl, vh = _i32(qs, iqs), ~_i32(hmask, iqs % 8) >> bq8
    sumf = 0.0
    for i in range(4):
        d8, _, q8 = y[yb + bq8 + i]
        isc = scale_offset + 2 * i
        sc = (((int(scales[isc % 8]) >> (4 * (isc // 8))) & 0xF)
              | (((int(scales[8 + isc % 4]) >> (2 * (isc // 4))) & 3) << 4)) - 32
        vi = _vsubss4((vl >> (2 * i)) & 0x03030303, ((vh >> i) << 2) & 0x04040404)
        sumf += d8 * (_dp4a(vi, _i32(q8, iqs % 8), 0) * sc)
    return _f16(b, 108) * sumf


def _vd_q5_K(row, y, yb, kbx, iqs):
    b = row[176 * kbx:176 * kbx + 176]
    qh, qs = b[16:48], b[48:176]
    bq8 = 2 * ((iqs // 2) // 4)
    w = (16 * bq8 + 4 * ((iqs // 2) % 4)) // 4
    vl0, vl1 = _i32(qs, w), _i32(qs, w + 4)
    vh0, vh1 = _i32(qh, (iqs // 2) % 4) >> bq8, _i32(qh, (iqs // 2) % 4 + 4) >> bq8
    sc, m = _scale_min_k4_pair(b[4:16], bq8 // 2)
    sumf_d = sumf_m = 0.0
    for i in range(2):
        d8, _, q8 = y[yb + bq8 + i]
        u0, u1 = _i32(q8, (iqs // 2) % 4), _i32(q8, (iqs // 2) % 4 + 4)
        v0i = ((vl0 >> (4 * i)) & 0x0F0F0F0F) | (((vh0 >> i) << 4) & 0x10101010)
        v1i = ((vl1 >> (4 * i)) & 0x0F0F0F0F) | (((vh1 >> i) << 4) & 0x10101010)
        sumf_d += d8 * (_dp4a(v0i, u0, _dp4a(v1i, u1, 0)) * sc[i])
        sumf_m += d8 * (_dp4a(0x01010101, u0, _dp4a(0x01010101, u1, 0)) * m[i])
    return _f16(b, 0) * sumf_d - _f16(b, 2) * sumf_m


_VEC_DOT = {Type.Q4_0: _vd_q4_0, Type.Q4_1: _vd_q4_1, Type.Q5_0: _vd_q5_0, Type.Q5_1: _vd_q5_1, Type.Q8_0: _vd_q8_0,
            Type.Q2_K: _vd_q2_K, Type.Q3_K: _vd_q3_K, Type.Q4_K: _vd_q4_K, Type.Q5_K: _vd_q5_K,
            Type.Q6_K: _vd_q6_K}
_HALF_SCALES = {Type.Q2_K: (80, 82), Type.Q3_K: (108,), Type.Q5_K: (0, 2)}   # byte offsets of d (and dmin)


def _weights(type_, w):
    """(uint8 block rows, their values) for the float rows w: ggml_lite's quantizer where it has
    one, else gguf's (Q5_0, Q5_1), else random bytes with F16 scales in [0.002, 0.02] (every byte
    pattern is a K-quant block); the values by gguf's dequantizers."""
    from gguf import GGMLQuantizationType, quants
    gt = GGMLQuantizationType(int(type_))
    if ggml.get_type_traits(type_).from_float is not None:
        rows = ggml.quantize_chunk(type_, w).reshape(w.shape[0], -1)
    elif type_ in (Type.Q5_0, Type.Q5_1):
        rows = quants.quantize(w, gt)
    else:
        rng = np.random.default_rng(w.size)
        b = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, ggml.type_size(type_)), dtype=np.uint8)
        for off in _HALF_SCALES[type_]:
            b[..., off:off + 2] = rng.uniform(0.002, 0.02, b.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        rows = b.reshape(w.shape[0], -1)
    return rows, quants.dequantize(rows, gt).astype(np.float64)


@pytest.mark.parametrize("type_", list(_VEC_DOT))
def test_mat_vec_arithmetic_emulated_equals_the_dequantized_dot(type_):
    qk, qi, vdr = _QK_QI_VDR[type_]
    n = 512
    rng = np.random.default_rng(int(type_))
    # as test-backend-ops fills tensors: uniform in [-1, 1]; 16 rows, since an NMSE over a few dots
    # is noisy (the activations' Q8_1 rounding, and the offset terms taken with their unrounded sum)
    w = rng.uniform(-1, 1, (16, n)).astype(np.float32)
    x = rng.uniform(-1, 1, n).astype(np.float32)
    rows, values = _weights(type_, w)
    want = values @ x
    y = _quantize_q8_1(x)
    _, (warp, nwarps) = ck.mmvq_launch_dims(1, 16, 1, 1)
    blocks_per_iter = vdr * nwarps * warp // qi
    got = []
    for r in range(16):
        total = 0.0
        for tid in range(nwarps * warp):
            for kbx in range(tid // (qi // vdr), n // qk, blocks_per_iter):
                total += _VEC_DOT[type_](rows[r], y, kbx * qk // 32, kbx, vdr * (tid % (qi // vdr)))
        got.append(total)
    err = np.sum((np.array(got) - want) ** 2) / np.sum(want ** 2)
    assert err < 5e-4, (type_, got, want)


def _emulate_mul_mat_vec_q(type_, name, grid, block, args, x_bytes, y_blocks, dst_size):
    """mul_mat_vec_q's indexing over the whole grid, with the vec_dot emulations: the launcher's
    strides and ratios, read from its captured arguments, place every product."""
    (_, _, _, ncols_x, nrows_x, stride_row_x, stride_col_y, stride_col_dst, channel_ratio, stride_channel_x,
     stride_channel_y, stride_channel_dst, sample_ratio, stride_sample_x, stride_sample_y, stride_sample_dst) = map(int, args)
    qk, qi, vdr = _QK_QI_VDR[type_]
    ncols_dst = int(name.rsplit("_", 1)[1])
    warp, nwarps = block
    rows_per_block = 1 if ncols_dst == 1 else 2
    blocks_per_iter = vdr * nwarps * warp // qi
    dst = np.full(dst_size, np.nan)
    for bx in range(grid[0]):
        for channel_dst in range(grid[1]):
            for sample_dst in range(grid[2]):
                row0 = rows_per_block * bx
                y0 = sample_dst * stride_sample_y + channel_dst * stride_channel_y
                kbx_offset = (sample_dst // sample_ratio) * stride_sample_x + (channel_dst // channel_ratio) * stride_channel_x \
                    + row0 * stride_row_x
                tmp = np.zeros((ncols_dst, rows_per_block))
                for tid in range(nwarps * warp):
                    for kbx in range(tid // (qi // vdr), ncols_x // qk, blocks_per_iter):
                        for j in range(ncols_dst):
                            for i in range(rows_per_block):
                                if rows_per_block > 1 and row0 + i >= nrows_x:
                                    continue
                                tmp[j, i] += _VEC_DOT[type_](x_bytes, y_blocks, y0 + j * stride_col_y + kbx * qk // 32,
                                                             kbx_offset + i * stride_row_x + kbx, vdr * (tid % (qi // vdr)))
                base = sample_dst * stride_sample_dst + channel_dst * stride_channel_dst + row0
                for j in range(ncols_dst):
                    for lane in range(rows_per_block):
                        if row0 + lane < nrows_x:
                            dst[base + j * stride_col_dst + lane] = tmp[j, lane]
    return dst


@pytest.mark.parametrize("type_", [Type.Q4_0, Type.Q5_1, Type.Q3_K, Type.Q6_K])
def test_mat_vec_launch_places_every_product(ptx, ctx, type_):
    """Weights [256, 5 rows, 2 channels] broadcast over 4 channels of 3 columns (channel_ratio 2):
    the emulated grid with the launcher's own arguments gives ggml's mul_mat, every value written."""
    ne00, ne01, ne02, ncols, ne12 = 256, 5, 2, 3, 4
    w = ggml.new_tensor_3d(ctx, type_, ne00, ne01, ne02)
    y = ggml.new_tensor_3d(ctx, Type.F32, ne00, ncols, ne12)
    node = ggml.mul_mat(ctx, w, y)
    (_, q_grid, _, q_args), (name, grid, block, args) = _launch(ptx, ck.cuda_op_mul_mat, node)
    rng = np.random.default_rng(7)
    wf = rng.standard_normal((ne02, ne01, ne00)).astype(np.float32)
    yf = rng.standard_normal((ne12, ncols, ne00)).astype(np.float32)
    x_rows, wd = _weights(type_, wf.reshape(-1, ne00))
    x_bytes = x_rows.reshape(-1)
    ne10_padded = int(q_args[6])
    padded = np.zeros((ne12, ncols, ne10_padded), np.float32)
    padded[..., :ne00] = yf                                    # quantize_q8_1's layout: padded columns
    y_blocks = _quantize_q8_1(padded.reshape(-1))
    got = _emulate_mul_mat_vec_q(type_, name, grid, block, args, x_bytes, y_blocks, ggml.nelements(node))
    wd = wd.reshape(ne02, ne01, ne00)
    want = np.einsum("cri,cki->ckr", wd[np.arange(ne12) // (ne12 // ne02)], yf).reshape(-1)
    assert not np.isnan(got).any(), "a result was never written"
    assert np.sum((got - want) ** 2) / np.sum(want ** 2) < 5e-4


# ---------------------------------------------------------------------------------------------
# The Python around the kernels, run against a stand-in for cupy: host memory plays device
# memory, copies are memmoves, kernels record their launches and do nothing, matmul is numpy's.
# What this proves: buffers, streams, events, copies, the registry, the dispatch and the cuBLAS
# path's arithmetic work as written. What it cannot: any kernel's result (the GPU run does that).
# ---------------------------------------------------------------------------------------------

import ctypes  # noqa: E402
import types as _types  # noqa: E402


class _FakeArray(np.ndarray):
    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


def _fake_cupy(launches, entries=None):
    """entries ({file: _entries(ptx)}): check every launch against the PTX as FakeContext does."""
    class CUDARuntimeError(RuntimeError):
        pass

    keep = []

    def host_array(ptr, shape, dtype, strides=None):
        dtype = np.dtype(dtype)
        span = 1 + sum((n - 1) * abs(s) for n, s in zip(shape, strides)) if strides else int(np.prod(shape)) * dtype.itemsize
        raw = (ctypes.c_char * max(span + dtype.itemsize, 1)).from_address(ptr)
        return np.ndarray(shape, dtype, buffer=raw, strides=strides).view(_FakeArray)

    class Memory:
        def __init__(self, size):
            self._a = np.zeros(size + 256, np.uint8)
            self.ptr = self._a.ctypes.data + (-self._a.ctypes.data) % 256

    from ggml_lite.backends.cuda.emu import _Context as Ctx    # device, stream and event that do nothing

    class RawModule:
        def __init__(self, code, options=()):
            assert any(o.startswith("-I") for o in options)

        def get_function(self, name):
            if entries is not None:
                file = next((f for f, e in entries.items() if name in e), None)
                assert file is not None, f"no kernel file defines {name}"
                recorder = SimpleNamespace(launches=[])
                checked = _FakeKernel(recorder, file, name, *entries[file][name])
            else:
                checked = None

            def kernel(grid, block, args, shared_mem=0):
                if checked is not None:
                    checked(grid, block, args, shared_mem)
                launches.append(name)
            return kernel

    def pinned(n):                           # page-aligned, as cudaHostAlloc's memory is
        raw = bytearray(n + 4096)
        off = (-ctypes.addressof((ctypes.c_char * len(raw)).from_buffer(raw))) % 4096
        return memoryview(raw)[off:off + n]

    def empty(shape, dtype=np.float32):
        a = np.empty(shape, dtype).view(_FakeArray)
        keep.append(a)
        return a

    rt = _types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError, getDeviceCount=lambda: 1, memGetInfo=lambda: (1 << 30, 2 << 30),
        getDeviceProperties=lambda i: {"name": b"Stand-in GPU", "integrated": 0, "pciBusID": 3,
                                       "pciDeviceID": 0, "pciDomainID": 0},
        memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n),
        memcpyPeerAsync=lambda dst, dd, src, sd, n, stream: ctypes.memmove(dst, src, n),
        memsetAsync=lambda ptr, v, n, stream: ctypes.memset(ptr, v, n),
        streamSynchronize=lambda s: None)
    cuda = _types.SimpleNamespace(
        runtime=rt, Device=Ctx, Stream=Ctx, Event=Ctx, Memory=Memory, get_current_stream=lambda: Ctx(),
        alloc_pinned_memory=pinned,
        UnownedMemory=lambda ptr, size, owner, device_id: SimpleNamespace(ptr=ptr),
        MemoryPointer=lambda mem, off: SimpleNamespace(ptr=mem.ptr + off))
    fake = _types.ModuleType("cupy")
    fake.cuda, fake.RawModule, fake.empty, fake.matmul = cuda, RawModule, empty, np.matmul
    fake.ndarray = lambda shape, dtype, memptr, strides=None: host_array(memptr.ptr, shape, dtype, strides)
    return fake


@pytest.fixture
def stand_in(monkeypatch):
    launches = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(launches))
    for f in (ck._raw_module, ck._kernel):
        f.cache_clear()
    monkeypatch.setattr(cb, "_CUDA_REG", None)
    monkeypatch.setattr(cb, "_CUDA_HOST_BUFFER_TYPE", None)
    yield launches
    for f in (ck._raw_module, ck._kernel):
        f.cache_clear()
    for r, _ in list(ggml.backend._registry.backends):
        if r.get_name() == "CUDA":
            ggml.backend_unload(r)


def test_stand_in_registry_device_and_props(stand_in, caplog):
    assert ggml.backends.cuda.backend.cuda_availability() == (True, "")
    with caplog.at_level(logging.DEBUG, logger="ggml_lite"):
        ggml.backend_load_all()
    reg = ggml.backend_reg_by_name("CUDA")
    assert reg is not None and ggml.backend_reg_dev_count(reg) == 1
    dev = ggml.backend_dev_by_name("CUDA0")
    assert dev.reg is reg and ggml.backend_dev_type(dev) == ggml.BackendDevType.GPU
    props = ggml.backend_dev_get_props(dev)
    assert props.description == "Stand-in GPU" and props.device_id == "0000:03:00.0"
    assert props.caps.async_ and props.caps.events and not props.caps.buffer_from_host_ptr
    assert ggml.backend_dev_buffer_type(dev).get_name() == "CUDA0"
    assert ggml.backend_dev_host_buffer_type(dev).get_name() == "CUDA_Host"
    assert ggml.backend_dev_supports_buft(dev, ggml.backend_dev_buffer_type(dev))
    assert not ggml.backend_dev_supports_buft(dev, ggml.backend_cpu_buffer_type())
    assert not ggml.backend_dev_supports_buft(dev, ggml.backend_cuda_host_buffer_type())   # not integrated
    backend = ggml.backend_dev_init(dev)
    assert ggml.backend_is_cuda(backend) and not ggml.backend_is_cuda(ggml.backend_cpu_init())
    assert ggml.backend_name(backend) == "CUDA0"


def test_stand_in_buffers_copies_and_padding(stand_in):
    cuda = ggml.backend_cuda_init(0)
    c = ggml.init(mem_size=8 * ggml.tensor_overhead(), no_alloc=True)
    q = ggml.new_tensor_2d(c, Type.Q4_0, 4064, 2)
    f = ggml.new_tensor_2d(c, Type.F32, 16, 4)
    buft = ggml.backend_get_default_buffer_type(cuda)
    size = ggml.backend_alloc_ctx_tensors_from_buft_size(c, buft)
    buf = ggml.backend_buft_alloc_buffer(buft, size)
    ggml.backend_buffer_clear(buf, 0xAB)
    talloc = ggml.tallocr_new(buf)
    ggml.tallocr_alloc(talloc, q)
    ggml.tallocr_alloc(talloc, f)
    pad = ggml.backends.cuda.backend.cuda_alloc_size(q) - ggml.nbytes(q)
    assert pad == 18 and ctypes.string_at(q.data + ggml.nbytes(q), pad) == bytes(pad)   # zeroed by init_tensor
    assert ctypes.string_at(q.data, 4) == b"\xab" * 4                                    # the data is not touched
    x = np.arange(64, dtype=np.float32).reshape(4, 16)
    ggml.backend_tensor_set(f, x)
    assert np.array_equal(ggml.backend_tensor_get(f).reshape(4, 16), x)
    out = np.zeros(64, np.float32)
    ggml.backend_tensor_set_async(cuda, f, x[::-1].copy())
    ggml.backend_tensor_get_async(cuda, f, out)
    ggml.backend_synchronize(cuda)
    assert np.array_equal(out, x[::-1].reshape(-1)) and cuda._pending == []
    ggml.backend_tensor_memset(f, 0, 4, 8)
    assert np.array_equal(ggml.backend_tensor_get(f).reshape(-1)[1:3], [0, 0])
    # device to device, between two streams of the device; and through a pinned host buffer
    c2 = ggml.init(mem_size=4 * ggml.tensor_overhead(), no_alloc=True)
    g = ggml.new_tensor_2d(c2, Type.F32, 16, 4)
    h = ggml.new_tensor_2d(c2, Type.F32, 16, 4)
    buf2 = ggml.backend_alloc_ctx_tensors(c2, cuda)
    other = ggml.backend_cuda_init(0)
    ggml.backend_tensor_copy_async(other, cuda, f, g)
    assert np.array_equal(ggml.backend_tensor_get(g), ggml.backend_tensor_get(f))
    assert not cuda.cpy_tensor_async(ggml.backend_cpu_init(), f, h)                   # not CUDA: False
    c3 = ggml.init(mem_size=2 * ggml.tensor_overhead(), no_alloc=True)
    p = ggml.new_tensor_2d(c3, Type.F32, 16, 4)
    pbuf = ggml.backend_alloc_ctx_tensors_from_buft(c3, ggml.backend_cuda_host_buffer_type())
    assert ggml.backend_buffer_is_host(pbuf)
    ggml.backend_tensor_copy(g, p)                                                      # device -> pinned
    assert np.array_equal(p.numpy(), ggml.backend_tensor_get(g))         # the CPU reads it
    ggml.backend_tensor_copy(p, h)                                                      # pinned -> device
    assert np.array_equal(ggml.backend_tensor_get(h), ggml.backend_tensor_get(g))
    event = ggml.backend_event_new(ggml.backend_get_device(cuda))
    ggml.backend_event_record(event, cuda)
    ggml.backend_event_wait(other, event)
    ggml.backend_event_synchronize(event)
    ggml.backend_event_free(event)
    for b, cc in ((buf, c), (buf2, c2), (pbuf, c3)):
        ggml.backend_buffer_free(b)
        ggml.free(cc)


def test_stand_in_graph_compute_dispatches_every_op_and_cublas_computes(stand_in):
    cuda = ggml.backend_cuda_init(0)
    c = ggml.init(mem_size=64 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    w32 = ggml.new_tensor_3d(c, Type.F32, 64, 24, 2)
    w16 = ggml.new_tensor_2d(c, Type.F16, 64, 24)
    wq = ggml.new_tensor_2d(c, Type.Q4_K, 256, 8)
    x = ggml.new_tensor_3d(c, Type.F32, 64, 16, 4)
    xq = ggml.new_tensor_2d(c, Type.F32, 256, 1)
    pos = ggml.new_tensor_1d(c, Type.I32, 16)
    ids = ggml.new_tensor_1d(c, Type.I32, 3)
    p32 = ggml.mul_mat(c, w32, x)                                    # [24, 16, 4] F32 cuBLAS, broadcast
    p16 = ggml.mul_mat(c, w16, x)                                    # F16 cuBLAS
    nodes = [p32, p16, ggml.mul_mat(c, wq, xq), ggml.add(c, p32, p16), ggml.scale(c, x, 0.5),
             ggml.silu(c, x), ggml.swiglu(c, x), ggml.rms_norm(c, x, 1e-5), ggml.norm(c, x, 1e-5),
             ggml.rope(c, ggml.reshape_4d(c, x, 64, 4, 16, 1), pos, 64, 0),
             ggml.soft_max_ext(c, x, None, 0.5, 0.0), ggml.get_rows(c, w16, ids), ggml.cast(c, x, Type.F16),
             ggml.cont(c, ggml.transpose(c, x)), ggml.dup(c, x)]
    gf = ggml.new_graph(c)
    for n in nodes:
        ggml.build_forward_expand(gf, n)
    buf = ggml.backend_alloc_ctx_tensors(c, cuda)
    rng = np.random.default_rng(3)
    a32 = rng.standard_normal((2, 24, 64)).astype(np.float32)
    a16 = rng.standard_normal((24, 64)).astype(np.float16)
    xs = rng.standard_normal((4, 16, 64)).astype(np.float32)
    ggml.backend_tensor_set(w32, a32)
    ggml.backend_tensor_set(w16, a16)
    ggml.backend_tensor_set(x, xs)
    assert ggml.backend_graph_compute(cuda, gf) == ggml.Status.SUCCESS
    for kernel in ("quantize_q8_1", "mul_mat_vec_q4_K_q8_1_1", "add_f32", "scale_f32", "silu_f32", "swiglu_f32",
                   "rms_norm_f32", "norm_f32", "rope_norm_f32", "soft_max_f32_mask_f32", "get_rows_f16",
                   "cpy_f32_f16", "cpy_f32_f32"):
        assert kernel in stand_in, kernel
    want32 = np.matmul(xs.reshape(2, 2, 16, 64), a32.reshape(2, 1, 24, 64).swapaxes(-1, -2)).reshape(4, 16, 24)
    assert np.allclose(ggml.backend_tensor_get(p32).reshape(4, 16, 24), want32, atol=1e-4)
    want16 = xs.astype(np.float16).astype(np.float32) @ a16.astype(np.float32).T
    assert np.allclose(ggml.backend_tensor_get(p16).reshape(4, 16, 24), want16, rtol=1e-2, atol=5e-2)
    assert np.array_equal(ggml.backend_tensor_get(nodes[-1]).reshape(4, 16, 64), xs)   # DUP: one memcpy
    ggml.backend_buffer_free(buf)
    ggml.free(c)


def test_stand_in_refuses_host_tensors_and_unclaimed_nodes(stand_in):
    cuda = ggml.backend_cuda_init(0)
    c = ggml.init(mem_size=1 << 20)
    a = ggml.new_tensor_1d(c, Type.F32, 8)
    gf = ggml.new_graph(c)
    ggml.build_forward_expand(gf, ggml.scale(c, a, 2.0))
    with pytest.raises(GGMLError, match="is in a context.s own host memory, not in CUDA0 memory"):
        ggml.backend_graph_compute(cuda, gf)
    gf = ggml.new_graph(c)
    ggml.build_forward_expand(gf, ggml.gelu_erf(c, a))
    with pytest.raises(GGMLError, match="unsupported node"):
        ggml.backend_graph_compute(cuda, gf)
    ggml.free(c)


def test_stand_in_runs_every_claimed_harness_case(ptx, monkeypatch):
    """Each harness case the CUDA backend claims, allocated in its buffer type and computed: every
    launch of it checked against the PTX (name, arguments, grid), no launcher error on any shape."""
    B = pytest.importorskip("backend_ops_cases", reason="the harness of the cpu chapters is not here")
    launches = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(launches, {f: _entries(t) for f, t in ptx.items()}))
    for f in (ck._raw_module, ck._kernel):
        f.cache_clear()
    monkeypatch.setattr(cb, "_CUDA_REG", None)
    monkeypatch.setattr(cb, "_CUDA_HOST_BUFFER_TYPE", None)
    try:
        cuda = ggml.backend_cuda_init(0)
        claimed = 0
        with np.errstate(all="ignore"):                 # the stand-in's kernels leave garbage behind
            for case in B.make_test_cases():
                built = B.build_case(case, no_alloc=True, sentinels=False)
                try:
                    if not all(ggml.backend_supports_op(cuda, t) for t in built.ctx):
                        continue
                    claimed += 1
                    buf = ggml.backend_alloc_ctx_tensors(built.ctx, cuda)
                    assert ggml.backend_graph_compute(cuda, built.gf) == ggml.Status.SUCCESS, case.name()
                    ggml.backend_buffer_free(buf)
                finally:
                    B.free_built(built)
        assert claimed > 500 and launches
    finally:
        for f in (ck._raw_module, ck._kernel):
            f.cache_clear()


def _two_layers(c, w_bufts, n_embd, n_tok):
    """x -> [rms_norm * g, mul_mat F32, silu, mul_mat Q8_0, + residual] x 2; layer i's weights in
    a buffer of type w_bufts[i] (as llama.cpp offloads the last layers)."""
    x = ggml.new_tensor_2d(c, Type.F32, n_embd, n_tok)
    ggml.set_input(x)
    bufs, cur = [], x
    for buft in w_bufts:
        wc = ggml.init(mem_size=4 * ggml.tensor_overhead(), no_alloc=True)
        g = ggml.new_tensor_1d(wc, Type.F32, n_embd)
        a = ggml.new_tensor_2d(wc, Type.F32, n_embd, n_embd)
        b = ggml.new_tensor_2d(wc, Type.Q8_0, n_embd, n_embd)
        buf = ggml.backend_alloc_ctx_tensors_from_buft(wc, buft)
        ggml.backend_buffer_set_usage(buf, ggml.BackendBufferUsage.WEIGHTS)
        bufs.append((buf, wc))
        h = ggml.mul_mat(c, b, ggml.silu(c, ggml.mul_mat(c, a, ggml.mul(c, ggml.rms_norm(c, cur, 1e-5), g))))
        cur = ggml.add(c, cur, h)
    gf = ggml.new_graph(c)
    ggml.build_forward_expand(gf, cur)
    return gf, bufs


@pytest.mark.skipif(not hasattr(ggml, "backend_sched_new"), reason="ggml_lite has no scheduler in this checkout")
def test_stand_in_scheduler_splits_over_cuda_and_cpu(stand_in):
    """The scheduler's passes read only supports_op, offload_op and the buffer types, so the splits
    over CUDA + CPU are known without a GPU: one token -> the weights decide (CPU, then CUDA0,
    the second split taking the input and layer 0's output); 64 tokens -> every product is
    offloaded, one CUDA0 split per host-resident weight it copies (ggml starts a new split so the
    copied weights' memory can be reused)."""
    import io
    cuda, cpu = ggml.backend_cuda_init(0), ggml.backend_cpu_init()
    got = {}
    for n_tok in (1, 64):
        c = ggml.init(mem_size=64 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
        gf, bufs = _two_layers(c, [ggml.backend_cpu_buffer_type(), ggml.backend_get_default_buffer_type(cuda)], 256, n_tok)
        sched = ggml.backend_sched_new([cuda, cpu], None, 2, ggml.DEFAULT_GRAPH_SIZE, False, True)
        assert ggml.backend_sched_alloc_graph(sched, gf)
        text = io.StringIO()
        ggml.sched_passes.backend_sched_print_assignments(sched, gf, 1, False, text)
        got[n_tok] = (ggml.backend_sched_get_n_splits(sched), re.findall(r"SPLIT #\d+: (\w+) # (\d+) inputs", text.getvalue()))
        ggml.backend_sched_free(sched)
        for buf, wc in bufs:
            ggml.backend_buffer_free(buf)
            ggml.free(wc)
        ggml.free(c)
    assert got[1] == (2, [("CPU", "0"), ("CUDA0", "2")])
    assert got[64] == (4, [("CUDA0", "1")] * 4)
