"""Generation libraries from torch exports of transformers decoders (LLaMA, Qwen2, GPT-2), whose
KV cache grows by Concat(past, new): passes/write_kv_in_place.py, cuvil/generation.py kv_form.

Each model is a tiny transformers config with seeded random weights, exported in the test with
torch.onnx.export (dynamo, and the TorchScript exporter) from a wrapper taking input_ids,
attention_mask, position_ids and past_key_values.N.key / .value and returning logits and
present.N.key / .value (the layout optimum and docs/generation.md use). Oracles: transformers'
own greedy `generate` (torch, fp32) for the tokens, onnxruntime running the exported file for
the logits and for the rewritten graph."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import cuvil
from cuvil import generation
from cuvil.pipeline import import_model
from cuvil.errors import CuvilError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

# one worker runs the module: each export and build is made once (module fixtures)
pytestmark = pytest.mark.xdist_group("llm_torch_export")
LAYERS, VOCAB = 2, 256
GENERATE = {"max_context": 64, "prefill_buckets": [8]}
PROMPT = list(range(3, 14))      # 11 tokens: prefilled as 8 + 3 (the second chunk padded to 8)
NEW_TOKENS = 32
# float32 logits of the same model by two engines: per layer, dot products of <= 128 terms
# (unit roundoff 6e-8, error ~ sqrt(128) * 6e-8 ~ 7e-7 relative to their magnitude), exp by a
# polynomial (~1e-7 relative), 2 layers and the vocabulary product: ~3e-6 of the largest logit;
# 1e-4 leaves 30x for the summation orders of different kernels.
LOGITS_RTOL = 1e-4


def _model(family: str):
    """A seeded random decoder of `family`; weights scaled up from the default 0.02 so that greedy
    decoding does not repeat one token (the tokens then say more)."""
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=LAYERS, n_head=4, vocab_size=VOCAB, n_positions=128,
                                         initializer_range=0.5, bos_token_id=1, eos_token_id=2)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config_type, model_type = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                   "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
        config = config_type(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                             initializer_range=0.2)
        model = model_type(config)
    model.eval()
    # greedy for NEW_TOKENS tokens whatever they are (Cuvil is asked with stop_tokens=())
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class _Flat(torch.nn.Module):
    """The decoder with its cache as flat tensors: (input_ids, attention_mask, position_ids,
    past.0.key, past.0.value, ...) -> (logits, present.0.key, present.0.value, ...)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = transformers.DynamicCache(config=self.model.config)
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def export(model, path, exporter: str):
    """torch.onnx.export of the decoder with dynamic sequence and past lengths."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head = config.hidden_size // heads
    S, P = 3, 5
    args = (torch.randint(0, VOCAB, (1, S)), torch.ones(1, P + S, dtype=torch.int64), torch.arange(P, P + S)[None],
            *[torch.randn(1, kv_heads, P, head) for _ in range(2 * LAYERS)])
    past = [f"past_key_values.{i}.{k}" for i in range(LAYERS) for k in ("key", "value")]
    inputs = ["input_ids", "attention_mask", "position_ids"] + past
    outputs = ["logits"] + [name.replace("past_key_values", "present") for name in past]
    if exporter == "dynamo":
        seq, total, past_len = torch.export.Dim("S"), torch.export.Dim("T"), torch.export.Dim("P")
        dims = ({1: seq}, {1: total}, {1: seq}, tuple({2: past_len} for _ in past))
        torch.onnx.export(_Flat(model).eval(), args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_shapes=dims, dynamo=True)
    else:
        axes = {"input_ids": {1: "S"}, "attention_mask": {1: "T"}, "position_ids": {1: "S"},
                **{name: {2: "P"} for name in past}}
        torch.onnx.export(_Flat(model).eval(), args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=axes, dynamo=False, opset_version=17)
    return path


CASES = [pytest.param("llama", "dynamo", id="llama-dynamo"),
         *[pytest.param(f, e, id=f"{f}-{e}", marks=pytest.mark.slow)
           for f, e in (("qwen2", "dynamo"), ("gpt2", "dynamo"), ("llama", "torchscript"), ("qwen2", "torchscript"),
                        ("gpt2", "torchscript"))]]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(family, exporter):
        if (family, exporter) not in cache:
            model = _model(family)
            path = export(model, tmp_path_factory.mktemp(f"{family}-{exporter}") / "model.onnx", exporter)
            lib = cuvil.compile(path, name="dec", generate=GENERATE)
            cache[family, exporter] = model, path, lib
        return cache[family, exporter]
    return get


def _hf_greedy(model, prompt, new_tokens):
    """transformers' own greedy tokens and the gap between the two largest logits of each step."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    gaps = [float(np.diff(np.sort(s[0].numpy())[-2:])[0]) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), min(gaps)


