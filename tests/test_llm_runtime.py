"""Generation libraries (generate: / compile(generate=...)): prefill + decode entries over one
static KV cache, the C ABI and Python generate, against onnxruntime-genai on decoders its own
model builder writes (cuvil/generation.py, backends/native/generation.py)."""
from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from tests.helpers import DECODER_CONFIG, genai_decoder
from cuvil.errors import CuvilError, RuntimeFailure

ROOT = Path(__file__).resolve().parents[1]
# one worker runs the module: its decoders are written and built once (module fixtures)
pytestmark = pytest.mark.xdist_group("llm_runtime")
# A LLaMA from a transformers config (tests/test_llm_ops.py uses the same shape)
GENERATE = {"max_context": 128, "prefill_buckets": [16]}
PROMPT = list(range(3, 40))    # 37 tokens: prefilled in chunks 16 + 16 + 5 (the last padded to 16)


def genai_greedy(folder: Path, prompt, new_tokens: int) -> list[int]:
    """onnxruntime-genai's greedy tokens after `prompt` (the oracle)."""
    import onnxruntime_genai as og
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("llm")


@pytest.fixture(scope="module")
def fp32(models):
    folder = genai_decoder(models, "fp32")
    lib = cuvil.compile(folder / "model.onnx", name="llm", generate={**GENERATE, "tokenizer": folder / "tokenizer.json"})
    return folder, lib


# -- fp32: the same tokens as onnxruntime-genai ------------------------------------------------

def test_greedy_tokens_equal_onnxruntime_genai_fp32(fp32):
    folder, lib = fp32
    want = genai_greedy(folder, PROMPT, 64)
    assert len(want) == 64
    # exact: float32 logits within ~1e-5 relative of onnxruntime's (tests/test_llm_ops.py) pick
    # the same argmax unless two logits tie that closely, which a seeded model does not hit here
    assert list(lib.generate(PROMPT, max_new_tokens=64)) == want
    assert lib.position == len(PROMPT) + 63   # the last token is returned, not decoded


def test_streaming_prefix_reset_and_one_token_prompt(fp32):
    folder, lib = fp32
    stream = lib.generate(PROMPT, max_new_tokens=64)
    first = [next(stream) for _ in range(5)]
    assert first == genai_greedy(folder, PROMPT, 5)
    # generate() resets: a second call starts again from the prompt
    assert list(lib.generate([7], max_new_tokens=10)) == genai_greedy(folder, [7], 10)
    lib.reset()
    assert lib.position == 0
    # a prompt of exactly one bucket, then continued with reset=False
    head = list(lib.generate(PROMPT[:16], max_new_tokens=3))
    assert head == genai_greedy(folder, PROMPT[:16], 3)


def test_weights_are_stored_once(fp32):
    folder, lib = fp32
    model = onnx.load(str(folder / "model.onnx"))
    model_bytes = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    memory = lib.info["memory"]
    # two entries (prefill 16, decode) read the same weights: stored once, the blob within 10 % of
    # the model's own initializers (alignment, packed layouts), not twice them
    assert memory["weights_bytes"] <= 1.1 * model_bytes, (memory, model_bytes)
    assert lib.artifacts.library.stat().st_size <= 1.1 * model_bytes + (2 << 20)
    assert [e["tokens"] for e in lib.info["generate"]["entries"]] == [1, 16]
    # the prefill entry computes the logits of the prompt's last row only (last_row_logits)
    assert [e["logits_rows"] for e in lib.info["generate"]["entries"]] == [1, 1]
    # the KV cache: 2 layers x key and value x [1, 2 kv heads, 128, 16] float32
    assert memory["kv_cache_bytes"] == 2 * 2 * 2 * 128 * 16 * 4


def _kv_rows(lib, session):
    """The session's KV cache as [pair, kv_heads, max_context, head] float32."""
    C, kv, head = 128, DECODER_CONFIG["num_key_value_heads"], DECODER_CONFIG["hidden_size"] // DECODER_CONFIG["num_attention_heads"]
    return session.kv_cache().view(np.float32).reshape(-1, kv, C, head)


