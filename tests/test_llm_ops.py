"""onnxruntime's LLM decoder ops (cuvil/contrib.py, backends/numba_cpu/gqa.py, norm.py) against
onnxruntime, in the static-shape form a generation runtime compiles: input [1, S], attention_mask
[1, C] (ones for the first past + S positions), past and present [1, kv_heads, C, head].

Tolerances (float32, u = 2^-24):
- GroupQueryAttention. Both engines compute a score as a dot product of H terms (rotated q and k,
  each rotated component one product pair off the exact value: relative 3u), so each score is within
  gamma(H + 3) * scale * sum_i |q_i k_i| of the exact one, and the two within twice that (`ds`).
  Softmax moves a probability by at most p_t (2 ds + gamma(n + 8)) (exp to a few ulp, the sum of n
  terms, the division), and the output row, a sum of n products p_t v_t, by gamma(n) sum p_t |v_t|
  more. So |cuvil - ort| <= (2 ds + gamma(n + 8) + 2 gamma(n)) * max |v| per output row; the test
  takes the largest bound over the rows (n = the longest row) and allows 2x for the libm/vexp
  differences in exp.  The present rows written are copies of the inputs, rotated for the keys:
  within 3u of the exact rotation each, so 6u * max|k| apart.
- SimplifiedLayerNormalization / Skip...: y = x * inv * gamma, inv from a sum of `size` squares:
  relative gamma(size + 4) per engine, so 2 gamma(size + 4) * max|y| apart.
"""
from __future__ import annotations

import ctypes
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import cuvil
from cuvil.errors import CuvilError
from tests.helpers import genai_decoder, run_ort

U = 2.0 ** -24


def gamma(n):
    return n * U / (1 - n * U)


def _rotary_tables(max_pos, half, seed=3):
    inv = 1.0 / (10000 ** (np.arange(half) / half))
    t = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(t).astype(np.float32), np.sin(t).astype(np.float32)