@pytest.mark.parametrize("family,exporter", CASES)
def test_greedy_tokens_equal_transformers(built, family, exporter):
    model, _, lib = built(family, exporter)
    want, gap = _hf_greedy(model, PROMPT, NEW_TOKENS)
    # exact equality is the right oracle when no step's two best logits are closer than the engines'
    # logits may differ (LOGITS_RTOL of their scale, test below); say so if a seed ever breaks it
    assert gap > 10 * LOGITS_RTOL, f"a near tie ({gap:.2g}) in transformers' greedy steps: pick another seed"
    assert list(lib.generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_tokens=())) == want
    # a one-token prompt (decode entry only) and a prompt of exactly one bucket
    assert list(lib.generate([7], max_new_tokens=8, stop_tokens=())) == _hf_greedy(model, [7], 8)[0]
    assert list(lib.generate(PROMPT[:8], max_new_tokens=8, stop_tokens=())) == _hf_greedy(model, PROMPT[:8], 8)[0]


@pytest.mark.parametrize("family,exporter", CASES)
def test_logits_match_onnxruntime_on_the_export(built, family, exporter):
    """The prompt's last logits and five decode steps' against onnxruntime running the exported
    file with its own growing cache (past 0, then the presents fed back)."""
    _, path, lib = built(family, exporter)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    kv = {i.name: i.shape for i in sess.get_inputs() if i.name.startswith("past_key_values")}
    past = {name: np.zeros((1, shape[1], 0, shape[3]), np.float32) for name, shape in kv.items()}
    session = lib.session()
    tokens, position = list(PROMPT), 0
    got = session.prefill(tokens)
    for step in range(6):
        feeds = {"input_ids": np.array([tokens], np.int64),
                 "attention_mask": np.ones((1, position + len(tokens)), np.int64),
                 "position_ids": np.arange(position, position + len(tokens), dtype=np.int64)[None], **past}
        out = dict(zip(names, sess.run(names, feeds)))
        want = out["logits"][0, -1]
        err = float(np.abs(got.reshape(-1) - want).max())
        assert err <= LOGITS_RTOL * float(np.abs(want).max()), (step, err, float(np.abs(want).max()))
        past = {name: out[name.replace("past_key_values", "present")] for name in kv}
        position += len(tokens)
        tokens = [int(np.argmax(want))]
        got = session.decode(tokens[0])
    session.close()


def test_decode_writes_one_row_in_place_through_group_query_attention(built):
    """No copy of past keys and values per token: each layer's attention is one GroupQueryAttention
    over the session's cache (the Concat, repeat_kv's Expand and K's Transpose are gone), and a
    decode step changes only the row of its position in each cache, in the buffer allocated once."""
    _, path, lib = built("llama", "dynamo")
    model = onnx.load(str(path))
    settings = generation.check_settings(GENERATE)
    layout = generation.layout(model, settings, {}, "dec")
    assert layout.kv_form == "concat"
    graph = generation.prepare_entry(import_model(str(path), layout.input_shapes(1)), layout, "dec")
    ops = graph.op_counts()
    assert ops.get("GroupQueryAttention") == LAYERS and "Softmax" not in ops and "Expand" not in ops, ops
    assert not any(n.op == "Concat" and set(n.outputs) & {p for _, p in layout.pairs} for n in graph.nodes)
    kv_heads, head = 2, 16
    assert lib.info["memory"]["kv_cache_bytes"] == 2 * LAYERS * kv_heads * GENERATE["max_context"] * head * 4
    session = lib.session()
    address = session.kv_cache().ctypes.data
    session.prefill(PROMPT)
    rows = lambda: session.kv_cache().view(np.float32).reshape(-1, kv_heads, GENERATE["max_context"], head)
    before = rows().copy()
    session.decode(5)
    changed = np.argwhere((rows() != before).any(axis=(0, 1, 3))).ravel().tolist()
    assert changed == [len(PROMPT)]
    assert session.kv_cache().ctypes.data == address
    session.close()


# -- the rewrite on its own: before (the export, dynamic past) / after (static cache) in onnxruntime

@pytest.fixture(scope="module")
def llama_dynamo(built):
    return built("llama", "dynamo")[1]