def test_decode_writes_the_new_row_in_place(fp32):
    """No copy of past keys and values per token: a decode step changes only the row of its
    position in each layer's cache, in the buffer the session allocated once."""
    _, lib = fp32
    session = lib.session()
    address = session.kv_cache().ctypes.data
    session.prefill(PROMPT[:10])
    before = _kv_rows(lib, session).copy()
    assert np.abs(before[:, :, :10]).max() > 0 and not before[:, :, 16:].any()   # prefill bucket 16
    session.decode(5)
    after = _kv_rows(lib, session)
    changed = np.argwhere((after != before).any(axis=(0, 1, 3))).ravel().tolist()
    assert changed == [10]
    assert session.kv_cache().ctypes.data == address
    session.close()


def test_driver_binds_past_and_present_to_one_region(fp32):
    """The generated C: each entry's run copies nothing (the cache is written by the attention
    kernel in place), and every entry gets the same region for a layer's past and present."""
    from cuvil.build import VariantSpec, plan_variant, tool_versions
    from cuvil.cache import Cache, default_cache_dir
    from cuvil.dag import StepGraph
    folder, _ = fp32
    dag = StepGraph(Cache(default_cache_dir()), tool_versions())
    link = plan_variant(dag, VariantSpec(name="llm", source=folder / "model.onnx", generate=GENERATE))
    driver_c = dag.get(dag.step(link).deps[0])["driver.c"].decode()   # the codegen step, cached
    entries = driver_c.split("static int run_entry_")[1:]
    assert len(entries) == 2 and all("memcpy" not in e.split("\n}\n")[0] for e in entries)
    for k in range(2):
        binder = driver_c.split(f"static int gen_entry_{k}(")[1].split("\n}")[0]
        regions = [part.split(")")[0] for part in binder.split("s->kv + ")[1:]]
        assert len(regions) == 8 and sorted(regions[:4]) == sorted(regions[4:])   # 4 pasts, the same 4 presents


def test_context_full_and_bad_tokens_are_clear_errors(fp32):
    _, lib = fp32
    session = lib.session()
    session.prefill(list(range(3, 3 + 127)))              # bucket chunks up to the last free position
    session.decode(4)
    assert session.position == 128
    with pytest.raises(RuntimeFailure, match="code 4: context full: 128 tokens in the cache \\+ 1 new > max_context 128"):
        session.decode(5)
    session.reset()
    with pytest.raises(RuntimeFailure, match="context full"):
        session.prefill(list(range(3, 3 + 129)))
    with pytest.raises(RuntimeFailure, match="code 5: token 512 at index 1 is outside the vocabulary"):
        session.prefill([3, 512])
    assert session.position == 0
    with pytest.raises(RuntimeFailure, match="n must be at least 1"):
        session.prefill([])
    session.close()


def test_prefill_chunks_and_the_end_of_the_context(fp32):
    """A prompt longer than the bucket goes in chunks; where no bucket fits in what is left of the
    context, its tokens go through the decode entry: the logits are those of one prefill."""
    _, lib = fp32
    session = lib.session()
    prompt = [3 + (7 * i) % 500 for i in range(125)]
    whole = session.prefill(prompt)                  # 7 chunks of 16, then 13 in the bucket (128 = C)
    session.reset()
    session.prefill(prompt[:120])
    tail = session.prefill(prompt[120:])             # 120 + 16 > 128: five decode steps
    assert session.position == 125
    # the same function through kernels for 1 and 16 rows, which sum in other orders: float32
    # rounding (~1e-7 relative a product, over two layers and a softmax) stays far below 1e-4
    # of the largest logit
    assert np.abs(whole - tail).max() <= 1e-4 * np.abs(whole).max()
    assert np.argmax(whole) == np.argmax(tail)
    session.close()


def test_generate_text_through_the_tokenizer(fp32):
    folder, lib = fp32
    ids = genai_greedy(folder, [5, 6, 7], 8)
    text = lib.generate_text("t5 t6 t7", max_new_tokens=8)
    assert text == lib.tokenizer.decode(ids)
    assert "".join(lib.generate_text("t5 t6 t7", max_new_tokens=8, stream=True)) == "".join(
        lib.tokenizer.decode([i]) for i in ids)


# -- sampling: the C algorithm against numpy doing the same ------------------------------------

def splitmix64(state: int) -> tuple[int, int]:
    mask = (1 << 64) - 1
    state = (state + 0x9E3779B97F4A7C15) & mask
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31), state


