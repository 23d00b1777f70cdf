"""Shared test helpers: build small ONNX models and compare cuvil with onnxruntime."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import cuvil


def make_model(nodes, inputs, outputs, initializers=None, opset=17) -> onnx.ModelProto:
    """inputs/outputs: lists of (name, np.dtype or onnx elem type, shape or None)."""
    def vi(name, dtype, shape):
        elem = dtype if isinstance(dtype, int) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        return helper.make_tensor_value_info(name, elem, shape)
    graph = helper.make_graph(nodes, "test", [vi(*i) for i in inputs], [vi(*o) for o in outputs],
                              initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 10)
    return model


def run_ort(model: onnx.ModelProto, feeds: dict, optimize: bool = True) -> dict:
    """Outputs by name on one thread; `optimize=False` turns onnxruntime's graph optimisations off
    (a QDQ model then runs as float emulation, node by node, instead of fused integer ops)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def assert_matches_ort(model: onnx.ModelProto, feeds: dict, tol: float = 1e-4, input_shapes=None, **compile_options):
    """Compile with cuvil, run both engines, require max|diff| / max|ref| <= tol for every output."""
    compiled = cuvil.compile(model, input_shapes=input_shapes, **compile_options)
    got = compiled.run(feeds)
    want = run_ort(model, feeds)
    assert list(got) == list(want), f"output names differ: {list(got)} vs {list(want)}"
    for name, ref in want.items():
        out = got[name]
        assert out.shape == ref.shape, f"{name}: shape {out.shape} vs {ref.shape}"
        assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} vs {ref.dtype}"
        if ref.dtype.kind in "fc":
            scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, 1e-6)
            err = float(np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64)))) if ref.size else 0.0
            assert err / scale <= tol, f"{name}: max abs error {err:.3g} / max |ref| {scale:.3g} > {tol}"
        else:
            np.testing.assert_array_equal(out, ref, err_msg=name)
    return compiled, got


def cosine(a, b) -> float:
    """Cosine similarity of two arrays (flattened, in float64): the accuracy measure of the reduced
    precisions' whole-model checks."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def rand(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# onnxruntime-genai decoders (tests/test_llm_ops.py, tests/test_llm_runtime.py)
DECODER_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=512, max_position_embeddings=512)


def genai_decoder(folder: Path, precision: str) -> Path:
    """The model folder (model.onnx, genai_config.json, tokenizer.json) onnxruntime-genai's builder
    writes for a LLaMA with seeded random weights and a word-level tokenizer; nothing downloaded."""
    pytest.importorskip("onnxruntime_genai")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    hf = folder / "hf"
    if not (hf / "config.json").exists():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER_CONFIG)).save_pretrained(hf)
        # ids 0-2 are the special tokens only (a word sharing one would give the tokenizer a 513th id)
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, DECODER_CONFIG["vocab_size"])}}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                             eos_token="</s>").save_pretrained(hf)
    out = folder / precision
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(hf), "-o", str(out),
                    "-p", precision, "-e", "cpu", "-c", str(folder / "cache")], check=True, capture_output=True)
    return out
