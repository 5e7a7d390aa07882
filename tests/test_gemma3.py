"""The second architecture, gemma3, against real llama.cpp (llama-cpp-python 0.3.36): logits of a
prompt and of greedy steps through the KV cache, past the sliding window, on random-weight files
written by ggml_lite's writer; the architecture table; both masks; graph reuse with both; the
tokenizer without a space prefix and with Gemma's turn markers; the loader's errors for gemma3
files. Fixtures: tests/ggml_ref/gemma3_ref.py."""
import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ggml_lite import llama  # noqa: E402
from ggml_lite.core import GGMLError  # noqa: E402
from ggml_lite.llama import graph as G  # noqa: E402
from ggml_lite.types import Type  # noqa: E402

DATA = Path(__file__).parent / "data"
REF = np.load(DATA / "gemma3_ref.npz")
META = json.loads((DATA / "gemma3_ref.json").read_text(encoding="utf-8"))
MODELS = list(META["models"])
# as tests/test_llama.py: test-backend-ops' limits, 1e-6 for F32 weights, mul_mat's 5e-4 for the rest
LIMIT = {name: 1e-6 if name == "f32" else 5e-4 for name in MODELS}


_files = {}


def gemma3_file(name):
    """The test model, written by the package's writer into a temporary directory (once per
    run): the files are not stored. Its bytes must be the ones llama.cpp's fixture ran on."""
    if name not in _files:
        import hashlib
        import tempfile
        path = llama.writer.write_gemma3_test_model(
            Path(tempfile.mkdtemp()) / f"gemma3_{name}.gguf", DATA / "llama_vocab_spm.gguf",
            Type[name.upper()])
        assert hashlib.sha256(path.read_bytes()).hexdigest() == META["files"][name]["sha256"]
        _files[name] = path
    return _files[name]


def nmse(a, b):
    return float(((a.astype(np.float64) - b) ** 2).sum() / (b.astype(np.float64) ** 2).sum())


_loaded = {}


def model(name, **kw):
    key = (name, tuple(sorted(kw.items())))
    if key not in _loaded:
        _loaded[key] = llama.load(gemma3_file(name), n_ctx=META["n_ctx"], n_threads=2,
                                  progress=False, **kw)
    return _loaded[key]


def test_the_file_has_every_feature():
    """What the fixture is meant to exercise, read back from the loaded model."""
    m = model("f32")
    hp = m.hparams
    assert hp.arch == "gemma3" and llama.LLM_ARCHS["gemma3"].build_graph is G.llm_build_gemma3
    assert hp.n_layer == 6 and hp.swa_layers == (0, 1, 2, 3, 4) and not hp.is_swa(5)
    assert hp.n_swa == META["n_swa"] < len(META["models"]["f32"]["prompt_tokens"])
    assert hp.n_head_kv < hp.n_head and hp.n_embd_head * hp.n_head != hp.n_embd
    assert list(m.w(0, "attn_q").ne[:2]) == [hp.n_embd, hp.n_embd_head * hp.n_head]
    assert list(m.w(0, "attn_output").ne[:2]) == [hp.n_embd_head * hp.n_head, hp.n_embd]
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(str(gemma3_file("f32"))).tensors}
    assert (hp.rope_freq_base, hp.rope_freq_base_swa) == (1e6, 1e4)
    assert hp.f_attention_scale == pytest.approx(1 / np.sqrt(hp.n_embd_head), rel=1e-15)
    assert hp.f_final_logit_softcapping == 0.0


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_llama_cpp(name):
    m, info = model(name), META["models"][name]
    tokens = m.tokenize(META["prompt"])
    assert tokens == info["prompt_tokens"]
    logits = m.eval(tokens)
    assert logits.shape == (len(tokens), m.hparams.n_vocab) and logits.dtype == np.float32
    errs = [nmse(logits[i], REF[f"{name}_prompt"][i]) for i in range(len(tokens))]
    assert max(errs) <= LIMIT[name], errs
    for step, tok in enumerate(info["greedy"]):                # one token at a time, past the window
        row = m.eval([tok], n_past=len(tokens) + step)
        assert nmse(row[0], REF[f"{name}_steps"][step]) <= LIMIT[name], step


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_is_llama_cpps(name):
    m, info = model(name), META["models"][name]
    assert m.generate(info["prompt_tokens"], len(info["greedy"]), stop_at_eos=False) == info["greedy"]


