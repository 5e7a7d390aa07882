"""Graphs for the graph allocator, written once and run twice (real ggml and ggml_lite).

Every scenario takes `G` (ggml's functions without the `ggml_` prefix, as in graph_scenarios.py)
and returns a dict: `ctx` (the context to keep alive), `graphs` (a list of graphs, planned one
after the other by the same allocator), and optionally `buft` (a buffer type made with custom
alignment / max_size: `(alignment, max_size)`), `n_bufs` and `node_ids`/`leaf_ids` for
`gallocr_reserve_n`, `measure_only` (only `gallocr_reserve_n_size`) and `alloc_only` (no reserve:
the first `gallocr_alloc_graph` reserves by itself). tests/ggml_ref/alloc_ref.py runs them against
real ggml and prints what gallocr decided; tests/test_alloc.py runs them against ggml_lite.
Nothing here touches tensor data.
"""
import math

import graph_scenarios

MB = 1024 * 1024


def _ctx(G, mb=8, no_alloc=True):
    return G.init(mb * MB, None, no_alloc)


def _graph(G, ctx, *roots):
    gf = G.new_graph(ctx)
    for r in roots:
        G.build_forward_expand(gf, r)
    return gf


def chain(G):
    """x -> four matmuls: no matmul can work in place, so two buffers take turns (ping-pong)."""
    ctx = _ctx(G)
    x = G.new_tensor_2d(ctx, G.Type.F32, 64, 8)
    h = x
    for _ in range(4):
        w = G.new_tensor_2d(ctx, G.Type.F32, 64, 64)
        h = G.mul_mat(ctx, w, h)
    return {"ctx": ctx, "graphs": [_graph(G, ctx, h)]}


def inplace_chain(G, flags=""):
    """Element-wise ops one after the other: each result can take over its operand's memory.

    flags: "in" marks x INPUT, "out" marks the middle result OUTPUT, "all_out" every result.
    """
    ctx = _ctx(G)
    x = G.new_tensor_2d(ctx, G.Type.F32, 100, 10)
    b = G.new_tensor_1d(ctx, G.Type.F32, 100)
    h1 = G.scale(ctx, x, 0.5)
    h2 = G.silu(ctx, h1)
    h3 = G.add(ctx, h2, b)
    h4 = G.rms_norm(ctx, h3, 1e-5)
    h5 = G.soft_max(ctx, h4)
    h6 = G.gelu(ctx, h5)
    if "in" in flags:
        G.set_input(x)
    if flags == "out":
        G.set_output(h3)
    if flags == "all_out":
        for h in (h1, h2, h3, h4, h5, h6):
            G.set_output(h)
    return {"ctx": ctx, "graphs": [_graph(G, ctx, h6)]}


def not_inplace_chain(G):
    """The same shapes through ops that cannot work in place (norm, cont, dup)."""
    ctx = _ctx(G)
    x = G.new_tensor_2d(ctx, G.Type.F32, 100, 10)
    h = G.norm(ctx, x, 1e-5)
    h = G.cont(ctx, h)
    h = G.norm(ctx, h, 1e-5)
    h = G.dup(ctx, h)
    h = G.norm(ctx, h, 1e-5)
    return {"ctx": ctx, "graphs": [_graph(G, ctx, h)]}


def diamond(G, flags=""):
    """x feeds two branches that meet again: x must live until both have read it."""
    ctx = _ctx(G)
    x = G.new_tensor_2d(ctx, G.Type.F32, 64, 16)
    a = G.silu(ctx, x)
    b = G.scale(ctx, x, 3.0)
    c = G.add(ctx, a, b)
    d = G.mul(ctx, c, x)
    e = G.gelu(ctx, d)
    if "in" in flags:
        G.set_input(x)
    if "out" in flags:
        G.set_output(a)
    return {"ctx": ctx, "graphs": [_graph(G, ctx, e)]}


