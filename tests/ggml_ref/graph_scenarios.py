"""Graphs built with ggml's API, written once and run twice.

Every scenario takes `G`, a module-like object with ggml's functions under their names without the
`ggml_` prefix (`G.mul_mat(ctx, a, b)`) and `G.Type.F32`-style type ids, and returns
`(ctx, graphs)`. `tests/ggml_ref/graph_ref.py` runs them against real ggml (ggml-python) and
writes what ggml computed to `tests/data/graph_ref.json`; `tests/test_graph.py` and
`tests/test_ops.py` run the very same calls against ggml_lite and compare. Nothing here touches tensor data.
"""
import math

MB = 1024 * 1024


def axb(G, no_alloc=False, order=0):
    """f = a*x^2 + b, the example at the top of ggml.h (and of the seed): three 1-element tensors."""
    ctx = G.init(4 * MB, None, no_alloc)
    x = G.new_tensor_1d(ctx, G.Type.F32, 1)
    a = G.new_tensor_1d(ctx, G.Type.F32, 1)
    b = G.new_tensor_1d(ctx, G.Type.F32, 1)   # left unnamed: the graph names it
    G.set_name(x, "x")
    G.set_name(a, "a")
    x2 = G.mul(ctx, x, x)
    f = G.add(ctx, G.mul(ctx, a, x2), b)
    gf = G.new_graph(ctx)
    if order:
        G.set_eval_order(gf, order)
    G.build_forward_expand(gf, f)
    return ctx, {"gf": gf}


def select(G, then_expand=True):
    """build_forward_select: three alternative branches, only one flagged COMPUTE; then a later
    expand that reaches an unflagged branch again propagates the flag (the revisit path)."""
    ctx = G.init(1 * MB, None, True)
    x = G.new_tensor_2d(ctx, G.Type.F32, 8, 3)
    G.set_name(x, "x")
    branches = [G.silu(ctx, x), G.scale(ctx, x, 2.0), G.gelu(ctx, G.mul(ctx, x, x))]
    gf = G.new_graph_custom(ctx, 32, False)
    out = G.build_forward_select(gf, branches, 3, 1)
    if then_expand:
        G.build_forward_expand(gf, G.add(ctx, out, x))
        G.build_forward_expand(gf, G.sum(ctx, G.add(ctx, branches[2], branches[0])))
    return ctx, {"gf": gf}


# sizes of the llama-style block: GQA with 4 query heads sharing 2 KV heads
N_EMBD, N_HEAD, N_HEAD_KV, N_TOKENS, N_CTX, N_FF, N_VOCAB = 64, 4, 2, 5, 8, 128, 32
HEAD_DIM = N_EMBD // N_HEAD
N_EMBD_GQA = HEAD_DIM * N_HEAD_KV
KV_HEAD = 2          # the batch is written into cache cells 2..6
EPS = 1e-5