@pytest.mark.parametrize("fuse", [True, False], ids=["group-query-attention", "tensor-scatter"])
def test_rewrite_equals_the_export_in_onnxruntime(llama_dynamo, fuse):
    """The entry graph after write_kv_in_place, run by onnxruntime on a cache of C rows whose rows
    after the past hold garbage, gives the export's logits and new rows for the real past (fuse:
    GroupQueryAttention per layer; without: TensorScatter and the causal bias, the fallback)."""
    from cuvil.ir import to_onnx, verify
    from passes.write_kv_in_place import write_kv_in_place
    C, S, p = 16, 3, 5
    model = onnx.load(str(llama_dynamo))
    layout = generation.layout(model, generation.check_settings({"max_context": C, "prefill_buckets": [S]}), {}, "m")
    graph = import_model(str(llama_dynamo), layout.input_shapes(S))
    after = write_kv_in_place(graph, layout.pairs, layout.keys, layout.attention_mask, "m", fuse=fuse)
    verify(after)
    ops = after.op_counts()
    assert (ops.get("GroupQueryAttention"), ops.get("TensorScatter")) == ((LAYERS, None) if fuse else (None, 2 * LAYERS))
    rng = np.random.default_rng(1)
    ids, positions = rng.integers(0, VOCAB, (1, S)), np.arange(p, p + S)[None]
    past = {k: rng.standard_normal([1, 2, p, 16]).astype(np.float32) for k, _ in layout.pairs}
    export = ort.InferenceSession(str(llama_dynamo), providers=["CPUExecutionProvider"])
    names = [o.name for o in export.get_outputs()]
    want = dict(zip(names, export.run(names, {"input_ids": ids, "attention_mask": np.ones((1, p + S), np.int64),
                                              "position_ids": positions, **past})))
    rewritten = to_onnx(after)
    rewritten.opset_import[0].version = 24          # TensorScatter
    rewritten.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    cache = {k: rng.standard_normal([1, 2, C, 16]).astype(np.float32) for k in past}
    for k in past:
        cache[k][:, :, :p] = past[k]
    mask = (np.arange(C) < p + S).astype(np.int64)[None]
    sess = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip(names, sess.run(names, {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                                           **cache})))
    # the same float32 operations but for the attention's summation order (GroupQueryAttention's
    # kernel): LOGITS_RTOL of the logits' scale; the cache rows are moved, or computed alike
    scale = float(np.abs(want["logits"]).max())
    assert float(np.abs(got["logits"] - want["logits"]).max()) <= LOGITS_RTOL * scale
    for past_name, present in layout.pairs:
        np.testing.assert_allclose(got[present][:, :, :p + S], want[present], rtol=1e-5, atol=1e-6)
        if not fuse:    # TensorScatter keeps every other row as it was
            np.testing.assert_array_equal(got[present][:, :, p + S:], cache[past_name][:, :, p + S:])


def test_static_cache_decoders_are_not_rewritten():
    """Must not fire: a decoder that keeps its cache at max_context rows itself (GroupQueryAttention,
    tests/test_llm_runtime.py's toy) is left as it is."""
    from cuvil.ir import Graph, Node, Value
    f32 = np.dtype(np.float32)
    graph = Graph("g", {n: Value(n, f32, (1, 1, 16, 2)) for n in ("past", "present")},
                  [Node("Identity", "copy", ["past"], ["present"])], ["past"], ["present"])
    layout = generation.Layout("input_ids", "attention_mask", None, "logits", (("past", "present"),), 16, (4,), 0, (),
                               {})
    assert layout.kv_form == "static"
    assert generation.prepare_entry(graph, layout, "m") is graph


# -- TensorScatter, the write the fallback uses -------------------------------------------------

@pytest.mark.parametrize("mode,indices", [("linear", [0, 5]), ("circular", [6, 3])])
def test_tensor_scatter_matches_onnxruntime(mode, indices):
    from tests.helpers import assert_matches_ort, make_model
    node = helper.make_node("TensorScatter", ["cache", "update", "index"], ["out"], axis=-2, mode=mode)
    model = make_model([node], [("cache", np.float32, [2, 3, 8, 4]), ("update", np.float32, [2, 3, 3, 4]),
                                ("index", np.int64, [2])], [("out", np.float32, [2, 3, 8, 4])], opset=24)
    rng = np.random.default_rng(0)
    feeds = {"cache": rng.standard_normal((2, 3, 8, 4)).astype(np.float32),
             "update": rng.standard_normal((2, 3, 3, 4)).astype(np.float32), "index": np.array(indices)}
    assert_matches_ort(model, feeds, tol=0.0)     # rows moved, nothing computed: exact


# -- what is refused, and how -------------------------------------------------------------------