def wide_diamond(G):
    """Tensors of different sizes freed out of order: best fit, block merging, tail reuse."""
    ctx = _ctx(G)
    x = G.new_tensor_2d(ctx, G.Type.F32, 32, 8)
    ws = [G.new_tensor_2d(ctx, G.Type.F32, 32, n) for n in (16, 96, 48, 8, 200)]
    hs = [G.mul_mat(ctx, w, x) for w in ws]              # [n, 8] each
    rs = [G.sum_rows(ctx, h) for h in hs]                 # [1, 8] each
    acc = rs[0]
    for i, r in enumerate(rs[1:]):
        acc = G.add(ctx, acc, r)
        if i == 1:
            acc = G.mul_mat(ctx, G.new_tensor_2d(ctx, G.Type.F32, 1, 40), acc)   # [40, 8]
            acc = G.sum_rows(ctx, acc)
    return {"ctx": ctx, "graphs": [_graph(G, ctx, acc)]}


def views(G):
    """Reshape, permute, transpose and view nodes: they own no memory but keep their source alive."""
    ctx = _ctx(G)
    T = G.Type
    x = G.new_tensor_2d(ctx, T.F32, 32, 24)
    y = G.scale(ctx, x, 2.0)
    r = G.reshape_3d(ctx, y, 8, 4, 24)
    p = G.permute(ctx, r, 1, 0, 2, 3)                    # [4, 8, 24], not contiguous
    c = G.cont(ctx, p)
    t = G.transpose(ctx, G.reshape_2d(ctx, c, 32, 24))
    ct = G.cont(ctx, t)
    v = G.view_2d(ctx, y, 16, 24, 32 * 4, 16 * 4)        # right half of y's rows
    s = G.scale(ctx, v, 0.5)                             # same layout as v: a view parent
    w = G.view_1d(ctx, ct, 100, 0)
    z = G.silu(ctx, w)
    out = G.add(ctx, G.sum_rows(ctx, s), G.sum_rows(ctx, G.cont(ctx, G.transpose(ctx, ct))))
    return {"ctx": ctx, "graphs": [_graph(G, ctx, out, z)]}


def view_inplace(G):
    """An in-place op on a full-size view of a dying tensor (the view branch of ggml's reuse rule)."""
    ctx = _ctx(G)
    x = G.new_tensor_1d(ctx, G.Type.F32, 4096)
    y = G.cont(ctx, G.silu(ctx, x))
    v = G.view_1d(ctx, y, 1024, 0)
    z = G.scale(ctx, v, 2.0)
    u = G.view_1d(ctx, G.cont(ctx, z), 512, 1024)
    out = G.gelu(ctx, u)
    return {"ctx": ctx, "graphs": [_graph(G, ctx, out)]}


def output_view(G):
    """OUTPUT on a view: its source must survive, and must not be reused in place."""
    ctx = _ctx(G)
    x = G.new_tensor_2d(ctx, G.Type.F32, 64, 8)
    y = G.cont(ctx, G.transpose(ctx, x))
    v = G.view_1d(ctx, y, 64, 0)
    G.set_output(v)
    z = G.scale(ctx, y, 2.0)
    z = G.silu(ctx, z)
    return {"ctx": ctx, "graphs": [_graph(G, ctx, v, z)]}


def late_input(G, flag=True):
    """An input that is a node (a PARAM tensor: op NONE, but listed among the nodes), read only at
    the end. With INPUT it gets memory before everything; without, when its turn comes."""
    ctx = _ctx(G)
    a = G.new_tensor_2d(ctx, G.Type.F32, 64, 32)
    h = a
    for n_in, n_out in ((64, 48), (48, 40), (40, 32)):
        h = G.mul_mat(ctx, G.new_tensor_2d(ctx, G.Type.F32, n_in, n_out), h)   # [n_out, 32]
    x = G.new_tensor_2d(ctx, G.Type.F32, 32, 32)
    G.set_param(x)
    if flag:
        G.set_input(x)
    y = G.add(ctx, h, x)
    return {"ctx": ctx, "graphs": [_graph(G, ctx, y)]}


def output_view_read(G):
    """OUTPUT on a view that a node reads: ggml frees the source after that reader anyway."""
    ctx = _ctx(G)
    x = G.new_tensor_2d(ctx, G.Type.F32, 64, 8)
    y = G.cont(ctx, G.transpose(ctx, x))
    v = G.view_1d(ctx, y, 512, 0)                         # all of y, as one row
    G.set_output(v)
    z = G.scale(ctx, v, 2.0)                              # reads the OUTPUT view
    w = G.silu(ctx, G.cont(ctx, z))
    return {"ctx": ctx, "graphs": [_graph(G, ctx, w)]}