def test_the_window_matters():
    """The same file with a window wider than the context (the sliding layers' mask then equals the
    causal one): the logits of the positions inside the window are llama.cpp's bit for bit as
    before, those past it are not."""
    tokens = META["models"]["f32"]["prompt_tokens"]
    m = llama.load(gemma3_file("f32"), n_ctx=META["n_ctx"], n_threads=2, progress=False)
    windowed = m.eval(tokens)
    m.hparams = llama.LlamaHParams(**{**m.hparams.__dict__, "n_swa": 10**6})
    m.last_graph = None
    wide = m.eval(tokens)
    n = META["n_swa"]
    assert np.array_equal(wide[:n], windowed[:n])
    assert min(nmse(wide[i], REF["f32_prompt"][i]) for i in range(n + 1, len(tokens))) > 1e-4


def test_masks_are_llama_cpps():
    """llama_kv_cache::set_input_kq_mask: causal, and for the sliding layers also p1 - p0 >= n_swa
    masked (LLAMA_SWA_TYPE_STANDARD)."""
    causal = G._causal_mask(3, 6, 12)
    swa = G._causal_mask(3, 6, 12, 5)
    for i in range(3):
        p1 = 6 + i
        for p0 in range(12):
            assert (causal[i, p0] == 0) == (p0 <= p1)
            assert (swa[i, p0] == 0) == (p0 <= p1 and p1 - p0 < 5)
    assert np.isneginf(swa[swa != 0]).all()


def test_two_mask_inputs_and_which_layer_reads_which():
    m = model("q8_0")
    g = llama.build_graph(m, 4, 64, 4)
    assert g.kq_mask.name == "attn_inp_kq_mask" and g.kq_mask_swa.name == "attn_inp_kq_mask_swa"
    assert list(g.kq_mask_swa.ne[:2]) == [64, 4] and g.n_swa == META["n_swa"]
    import ggml_lite as ggml
    masks = {}
    for node in ggml.graph_nodes(g.gf):
        if node.name.startswith("kq_soft_max-"):
            masks[int(node.name.split("-")[1])] = node.src[1].name
    assert masks == {il: "attn_inp_kq_mask_swa" if il < 5 else "attn_inp_kq_mask" for il in range(6)}


def _count(monkeypatch, module, name, counts, key):
    real = getattr(module, name)

    def counted(*a, **kw):
        counts[key] += 1
        return real(*a, **kw)
    monkeypatch.setattr(module, name, counted)


def test_decode_reuses_one_graph_with_both_masks(monkeypatch):
    """Every decode step after the first reuses the graph (can_reuse holds with both masks), the
    masks are set anew each step, and the logits are those of a graph built for every step."""
    import ggml_lite.sched as sched_module
    tokens = META["models"]["q8_0"]["prompt_tokens"]
    greedy = META["models"]["q8_0"]["greedy"]
    m = llama.load(gemma3_file("q8_0"), n_ctx=META["n_ctx"], n_threads=1, progress=False)
    counts = dict(build=0, alloc=0)
    _count(monkeypatch, llama, "build_graph", counts, "build")
    _count(monkeypatch, sched_module, "gallocr_alloc_graph", counts, "alloc")
    m.eval(tokens, logits_all=False)
    rows = [m.eval([t], n_past=len(tokens) + i)[0] for i, t in enumerate(greedy)]
    assert counts == dict(build=2, alloc=2), counts
    assert m.timings["n_reused"] == len(greedy) - 1
    g = m.last_graph
    assert g.can_reuse(1, 1, g.n_kv) and not g.can_reuse(1, 1, g.n_kv + 1) and not g.can_reuse(2, 1, g.n_kv)
    for i, row in enumerate(rows):
        assert nmse(row, REF["q8_0_steps"][i]) <= 5e-4, i
    monkeypatch.undo()
    monkeypatch.setenv("LLAMA_GRAPH_REUSE_DISABLE", "1")
    m2 = llama.load(gemma3_file("q8_0"), n_ctx=META["n_ctx"], n_threads=1, progress=False)
    m2.eval(tokens, logits_all=False)
    rebuilt = [m2.eval([t], n_past=len(tokens) + i)[0] for i, t in enumerate(greedy)]
    assert m2.timings["n_reused"] == 0 and np.array_equal(np.stack(rows), np.stack(rebuilt))