def sample_reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float, state: int):
    """backends/native/generation.py's sampling, in Python floats (C doubles) and libm's exp."""
    if temperature <= 0 or top_k == 1:
        return int(np.argmax(logits)), state
    t = float(np.float32(temperature))
    x = [float(v) / t for v in logits]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    k = top_k if 0 < top_k < len(x) else len(x)
    order = order[:k]
    p = [math.exp(x[i] - x[order[0]]) for i in order]
    total = 0.0
    for v in p:
        total += v
    top_p = float(np.float32(top_p))
    if 0 < top_p < 1:
        want, acc = top_p * total, 0.0
        for j, v in enumerate(p):
            acc += v
            if acc >= want:
                k = j + 1
                break
        total = acc
    draw, state = splitmix64(state)
    target, acc = (draw >> 11) * (1.0 / 9007199254740992.0) * total, 0.0
    for j in range(k):
        acc += p[j]
        if target < acc:
            return order[j], state
    return order[k - 1], state


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 40, 1.0),
                                                       (1.3, 0, 0.9), (0.9, 50, 0.8), (2.0, 1, 1.0)])
def test_sampling_matches_the_numpy_reference(fp32, temperature, top_k, top_p):
    from cuvil.runtime import Sampling
    _, lib = fp32
    gen = lib._generation()
    params = ctypes.pointer(Sampling(temperature, top_k, top_p))
    rng = np.random.default_rng(1)
    state = ctypes.c_uint64(12345)
    ref_state = 12345
    for _ in range(40):
        logits = (rng.standard_normal(512) * 3).astype(np.float32)
        got = gen.sample(logits.ctypes.data, params, ctypes.byref(state))
        want, ref_state = sample_reference(logits, temperature, top_k, top_p, ref_state)
        assert got == want
        assert state.value == ref_state
    if top_k == 0 and top_p < 1:   # the top-p set: a draw never leaves it
        probs = np.exp(logits / temperature - (logits / temperature).max())
        assert probs[got] > 0


def test_sampled_generation_is_reproducible_with_a_seed(fp32):
    _, lib = fp32
    sampling = {"temperature": 0.9, "top_k": 50, "top_p": 0.95}
    a = list(lib.generate(PROMPT, max_new_tokens=20, sampling=sampling, seed=7))
    b = list(lib.generate(PROMPT, max_new_tokens=20, sampling=sampling, seed=7))
    c = list(lib.generate(PROMPT, max_new_tokens=20, sampling=sampling, seed=8))
    assert a == b and a != c
    # the same tokens as the reference drawing from the library's own logits step by step
    session, state, tokens = lib.session(), 7, []
    logits = session.prefill(PROMPT)
    for _ in range(20):
        token, state = sample_reference(logits, 0.9, 50, 0.95, state)
        tokens.append(token)
        logits = session.decode(token)
    assert tokens == a
    session.close()


# -- int4 (MatMulNBits) ------------------------------------------------------------------------

def test_int4_agrees_with_onnxruntime_genai(models):
    folder = genai_decoder(models, "int4")
    lib = cuvil.compile(folder / "model.onnx", name="llm4", generate={**GENERATE, "prefill_buckets": [8, 16]})
    model = onnx.load(str(folder / "model.onnx"))
    # the packed int4 weights stored once for the three entries (1, 8 and 16 rows), as in fp32
    assert lib.info["memory"]["weights_bytes"] <= 1.1 * sum(numpy_helper.to_array(t).nbytes
                                                            for t in model.graph.initializer)
    want = genai_greedy(folder, PROMPT, 64)
    # The builder's MatMulNBits (accuracy_level 4) has onnxruntime quantise the activations to int8
    # per block; Cuvil does the same (cuvil/nbits.py int8_activations), so the logits differ only by
    # float32 rounding, as in the fp32 build. The issue asks >= 95 % of 64 greedy tokens equal; the
    # teacher-forced count (Cuvil's next token after each prefix of onnxruntime-genai's sequence)
    # is checked too, since a free-running sequence diverges for good at a first swap.
    assert sum(a == b for a, b in zip(lib.generate(PROMPT, max_new_tokens=64), want)) >= 0.95 * len(want)
    session = lib.session()
    logits = session.prefill(PROMPT)
    agree = 0
    for i, token in enumerate(want):
        agree += int(np.argmax(logits)) == token
        if i + 1 < len(want):
            logits = session.decode(token)
    session.close()
    assert agree >= 0.95 * len(want), agree


# -- the C example -----------------------------------------------------------------------------

