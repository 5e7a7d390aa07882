"""Graphs computed through ggml-rpc, built with the same calls by real ggml (rpc_ref.py, through
ggml-python) and by ggml_lite (tests/test_rpc.py).

`build(api, ctx, name)` makes the scenario's tensors in the no_alloc context ctx with `api`
(ggml_lite, or rpc_ref.py's wrapper of ggml-python) and returns (inputs, out): the input tensors
by name and the output. `input_bytes(name)` gives every input's raw bytes (numpy uint8), the same
on both sides.
"""
import zlib

import numpy as np

SCENARIOS = ["axx_b", "mlp", "q8_matmul", "attention_bits", "views"]


def build(api, ctx, name):
    T = api.Type
    inputs = {}

    def inp(t, tname):
        api.set_name(t, tname)
        inputs[tname] = t
        return t

    if name == "axx_b":
        a = inp(api.new_tensor_1d(ctx, T.F32, 8), "a")
        x = inp(api.new_tensor_1d(ctx, T.F32, 8), "x")
        b = inp(api.new_tensor_1d(ctx, T.F32, 8), "b")
        out = api.add(ctx, api.mul(ctx, a, api.mul(ctx, x, x)), b)
    elif name == "mlp":
        w1 = inp(api.new_tensor_2d(ctx, T.F32, 16, 24), "w1")
        b1 = inp(api.new_tensor_1d(ctx, T.F32, 24), "b1")
        w2 = inp(api.new_tensor_2d(ctx, T.F16, 24, 8), "w2")
        x = inp(api.new_tensor_2d(ctx, T.F32, 16, 5), "x")
        h = api.gelu(ctx, api.add(ctx, api.mul_mat(ctx, w1, x), b1))
        out = api.rms_norm(ctx, api.silu(ctx, api.mul_mat(ctx, w2, h)), 1e-5)
    elif name == "q8_matmul":
        w = inp(api.new_tensor_2d(ctx, T.Q8_0, 64, 12), "w")
        x = inp(api.new_tensor_2d(ctx, T.F32, 64, 3), "x")
        out = api.scale(ctx, api.mul_mat(ctx, w, x), 0.5)
    elif name == "attention_bits":
        q = inp(api.new_tensor_3d(ctx, T.F32, 8, 2, 4), "q")           # head dim 8, 2 heads, 4 tokens
        pos = inp(api.new_tensor_1d(ctx, T.I32, 4), "pos")
        mask = inp(api.new_tensor_2d(ctx, T.F32, 4, 4), "mask")
        emb = inp(api.new_tensor_2d(ctx, T.F32, 8, 10), "emb")
        ids = inp(api.new_tensor_1d(ctx, T.I32, 4), "ids")
        r = api.rope_ext(ctx, q, pos, None, 8, 0, 0, 10000.0, 1.0, 0.0, 1.0, 0.0, 0.0)
        kq = api.mul_mat(ctx, api.cont(ctx, api.permute(ctx, r, 0, 2, 1, 3)),
                         api.cont(ctx, api.permute(ctx, r, 0, 2, 1, 3)))
        sm = api.soft_max_ext(ctx, kq, mask, 0.35, 0.0)
        rows = api.get_rows(ctx, emb, ids)
        out = api.concat(ctx, api.cpy(ctx, sm, api.new_tensor_3d(ctx, T.F16, 4, 4, 2)),
                         api.cpy(ctx, api.view_2d(ctx, rows, 4, 4, 32, 0),
                                 api.new_tensor_3d(ctx, T.F16, 4, 4, 1)), 2)
    elif name == "views":
        a = inp(api.new_tensor_3d(ctx, T.F32, 6, 4, 2), "a")
        b = inp(api.new_tensor_2d(ctx, T.F32, 4, 6), "b")
        t = api.cont(ctx, api.transpose(ctx, api.view_2d(ctx, a, 6, 4, 24, 96)))
        out = api.sub(ctx, api.swiglu_split(ctx, t, b), api.sum_rows(ctx, b))
    else:
        raise KeyError(name)
    return inputs, out


def input_bytes(name, t_name, nbytes, type_name):
    """The raw bytes of input t_name of scenario name: floats in [-1, 1), ids and positions in
    range, Q8_0 blocks with scale 1/64 (fp16) and int8 quants."""
    rng = np.random.default_rng(zlib.crc32(f"{name}/{t_name}".encode()))
    type_name = type_name.upper()
    if type_name == "I32":
        hi = 10 if t_name == "ids" else 16
        return rng.integers(0, hi, nbytes // 4, dtype=np.int32).view(np.uint8)
    if type_name == "Q8_0":
        blocks = np.zeros((nbytes // 34, 34), np.uint8)
        blocks[:, :2] = np.frombuffer(np.float16(1 / 64).tobytes(), np.uint8)
        blocks[:, 2:] = rng.integers(-127, 128, (nbytes // 34, 32), dtype=np.int8).view(np.uint8)
        return blocks.reshape(-1)
    if type_name == "F16":
        return rng.uniform(-1, 1, nbytes // 2).astype(np.float16).view(np.uint8)
    if t_name == "mask":
        m = np.triu(np.full((4, 4), -np.inf, np.float32), 1)
        return m.reshape(-1).view(np.uint8)
    return rng.uniform(-1, 1, nbytes // 4).astype(np.float32).view(np.uint8)
