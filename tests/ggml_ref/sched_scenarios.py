"""Graphs for the backend scheduler, written once and run twice (real ggml and ggml_lite).

`build(G, spec)` makes one scenario's graph with `G` (ggml's functions without the `ggml_`
prefix, as in graph_scenarios.py) and returns a dict:

- `gf`: the graph (in a no_alloc context `ctx`);
- `weights`: a list of `(ctx, backend_name, usage)`, one per layer (its matrices and norm
  weights, as llama.cpp keeps a layer together): contexts of weight tensors that the driver
  allocates in a buffer of that backend's default buffer type, with that buffer usage
  ("weights" or "any");
- `pins`: `(node_name, backend_name)` pairs for `backend_sched_set_tensor_backend`;
- `inputs`: the INPUT tensors (embeddings, positions, mask), which the driver fills before computing.

`SCENARIOS` maps a scenario name to its spec (a dict: graph, n_layer, n_tok, wtype, weights,
backends, parallel, pins). tests/ggml_ref/sched_ref.py runs them through real ggml's
ggml_backend_sched and records its decisions in tests/data/sched_ref.json; tests/test_sched.py
runs them through ggml_lite's scheduler and compares.
"""

MB = 1024 * 1024
N_EMBD, N_HEAD, N_HEAD_KV, N_FF = 64, 4, 2, 128
HEAD_DIM = N_EMBD // N_HEAD
EPS = 1e-5


def _weight(G, wctx, wtype, ne0, ne1, name):
    t = G.new_tensor_2d(wctx, getattr(G.Type, wtype), ne0, ne1)
    G.set_name(t, name)
    return t


def _named(G, t, name):
    G.set_name(t, name)
    return t


def _ffn_layer(G, ctx, wctx, nctx, wtype, il, x):
    """rms_norm, mul, mul_mat, silu, mul_mat, add: the 2-layer graph of the scheduler's notes."""
    norm_w = G.new_tensor_1d(nctx, G.Type.F32, N_EMBD)
    G.set_name(norm_w, f"ffn_norm-{il}")
    w_up = _weight(G, wctx, "F32", N_EMBD, N_FF, f"ffn_up-{il}")
    w_down = _weight(G, wctx, wtype, N_FF, N_EMBD, f"ffn_down-{il}")
    cur = _named(G, G.rms_norm(ctx, x, EPS), f"norm-{il}")
    cur = _named(G, G.mul(ctx, cur, norm_w), f"ffn_inp-{il}")
    cur = _named(G, G.mul_mat(ctx, w_up, cur), f"up-{il}")
    cur = _named(G, G.silu(ctx, cur), f"act-{il}")
    cur = _named(G, G.mul_mat(ctx, w_down, cur), f"down-{il}")
    return _named(G, G.add(ctx, cur, x), f"l_out-{il}")