def test_end_of_generation_tokens_are_llama_cpps():
    m = model("f32")
    assert sorted(m.eog) == META["eog"] == [m.vocab.eos, m.vocab.text_to_id[b"<end_of_turn>"]]


def test_generation_stops_at_end_of_turn(monkeypatch):
    m = model("f32")
    end = m.vocab.text_to_id[b"<end_of_turn>"]
    # a model that always prefers <end_of_turn>: generate stops there, as llama.cpp at any EOG
    real = llama._eval

    def biased(mm, tokens, n_past, logits_all):
        out = real(mm, tokens, n_past, logits_all)
        out[:, end] = 1e9
        return out
    monkeypatch.setattr(llama, "_eval", biased)
    assert m.generate(META["models"]["f32"]["prompt_tokens"], 10) == [end]


@pytest.mark.parametrize("key", ["ids", "ids_bos", "ids_special", "detok", "detok_special"])
def test_tokenizer_matches_llama_cpp(key):
    """No space prefix (add_space_prefix = false), <start_of_turn>/<end_of_turn> as control tokens,
    byte fallback."""
    v = model("f32").vocab
    assert v.add_space_prefix is False
    for case in META["tokenizer"]:
        text = case["text"]
        got = {"ids": lambda: v.tokenize(text, False), "ids_bos": lambda: v.tokenize(text, True),
               "ids_special": lambda: v.tokenize(text, True, True),
               "detok": lambda: v.detokenize(case["ids_special"]),
               "detok_special": lambda: v.detokenize(case["ids_special"], unparse_special=True)}[key]()
        assert got == case[key], (text, got, case[key])


def test_writer_writes_gemma3_keys():
    r = gguf.GGUFReader(str(gemma3_file("q8_0")))
    f = lambda k: r.fields[k].contents()
    assert f("general.architecture") == "gemma3"
    assert (f("gemma3.attention.key_length"), f("gemma3.attention.value_length")) == (32, 32)
    assert f("gemma3.attention.sliding_window") == META["n_swa"]
    assert f("tokenizer.ggml.add_space_prefix") is False
    assert "gemma3.attention.sliding_window_pattern" not in r.fields            # llama.cpp's default 6
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_q_norm.weight"] == "F32"


def test_writer_round_trip_of_an_unusual_pattern(tmp_path):
    hp = llama.LlamaHParams(**{**model("f32").hparams.__dict__, "swa_layers": (1, 3)})
    path = tmp_path / "p.gguf"
    llama.write_llama_gguf(path, hp, model("f32").vocab, Type.F32, seed=1, tied=True)
    m = llama.load(path, n_ctx=16, n_threads=1, progress=False)
    assert m.hparams.swa_layers == (1, 3) and m.hparams == hp


# --- the loader's errors: a copy of the good file with one thing changed ----------------------