def test_c_example_generates_the_same_tokens(fp32, tmp_path):
    if shutil.which("make") is None or shutil.which("gcc") is None:
        pytest.skip("make and gcc are needed")
    _, lib = fp32
    lib_dir = lib.save(tmp_path / "lib").parent
    example = tmp_path / "example"
    shutil.copytree(ROOT / "examples" / "llm-c", example)
    subprocess.run(["make", "-s", "-C", str(example), f"LIBDIR={lib_dir}", "NAME=llm"], check=True,
                   capture_output=True)
    run = subprocess.run([str(example / "generate"), "-n", "12", *map(str, PROMPT)], check=True,
                         capture_output=True, text=True)
    assert [int(t) for t in run.stdout.split()] == list(lib.generate(PROMPT, max_new_tokens=12))
    sampled = subprocess.run([str(example / "generate"), "-n", "12", "-t", "0.8", "-k", "40", "-s", "3",
                              *map(str, PROMPT)], check=True, capture_output=True, text=True)
    want = list(lib.generate(PROMPT, max_new_tokens=12, sampling={"temperature": 0.8, "top_k": 40}, seed=3))
    assert [int(t) for t in sampled.stdout.split()] == want


# -- a toy decoder without genai_config.json: the default names, bucket padding -----------------

def toy_decoder(vocab=37, dim=8, seed=0) -> onnx.ModelProto:
    """One attention layer over a cache in the agreed static form, from standard ONNX ops: the S new
    rows of K and V written at past = sum(mask) - S, queries attending causally."""
    rng = np.random.default_rng(seed)
    init = [numpy_helper.from_array(a, n) for n, a in (
        ("Wq", rng.standard_normal((vocab, dim)).astype(np.float32)),
        ("Wk", rng.standard_normal((vocab, dim)).astype(np.float32)),
        ("Wv", rng.standard_normal((vocab, dim)).astype(np.float32)),
        ("Wo", rng.standard_normal((dim, vocab)).astype(np.float32)),
        ("zero", np.array(0, np.int64)), ("one", np.array(1, np.int64)), ("onef", np.array(1.0, np.float32)),
        ("neg", np.array(-1e9, np.float32)), ("scale", np.array(dim ** -0.5, np.float32)),
        ("ax0", np.array([0], np.int64)), ("ax1", np.array([1], np.int64)), ("flat", np.array([-1, dim], np.int64)),
        ("cache", np.array([1, 1, -1, dim], np.int64)), ("lshape", np.array([1, -1, vocab], np.int64)))]
    N = helper.make_node
    nodes = [N("Shape", ["input_ids"], ["S1"], start=1, end=2), N("Squeeze", ["S1"], ["S"]),
             N("Shape", ["past_key_values.0.key"], ["C1"], start=2, end=3), N("Squeeze", ["C1"], ["C"]),
             N("ReduceSum", ["attention_mask"], ["total"], keepdims=0), N("Sub", ["total", "S"], ["past"]),
             N("Range", ["zero", "S", "one"], ["arS"]), N("Add", ["arS", "past"], ["pos"]),
             N("Range", ["zero", "C", "one"], ["arC"]),
             N("Unsqueeze", ["arC", "ax1"], ["arC_col"]), N("Unsqueeze", ["pos", "ax0"], ["pos_row"]),
             N("Equal", ["arC_col", "pos_row"], ["Pb"]), N("Cast", ["Pb"], ["P"], to=TensorProto.FLOAT),
             N("ReduceSum", ["P", "ax1"], ["hit"], keepdims=1), N("Sub", ["onef", "hit"], ["keep"]),
             N("Unsqueeze", ["arC", "ax0"], ["arC_row"]), N("Unsqueeze", ["pos", "ax1"], ["pos_col"]),
             N("LessOrEqual", ["arC_row", "pos_col"], ["allowed"])]
    for kind, W in (("key", "Wk"), ("value", "Wv")):
        nodes += [N("Gather", [W, "input_ids"], [f"e_{kind}"]), N("Reshape", [f"e_{kind}", "flat"], [f"n_{kind}"]),
                  N("MatMul", ["P", f"n_{kind}"], [f"rows_{kind}"]),
                  N("Reshape", [f"past_key_values.0.{kind}", "flat"], [f"old_{kind}"]),
                  N("Mul", [f"old_{kind}", "keep"], [f"kept_{kind}"]),
                  N("Add", [f"kept_{kind}", f"rows_{kind}"], [f"all_{kind}"]),
                  N("Reshape", [f"all_{kind}", "cache"], [f"present.0.{kind}"])]
    nodes += [N("Gather", ["Wq", "input_ids"], ["eq"]), N("Reshape", ["eq", "flat"], ["q"]),
              N("Transpose", ["all_key"], ["kT"]), N("MatMul", ["q", "kT"], ["raw"]), N("Mul", ["raw", "scale"], ["sc"]),
              N("Where", ["allowed", "sc", "neg"], ["masked"]), N("Softmax", ["masked"], ["attn"], axis=-1),
              N("MatMul", ["attn", "all_value"], ["ctx"]), N("MatMul", ["ctx", "Wo"], ["lg"]),
              N("Reshape", ["lg", "lshape"], ["logits"])]
    cache = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, "P", dim])
    graph = helper.make_graph(
        nodes, "toy_decoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "S"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, "T"]),
         cache("past_key_values.0.key"), cache("past_key_values.0.value")],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "S", vocab]),
         cache("present.0.key"), cache("present.0.value")], init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_toy_decoder_matches_onnxruntime_step_by_step(tmp_path):
    import onnxruntime as ort
    path = tmp_path / "toy.onnx"
    onnx.save(toy_decoder(), str(path))
    C = 16
    lib = cuvil.compile(path, name="toy", generate={"max_context": C, "prefill_buckets": [4]})
    session = ort.InferenceSession(str(path))
    # its logits come from a Reshape, not a product: every row is computed (last_row_logits does not fire)
    assert [e["logits_rows"] for e in lib.info["generate"]["entries"]] == [1, 4]

    def greedy(prompt, n):
        """onnxruntime on the unpadded prompt, the cache carried from present to past."""
        k = v = np.zeros((1, 1, C, 8), np.float32)
        ids, past, out = list(prompt), 0, []
        while len(out) < n:
            mask = (np.arange(C) < past + len(ids)).astype(np.int64)[None]
            logits, k, v = session.run(None, {"input_ids": np.array([ids]), "attention_mask": mask,
                                              "past_key_values.0.key": k, "past_key_values.0.value": v})
            past += len(ids)
            ids = [int(np.argmax(logits[0, -1]))]
            out += ids
        return out

    for prompt in ([3, 4, 5], [1, 2, 3, 4, 5, 6, 7], [9]):     # padded, chunked 4 + 3, one token
        # argmax of logits within float32 rounding of onnxruntime's: exact unless a near-tie
        assert list(lib.generate(prompt, max_new_tokens=8, stop_tokens=())) == greedy(prompt, 8)
    # session_run still runs one entry (decode) on the caller's tensors, as for any library
    feeds = {"input_ids": np.array([[3]]), "attention_mask": (np.arange(C) < 1).astype(np.int64)[None],
             "past_key_values.0.key": np.zeros((1, 1, C, 8), np.float32),
             "past_key_values.0.value": np.zeros((1, 1, C, 8), np.float32)}
    got = lib.run(feeds)
    want = session.run(None, feeds)
    # float32 sums of 8 products and a softmax over 16: 1e-5 relative
    np.testing.assert_allclose(got["logits"], want[0], rtol=1e-5, atol=1e-5)


