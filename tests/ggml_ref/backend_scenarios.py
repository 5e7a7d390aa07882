"""Contexts for backend_alloc_ctx_tensors(_from_buft), run by real ggml (backend_ref.py) and by
ggml_lite (tests/test_backend.py) with the same calls.

`build(api, name)` makes the scenario's tensors in a no_alloc context with `api` (ggml_lite, or
the GgmlPy wrapper of graph_ref.py) and returns (ctx, tensors, max_size): the tensors in creation
order and the buffer type's max_size to use (None = the CPU buffer type as it is).
"""

SCENARIOS = ["mixed", "types", "views", "max_size", "max_size_big_tensor", "empty"]


def build(api, name):
    T = api.Type
    ctx = api.init(64 * api.tensor_overhead(), None, True)
    ts = []

    def add(t, tname):
        api.set_name(t, tname)
        ts.append(t)
        return t

    max_size = None
    if name == "mixed":
        w = add(api.new_tensor_2d(ctx, T.F32, 4, 3), "w")
        add(api.new_tensor_2d(ctx, T.Q4_0, 64, 1), "q")
        add(api.new_tensor_1d(ctx, T.F16, 5), "b")
        add(api.view_1d(ctx, w, 4, 16), "w1")
    elif name == "types":
        add(api.new_tensor_2d(ctx, T.Q4_K, 256, 3), "q4k")
        add(api.new_tensor_2d(ctx, T.Q6_K, 256, 1), "q6k")
        add(api.new_tensor_3d(ctx, T.Q8_0, 64, 3, 2), "q8")
        add(api.new_tensor_1d(ctx, T.I32, 7), "pos")
        add(api.new_tensor_2d(ctx, T.BF16, 33, 3), "bf")
        add(api.new_tensor_1d(ctx, T.I8, 1), "one")
    elif name == "views":
        a = add(api.new_tensor_3d(ctx, T.F32, 8, 4, 2), "a")
        add(api.transpose(ctx, a), "at")
        add(api.view_2d(ctx, a, 4, 4, 32, 16), "cols")        # nb1 = 8 floats
        add(api.reshape_2d(ctx, a, 16, 4), "r")
        add(api.new_tensor_1d(ctx, T.F32, 3), "after")
        add(api.permute(ctx, a, 1, 0, 2, 3), "p")
    elif name == "max_size":
        max_size = 200
        for i in range(5):
            add(api.new_tensor_1d(ctx, T.F32, 20 + 3 * i), f"t{i}")
    elif name == "max_size_big_tensor":
        max_size = 100
        add(api.new_tensor_1d(ctx, T.F32, 10), "small")
        add(api.new_tensor_1d(ctx, T.F32, 100), "big")      # alone over max_size: its own buffer
        add(api.new_tensor_1d(ctx, T.F32, 5), "s2")
        add(api.new_tensor_1d(ctx, T.F32, 5), "s3")
    elif name == "empty":
        pass
    return ctx, ts, max_size