def _attn_layer(G, ctx, gf, wctx, nctx, wtype, il, x, pos, mask, n_tok, qkv_together):
    """A llama decoder layer without KV cache: norm, Q/K/V, RoPE, masked softmax attention with
    grouped-query heads, output projection, residual, SiLU-gated FFN, residual."""
    T = G.Type
    attn_norm = G.new_tensor_1d(nctx, T.F32, N_EMBD)
    G.set_name(attn_norm, f"attn_norm-{il}")
    ffn_norm = G.new_tensor_1d(nctx, T.F32, N_EMBD)
    G.set_name(ffn_norm, f"ffn_norm-{il}")
    wq = _weight(G, wctx, wtype, N_EMBD, N_EMBD, f"wq-{il}")
    wk = _weight(G, wctx, wtype, N_EMBD, HEAD_DIM * N_HEAD_KV, f"wk-{il}")
    wv = _weight(G, wctx, wtype, N_EMBD, HEAD_DIM * N_HEAD_KV, f"wv-{il}")
    wo = _weight(G, wctx, wtype, N_EMBD, N_EMBD, f"wo-{il}")
    w_gate = _weight(G, wctx, wtype, N_EMBD, N_FF, f"ffn_gate-{il}")
    w_up = _weight(G, wctx, wtype, N_EMBD, N_FF, f"ffn_up-{il}")
    w_down = _weight(G, wctx, wtype, N_FF, N_EMBD, f"ffn_down-{il}")

    cur = _named(G, G.rms_norm(ctx, x, EPS), f"norm-{il}")
    cur = _named(G, G.mul(ctx, cur, attn_norm), f"attn_norm-{il}")
    q = _named(G, G.mul_mat(ctx, wq, cur), f"Qcur-{il}")
    k = _named(G, G.mul_mat(ctx, wk, cur), f"Kcur-{il}")
    v = _named(G, G.mul_mat(ctx, wv, cur), f"Vcur-{il}")
    if qkv_together:             # llama-graph expands Q, K, V together: fewer splits
        for t in (q, k, v):
            G.build_forward_expand(gf, t)
    q = G.reshape_3d(ctx, q, HEAD_DIM, N_HEAD, n_tok)
    k = G.reshape_3d(ctx, k, HEAD_DIM, N_HEAD_KV, n_tok)
    q = _named(G, G.rope_ext(ctx, q, pos, None, HEAD_DIM, 0, 512, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0), f"Qrope-{il}")
    k = _named(G, G.rope_ext(ctx, k, pos, None, HEAD_DIM, 0, 512, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0), f"Krope-{il}")
    q = G.permute(ctx, q, 0, 2, 1, 3)                       # [hd, n_tok, n_head]
    k = G.permute(ctx, k, 0, 2, 1, 3)                       # [hd, n_tok, n_head_kv]
    kq = _named(G, G.mul_mat(ctx, k, q), f"kq-{il}")         # [n_tok, n_tok, n_head]
    kq = _named(G, G.soft_max_ext(ctx, kq, mask, 1.0 / HEAD_DIM ** 0.5, 0.0), f"kq_soft_max-{il}")
    v = G.reshape_3d(ctx, v, HEAD_DIM, N_HEAD_KV, n_tok)
    v = _named(G, G.cont(ctx, G.permute(ctx, v, 1, 2, 0, 3)), f"v_t-{il}")   # [n_tok, hd, n_head_kv]
    kqv = _named(G, G.mul_mat(ctx, v, kq), f"kqv-{il}")      # [hd, n_tok, n_head]
    kqv = G.permute(ctx, kqv, 0, 2, 1, 3)                   # [hd, n_head, n_tok]
    cur = _named(G, G.cont_2d(ctx, kqv, N_EMBD, n_tok), f"kqv_out-{il}")
    cur = _named(G, G.mul_mat(ctx, wo, cur), f"attn_out-{il}")
    ffn_inp = _named(G, G.add(ctx, cur, x), f"ffn_inp-{il}")
    cur = _named(G, G.rms_norm(ctx, ffn_inp, EPS), f"ffn_rms-{il}")
    cur = _named(G, G.mul(ctx, cur, ffn_norm), f"ffn_normed-{il}")
    gate = _named(G, G.silu(ctx, _named(G, G.mul_mat(ctx, w_gate, cur), f"ffn_gate-{il}")), f"ffn_silu-{il}")
    up = _named(G, G.mul_mat(ctx, w_up, cur), f"ffn_up-{il}")
    cur = _named(G, G.mul(ctx, gate, up), f"ffn_gate_par-{il}")
    cur = _named(G, G.mul_mat(ctx, w_down, cur), f"ffn_out-{il}")
    return _named(G, G.add(ctx, cur, ffn_inp), f"l_out-{il}")


