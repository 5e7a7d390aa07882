"""Random graphs for the differential test, as plain data (pure Python + numpy, no ggml_lite).

A *spec* is a JSON-able dict: {"seed", "n_threads", "via", "tensors": [...]}. Each tensor entry
is either an input ({"op": "INPUT", "type", "ne", "init"}) or an op over earlier entries
({"op": "MUL_MAT", "src": [i, j], "p": {...}}); every entry also carries the "type", "ne" and "nb"
ggml gives it, so the generator knows which layouts an op accepts and the tests can check the
descriptors. Index order is creation order, the order both sides make the calls in.

`generate(chooser)` builds a spec from a chooser's answers: tests/test_differential.py drives it
with hypothesis, tests/ggml_ref/differential_ref.py with `RandomChooser(seed)` to make the
fixture list, so this file must not import ggml_lite (real ggml's Python runs it too).
`input_data(spec, i)` makes an input's values from the spec's seed: floats for every float and
quantized type (each side quantizes them with its own library), exact bytes otherwise.

Shapes follow ggml's constructors' asserts and the CPU kernels' layout asserts (ggml 0.15.3
src/ggml.c, src/ggml-cpu/ops.cpp, binary-ops.cpp, unary-ops.cpp): where an op needs dense rows
or a contiguous tensor and the current tensor is a view, the generator puts a CONT first.
"""
from __future__ import annotations

import random

import numpy as np

# name -> (block size, bytes per block) (ggml's type_traits)
TYPES = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "I32": (1, 4),
         "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}
QUANTIZED = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
WEIGHT_TYPES = ("F32", "F16", "BF16") + QUANTIZED
VIEW_OPS = ("PERMUTE", "TRANSPOSE", "RESHAPE", "VIEW")
BINARY = ("ADD", "SUB", "MUL", "DIV")
# the unary and GLU kinds the generator may draw (a test passes the subset the backend accepts)
UNARY_KINDS = ("ABS", "SGN", "NEG", "STEP", "TANH", "ELU", "RELU", "SIGMOID", "GELU", "GELU_QUICK",
               "SILU", "HARDSWISH", "HARDSIGMOID", "EXP", "GELU_ERF", "FLOOR", "CEIL", "ROUND",
               "TRUNC", "SOFTPLUS", "EXPM1")
GLU_KINDS = ("REGLU", "GEGLU", "SWIGLU", "SWIGLU_OAI", "GEGLU_ERF", "GEGLU_QUICK")
MAX_NODES = 24


def row_size(type, ne0):
    blck, size = TYPES[type]
    return ne0 // blck * size


def contiguous_nb(type, ne):
    nb = [TYPES[type][1], row_size(type, ne[0])]
    nb.append(nb[1] * ne[1])
    nb.append(nb[2] * ne[2])
    return nb


def is_contiguous(t) -> bool:
    """ggml_is_contiguous (= ggml_is_contiguous_n(t, 0)): dims of size 1 may have any stride."""
    blck, size = TYPES[t["type"]]
    ne, nb = t["ne"], t["nb"]
    nxt = size
    if ne[0] != blck and nb[0] != nxt:
        return False
    nxt *= ne[0] // blck
    for i in (1, 2, 3):
        if ne[i] != 1:
            if nb[i] != nxt:
                return False
            nxt *= ne[i]
    return True


def is_packed(t) -> bool:
    """Strides exactly a fresh tensor's (ggml_is_contiguous and ggml_is_padded_1d both hold)."""
    return t["nb"] == contiguous_nb(t["type"], t["ne"])


def dense_rows(t) -> bool:
    return t["nb"][0] == TYPES[t["type"]][1]


def nelements(t):
    return int(np.prod(t["ne"]))


class RandomChooser:
    """The generator's choices from a seeded random.Random (the fixture list)."""

    def __init__(self, seed):
        self.r = random.Random(seed)

    def int(self, lo, hi):
        return self.r.randint(lo, hi)

    def pick(self, seq):
        seq = list(seq)
        return seq[self.r.randrange(len(seq))]