def input_nodes(G):
    """Two INPUT nodes (PARAM tensors, expanded first) read in the opposite order: INPUT nodes are
    placed when the counting pass reaches them, not when their first reader does."""
    ctx = _ctx(G)
    T = G.Type
    a = G.new_tensor_2d(ctx, T.F32, 16, 16)
    p = G.new_tensor_2d(ctx, T.F32, 16, 16)
    q = G.new_tensor_2d(ctx, T.F32, 16, 40)
    for t in (p, q):
        G.set_param(t)
        G.set_input(t)
    z = G.mul_mat(ctx, q, a)                              # reads q first
    w = G.silu(ctx, p)                                    # then p
    return {"ctx": ctx, "graphs": [_graph(G, ctx, p, q, z, w)]}


ATT = dict(n_embd=64, n_head=4, n_tokens=12, head_dim=16)


def attention_block(G, preloaded_weights=False):
    """Self-attention as llama.cpp builds it: RMSNorm, Q/K/V, RoPE, masked softmax, output, residual.

    preloaded_weights: the weights live in a context with its own memory (as if loaded from a
    file), so the allocator plans only the activations.
    """
    T = G.Type
    n_embd, n_head, n_tokens, hd = (ATT[k] for k in ("n_embd", "n_head", "n_tokens", "head_dim"))
    ctx = _ctx(G)
    wctx = _ctx(G, 1, no_alloc=False) if preloaded_weights else ctx

    def weight(*ne):
        return (G.new_tensor_2d if len(ne) == 2 else G.new_tensor_1d)(wctx, T.F32, *ne)

    norm_w = weight(n_embd)
    wq, wk, wv, wo = (weight(n_embd, n_embd) for _ in range(4))
    x = G.new_tensor_2d(ctx, T.F32, n_embd, n_tokens)
    pos = G.new_tensor_1d(ctx, T.I32, n_tokens)
    mask = G.new_tensor_2d(ctx, T.F32, n_tokens, n_tokens)
    for t in (x, pos, mask):
        G.set_input(t)

    cur = G.mul(ctx, G.rms_norm(ctx, x, 1e-5), norm_w)
    q = G.reshape_3d(ctx, G.mul_mat(ctx, wq, cur), hd, n_head, n_tokens)
    k = G.reshape_3d(ctx, G.mul_mat(ctx, wk, cur), hd, n_head, n_tokens)
    v = G.reshape_3d(ctx, G.mul_mat(ctx, wv, cur), hd, n_head, n_tokens)
    rope = (hd, 0, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    q = G.rope_ext(ctx, q, pos, None, *rope)
    k = G.rope_ext(ctx, k, pos, None, *rope)
    q = G.permute(ctx, q, 0, 2, 1, 3)                     # [hd, n_tokens, n_head]
    k = G.permute(ctx, k, 0, 2, 1, 3)
    kq = G.mul_mat(ctx, k, q)                             # [n_tokens, n_tokens, n_head]
    kq = G.soft_max_ext(ctx, kq, mask, 1.0 / math.sqrt(hd), 0.0)
    vt = G.cont(ctx, G.permute(ctx, v, 1, 2, 0, 3))       # [n_tokens, hd, n_head]
    kqv = G.mul_mat(ctx, vt, kq)                          # [hd, n_tokens, n_head]
    cur = G.cont_2d(ctx, G.permute(ctx, kqv, 0, 2, 1, 3), n_embd, n_tokens)
    cur = G.mul_mat(ctx, wo, cur)
    out = G.add(ctx, cur, x)
    G.set_output(out)
    scenario = {"ctx": ctx, "graphs": [_graph(G, ctx, out)]}
    if preloaded_weights:
        scenario["wctx"] = wctx
    return scenario


MLP = dict(n_in=64, n_hidden=256, n_layers=4, n_tokens=16)


def mlp(G, n_tokens=None, preloaded_weights=True):
    """An MLP of several layers: h = gelu(W h + b) four times, then a projection; x INPUT, y OUTPUT."""
    T = G.Type
    n_in, n_hidden, n_layers = MLP["n_in"], MLP["n_hidden"], MLP["n_layers"]
    n_tokens = n_tokens or MLP["n_tokens"]
    ctx = _ctx(G)
    wctx = _ctx(G, 4, no_alloc=False) if preloaded_weights else ctx
    x = G.new_tensor_2d(ctx, T.F32, n_in, n_tokens)
    G.set_input(x)
    h, width = x, n_in
    for _ in range(n_layers):
        w = G.new_tensor_2d(wctx, T.F32, width, n_hidden)
        b = G.new_tensor_1d(wctx, T.F32, n_hidden)
        h = G.gelu(ctx, G.add(ctx, G.mul_mat(ctx, w, h), b))
        width = n_hidden
    y = G.mul_mat(ctx, G.new_tensor_2d(wctx, T.F32, n_hidden, n_in), h)
    G.set_output(y)
    scenario = {"ctx": ctx, "graphs": [_graph(G, ctx, y)]}
    if preloaded_weights:
        scenario["wctx"] = wctx
    return scenario


def quantized(G):
    """Quantized and half weights among the leafs: sizes come from the block layouts."""
    T = G.Type
    ctx = _ctx(G)
    emb = G.new_tensor_2d(ctx, T.Q8_0, 64, 50)
    ids = G.new_tensor_1d(ctx, T.I32, 7)
    G.set_input(ids)
    h = G.get_rows(ctx, emb, ids)                          # F32 [64, 7]
    w1 = G.new_tensor_2d(ctx, T.Q4_0, 64, 96)
    w2 = G.new_tensor_2d(ctx, T.F16, 96, 64)
    h = G.silu(ctx, G.mul_mat(ctx, w1, h))
    h = G.mul_mat(ctx, w2, h)
    h16 = G.cpy(ctx, h, G.new_tensor_2d(ctx, T.F16, 64, 7))
    return {"ctx": ctx, "graphs": [_graph(G, ctx, h16)]}


def llama_layer(G):
    """graph_scenarios.attention: a whole llama layer with a KV cache, every tensor planned here."""
    ctx, graphs = graph_scenarios.attention(G, no_alloc=True)
    return {"ctx": ctx, "graphs": [graphs["gf"]]}


def zoo(G):
    """graph_scenarios.zoo: every op constructor of the ops chapter in one graph of many roots."""
    ctx, graphs = graph_scenarios.zoo(G, no_alloc=True)
    return {"ctx": ctx, "graphs": [graphs["gf"]]}


def realloc(G):
    """One allocator, four graphs: reserve for 8 tokens, then alloc_graph for 16 (grows by itself),
    for 4 (fits), and for a graph with one more node (re-plans, keeps the larger buffer)."""
    s8, s16, s4 = mlp(G, 8), mlp(G, 16), mlp(G, 4)
    s5 = inplace_chain(G)
    return {"ctx": [s8, s16, s4, s5], "graphs": s8["graphs"] + s16["graphs"] + s4["graphs"] + s5["graphs"],
            "steps": ["reserve", "alloc", "alloc", "alloc"]}


def alloc_only(G):
    """No reserve at all: the first alloc_graph plans by itself (one buffer)."""
    s = attention_block(G)
    s["steps"] = ["alloc"]
    return s


def two_buffers(G):
    """gallocr_new_n with the CPU buffer type twice: both ids share one planner and one buffer."""
    s = attention_block(G)
    n = G.graph_n_nodes(s["graphs"][0])
    s["n_bufs"] = 2
    s["node_ids"] = [i % 2 for i in range(n)]
    return s


def chunks(G):
    """A buffer type whose buffers hold at most 16 KiB: the planner spreads the MLP over chunks."""
    s = mlp(G, preloaded_weights=True)
    s["buft"] = (32, 16 * 1024)
    return s


def chunks_big_tensor(G):
    """A tensor larger than the buffer type's max_size gets a chunk of its own, as large as needed."""
    ctx = _ctx(G)
    x = G.new_tensor_1d(ctx, G.Type.F32, 3000)             # 12000 bytes > 8 KiB
    y = G.scale(ctx, x, 2.0)
    z = G.mul_mat(ctx, G.new_tensor_2d(ctx, G.Type.F32, 3000, 100), G.reshape_2d(ctx, y, 3000, 1))
    w = G.gelu(ctx, G.cont(ctx, G.transpose(ctx, z)))
    s = {"ctx": ctx, "graphs": [_graph(G, ctx, w)]}
    s["buft"] = (32, 8 * 1024)
    return s


def wide_alignment(G):
    """A buffer type that wants 256-byte alignment: every size rounds up to it."""
    s = diamond(G)
    s["buft"] = (256, 2**64 - 1)
    return s


def random_graph(G, seed):
    """A random graph of element-wise ops, matmuls, norms and views over a few 2-D shapes, with
    random INPUT and OUTPUT flags and several roots. Python's random with a fixed seed: both
    sides build the very same graph."""
    import random
    rng = random.Random(seed)
    T = G.Type
    ctx = _ctx(G)
    dims = (8, 16, 24, 40)
    pool = []                                    # (tensor, ne0, ne1)

    def leaf():
        n0, n1 = rng.choice(dims), rng.choice(dims)
        t = G.new_tensor_2d(ctx, T.F32, n0, n1)
        if rng.random() < 0.3:
            G.set_input(t)
        pool.append((t, n0, n1))

    for _ in range(rng.randint(2, 4)):
        leaf()
    made = []
    used = set()
    for _ in range(rng.randint(6, 30)):
        a, n0, n1 = rng.choice(pool[-4:]) if rng.random() < 0.8 else rng.choice(pool)
        used.add(id(a))
        kind = rng.choice(["bin", "bin", "unary", "unary", "scale", "norm", "matmul", "cont_t",
                           "view", "sum_rows", "leaf"])
        if kind == "leaf":
            leaf()
            continue
        if kind == "bin":
            b = rng.choice([p for p in pool if p[1] == n0 and p[2] in (n1, 1)])[0]
            used.add(id(b))
            r, shape = rng.choice([G.add, G.mul, G.sub])(ctx, a, b), (n0, n1)
        elif kind == "unary":
            r, shape = rng.choice([G.silu, G.gelu, G.silu])(ctx, a), (n0, n1)
        elif kind == "scale":
            r, shape = G.scale(ctx, a, 0.5), (n0, n1)
        elif kind == "norm":
            r = rng.choice([G.rms_norm, G.norm])(ctx, a, 1e-5) if rng.random() < 0.7 else G.soft_max(ctx, a)
            shape = (n0, n1)
        elif kind == "matmul":
            m = rng.choice(dims)
            r, shape = G.mul_mat(ctx, G.new_tensor_2d(ctx, T.F32, n0, m), a), (m, n1)
        elif kind == "cont_t":
            r, shape = G.cont(ctx, G.transpose(ctx, a)), (n1, n0)
        elif kind == "view":
            rows = rng.randint(1, n1)
            first = rng.randint(0, n1 - rows)
            r, shape = G.view_2d(ctx, a, n0, rows, 4 * n0, 4 * n0 * first), (n0, rows)
        else:
            r, shape = G.sum_rows(ctx, a), (1, n1)
        pool.append((r, *shape))
        made.append(r)
        if rng.random() < 0.1:
            G.set_output(r)
    roots = [t for t in made if id(t) not in used]   # every result nobody reads is a root
    return {"ctx": ctx, "graphs": [_graph(G, ctx, *roots)]}


N_RANDOM = 40

SCENARIOS = {
    "chain": chain,
    "inplace_chain": inplace_chain,
    "inplace_chain_input": lambda G: inplace_chain(G, "in"),
    "inplace_chain_output": lambda G: inplace_chain(G, "out"),
    "inplace_chain_all_output": lambda G: inplace_chain(G, "all_out"),
    "not_inplace_chain": not_inplace_chain,
    "diamond": diamond,
    "diamond_input": lambda G: diamond(G, "in"),
    "diamond_output": lambda G: diamond(G, "out"),
    "wide_diamond": wide_diamond,
    "late_input": late_input,
    "input_nodes": input_nodes,
    "late_input_no_flag": lambda G: late_input(G, False),
    "views": views,
    "view_inplace": view_inplace,
    "output_view": output_view,
    "output_view_read": output_view_read,
    "attention": attention_block,
    "attention_preloaded": lambda G: attention_block(G, preloaded_weights=True),
    "mlp": mlp,
    "mlp_all_weights": lambda G: mlp(G, preloaded_weights=False),
    "quantized": quantized,
    "llama_layer": llama_layer,
    "zoo": zoo,
    "realloc": realloc,
    "alloc_only": alloc_only,
    "two_buffers": two_buffers,
    "chunks": chunks,
    "chunks_big_tensor": chunks_big_tensor,
    "wide_alignment": wide_alignment,
}
SCENARIOS.update({f"random_{i}": (lambda G, i=i: random_graph(G, i)) for i in range(N_RANDOM)})
