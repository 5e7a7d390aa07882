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
    return ggml.cuda_availability()[0]


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
        assert grid[0] == (2 if type_ in (Type.Q4_K, Type.Q6_K) else 1)