# -- what is refused, and how ------------------------------------------------------------------

def test_generate_settings_are_checked(tmp_path):
    path = tmp_path / "toy.onnx"
    onnx.save(toy_decoder(), str(path))
    with pytest.raises(CuvilError, match="prefill_buckets .*longer than max_context 8"):
        cuvil.compile(path, generate={"max_context": 8, "prefill_buckets": [16]})
    with pytest.raises(CuvilError, match="max_context"):
        cuvil.compile(path, generate={"max_context": 1})
    with pytest.raises(CuvilError, match="prefill_bucket"):
        cuvil.compile(path, generate={"prefill_buckets": [0]})
    with pytest.raises(CuvilError, match="context: Extra inputs are not permitted"):
        cuvil.compile(path, generate={"context": 8})


def test_a_model_without_a_cache_is_refused_with_its_names(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "relu.onnx"
    onnx.save(model, str(path))
    with pytest.raises(CuvilError, match="no input named 'input_ids'.*the model's inputs: \\['x'\\]"):
        cuvil.compile(path, generate={"max_context": 8, "prefill_buckets": [4]})


def test_cuvil_yaml_generate_block(tmp_path):
    from cuvil.config import parse_config
    from cuvil.errors import ConfigError
    onnx.save(toy_decoder(), str(tmp_path / "toy.onnx"))
    (tmp_path / "tokenizer.json").write_text("{}")
    text = ("version: 1\nmodels:\n  - name: toy\n    source: toy.onnx\n"
            "    generate: {max_context: 16, prefill_buckets: [4, 8], tokenizer: tokenizer.json}\n")
    spec = parse_config(text, tmp_path / "cuvil.yaml")
    assert spec.models[0].generate == {"max_context": 16, "prefill_buckets": [4, 8],
                                       "tokenizer": str(tmp_path / "tokenizer.json"), "pad_token": None}
    with pytest.raises(ConfigError, match=r"cuvil.yaml:5:\d+: .*file not found"):
        parse_config(text.replace("tokenizer.json}", "missing.json}"), tmp_path / "cuvil.yaml")
    with pytest.raises(ConfigError, match=r"cuvil.yaml:5:\d+: .*longer than max_context 16"):
        parse_config(text.replace("[4, 8]", "[4, 32]"), tmp_path / "cuvil.yaml")
    with pytest.raises(ConfigError, match="unknown key 'buckets'"):
        parse_config(text.replace("prefill_buckets", "buckets"), tmp_path / "cuvil.yaml")


def test_cuvil_build_and_check_of_a_generate_model(fp32, tmp_path):
    from cuvil.cli import main
    from cuvil.runtime import load
    folder, lib = fp32
    config = tmp_path / "cuvil.yaml"
    config.write_text(f"version: 1\noutput_dir: out\nmodels:\n  - name: llm\n    source: {folder / 'model.onnx'}\n"
                      f"    generate: {{max_context: 128, prefill_buckets: [16], tokenizer: {folder / 'tokenizer.json'}}}\n")
    assert main(["check", "-f", str(config)]) == 0      # at the decode entry's shapes
    assert main(["build", "-f", str(config)]) == 0
    built = tmp_path / "out" / "llm" / "native"
    assert (built / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    # the same settings as compile(generate=...): the same library, byte for byte
    assert (built / "libllm.so").read_bytes() == lib.artifacts.library.read_bytes()
    assert list(load(built / "libllm.so").generate(PROMPT[:5], max_new_tokens=8)) == \
        list(lib.generate(PROMPT[:5], max_new_tokens=8))


@pytest.mark.slow
def test_two_thread_library_generates_the_same_tokens(fp32):
    """threads: 2 (each entry's steps split over the session's pool): onnxruntime-genai's tokens."""
    folder, _ = fp32
    lib = cuvil.compile(folder / "model.onnx", name="llm2", threads=2, generate=GENERATE)
    assert list(lib.generate(PROMPT, max_new_tokens=64)) == genai_greedy(folder, PROMPT, 64)


def test_cuvil_compile_max_context_builds_the_generation_library(tmp_path, capsys):
    """`cuvil-compile --max-context N --prefill-buckets ...` is cuvil.yaml's `generate:` block: the same
    library, byte for byte, as cuvil.compile(generate=...) with the same settings."""
    from cuvil.cli import compile_main
    from cuvil.runtime import load
    path = tmp_path / "toy.onnx"
    onnx.save(toy_decoder(), str(path))
    out = tmp_path / "out" / "libtoy.so"
    assert compile_main(["--model", str(path), "--output", str(out), "--max-context", "16", "--prefill-buckets", "4,8",
                         "--cache-dir", str(tmp_path / "cache")]) == 0
    lib = cuvil.compile(path, name="toy", generate={"max_context": 16, "prefill_buckets": [4, 8]},
                        cache_dir=tmp_path / "cache")
    assert out.read_bytes() == lib.artifacts.library.read_bytes()
    assert load(out).info["generate"]["max_context"] == 16
    # a model without a KV cache is a clear usage error naming what is missing
    relu = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])]),
                             opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(relu, str(tmp_path / "relu.onnx"))
    capsys.readouterr()
    assert compile_main(["--model", str(tmp_path / "relu.onnx"), "--output", str(tmp_path / "r" / "librelu.so"),
                         "--max-context", "16", "--prefill-buckets", "4", "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert "no input named 'input_ids'" in err and "Traceback" not in err