def rewrite(dst, drop_keys=(), set_keys=None, drop_tensors=(), retype=None):
    r = gguf.GGUFReader(str(gemma3_file("f32")))
    w = gguf.GGUFWriter(str(dst), "gemma3")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        if set_keys and key in set_keys:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub)
    for key, (value, vtype) in (set_keys or {}).items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        data, raw = (retype[t.name] if retype and t.name in retype else (np.array(t.data), t.tensor_type))
        w.add_tensor(t.name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def load_error(path):
    with pytest.raises(GGMLError) as e:
        llama.load(path, n_ctx=32, progress=False)
    return str(e.value)


def test_rewrite_of_the_good_file_loads(tmp_path):
    m = llama.load(rewrite(tmp_path / "same.gguf"), n_ctx=META["n_ctx"], progress=False, n_threads=1)
    tokens = META["models"]["f32"]["prompt_tokens"]
    assert nmse(m.eval(tokens)[-1], REF["f32_prompt"][-1]) <= 1e-6


@pytest.mark.parametrize("key", ["gemma3.embedding_length", "gemma3.block_count", "gemma3.context_length",
                                 "gemma3.attention.layer_norm_rms_epsilon", "gemma3.attention.head_count",
                                 "gemma3.feed_forward_length"])
def test_missing_key(tmp_path, key):
    assert f"key not found in model: {key}" in load_error(rewrite(tmp_path / "k.gguf", drop_keys=[key]))


def test_no_sliding_window_key_means_every_layer_global(tmp_path):
    m = llama.load(rewrite(tmp_path / "w.gguf", drop_keys=["gemma3.attention.sliding_window"]), n_ctx=32,
                   progress=False, n_threads=1)
    assert m.hparams.n_swa == 0 and m.hparams.swa_layers == () and m.reserve_graph.kq_mask_swa is None


@pytest.mark.parametrize("name", ["blk.5.attn_q_norm.weight", "blk.0.post_attention_norm.weight",
                                  "blk.3.post_ffw_norm.weight", "output_norm.weight"])
def test_missing_tensor(tmp_path, name):
    assert f"missing tensor '{name}'" in load_error(rewrite(tmp_path / "t.gguf", drop_tensors=[name]))


def test_bad_keys_and_tensors(tmp_path):
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    msg = load_error(rewrite(tmp_path / "a.gguf", set_keys={"gemma3.attention.key_length": (16, u32)}))
    assert "key_length = 16, value_length = 32, rope.dimension_count = 16" in msg
    msg = load_error(rewrite(tmp_path / "b.gguf", set_keys={"gemma3.attention.head_count_kv": (3, u32)}))
    assert "n_head = 2, n_head_kv = 3: n_head_kv must divide n_head" in msg
    msg = load_error(rewrite(tmp_path / "c.gguf", set_keys={"gemma3.rope.freq_base": (0.0, f32)}))
    assert "gemma3.rope.freq_base = 0.0 must be a positive number" in msg
    wrong = np.zeros((32, 32), np.float32)                     # attn_q must be [32, 64]
    msg = load_error(rewrite(tmp_path / "d.gguf", retype={"blk.0.attn_q.weight": (wrong, None)}))
    assert "tensor 'blk.0.attn_q.weight' has wrong shape; expected [32, 64], got [32, 32]" in msg
    msg = load_error(rewrite(tmp_path / "e.gguf", retype={"blk.2.attn_k_norm.weight": (np.ones(16, np.float32),
                                                                                        None)}))
    assert "tensor 'blk.2.attn_k_norm.weight' has wrong shape; expected [32], got [16]" in msg


def test_an_unknown_architecture_names_the_known_ones(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    w.add_key_value("gemma2.block_count", 6, gguf.GGUFValueType.UINT32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert ("general.architecture is 'gemma2'; this loader reads 'llama', 'gemma3' models"
            in load_error(tmp_path / "g.gguf"))


@pytest.mark.parametrize("name", MODELS)
def test_cuda_and_cpu_through_the_scheduler(name):
    """All layers on CUDA0 (the embeddings on the CPU; a node CUDA does not take runs on the CPU):
    llama.cpp's logits within mul_mat's limit, prompt and steps past the window. Skipped on a
    machine without a GPU."""
    import ggml_lite as ggml
    ggml.backend_load_all()
    cuda = ggml.backend_init_by_name("CUDA0")
    if cuda is None:
        pytest.skip("no CUDA device here")
    m = llama.load(gemma3_file(name), n_ctx=META["n_ctx"], n_threads=1, progress=False,
                   backends=[cuda, ggml.backend_cpu_init()])
    info = META["models"][name]
    logits = m.eval(info["prompt_tokens"])
    assert max(nmse(logits[i], REF[f"{name}_prompt"][i]) for i in range(len(logits))) <= 5e-4
    for step, tok in enumerate(info["greedy"][:8]):
        row = m.eval([tok], n_past=len(logits) + step)
        assert nmse(row[0], REF[f"{name}_steps"][step]) <= 5e-4, step


@pytest.mark.parametrize("name", MODELS)
def test_the_writer_remakes_the_files_llama_cpp_ran_on(name):
    path = gemma3_file(name)                      # asserts the sha256 the fixture recorded
    assert path.stat().st_size == META["files"][name]["bytes"]