class _Graph:
    def __init__(self, c, unary_kinds, glu_kinds):
        self.c, self.t = c, []
        self.unary_kinds, self.glu_kinds = unary_kinds, glu_kinds

    # --- tensors ---------------------------------------------------------------------------
    def add(self, entry):
        self.t.append(entry)
        return len(self.t) - 1

    def input(self, type, ne, init=("uniform", -1.0, 1.0)):
        ne = list(ne) + [1] * (4 - len(ne))
        return self.add({"op": "INPUT", "type": type, "ne": ne, "nb": contiguous_nb(type, ne),
                         "init": list(init)})

    def node(self, op, type, ne, src, p=None):
        ne = list(ne)
        return self.add({"op": op, "type": type, "ne": ne, "nb": contiguous_nb(type, ne),
                         "src": list(src), "p": dict(p or {})})

    def view_entry(self, op, a, ne, nb, offs, p=None):
        return self.add({"op": op, "type": self.t[a]["type"], "ne": list(ne), "nb": list(nb),
                         "src": [a], "p": dict(p or {}), "offs": offs})

    # --- views (ggml's rules for ne and nb) --------------------------------------------------
    def permute(self, a, axes):
        ta = self.t[a]
        ne, nb = [0] * 4, [0] * 4
        for i, ax in enumerate(axes):
            ne[ax], nb[ax] = ta["ne"][i], ta["nb"][i]
        return self.view_entry("PERMUTE", a, ne, nb, 0, {"axes": list(axes)})

    def transpose(self, a):
        ta = self.t[a]
        ne, nb = list(ta["ne"]), list(ta["nb"])
        ne[0], ne[1], nb[0], nb[1] = ne[1], ne[0], nb[1], nb[0]
        return self.view_entry("TRANSPOSE", a, ne, nb, 0)

    def reshape(self, a, ne):
        return self.view_entry("RESHAPE", a, ne, contiguous_nb(self.t[a]["type"], ne), 0)

    def view(self, a, ne, start):
        """view_4d(a, ne..., a.nb1, a.nb2, a.nb3, offset of `start`): a sub-block of a."""
        ta = self.t[a]
        offs = sum(s * n for s, n in zip(start, ta["nb"]))
        nb = [TYPES[ta["type"]][1]] + ta["nb"][1:]
        return self.view_entry("VIEW", a, ne, nb, offs, {"offset": offs})

    def cont(self, a):
        return self.node("CONT", self.t[a]["type"], self.t[a]["ne"], [a])

    def need_rows(self, a):
        return a if dense_rows(self.t[a]) else self.cont(a)

    def need_contiguous(self, a):
        return a if is_packed(self.t[a]) else self.cont(a)

    # --- random pieces -----------------------------------------------------------------------
    def shape(self):
        c = self.c
        return [c.pick((1, 3, 4, 6, 16, 32, 64, 96, 256)), c.int(1, 6), c.int(1, 3), c.int(1, 2)]

    def divisor(self, n):
        return self.c.pick([d for d in range(1, n + 1) if n % d == 0])

    def bcast_shape(self, ne):
        """A shape that repeats to ne (ggml_can_repeat): each dim a divisor of ne's."""
        return [self.c.pick((n, 1, self.divisor(n))) for n in ne]

    def some_view(self, a):
        """a, or a view of it: permuted, transposed, a sub-block, or reshaped."""
        c, ta = self.c, self.t[a]
        kind = c.pick(("none", "none", "permute", "transpose", "view", "reshape"))
        if kind == "permute":
            axes = c.pick(((0, 2, 1, 3), (1, 0, 2, 3), (0, 1, 3, 2), (2, 0, 1, 3), (0, 3, 2, 1), (3, 2, 1, 0)))
            return self.permute(a, axes)
        if kind == "transpose" and TYPES[ta["type"]][0] == 1:
            return self.transpose(a)
        if kind == "view" and dense_rows(ta) and TYPES[ta["type"]][0] == 1:
            ne = [c.int(1, n) for n in ta["ne"]]
            start = [c.int(0, n - m) for n, m in zip(ta["ne"], ne)]
            return self.view(a, ne, start)
        if kind == "reshape" and is_contiguous(ta):
            ne = ta["ne"]
            merged = c.pick(([ne[0], ne[1] * ne[2], ne[3], 1], [ne[0] * ne[1], ne[2], ne[3], 1],
                             [ne[0], ne[1], ne[2] * ne[3], 1], [ne[0], 1, ne[1], ne[2] * ne[3]]))
            if TYPES[ta["type"]][0] == 1 or merged[0] == ne[0]:
                return self.reshape(a, merged)
        return a

    def float_input(self, ne, type="F32", lo=-1.0, hi=1.0):
        return self.input(type, ne, ("uniform", lo, hi))

    def operand(self, type, ne, lo=-1.0, hi=1.0):
        """An input of shape ne: plain, a view into a bigger input (test-backend-ops' `v`
        cases), or made in permuted order and permuted back."""
        c = self.c
        kind = c.pick(("plain", "plain", "view", "permuted"))
        if kind == "view" and TYPES[type][0] == 1:
            grow = [c.pick((1, 2)), c.pick((1, 2)), c.pick((1, 2)), 1]
            big = self.input(type, [n * k for n, k in zip(ne, grow)], ("uniform", lo, hi))
            start = [c.int(0, n * (k - 1)) for n, k in zip(ne, grow)]
            return self.view(big, list(ne), start)
        if kind == "permuted" and TYPES[type][0] == 1:
            axes = c.pick(((0, 2, 1, 3), (1, 0, 2, 3), (0, 1, 3, 2)))
            inv = [0] * 4
            for i, ax in enumerate(axes):
                inv[ax] = i
            made = self.input(type, [ne[inv[j]] for j in range(4)], ("uniform", lo, hi))
            return self.permute(made, axes)
        return self.input(type, ne, ("uniform", lo, hi))

    # --- op templates: each takes the current tensor and returns the new one, or None ----------
    def mul_mat(self, x):
        c, tx = self.c, self.t[x]
        if tx["type"] not in ("F32", "F16"):
            return None
        k = tx["ne"][0]
        if c.pick(("weights", "weights", "weights", "activations")) == "activations" and tx["type"] == "F32":
            # x as src0 (an attention-like product): src1 a new F32 input broadcast over x
            if tx["nb"][0] > tx["nb"][1] or not dense_rows(tx):
                x = self.cont(x)
                tx = self.t[x]
            n = c.pick((1, 2, 5, 8))
            r2, r3 = c.pick((1, 2)), c.pick((1, 2))
            b = self.operand("F32", [k, n, tx["ne"][2] * r2, tx["ne"][3] * r3])
            if not dense_rows(self.t[b]):
                b = self.cont(b)
            tb = self.t[b]
            return self.node("MUL_MAT", "F32", [tx["ne"][1], tb["ne"][1], tb["ne"][2], tb["ne"][3]], [x, b])
        wt = "F16" if tx["type"] == "F16" else c.pick(WEIGHT_TYPES)   # F16 src1: src0's vec_dot_type
        blck = TYPES[wt][0]
        if k % blck:                              # first an F32 projection to rows the blocks fit
            x = self.need_rows(x)
            tx = self.t[x]
            kp = blck * c.pick((1, 2)) if blck < 256 else 256
            w = self.input("F32", [k, kp, 1, 1], ("uniform", -(3.0 / k) ** 0.5, (3.0 / k) ** 0.5))
            x = self.node("MUL_MAT", "F32", [kp] + tx["ne"][1:], [w, x])
            tx, k = self.t[x], kp
        cols = tx["ne"][1] * tx["ne"][2] * tx["ne"][3]
        if wt != "F32" and cols < 16:
            # src1 is rounded to src0's vec_dot_type (Q8_0, Q8_1, Q8_K, F16, BF16): on a handful
            # of dot products with cancelling terms that rounding alone can pass 5e-4 NMSE, for
            # ggml as for ggml_lite, so at least 16 outputs, as test-backend-ops' m = 16
            m = c.pick((16, 33))
        else:
            m = c.pick((1, 3, 8, 16, 33))
        w2, w3 = self.divisor(tx["ne"][2]), self.divisor(tx["ne"][3])
        scale = (3.0 / k) ** 0.5                  # keeps values about as large as x's
        if c.pick((False, False, True)):          # weights made permuted, then permuted back
            w = self.input(wt, [k, w2, m, w3], ("uniform", -scale, scale))
            w = self.permute(w, (0, 2, 1, 3))
        else:
            w = self.input(wt, [k, m, w2, w3], ("uniform", -scale, scale))
        if not dense_rows(tx):
            x = self.cont(x)
            tx = self.t[x]
        return self.node("MUL_MAT", "F32", [m, tx["ne"][1], tx["ne"][2], tx["ne"][3]], [w, x])

    def binary(self, x, earlier):
        c = self.c
        op = c.pick(BINARY)
        x = self.need_rows(x)
        tx = self.t[x]
        same = [e for e in earlier if self.t[e]["ne"] == tx["ne"] and self.t[e]["type"] == tx["type"]]
        if op != "DIV" and same and c.pick((False, True)):
            b = c.pick(same)
        else:
            lo, hi = (0.9, 1.1) if op in ("MUL", "DIV") else (-1.0, 1.0)
            tb = "F32" if tx["type"] == "F32" else c.pick(("F32", tx["type"]))
            b = self.operand(tb, self.bcast_shape(tx["ne"]), lo, hi)
        return self.node(op, tx["type"], tx["ne"], [x, b])

    def scale(self, x):
        if self.t[x]["type"] != "F32":
            return None
        x = self.need_contiguous(x)
        s = self.c.pick((0.5, 2.0, -1.25, 0.125))
        bias = self.c.pick((0.0, 0.0, 0.5))
        return self.node("SCALE", "F32", self.t[x]["ne"], [x], {"s": s, "b": bias})

    def norm(self, x):
        if self.t[x]["type"] != "F32":
            return None
        x = self.need_rows(x)
        op = self.c.pick(("RMS_NORM", "NORM"))
        eps = self.c.pick((1e-6, 1e-5, 1e-1))
        return self.node(op, "F32", self.t[x]["ne"], [x], {"eps": eps})

    def soft_max(self, x):
        c = self.c
        if self.t[x]["type"] != "F32":
            return None
        x = self.need_contiguous(x)
        ne = self.t[x]["ne"]
        if c.pick(("mask", "mask", "causal", "plain")) == "causal":
            x = self.node("DIAG_MASK_INF", "F32", ne, [x], {"n_past": c.int(0, 3)})
            return self.node("SOFT_MAX", "F32", ne, [x, None], {"scale": 1.0, "max_bias": 0.0})
        mask = None
        max_bias = 0.0
        if c.pick((True, False)):
            mt = c.pick(("F32", "F16"))
            mask = self.input(mt, [ne[0], ne[1] + c.pick((0, 0, 3)), self.divisor(ne[2]), self.divisor(ne[3])])
            max_bias = c.pick((0.0, 0.0, 8.0))
        scale = c.pick((1.0, 0.125, 0.5))
        return self.node("SOFT_MAX", "F32", ne, [x, mask], {"scale": scale, "max_bias": max_bias})

    def rope(self, x):
        c, tx = self.c, self.t[x]
        if tx["type"] not in ("F32", "F16") or tx["ne"][0] % 2 or tx["ne"][3] != 1:
            return None
        x = self.need_rows(x)
        tx = self.t[x]
        ne0 = tx["ne"][0]
        n_dims = c.pick(sorted({ne0, max(2, ne0 // 2 // 2 * 2)}))
        mode = c.pick((0, 2))
        pos = self.input("I32", [tx["ne"][2]], ("int", 0, 512))
        ff = self.input("F32", [n_dims // 2], ("uniform", 0.9, 1.1)) if c.pick((False, True)) else None
        yarn = c.pick((False, True))
        p = {"n_dims": n_dims, "mode": mode, "n_ctx_orig": 4096 if yarn else 0, "freq_base": 10000.0,
             "freq_scale": c.pick((1.0, 0.25)) if yarn else 1.0,
             "ext_factor": c.pick((0.0, 0.75)) if yarn else 0.0,
             "attn_factor": c.pick((1.0, 1.4245)), "beta_fast": 32.0, "beta_slow": 1.0}
        return self.node("ROPE", tx["type"], tx["ne"], [x, pos, ff], p)

    def get_rows(self, x):
        c, tx = self.c, self.t[x]
        if tx["type"] not in ("F32", "F16", "BF16") or not dense_rows(tx):
            return None
        r = c.int(1, 5)
        idx = self.input("I32", [r, tx["ne"][2], tx["ne"][3]], ("int", 0, tx["ne"][1]))
        return self.node("GET_ROWS", "F32", [tx["ne"][0], r, tx["ne"][2], tx["ne"][3]], [x, idx])

    def copy(self, x):
        c, tx = self.c, self.t[x]
        if tx["type"] != "F32":
            return self.node("CONT", tx["type"], tx["ne"], [x]) if c.pick((False, True)) else None
        quant = [q for q in ("Q4_0", "Q4_1", "Q8_0") if tx["ne"][0] % 32 == 0]
        dt = c.pick(("F16", "BF16", "F32") + tuple(quant))
        if dt in QUANTIZED:
            x = self.need_rows(x)
            tx = self.t[x]
        dst = self.input(dt, tx["ne"], ("zero",))
        y = self.add({"op": "CPY", "type": dt, "ne": list(tx["ne"]), "nb": contiguous_nb(dt, tx["ne"]),
                      "src": [x, dst], "p": {}, "offs": 0, "src_type": tx["type"]})
        if dt in QUANTIZED:                        # back to F32 (dequantized) for what follows
            back = self.input("F32", tx["ne"], ("zero",))
            y = self.add({"op": "CPY", "type": "F32", "ne": list(tx["ne"]), "nb": contiguous_nb("F32", tx["ne"]),
                          "src": [y, back], "p": {}, "offs": 0, "src_type": dt})
        return y

    def unary(self, x):
        if self.t[x]["type"] not in ("F32", "F16") or not self.unary_kinds:
            return None
        x = self.need_contiguous(x)
        kind = self.c.pick(self.unary_kinds)
        return self.node("UNARY", self.t[x]["type"], self.t[x]["ne"], [x], {"kind": kind})

    def glu(self, x, earlier):
        c, tx = self.c, self.t[x]
        if tx["type"] not in ("F32", "F16") or not self.glu_kinds:
            return None
        x = self.need_contiguous(x)
        tx = self.t[x]
        kind = c.pick(self.glu_kinds)
        oai = {}
        if kind == "SWIGLU_OAI":
            # ggml_swiglu_oai(a, b, alpha, limit) is split only, and ggml's CPU kernel F32 only
            if tx["type"] != "F32":
                return None
            oai = {"alpha": 1.702, "limit": c.pick((7.0, 0.5))}
        if not oai and c.pick(("fused", "split")) == "fused":
            if tx["ne"][0] < 2:
                return None
            swapped = c.pick((False, True))
            ne = [tx["ne"][0] // 2] + tx["ne"][1:]
            return self.node("GLU", tx["type"], ne, [x, None], {"kind": kind, "swapped": swapped})
        same = [e for e in earlier if self.t[e]["ne"] == tx["ne"] and self.t[e]["type"] == tx["type"]
                and is_packed(self.t[e])]
        if same and c.pick((False, True)):
            g = c.pick(same)
        else:
            g = self.need_contiguous(self.operand(tx["type"], tx["ne"]))
        swap = c.pick((False, True))              # x as the gate or as the value
        src = [g, x] if swap else [x, g]
        return self.node("GLU", tx["type"], tx["ne"], src, {"kind": kind, "swapped": False, **oai})

    def concat(self, x):
        c, tx = self.c, self.t[x]
        if tx["type"] != "F32":
            return None
        dim = c.int(0, 3)
        ne_b = list(tx["ne"])
        ne_b[dim] = c.int(1, 4)
        b = self.operand("F32", ne_b)
        src = [x, b] if c.pick((False, True)) else [b, x]
        ne = list(tx["ne"])
        ne[dim] += ne_b[dim]
        return self.node("CONCAT", "F32", ne, src, {"dim": dim})

    def reduce(self, x):
        c, tx = self.c, self.t[x]
        if tx["type"] != "F32":
            return None
        op = c.pick(("SUM_ROWS", "SUM_ROWS", "MEAN", "SUM"))
        if op == "SUM_ROWS":
            x = self.need_rows(x)
        else:
            x = self.need_contiguous(x)
        ne = [1, 1, 1, 1] if op == "SUM" else [1] + self.t[x]["ne"][1:]
        return self.node(op, "F32", ne, [x])

    def repeat(self, x):
        c, tx = self.c, self.t[x]
        if tx["type"] != "F32" or nelements(tx) > 512:
            return None
        x = self.need_contiguous(x)
        ne = [n * c.pick((1, 1, 2, 3)) for n in self.t[x]["ne"]]
        return self.node("REPEAT", "F32", ne, [x])


def generate(c, n_threads=None, unary_kinds=UNARY_KINDS, glu_kinds=GLU_KINDS) -> dict:
    """One random graph: a start tensor (an input, or rows of a weight table), then 1-4 steps,
    each an op on the current tensor (perhaps seen through a view first), some reusing earlier
    results. Every compute node is a graph output."""
    g = _Graph(c, list(unary_kinds), list(glu_kinds))
    seed = c.int(0, 2 ** 31 - 1)
    if c.pick(("input", "input", "embedding")) == "embedding":
        ne0 = c.pick((32, 64, 256))
        wt = c.pick([t for t in WEIGHT_TYPES if ne0 % TYPES[t][0] == 0])
        table = g.input(wt, [ne0, 7, c.int(1, 2), 1])
        idx = g.input("I32", [c.int(1, 5), g.t[table]["ne"][2], 1], ("int", 0, 7))
        x = g.node("GET_ROWS", "F32", [ne0, g.t[idx]["ne"][0], g.t[table]["ne"][2], 1], [table, idx])
    else:
        x = g.float_input(g.shape(), c.pick(("F32", "F32", "F32", "F16", "BF16")))
    steps = c.int(1, 4)
    templates = ("mul_mat", "mul_mat", "binary", "binary", "scale", "norm", "soft_max", "rope",
                 "get_rows", "copy", "unary", "glu", "concat", "reduce", "repeat")
    done = 0
    tries = 0
    while done < steps and tries < 4 * steps and len(g.t) < MAX_NODES:
        tries += 1
        earlier = [i for i, t in enumerate(g.t) if t["op"] != "INPUT"]
        if c.pick((False, False, True)):
            x = g.some_view(x)
        name = c.pick(templates)
        fn = getattr(g, name)
        y = fn(x, earlier) if name in ("binary", "glu") else fn(x)
        if y is None:
            continue
        x, done = y, done + 1
        if name == "reduce":                      # a tensor of sums ends the graph: a single
            break                                 # value makes NMSE a test of one rounding
    if g.t[x]["op"] in ("INPUT",) + VIEW_OPS:       # end on a computed node
        x = g.cont(x)
    return {"seed": seed, "n_threads": n_threads or c.int(1, 4),
            "via": c.pick(("backend", "plan")), "tensors": g.t}


def compute_nodes(spec):
    """Indices of the entries that are computed (not inputs, not views): the compared nodes."""
    return [i for i, t in enumerate(spec["tensors"]) if t["op"] not in ("INPUT",) + VIEW_OPS]


def input_data(spec, i) -> np.ndarray:
    """Input i's contents from the spec's seed, the same on every side: float32 values shaped
    (ne3, ne2, ne1, ne0) for float and quantized types (F16 / BF16 / quantized: the side
    converts them), int32 for I32."""
    t = spec["tensors"][i]
    ne = t["ne"]
    shape = (ne[3], ne[2], ne[1], ne[0])
    rng = np.random.default_rng([spec["seed"], i])
    kind = t["init"][0]
    if kind == "zero":
        return np.zeros(shape, np.int32 if t["type"] == "I32" else np.float32)
    if kind == "int":
        return rng.integers(t["init"][1], t["init"][2], size=shape).astype(np.int32)
    lo, hi = t["init"][1], t["init"][2]
    return rng.uniform(lo, hi, size=shape).astype(np.float32)


def f32_to_f16_bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).view(np.uint16)


def f32_to_bf16_bits(x) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even; NaN -> quiet NaN."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 64, rne).astype(np.uint16)


def plain_bytes(type, values) -> np.ndarray:
    """The bytes of a non-quantized input (contiguous), from input_data's values."""
    if type == "F32":
        raw = np.ascontiguousarray(values, np.float32)
    elif type == "F16":
        raw = f32_to_f16_bits(values)
    elif type == "BF16":
        raw = f32_to_bf16_bits(values)
    elif type == "I32":
        raw = np.ascontiguousarray(values, np.int32)
    else:
        raise ValueError(f"{type} is quantized: quantize with the side's own library")
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)


def build(api, spec, ctx_in, ctx_graph, outputs=None):
    """Make the spec's tensors with `api` (ggml_lite, or real ggml behind the same names):
    inputs in ctx_in (flagged inputs), everything else in ctx_graph, the compute nodes in
    `outputs` (default: all) flagged outputs. Returns the tensors, index for index."""
    outputs = set(compute_nodes(spec) if outputs is None else outputs)
    ts = []
    for i, t in enumerate(spec["tensors"]):
        op, p, ne = t["op"], t.get("p", {}), t["ne"]
        s = [ts[j] if j is not None else None for j in t.get("src", [])]
        ctx = ctx_graph
        if op == "INPUT":
            r = api.new_tensor_4d(ctx_in, api.type(t["type"]), *ne)
            api.set_input(r)
        elif op == "PERMUTE":
            r = api.permute(ctx, s[0], *p["axes"])
        elif op == "TRANSPOSE":
            r = api.transpose(ctx, s[0])
        elif op == "RESHAPE":
            r = api.reshape_4d(ctx, s[0], *ne)
        elif op == "VIEW":
            r = api.view_4d(ctx, s[0], *ne, t["nb"][1], t["nb"][2], t["nb"][3], p["offset"])
        elif op == "CONT":
            r = api.cont(ctx, s[0])
        elif op == "CPY":
            r = api.cpy(ctx, s[0], s[1])
        elif op in BINARY:
            r = getattr(api, op.lower())(ctx, s[0], s[1])
        elif op == "MUL_MAT":
            r = api.mul_mat(ctx, s[0], s[1])
        elif op == "SCALE":
            r = api.scale_bias(ctx, s[0], p["s"], p["b"]) if p["b"] else api.scale(ctx, s[0], p["s"])
        elif op == "RMS_NORM":
            r = api.rms_norm(ctx, s[0], p["eps"])
        elif op == "NORM":
            r = api.norm(ctx, s[0], p["eps"])
        elif op == "DIAG_MASK_INF":
            r = api.diag_mask_inf(ctx, s[0], p["n_past"])
        elif op == "SOFT_MAX":
            r = api.soft_max_ext(ctx, s[0], s[1], p["scale"], p["max_bias"])
        elif op == "ROPE":
            r = api.rope_ext(ctx, s[0], s[1], s[2], p["n_dims"], p["mode"], p["n_ctx_orig"], p["freq_base"],
                             p["freq_scale"], p["ext_factor"], p["attn_factor"], p["beta_fast"], p["beta_slow"])
        elif op == "GET_ROWS":
            r = api.get_rows(ctx, s[0], s[1])
        elif op == "UNARY":
            r = api.unary(ctx, s[0], api.unary_op(p["kind"]))
        elif op == "GLU":
            if p["kind"] == "SWIGLU_OAI":
                r = api.swiglu_oai(ctx, s[0], s[1], p["alpha"], p["limit"])
            elif s[1] is None:
                r = api.glu(ctx, s[0], api.glu_op(p["kind"]), p["swapped"])
            else:
                r = api.glu_split(ctx, s[0], s[1], api.glu_op(p["kind"]))
        elif op == "CONCAT":
            r = api.concat(ctx, s[0], s[1], p["dim"])
        elif op in ("SUM_ROWS", "MEAN", "SUM"):
            r = getattr(api, op.lower())(ctx, s[0])
        elif op == "REPEAT":
            r = api.repeat_4d(ctx, s[0], *ne)
        else:
            raise ValueError(f"unknown op {op}")
        api.set_name(r, f"t{i}")
        if i in outputs:
            api.set_output(r)
        ts.append(r)
    return ts


def describe(spec) -> str:
    """One line per entry, for failure messages."""
    lines = [f"seed={spec['seed']} n_threads={spec['n_threads']} via={spec['via']}"]
    for i, t in enumerate(spec["tensors"]):
        extra = f" init={t['init']}" if t["op"] == "INPUT" else f" src={t['src']} p={t.get('p', {})}"
        lines.append(f"  #{i} {t['op']} {t['type']} ne={t['ne']} nb={t['nb']}{extra}")
    return "\n".join(lines)