def _decoder(past_reader: str = "Concat", position_ids: bool = True) -> onnx.ModelProto:
    """A one-layer stand-in decoder: present = Concat(past, new) (or `past_reader` reading past)."""
    from tests.helpers import make_model
    f = np.float32
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h"], axis=0),
             helper.make_node("Reshape", ["h", "kv_shape"], ["new"]),
             helper.make_node("Concat", ["past_key_values.0.key", "new"], ["present.0.key"], axis=2),
             helper.make_node("Concat", ["past_key_values.0.value", "new"], ["present.0.value"], axis=2),
             helper.make_node("MatMul", ["h", "unembed"], ["logits"])]
    if past_reader != "Concat":
        nodes[2:4] = [node for k in ("key", "value") for node in (
            helper.make_node(past_reader, [f"past_key_values.0.{k}"], [f"t_{k}"], perm=[0, 1, 3, 2]),
            helper.make_node("Transpose", [f"t_{k}"], [f"t2_{k}"], perm=[0, 1, 3, 2]),
            helper.make_node("Concat", [f"t2_{k}", "new"], [f"present.0.{k}"], axis=2))]
    inputs = [("input_ids", np.int64, [1, "S"]), ("attention_mask", np.int64, [1, "T"])]
    if position_ids:
        inputs.append(("position_ids", np.int64, [1, "S"]))
    inputs += [(f"past_key_values.0.{k}", f, [1, 1, "P", 8]) for k in ("key", "value")]
    outputs = [("logits", f, [1, "S", 16])] + [(f"present.0.{k}", f, [1, 1, "T", 8]) for k in ("key", "value")]
    return make_model(nodes, inputs, outputs, {"embed": np.ones((16, 8), f), "unembed": np.ones((8, 16), f),
                                               "kv_shape": np.array([1, 1, -1, 8], np.int64)})


def test_unrecognised_kv_form_names_the_tensors_and_the_supported_forms():
    """past -> Transpose -> Transpose -> Concat(_, new) -> present: neither a cache the graph keeps
    at max_context rows nor Concat growth of the past itself."""
    with pytest.raises(CuvilError, match=r"'present\.0\.key' \(written by Concat .*\) has shape \[1, 1, 65, 8\] for the "
                                         r"cache input 'past_key_values\.0\.key' of shape \[1, 1, 64, 8\]: not a KV "
                                         r"cache form") as info:
        cuvil.compile(_decoder("Transpose"), name="dec", generate=GENERATE)
    assert "GroupQueryAttention" in str(info.value.hint) and "Concat(past, new)" in str(info.value.hint)


def test_concat_form_needs_position_ids_and_buckets_below_the_context():
    with pytest.raises(CuvilError, match="needs a 'position_ids' input"):
        cuvil.compile(_decoder(position_ids=False), name="dec", generate=GENERATE)
    with pytest.raises(CuvilError, match=r"prefill_buckets \[64\] leave no past rows"):
        cuvil.compile(_decoder(), name="dec", generate={"max_context": 64, "prefill_buckets": [64]})


def test_an_attention_without_softmax_over_the_cache_is_refused():
    """A model whose keys reach no Softmax (not MatMul/Softmax attention) is a ModelError naming
    the form, not an internal exception."""
    with pytest.raises(CuvilError, match="no Softmax reads the keys"):
        cuvil.compile(_decoder(), name="dec", generate=GENERATE)


@pytest.mark.slow
def test_fallback_attention_generates_the_same_tokens(built, monkeypatch, tmp_path):
    """The TensorScatter + causal-bias form (what a layer not of transformers' attention form gets),
    built end to end: the same greedy tokens as transformers. (fuse=False through the module the
    build imports, in a step cache of its own: no cached fused entry is reused.)"""
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / "cache"))
    import passes.write_kv_in_place as rewrite
    model, path, _ = built("llama", "dynamo")
    fused, calls = rewrite.write_kv_in_place, []

    def unfused(*args, **kwargs):
        graph = fused(*args, **kwargs, fuse=False)
        calls.append(graph.op_counts())
        return graph
    monkeypatch.setattr(rewrite, "write_kv_in_place", unfused)
    lib = cuvil.compile(path, name="dec", generate={"max_context": 48, "prefill_buckets": [8]})
    # both entries imported through the fallback, in this process
    assert [(c.get("TensorScatter"), c.get("GroupQueryAttention")) for c in calls] == [(2 * LAYERS, None)] * 2
    assert list(lib.generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_tokens=())) == _hf_greedy(model, PROMPT,
                                                                                               NEW_TOKENS)[0]