def attention(G, no_alloc=False, graph_size=None):
    """One llama decoder layer as llama.cpp records it: token embedding, RMSNorm, Q/K/V with RoPE,
    K and V written into a KV cache (two extra roots), masked softmax attention with grouped-query
    heads, output projection, residual, SwiGLU FFN, residual, final norm and the vocabulary head."""
    T = G.Type
    ctx = G.init(16 * MB, None, no_alloc)

    def w(name, typ, *ne):
        t = {2: G.new_tensor_2d, 1: G.new_tensor_1d}[len(ne)](ctx, typ, *ne)
        G.set_name(t, name)
        return t

    tok_embd = w("token_embd.weight", T.F32, N_EMBD, N_VOCAB)
    attn_norm = w("attn_norm.weight", T.F32, N_EMBD)
    wq = w("attn_q.weight", T.F16, N_EMBD, N_EMBD)
    wk = w("attn_k.weight", T.F32, N_EMBD, N_EMBD_GQA)
    wv = w("attn_v.weight", T.F32, N_EMBD, N_EMBD_GQA)
    wo = w("attn_output.weight", T.Q4_0, N_EMBD, N_EMBD)
    ffn_norm = w("ffn_norm.weight", T.F32, N_EMBD)
    w_gate = w("ffn_gate.weight", T.F32, N_EMBD, N_FF)
    w_up = w("ffn_up.weight", T.F32, N_EMBD, N_FF)
    w_down = w("ffn_down.weight", T.Q8_0, N_FF, N_EMBD)
    out_norm = w("output_norm.weight", T.F32, N_EMBD)
    output = w("output.weight", T.F16, N_EMBD, N_VOCAB)
    k_cache = w("cache_k", T.F16, N_EMBD_GQA * N_CTX)
    v_cache = w("cache_v", T.F16, N_EMBD_GQA * N_CTX)

    tokens = w("inp_tokens", T.I32, N_TOKENS)
    pos = w("inp_pos", T.I32, N_TOKENS)
    kq_mask = w("kq_mask", T.F32, N_CTX, N_TOKENS)
    for t in (tokens, pos, kq_mask):
        G.set_input(t)

    gf = G.new_graph(ctx) if graph_size is None else G.new_graph_custom(ctx, graph_size, False)

    inpL = G.get_rows(ctx, tok_embd, tokens)
    cur = G.mul(ctx, G.rms_norm(ctx, inpL, EPS), attn_norm)

    q = G.reshape_3d(ctx, G.mul_mat(ctx, wq, cur), HEAD_DIM, N_HEAD, N_TOKENS)
    k = G.reshape_3d(ctx, G.mul_mat(ctx, wk, cur), HEAD_DIM, N_HEAD_KV, N_TOKENS)
    v = G.mul_mat(ctx, wv, cur)
    rope_args = (HEAD_DIM, 0, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    q = G.rope_ext(ctx, q, pos, None, *rope_args)
    k = G.rope_ext(ctx, k, pos, None, *rope_args)

    # store K and V of this batch into the cache (each copy is its own root, like llama.cpp)
    esz = G.type_size(T.F16)
    k_dst = G.view_1d(ctx, k_cache, N_TOKENS * N_EMBD_GQA, G.row_size(T.F16, N_EMBD_GQA) * KV_HEAD)
    G.build_forward_expand(gf, G.cpy(ctx, k, k_dst))
    v_dst = G.view_2d(ctx, v_cache, N_TOKENS, N_EMBD_GQA, N_CTX * esz, KV_HEAD * esz)
    G.build_forward_expand(gf, G.cpy(ctx, G.transpose(ctx, v), v_dst))

    # attention over the whole cache
    qp = G.permute(ctx, q, 0, 2, 1, 3)
    kc = G.view_3d(ctx, k_cache, HEAD_DIM, N_CTX, N_HEAD_KV,
                   G.row_size(T.F16, N_EMBD_GQA), G.row_size(T.F16, HEAD_DIM), 0)
    kq = G.mul_mat(ctx, kc, qp)
    kq = G.soft_max_ext(ctx, kq, kq_mask, 1.0 / math.sqrt(HEAD_DIM), 0.0)
    vc = G.view_3d(ctx, v_cache, N_CTX, HEAD_DIM, N_HEAD_KV, N_CTX * esz, N_CTX * HEAD_DIM * esz, 0)
    kqv = G.mul_mat(ctx, vc, kq)
    cur = G.cont_2d(ctx, G.permute(ctx, kqv, 0, 2, 1, 3), N_EMBD, N_TOKENS)
    cur = G.mul_mat(ctx, wo, cur)
    ffn_inp = G.add(ctx, cur, inpL)

    cur = G.mul(ctx, G.rms_norm(ctx, ffn_inp, EPS), ffn_norm)
    cur = G.swiglu_split(ctx, G.mul_mat(ctx, w_gate, cur), G.mul_mat(ctx, w_up, cur))
    cur = G.add(ctx, G.mul_mat(ctx, w_down, cur), ffn_inp)

    cur = G.mul(ctx, G.rms_norm(ctx, cur, EPS), out_norm)
    logits = G.mul_mat(ctx, output, cur)
    G.set_name(logits, "result_output")
    G.set_output(logits)
    G.build_forward_expand(gf, logits)
    return ctx, {"gf": gf}


def zoo(G, no_alloc=False):
    """Every other op constructor of the chapter, with broadcasting, in-place variants, views of
    views, shared sub-expressions, a parameter leaf and two graphs over the same tensors."""
    T = G.Type
    ctx = G.init(8 * MB, None, no_alloc)
    a = G.new_tensor_3d(ctx, T.F32, 8, 6, 4)
    b = G.new_tensor_1d(ctx, T.F32, 8)
    r = G.new_tensor_3d(ctx, T.F32, 1, 6, 2)
    G.set_name(a, "a")
    G.set_name(b, "b")
    # r stays unnamed

    add = G.add(ctx, a, b)
    sub = G.sub(ctx, add, r)
    mul = G.mul(ctx, sub, a)                 # a used twice: one leaf
    div = G.div(ctx, mul, G.repeat(ctx, b, a))
    sc = G.scale(ctx, div, 0.125)
    sci = G.scale_inplace(ctx, sc, -2.0)
    nrm = G.norm(ctx, sci, 1e-6)
    rms = G.rms_norm_inplace(ctx, nrm, 1e-5)
    ge = G.gelu(ctx, rms)
    si = G.silu_inplace(ctx, ge)
    dm = G.diag_mask_inf(ctx, si, 2)
    dmi = G.diag_mask_inf_inplace(ctx, dm, 0)
    sm = G.soft_max(ctx, dmi)
    smi = G.soft_max_inplace(ctx, sm)
    mask = G.new_tensor_3d(ctx, T.F16, 8, 6, 2)
    G.set_name(mask, "mask16")
    sme = G.soft_max_ext(ctx, smi, mask, 0.5, 8.0)      # ALiBi: max_bias > 0 with a mask

    s_all = G.sum(ctx, sme)
    s_rows = G.sum_rows(ctx, sme)
    m_rows = G.mean(ctx, sme)
    cat1 = G.concat(ctx, sme, a, 1)
    cat2 = G.concat(ctx, s_rows, m_rows, 2)

    # views, copies, contiguity
    tr = G.transpose(ctx, a)                               # [6, 8, 4]
    ct = G.cont(ctx, tr)
    c1 = G.cont_1d(ctx, tr, 8 * 6 * 4)
    c3 = G.cont_3d(ctx, tr, 12, 4, 4)
    c4 = G.cont_4d(ctx, G.permute(ctx, a, 2, 0, 1, 3), 4, 8, 3, 2)
    h16 = G.new_tensor_3d(ctx, T.F16, 6, 8, 4)
    cp = G.cpy(ctx, tr, h16)
    v4 = G.view_4d(ctx, a, 4, 3, 2, 2, 32, 96, 192, 16)
    vv = G.view_2d(ctx, G.view_1d(ctx, a, 96, 64), 8, 4, 32, 32)   # view of a view: rebased on a
    rs = G.reshape_4d(ctx, ct, 3, 2, 8, 4)
    rsb = G.reshape(ctx, c1, a)

    # matmul broadcast in dims 2 and 3 (GQA-style), get_rows on 3-D and I32 data
    wa = G.new_tensor_4d(ctx, T.F32, 8, 5, 2, 1)
    xb = G.new_tensor_4d(ctx, T.F32, 8, 3, 4, 3)
    mm = G.mul_mat(ctx, wa, xb)
    ids = G.new_tensor_2d(ctx, T.I32, 3, 4)
    gr = G.get_rows(ctx, a, ids)
    ia = G.new_tensor_2d(ctx, T.I32, 5, 7)
    ids1 = G.new_tensor_1d(ctx, T.I32, 2)
    gri = G.get_rows(ctx, ia, ids1)

    # rope: NEOX mode with frequency factors, and plain rope in place
    pos = G.new_tensor_1d(ctx, T.I32, 4)
    ff = G.new_tensor_1d(ctx, T.F32, 4)
    G.set_name(pos, "pos")
    x4 = G.new_tensor_3d(ctx, T.F32, 8, 6, 4)
    rp = G.rope_ext(ctx, x4, pos, ff, 8, 2, 2048, 500000.0, 0.25, 1.0, 1.0, 32.0, 1.0)
    rpi = G.rope_inplace(ctx, G.rope(ctx, x4, pos, 6, 0), pos, 6, 0)

    # swiglu, in-place binary ops, a parameter leaf (becomes a node)
    g1 = G.new_tensor_2d(ctx, T.F32, 16, 3)
    g2 = G.new_tensor_2d(ctx, T.F32, 16, 3)
    sw = G.swiglu_split(ctx, g1, g2)
    p = G.new_tensor_2d(ctx, T.F32, 16, 3)
    G.set_param(p)
    G.set_name(p, "param")
    ai = G.add_inplace(ctx, G.mul_inplace(ctx, G.sub_inplace(ctx, sw, p), g1), g2)
    di = G.div_inplace(ctx, ai, p)
    gi = G.gelu_inplace(ctx, G.silu(ctx, di))

    gf = G.new_graph_custom(ctx, 96, False)
    for t in (s_all, cat1, cat2, c3, c4, cp, v4, vv, rs, rsb, mm, gr, gri, rp, rpi, gi):
        G.build_forward_expand(gf, t)
    G.build_forward_expand(gf, cat2)      # already there: nothing changes
    # a second, smaller graph over the same tensors (with gradient arrays: a bigger pool object)
    gb = G.new_graph_custom(ctx, 16, True)
    G.build_forward_expand(gb, rpi)
    G.build_forward_expand(gb, gi)
    return ctx, {"gf": gf, "gb": gb}


def fits_exactly(G, n_tensors=5, graph_size=32):
    """A no_alloc context sized by ggml's formula for n tensors + one graph is exactly full."""
    mem = n_tensors * G.tensor_overhead() + G.graph_overhead_custom(graph_size, False)
    ctx = G.init(mem, None, True)
    x = G.new_tensor_2d(ctx, G.Type.F32, 4, 4)
    y = x
    for _ in range(n_tensors - 1):
        y = G.add(ctx, y, x)
    gf = G.new_graph_custom(ctx, graph_size, False)
    G.build_forward_expand(gf, y)
    return ctx, {"gf": gf}


# Bad calls, as code run with G, T = G.Type and ctx = G.init(1 << 20, None, False) in scope.
# graph_ref.py runs each in a child process (ggml aborts) and records the assertion; the tests
# run them against ggml_lite and expect a GGMLError naming the same condition and numbers.
BAD_CALLS = {
    "add_shape": "a=G.new_tensor_2d(ctx,T.F32,4,3); b=G.new_tensor_2d(ctx,T.F32,3,3); G.add(ctx,a,b)",
    "mul_mat_shape": "a=G.new_tensor_2d(ctx,T.F32,4,3); b=G.new_tensor_2d(ctx,T.F32,5,3); G.mul_mat(ctx,a,b)",
    "mul_mat_transposed": "a=G.new_tensor_2d(ctx,T.F32,4,3); at=G.transpose(ctx,a); b=G.new_tensor_2d(ctx,T.F32,3,2); G.mul_mat(ctx,at,b)",
    "reshape_noncontiguous": "a=G.new_tensor_2d(ctx,T.F32,4,3); at=G.transpose(ctx,a); G.reshape_1d(ctx,at,12)",
    "view_out_of_bounds": "a=G.new_tensor_1d(ctx,T.F32,10); G.view_1d(ctx,a,8,12)",
    "graph_full": "x=G.new_tensor_1d(ctx,T.F32,4); gf=G.new_graph_custom(ctx,4,False)\nfor _ in range(5): x=G.add(ctx,x,x)\nG.build_forward_expand(gf,x)",
    "pool_exhausted": "c2=G.init(1024,None,False); G.new_tensor_1d(c2,T.F32,256)",
    "get_rows_type": "a=G.new_tensor_2d(ctx,T.F32,4,3); b=G.new_tensor_1d(ctx,T.F32,2); G.get_rows(ctx,a,b)",
    "concat_shape": "a=G.new_tensor_2d(ctx,T.F32,4,3); b=G.new_tensor_2d(ctx,T.F32,5,3); G.concat(ctx,a,b,1)",
    "cpy_nelements": "a=G.new_tensor_1d(ctx,T.F32,4); b=G.new_tensor_1d(ctx,T.F16,5); G.cpy(ctx,a,b)",
    "rope_positions": "a=G.new_tensor_3d(ctx,T.F32,8,2,3); p=G.new_tensor_1d(ctx,T.I32,4); G.rope(ctx,a,p,8,0)",
    "soft_max_mask": "a=G.new_tensor_2d(ctx,T.F32,8,3); m=G.new_tensor_2d(ctx,T.F32,8,2); G.soft_max_ext(ctx,a,m,1.0,0.0)",
}



SCENARIOS = {
    "axb": lambda G: axb(G),
    "axb_right_to_left": lambda G: axb(G, order=1),
    "select_only": lambda G: select(G, then_expand=False),
    "select": lambda G: select(G),
    "axb_no_alloc": lambda G: axb(G, no_alloc=True),
    "attention": lambda G: attention(G),
    "attention_no_alloc": lambda G: attention(G, no_alloc=True),
    "attention_custom_64": lambda G: attention(G, no_alloc=True, graph_size=64),
    "zoo": lambda G: zoo(G),
    "fits_exactly": lambda G: fits_exactly(G),
}

HASH_SIZES = [0, 1, 2, 3, 4, 6, 12, 100, 2048, 4096, 4100, 70000, 2147483659, 2147483660]

OVERHEADS = [(1, False), (8, False), (16, False), (16, True), (64, False), (96, False),
             (2048, False), (2048, True), (4096, False), (100000, False)]