def _fan_in(G, spec):
    """n_tok user inputs summed by a chain of ADDs, every ADD pinned to spec's first backend:
    one split would need more than GGML_SCHED_MAX_SPLIT_INPUTS = 30 copies."""
    ctx = G.init(8 * MB, None, True)
    gf = G.new_graph_custom(ctx, spec.get("graph_size", 2048), False)
    xs = []
    for i in range(spec["n_tok"]):
        x = _named(G, G.new_tensor_1d(ctx, G.Type.F32, N_EMBD), f"x{i}")
        G.set_input(x)
        xs.append(x)
    acc, pins = xs[0], []
    for i, x in enumerate(xs[1:], 1):
        acc = _named(G, G.add(ctx, acc, x), f"acc{i}")
        pins.append((f"acc{i}", spec["backends"][0]))
    G.set_output(acc)
    G.build_forward_expand(gf, acc)
    return {"ctx": ctx, "gf": gf, "weights": [], "pins": pins, "inputs": xs, "out": acc}


def build(G, spec):
    """The graph of spec; see the module docstring."""
    if spec["graph"] == "fan_in":
        return _fan_in(G, spec)
    T = G.Type
    n_tok, n_layer = spec["n_tok"], spec["n_layer"]
    ctx = G.init(8 * MB, None, True)
    gf = G.new_graph_custom(ctx, spec.get("graph_size", 2048), False)
    weights, w_ctxs = [], []
    for il in range(n_layer):
        where, usage = spec["weights"](il, n_layer) if callable(spec["weights"]) else spec["weights"]
        wctx = G.init(64 * 1024, None, True)
        weights.append((wctx, where, usage))
        w_ctxs.append(wctx)
    x = _named(G, G.new_tensor_2d(ctx, T.F32, N_EMBD, n_tok), "inp_embd")
    pos = _named(G, G.new_tensor_1d(ctx, T.I32, n_tok), "inp_pos")
    mask = _named(G, G.new_tensor_2d(ctx, T.F32, n_tok, n_tok), "kq_mask")
    inputs = [x]
    G.set_input(x)
    if spec["graph"] != "ffn":
        G.set_input(pos)
        G.set_input(mask)
        inputs += [pos, mask]
    for il in range(n_layer):
        if spec["graph"] == "ffn":
            x = _ffn_layer(G, ctx, w_ctxs[il], w_ctxs[il], spec["wtype"], il, x)
        else:
            x = _attn_layer(G, ctx, gf, w_ctxs[il], w_ctxs[il], spec["wtype"], il, x, pos, mask, n_tok,
                            qkv_together=spec["graph"] == "llama")
    out = _named(G, G.rms_norm(ctx, x, EPS), "result_norm")
    G.set_output(out)
    G.build_forward_expand(gf, out)
    return {"ctx": ctx, "gf": gf, "weights": weights, "pins": spec.get("pins", []), "inputs": inputs,
            "out": out}


def half_layers(where_first, where_rest):
    """The first half of the layers' weights in one place, the rest in another (llama.cpp's
    -ngl N offloads the last N layers)."""
    def place(il, n_layer):
        return where_first if il < n_layer // 2 else where_rest
    return place


def make_spec(graph, n_tok, wtype="F32", weights=("CPU", "weights"), backends=("BLAS", "CPU"),
          parallel=False, pins=(), n_layer=2):
    return {"graph": graph, "n_tok": n_tok, "wtype": wtype, "weights": weights,
            "backends": list(backends), "parallel": parallel, "pins": list(pins), "n_layer": n_layer}