def gqa_model(S, C, heads=4, kv_heads=2, H=16, packed=True, rotary=True, interleaved=False, rotary_dim=None,
              max_pos=512, past=True):
    """A one-GroupQueryAttention model as onnxruntime-genai's builder writes it: seqlens_k =
    ReduceSum(attention_mask) - 1 as int32, total_sequence_length = Shape(attention_mask)[1]."""
    rotary_dim = rotary_dim or H
    nodes = [helper.make_node("ReduceSum", ["attention_mask", "one"], ["msum"], keepdims=0),
             helper.make_node("Sub", ["msum", "one"], ["sl64"]),
             helper.make_node("Cast", ["sl64"], ["seqlens_k"], to=TensorProto.INT32),
             helper.make_node("Shape", ["attention_mask"], ["mshape"]),
             helper.make_node("Gather", ["mshape", "one_s"], ["tot64"], axis=0),
             helper.make_node("Cast", ["tot64"], ["total"], to=TensorProto.INT32)]
    cos, sin = _rotary_tables(max_pos, rotary_dim // 2)
    inits = [helper.make_tensor("one", TensorProto.INT64, [1], [1]),
             helper.make_tensor("one_s", TensorProto.INT64, [], [1]),
             onnx.numpy_helper.from_array(cos, "cos_cache"), onnx.numpy_helper.from_array(sin, "sin_cache")]
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, C])]
    if packed:
        inputs.append(helper.make_tensor_value_info("qkv", f, [1, S, (heads + 2 * kv_heads) * H]))
        q_in = ["qkv", "", ""]
    else:
        inputs += [helper.make_tensor_value_info("q", f, [1, S, heads * H]),
                   helper.make_tensor_value_info("k", f, [1, S, kv_heads * H]),
                   helper.make_tensor_value_info("v", f, [1, S, kv_heads * H])]
        q_in = ["q", "k", "v"]
    if past:
        inputs += [helper.make_tensor_value_info("past_key", f, [1, kv_heads, C, H]),
                   helper.make_tensor_value_info("past_value", f, [1, kv_heads, C, H])]
    rot_in = ["cos_cache", "sin_cache"] if rotary else ["", ""]
    nodes.append(helper.make_node(
        "GroupQueryAttention", q_in + (["past_key", "past_value"] if past else ["", ""]) + ["seqlens_k", "total"]
        + rot_in, ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=heads,
        kv_num_heads=kv_heads, do_rotary=int(rotary), rotary_interleaved=int(interleaved), local_window_size=-1))
    P = C if past else C
    outputs = [helper.make_tensor_value_info("out", f, [1, S, heads * H]),
               helper.make_tensor_value_info("present_key", f, [1, kv_heads, P, H]),
               helper.make_tensor_value_info("present_value", f, [1, kv_heads, P, H])]
    graph = helper.make_graph(nodes, "gqa", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def gqa_feeds(S, C, past_len, heads=4, kv_heads=2, H=16, packed=True, past=True, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {"attention_mask": (np.arange(C) < past_len + S).astype(np.int64)[None]}
    if packed:
        feeds["qkv"] = rng.standard_normal((1, S, (heads + 2 * kv_heads) * H)).astype(np.float32)
    else:
        feeds["q"] = rng.standard_normal((1, S, heads * H)).astype(np.float32)
        feeds["k"] = rng.standard_normal((1, S, kv_heads * H)).astype(np.float32)
        feeds["v"] = rng.standard_normal((1, S, kv_heads * H)).astype(np.float32)
    if past:
        cache = rng.standard_normal((2, 1, kv_heads, C, H)).astype(np.float32)
        cache[:, :, :, past_len:] = 0.0       # rows past the real length are not read
        feeds["past_key"], feeds["past_value"] = cache[0], cache[1]
    return feeds


def _gqa_bound(feeds, S, past_len, H, heads, kv_heads, packed):
    """The derived bound on |cuvil - ort| for the attention output (module docstring)."""
    n = past_len + S
    if packed:
        x = feeds["qkv"].reshape(S, heads + 2 * kv_heads, H)
        q, k_new, v_new = x[:, :heads], x[:, heads:heads + kv_heads], x[:, heads + kv_heads:]
    else:
        q = feeds["q"].reshape(S, heads, H)
        k_new, v_new = feeds["k"].reshape(S, kv_heads, H), feeds["v"].reshape(S, kv_heads, H)
    k_abs = max(float(np.abs(k_new).max()), float(np.abs(feeds.get("past_key", np.zeros(1))).max()))
    v_abs = max(float(np.abs(v_new).max()), float(np.abs(feeds.get("past_value", np.zeros(1))).max()))
    dot = H * float(np.abs(q).max()) * k_abs / np.sqrt(H)
    ds = 2 * gamma(H + 3) * dot
    return 2 * (2 * ds + gamma(n + 8) + 2 * gamma(n)) * v_abs, 6 * U * k_abs


def _check_gqa(got, want, S, past_len, bound, kv_bound):
    assert np.abs(got["out"] - want["out"]).max() <= bound, (np.abs(got["out"] - want["out"]).max(), bound)
    rows = past_len + S        # present rows past the real length are not defined in cuvil's form
    for name in ("present_key", "present_value"):
        diff = np.abs(got[name][:, :, :rows] - want[name][:, :, :rows]).max()
        assert diff <= kv_bound, (name, diff, kv_bound)


GQA_CASES = [
    # S, C, past_len, packed, rotary, interleaved
    (1, 64, 0, True, True, False),
    (1, 64, 37, True, True, False),
    (16, 128, 0, True, True, False),
    (16, 128, 50, True, True, False),
    (1, 256, 200, False, True, False),
    (16, 64, 20, False, False, False),
    (1, 64, 10, True, True, True),
    (16, 96, 9, True, True, True),
]


@pytest.mark.parametrize("S,C,past_len,packed,rotary,interleaved", GQA_CASES)
def test_gqa_matches_onnxruntime(S, C, past_len, packed, rotary, interleaved):
    H, heads, kv_heads = 16, 4, 2
    model = gqa_model(S, C, heads, kv_heads, H, packed, rotary, interleaved)
    feeds = gqa_feeds(S, C, past_len, heads, kv_heads, H, packed)
    compiled = cuvil.compile(model, name="gqa")
    got, want = compiled.run(feeds), run_ort(model, feeds)
    bound, kv_bound = _gqa_bound(feeds, S, past_len, H, heads, kv_heads, packed)
    _check_gqa(got, want, S, past_len, bound, kv_bound)


@pytest.mark.parametrize("interleaved", [False, True])
def test_gqa_partial_rotary_matches_onnxruntime(interleaved):
    """cos_cache narrower than head_size / 2: the first 2 * cos_cache.shape[1] dims rotate, the
    others pass through."""
    S, C, past_len, H, heads, kv_heads = 4, 64, 10, 32, 4, 2
    model = gqa_model(S, C, heads, kv_heads, H, interleaved=interleaved, rotary_dim=16)
    feeds = gqa_feeds(S, C, past_len, heads, kv_heads, H)
    got, want = cuvil.compile(model, name="gqa_partial").run(feeds), run_ort(model, feeds)
    bound, kv_bound = _gqa_bound(feeds, S, past_len, H, heads, kv_heads, True)
    _check_gqa(got, want, S, past_len, bound, kv_bound)


@pytest.mark.parametrize("S,past_len", [(1, 40), (16, 7)])
def test_gqa_two_threads_matches_onnxruntime(S, past_len):
    """With 2 threads the head groups are split and a prefill's rows dealt into runs
    (gqa.py _split): the same bound holds."""
    H, heads, kv_heads, C = 16, 4, 2, 64
    model = gqa_model(S, C, heads, kv_heads, H)
    feeds = gqa_feeds(S, C, past_len, heads, kv_heads, H)
    compiled = cuvil.compile(model, name="gqa_t2", threads=2)
    got = run_sharing(compiled, feeds, {"present_key": "past_key", "present_value": "past_value"})
    bound, kv_bound = _gqa_bound(feeds, S, past_len, H, heads, kv_heads, True)
    _check_gqa(got, run_ort(model, feeds), S, past_len, bound, kv_bound)


@pytest.mark.parametrize("past", [True, False])
def test_gqa_first_prompt_matches_onnxruntime(past):
    """S == total_sequence_length (onnxruntime's first prompt): past_seqlen is 0 whatever seqlens_k
    says, and padding rows (mask 0) are still written and attend causally, rotated at their own
    positions."""
    S = C = 16
    H, heads, kv_heads = 16, 4, 2
    model = gqa_model(S, C, heads, kv_heads, H, past=past)
    feeds = gqa_feeds(S, C, 0, heads, kv_heads, H, past=past)
    feeds["attention_mask"][0, 10:] = 0
    got, want = cuvil.compile(model, name="gqa_first").run(feeds), run_ort(model, feeds)
    bound, kv_bound = _gqa_bound(feeds, S, 0, H, heads, kv_heads, True)
    _check_gqa(got, want, S, 0, bound, kv_bound)


def run_sharing(library, feeds: dict, shared: dict) -> dict:
    """Run a loaded library through the C ABI with output `o` bound to the buffer of input
    `shared[o]` (the runtime's in-place KV cache); return every output, the shared ones as the
    input buffers after the run."""
    info = library.info
    arrays = {v["name"]: np.ascontiguousarray(feeds[v["name"]]).copy() for v in info["inputs"]}
    ins = (ctypes.c_void_p * len(info["inputs"]))(*[arrays[v["name"]].ctypes.data for v in info["inputs"]])
    results = {}
    for v in info["outputs"]:
        results[v["name"]] = arrays[shared[v["name"]]] if v["name"] in shared \
            else np.empty(v["shape"], np.dtype(v["dtype"]))
    outs = (ctypes.c_void_p * len(info["outputs"]))(*[results[v["name"]].ctypes.data for v in info["outputs"]])
    lib, p = library._lib, library.prefix
    create, run, destroy = lib[f"{p}session_create"], lib[f"{p}session_run"], lib[f"{p}session_destroy"]
    create.restype = ctypes.c_void_p
    run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    destroy.argtypes = [ctypes.c_void_p]
    session = create()
    try:
        assert run(session, ins, outs) == 0
    finally:
        destroy(session)
    return results


@pytest.mark.parametrize("S,past_len", [(1, 30), (16, 21)])
def test_gqa_in_place_cache(S, past_len):
    """One buffer bound to past_key and present_key (and to the values): the cache is updated in
    place, equal to onnxruntime's present (which copies), rows past the real length untouched."""
    H, heads, kv_heads, C = 16, 4, 2, 64
    model = gqa_model(S, C, heads, kv_heads, H)
    feeds = gqa_feeds(S, C, past_len, heads, kv_heads, H)
    feeds["past_key"][:, :, past_len + S:] = 7.0     # must stay as it is
    compiled = cuvil.compile(model, name="gqa_inplace")
    got = run_sharing(compiled, feeds, {"present_key": "past_key", "present_value": "past_value"})
    want = run_ort(model, feeds)
    bound, kv_bound = _gqa_bound(feeds, S, past_len, H, heads, kv_heads, True)
    _check_gqa(got, want, S, past_len, bound, kv_bound)
    assert np.all(got["present_key"][:, :, past_len + S:] == 7.0)
    # the copying form (present apart from past) gives the same rows
    apart = compiled.run(feeds)
    np.testing.assert_array_equal(apart["out"], got["out"])
    np.testing.assert_array_equal(apart["present_key"][:, :, :past_len + S], got["present_key"][:, :, :past_len + S])


def _single(op, domain, inputs, outputs, inits=(), **attrs):
    node = helper.make_node(op, [i.name for i in inputs] + [t.name for t in inits], [o.name for o in outputs],
                            domain=domain or None, **attrs)
    graph = helper.make_graph([node], op, inputs, outputs, list(inits))
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


@pytest.mark.parametrize("layout,interleaved,start", [("bsnh", False, False), ("bsnh", True, False),
                                                       ("bnsh", False, False), ("bsnh", False, True)])
def test_rotary_embedding_matches_onnxruntime(layout, interleaved, start):
    """RotaryEmbedding (com.microsoft): each output is x1 cos - x2 sin (or x2 cos + x1 sin) of the
    same float32 inputs in both engines: within 2 gamma(2) * max|x| apart."""
    B, S, N, H = 1, 5, 3, 16
    cos, sin = _rotary_tables(64, H // 2)
    f = TensorProto.FLOAT
    shape = [B, S, N * H] if layout == "bsnh" else [B, N, S, H]
    model = _single("RotaryEmbedding", "com.microsoft",
                    [helper.make_tensor_value_info("x", f, shape),
                     helper.make_tensor_value_info("pos", TensorProto.INT64, [1] if start else [B, S])],
                    [helper.make_tensor_value_info("y", f, shape)],
                    [onnx.numpy_helper.from_array(cos, "cos"), onnx.numpy_helper.from_array(sin, "sin")],
                    interleaved=int(interleaved), num_heads=N)
    rng = np.random.default_rng(1)
    pos = np.array([7], np.int64) if start else np.array([[3, 4, 5, 9, 40]], np.int64)   # [1]: a start position
    feeds = {"x": rng.standard_normal(shape).astype(np.float32), "pos": pos}
    got, want = cuvil.compile(model, name="rope").run(feeds), run_ort(model, feeds)
    assert np.abs(got["y"] - want["y"]).max() <= 2 * gamma(2) * np.abs(feeds["x"]).max()


def test_simplified_layer_norms_match_onnxruntime():
    """SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization (output 3 = input + skip,
    exact in both engines) within 2 gamma(size + 4) * max|y| (module docstring)."""
    f = TensorProto.FLOAT
    size = 96
    rng = np.random.default_rng(2)
    gamma_w = onnx.numpy_helper.from_array(rng.standard_normal(size).astype(np.float32), "g")
    x = helper.make_tensor_value_info("x", f, [1, 3, size])
    s = helper.make_tensor_value_info("s", f, [1, 3, size])
    feeds = {"x": rng.standard_normal((1, 3, size)).astype(np.float32),
             "s": rng.standard_normal((1, 3, size)).astype(np.float32)}
    plain = _single("SimplifiedLayerNormalization", "", [x], [helper.make_tensor_value_info("y", f, [1, 3, size])],
                    [gamma_w], epsilon=1e-6, axis=-1, stash_type=1)
    plain.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    bias_w = onnx.numpy_helper.from_array(rng.standard_normal(size).astype(np.float32), "bias")
    skip_models = []
    for extra in ([], ["bias"]):        # input + skip, and input + skip + bias
        skip = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "s", "g"] + extra, ["y", "", "", "sum"],
                                domain="com.microsoft", epsilon=1e-6)
        skip_model = helper.make_model(helper.make_graph(
            [skip], "skip", [x, s], [helper.make_tensor_value_info("y", f, [1, 3, size]),
                                     helper.make_tensor_value_info("sum", f, [1, 3, size])],
            [gamma_w] + ([bias_w] if extra else [])),
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        skip_model.ir_version = 8
        skip_models.append((skip_model, f"skiprms{len(extra)}"))
    for model, name in [(plain, "rms")] + skip_models:
        feed = {k: v for k, v in feeds.items() if k in {i.name for i in model.graph.input}}
        got, want = cuvil.compile(model, name=name).run(feed), run_ort(model, feed)
        assert np.abs(got["y"] - want["y"]).max() <= 2 * gamma(size + 4) * np.abs(want["y"]).max()
        if "sum" in want:
            np.testing.assert_array_equal(got["sum"], want["sum"])


@pytest.mark.parametrize("attr,value,words", [("local_window_size", 8, "local_window_size=8"),
                                              ("softcap", 30.0, "softcap=30.0"),
                                              ("smooth_softmax", 1, "smooth_softmax=1")])
def test_gqa_refuses_what_it_does_not_compile(attr, value, words):
    model = gqa_model(1, 64)
    for a in model.graph.node[-1].attribute:
        if a.name == attr:
            model.graph.node[-1].attribute.remove(a)
            break
    model.graph.node[-1].attribute.append(helper.make_attribute(attr, value))
    with pytest.raises(CuvilError, match=words) as err:
        cuvil.compile(model, name="gqa_refused")
    assert "GroupQueryAttention" in str(err.value)


# --- a whole decoder written by onnxruntime-genai's model builder --------------------------------

WHOLE_TOL = 1e-3    # max |diff| / max |ref|, as the float32 zoo models (tests/test_zoo.py)


def static_shapes(path, S: int, C: int) -> dict:
    """The runtime's static form: input_ids [1, S], attention_mask [1, C], past [1, kv_heads, C, head]
    (the head size from the builder's genai_config.json: the model leaves it symbolic)."""
    decoder = json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"]
    shapes = {"input_ids": [1, S], "attention_mask": [1, C]}
    for layer in range(decoder["num_hidden_layers"]):
        for kv in ("key", "value"):
            shapes[f"past_key_values.{layer}.{kv}"] = [1, decoder["num_key_value_heads"], C, decoder["head_size"]]
    return shapes


def float_oracle(model: onnx.ModelProto) -> onnx.ModelProto:
    """The int4 file with MatMulNBits' accuracy_level 0: onnxruntime then dequantises to float32,
    and so does Cuvil. Level 4, the builder's choice, quantises the activations to int8 in both
    engines (tests/test_nbits.py checks each product against onnxruntime's), but not comparably
    over a whole decoder: int8 rounding is discontinuous, so a float32 difference of one ulp
    before a quantisation can move a code by one, and the moves cascade through the layers
    (a 16-token prefill of the issue's model: logits 5 % of their spread apart, as far as
    onnxruntime's own level 4 is from its level 0; a 1-token prompt: 2e-6). Both engines
    therefore run this file here; tests/test_llm_runtime.py checks level 4 by greedy tokens."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for a in node.attribute:
                if a.name == "accuracy_level":
                    a.i = 0
    return model


def _close(got, want, rows):
    for name, ref in want.items():
        g = got[name]
        if name.startswith("present."):
            g, ref = g[:, :, :rows], ref[:, :, :rows]
        err, scale = float(np.abs(g - ref).max()), float(np.abs(ref).max())
        assert err <= WHOLE_TOL * scale, (name, err, scale)


@pytest.fixture(scope="module")
def genai_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("genai")


def _prefill_then_decode(path, C=64, S=8, threads=1):
    model = onnx.load(str(path))
    oracle = float_oracle(model)
    prefill = cuvil.compile(oracle, input_shapes=static_shapes(path, S, C), name="genai_prefill", threads=threads)
    decode = cuvil.compile(oracle, input_shapes=static_shapes(path, 1, C), name="genai_decode", threads=threads)
    rng = np.random.default_rng(0)
    pasts = [v["name"] for v in prefill.info["inputs"] if v["name"].startswith("past_key_values.")]
    feeds = {"input_ids": rng.integers(3, 512, (1, S)).astype(np.int64),
             "attention_mask": (np.arange(C) < S).astype(np.int64)[None]}
    feeds.update({n: np.zeros(static_shapes(path, S, C)[n], np.float32) for n in pasts})
    shared = {n.replace("past_key_values.", "present."): n for n in pasts}
    got = run_sharing(prefill, feeds, shared)          # the cache updated in place
    want = run_ort(oracle, feeds)
    _close(got, want, S)
    # one decode step on the cache the prefill wrote (the runtime's loop), against onnxruntime
    # given the same cache
    step = {"input_ids": np.array([[int(np.argmax(want["logits"][0, -1]))]], np.int64),
            "attention_mask": (np.arange(C) < S + 1).astype(np.int64)[None]}
    step.update({n: got[shared_name] for shared_name, n in shared.items()})
    want_step = run_ort(oracle, step)
    got_step = run_sharing(decode, step, shared)
    _close(got_step, want_step, S + 1)
    # greedy decoding on: each engine on its own cache, the same tokens (the logits agree within
    # the tolerance above, far below this model's top-1 margins)
    tokens = {}
    for engine in ("cuvil", "ort"):
        cache = {n: got[shared_name].copy() for shared_name, n in shared.items()}
        token, out = int(step["input_ids"][0, 0]), []
        for pos in range(S, S + 12):
            feed = {"input_ids": np.array([[token]], np.int64),
                    "attention_mask": (np.arange(C) < pos + 1).astype(np.int64)[None], **cache}
            res = run_sharing(decode, feed, shared) if engine == "cuvil" else run_ort(oracle, feed)
            cache = {n: res[shared_name] for shared_name, n in shared.items()}
            token = int(np.argmax(res["logits"][0, -1]))
            out.append(token)
        tokens[engine] = out
    assert tokens["cuvil"] == tokens["ort"]


def test_genai_fp32_decoder_prefill_and_decode(genai_folder):
    _prefill_then_decode(genai_decoder(genai_folder, "fp32") / "model.onnx")


def test_genai_int4_decoder_prefill_and_decode(genai_folder):
    # at 2 threads: the split paths of the attention and of the products
    _prefill_then_decode(genai_decoder(genai_folder, "int4") / "model.onnx", S=16, threads=2)


def test_gqa_refuses_position_ids_and_a_runtime_total_length():
    model = gqa_model(1, 64)
    gqa = model.graph.node[-1]
    gqa.input.extend(["pos"])           # position_ids (input 9)
    model.graph.input.append(helper.make_tensor_value_info("pos", TensorProto.INT64, [1, 1]))
    with pytest.raises(CuvilError, match="position_ids is not supported"):
        cuvil.compile(model, name="gqa_pos")
    model = gqa_model(1, 64)
    gqa = model.graph.node[-1]
    gqa.input[6] = "total_in"           # total_sequence_length fed at run time
    model.graph.input.append(helper.make_tensor_value_info("total_in", TensorProto.INT32, [1]))
    with pytest.raises(CuvilError, match="total_sequence_length .* computed at run time"):
        cuvil.compile(model, name="gqa_total")


def test_gqa_right_padded_first_prompt():
    """A prompt of n tokens in a bucket of S > n with the mask's ones for the n tokens only (past 0,
    C > S): past_seqlen = n - S < 0 clamps to 0, so the n real rows are exactly onnxruntime's for
    the unpadded prompt (onnxruntime itself does not take this form). The padding rows are written
    at rows n .. S - 1 of present, which the next step overwrites."""
    S, n, C, H, heads, kv_heads = 16, 10, 64, 16, 4, 2
    padded = gqa_feeds(S, C, 0, heads, kv_heads, H)
    padded["attention_mask"][0, n:] = 0
    got = cuvil.compile(gqa_model(S, C, heads, kv_heads, H), name="gqa_padded").run(padded)
    exact = dict(padded, qkv=padded["qkv"][:, :n])
    want = run_ort(gqa_model(n, C, heads, kv_heads, H), exact)
    bound, kv_bound = _gqa_bound(exact, n, 0, H, heads, kv_heads, True)
    _check_gqa({"out": got["out"][:, :n], "present_key": got["present_key"], "present_value": got["present_value"]},
               want, n, 0, bound, kv_bound)


def test_gqa_batch_of_two_lengths():
    """Batch 2, each sequence with its own seqlens_k (past 20 and 33): each row is its own."""
    S, C, H, heads, kv_heads = 1, 64, 16, 4, 2
    model = gqa_model(S, C, heads, kv_heads, H)
    for vi in list(model.graph.input) + list(model.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_value = 2
    parts = [gqa_feeds(S, C, 20, heads, kv_heads, H), gqa_feeds(S, C, 33, heads, kv_heads, H, seed=1)]
    feeds = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    got, want = cuvil.compile(model, name="gqa_b2").run(feeds), run_ort(model, feeds)
    for b, past_len in enumerate((20, 33)):
        one = {k: v[b:b + 1] for k, v in feeds.items()}
        bound, kv_bound = _gqa_bound(one, S, past_len, H, heads, kv_heads, True)
        _check_gqa({k: v[b:b + 1] for k, v in got.items()}, {k: v[b:b + 1] for k, v in want.items()},
                   S, past_len, bound, kv_bound)