def _scenarios():
    s = {}
    for graph in ("ffn", "llama"):
        for wtype in ("F32", "Q8_0"):
            for n_tok in (1, 8, 31, 32, 33, 64):
                s[f"{graph}-{wtype}-{n_tok}-cpu"] = make_spec(graph, n_tok, wtype)
    for n_tok in (1, 32, 64):
        s[f"natural-F32-{n_tok}-cpu"] = make_spec("natural", n_tok)
        s[f"llama-Q4_0-{n_tok}-blas"] = make_spec("llama", n_tok, "Q4_0", weights=("BLAS", "weights"))
        s[f"llama-F32-{n_tok}-any"] = make_spec("llama", n_tok, weights=("CPU", "any"))
        s[f"llama-F32-{n_tok}-half"] = make_spec("llama", n_tok, weights=half_layers(("CPU", "any"), ("BLAS", "weights")))
        s[f"llama-F32-{n_tok}-parallel"] = make_spec("llama", n_tok, parallel=True)
        s[f"ffn-Q8_0-{n_tok}-parallel"] = make_spec("ffn", n_tok, "Q8_0", parallel=True)
        s[f"llama-F32-{n_tok}-cpu_only"] = make_spec("llama", n_tok, backends=("CPU",))
        s[f"llama-F32-{n_tok}-two_cpus"] = make_spec("llama", n_tok, backends=("CPU", "CPU"))
    s["ffn-F32-64-pin_down_cpu"] = make_spec("ffn", 64, pins=[("down-0", "CPU")])
    s["llama-F32-64-pin_q_cpu"] = make_spec("llama", 64, pins=[("Qcur-0", "CPU"), ("Qrope-1", "CPU")])
    s["llama-F32-8-pin_norm_blas"] = make_spec("llama", 8, pins=[("norm-0", "BLAS"), ("ffn_silu-1", "BLAS")])
    s["llama-Q8_0-64-pin_parallel"] = make_spec("llama", 64, "Q8_0", parallel=True,
                                            pins=[("ffn_up-1", "CPU"), ("attn_out-0", "BLAS")])
    s["llama-F32-32-four_layers"] = make_spec("llama", 32, n_layer=4)
    s["natural-Q8_0-64-four_layers"] = make_spec("natural", 64, "Q8_0", n_layer=4)
    # a device with its own memory: ggml's RPC backend (a local rpc-server) and the CPU; the
    # last layers' weights on the device, as llama.cpp's -ngl offloads them
    rpc_places = {"rpc_all": ("RPC", "weights"), "rpc_half": half_layers(("CPU", "weights"), ("RPC", "weights")),
                  "rpc_none": ("CPU", "weights")}
    for place, weights in rpc_places.items():
        for n_tok in (8, 64):
            s[f"llama-F32-{n_tok}-{place}"] = make_spec("llama", n_tok, weights=weights, backends=("RPC", "CPU"), n_layer=4)
        s[f"ffn-Q8_0-64-{place}-blas"] = make_spec("ffn", 64, "Q8_0", weights=weights, backends=("RPC", "BLAS", "CPU"), n_layer=4)
        s[f"llama-Q8_0-64-{place}-blas"] = make_spec("llama", 64, "Q8_0", weights=weights, backends=("RPC", "BLAS", "CPU"), n_layer=4)
    s["llama-F32-8-rpc_half-parallel"] = make_spec("llama", 8, weights=rpc_places["rpc_half"], backends=("RPC", "CPU"),
                                               n_layer=4, parallel=True)
    s["fan_in-F32-40-rpc_pinned"] = make_spec("fan_in", 40, backends=("RPC", "CPU"))
    s["fan_in-F32-29-rpc_pinned-parallel"] = make_spec("fan_in", 29, backends=("RPC", "CPU"), parallel=True)
    s["llama-F32-64-rpc_half-pin"] = make_spec("llama", 64, weights=rpc_places["rpc_half"], backends=("RPC", "CPU"),
                                           n_layer=4, pins=[("ffn_inp-1", "CPU"), ("kq-0", "RPC")])
    return s


SCENARIOS = _scenarios()

# the scenario whose compute the eval callback watches (ask about every MUL_MAT, stop at the
# observation of STOP_AT); see sched_ref.py
CALLBACK_SCENARIO = "llama-F32-64-cpu"
CALLBACK_STOP_AT = "Vcur-0"
