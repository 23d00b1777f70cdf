"""assign_precision: the weight products of a reduced-precision variant are marked; nothing else is.
(What a marked product computes is tested against onnxruntime in tests/test_precision.py.)"""
import numpy as np
from onnx import helper

from cuvil.frontends.onnx import import_onnx
from cuvil.ir import verify
from passes.assign_precision import Options, assign_precision, describe
from tests.helpers import make_model, rand

F = np.float32


def _model():
    """A Gemm with constant weights, a MatMul of two run-time inputs, a Softmax."""
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="dense"),
             helper.make_node("MatMul", ["h", "z"], ["s"], name="scores"),
             helper.make_node("Softmax", ["s"], ["y"], name="softmax")]
    return make_model(nodes, [("x", F, [2, 8]), ("z", F, [4, 3])], [("y", F, None)],
                      {"w": rand(8, 4, seed=1), "b": rand(4, seed=2)})


def _marks(graph):
    return {n.name: n.attr("precision") for n in graph.nodes}


def test_marks_the_products_with_constant_weights():
    before, _ = import_onnx(_model())
    after = assign_precision(before, Options(precision="bf16"))
    verify(after)
    assert _marks(after) == {"dense": "bf16", "scores": None, "softmax": None}
    assert _marks(before) == {"dense": None, "scores": None, "softmax": None}  # the pass is pure
    assert describe(before, after) == "1 weight products in bf16, 2 nodes in float32"


def test_must_not_fire_in_float32_or_on_what_is_kept():
    before, _ = import_onnx(_model())
    assert assign_precision(before, Options(precision="fp32")) is before
    assert assign_precision(before, Options(precision="fp16", keep_fp32=["dense"])) is before
    assert assign_precision(before, Options(precision="fp16", keep_fp32=["Gemm"])) is before


def _lstm(r_constant: bool):
    """An LSTM (hidden 4) whose R is a constant initializer or a run-time input."""
    H, I = 4, 3
    inits = {"w": rand(1, 4 * H, I, seed=3)}
    inputs = [("x", F, [2, 1, I])]
    if r_constant:
        inits["r"] = rand(1, 4 * H, H, seed=4)
    else:
        inputs.append(("r", F, [1, 4 * H, H]))
    nodes = [helper.make_node("LSTM", ["x", "w", "r"], ["y"], name="lstm", hidden_size=H)]
    return make_model(nodes, inputs, [("y", F, None)], inits)


def test_marks_an_lstm_with_a_constant_recurrence_and_not_one_without():
    before, _ = import_onnx(_lstm(True))
    after = assign_precision(before, Options(precision="bf16"))
    verify(after)
    assert _marks(after) == {"lstm": "bf16"}
    unmarked, _ = import_onnx(_lstm(False))
    assert assign_precision(unmarked, Options(precision="bf16")) is unmarked
    assert assign_precision(before, Options(precision="bf16", keep_fp32=["LSTM"])) is before


def _convs():
    """conv a -> MaxPool -> conv b -> output y, and conv a's output also read by a Softmax (s)."""
    nodes = [helper.make_node("Conv", ["x", "wa"], ["h"], name="a", pads=[1, 1, 1, 1]),
             helper.make_node("MaxPool", ["h"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "wb"], ["y"], name="b", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "wa"], ["k"], name="c", pads=[1, 1, 1, 1]),
             helper.make_node("Softmax", ["k"], ["s"], name="softmax", axis=1)]
    return make_model(nodes, [("x", F, [1, 4, 8, 8])], [("y", F, None), ("s", F, None)],
                      {"wa": rand(6, 4, 3, 3, seed=1), "wb": rand(5, 6, 3, 3, seed=2)})


def _dtypes(graph, names):
    return {name: np.dtype(graph.values[name].dtype).name for name in names}


def test_activations_between_16_bit_readers_and_writers_are_stored_in_16_bits():
    before, _ = import_onnx(_convs())
    names = ["x", "h", "p", "k", "y", "s"]
    for precision, stored in (("bf16", "bfloat16"), ("fp16", "float16")):
        after = assign_precision(before, Options(precision=precision))
        verify(after)
        # h (conv -> MaxPool) and p (MaxPool -> conv) are; the graph's input and outputs are not, nor
        # k, which a Softmax reads
        assert _dtypes(after, names) == {"x": "float32", "h": stored, "p": stored, "k": "float32",
                                         "y": "float32", "s": "float32"}
        assert describe(before, after) == f"3 weight products in {precision}, 2 nodes in float32, " \
                                          f"2 activations stored in {precision}"
    assert set(_dtypes(before, names).values()) == {"float32"}   # the pass is pure


def test_activations_stay_float32_when_asked_or_when_a_reader_is_kept_in_float32():
    before, _ = import_onnx(_convs())
    names = ["h", "p"]
    off = assign_precision(before, Options(precision="bf16", narrow_activations=False))
    assert _dtypes(off, names) == {"h": "float32", "p": "float32"}
    kept = assign_precision(before, Options(precision="bf16", keep_fp32=["b"]))
    # b stays float32, so p (its input) does; h still goes conv a -> MaxPool in 16 bits
    assert _dtypes(kept, names) == {"h": "bfloat16", "p": "float32"}


def test_marks_a_fused_attention_in_bf16_only():
    """FusedAttention's two products have a bf16 kernel (backends/numba_cpu/attention_bf16.py; its
    numerics against onnxruntime: tests/test_precision_attention.py), no fp16 one."""
    from passes.fuse_attention import fuse_attention
    from tests.test_attention import heads
    model, _ = heads(T=8, H=2, D=16)
    before = fuse_attention(import_onnx(model)[0])
    assert [n.op for n in before.nodes] == ["FusedAttention"]
    after = assign_precision(before, Options(precision="bf16"))
    verify(after)
    assert [n.attr("precision") for n in after.nodes] == ["bf16"]
    assert describe(before, after) == "0 weight products and 1 attentions in bf16, 0 nodes in float32"
    assert assign_precision(before, Options(precision="fp16")) is before
    assert assign_precision(before, Options(precision="bf16", keep_fp32=["FusedAttention"])) is before


def _block():
    """1x1 conv -> depthwise 3x3 conv -> 1x1 conv, fused into one DepthwiseBlock."""
    from passes.fuse_depthwise_block import Options as FuseOptions, fuse_depthwise_block
    nodes = [helper.make_node("Conv", ["x", "w1"], ["t"], name="expand"),
             helper.make_node("Conv", ["t", "w2"], ["u"], name="dw", group=12, pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["u", "w3"], ["y"], name="project")]
    model = make_model(nodes, [("x", F, [1, 4, 8, 8])], [("y", F, None)],
                       {"w1": rand(12, 4, 1, 1, seed=5), "w2": rand(12, 1, 3, 3, seed=6), "w3": rand(4, 12, 1, 1, seed=7)})
    graph, _ = import_onnx(model)
    fused = fuse_depthwise_block(graph, FuseOptions(min_bytes=0))
    assert [n.op for n in fused.nodes] == ["DepthwiseBlock"]
    return fused


def test_marks_a_depthwise_block_in_bf16_only():
    # its 1x1 convs run on the bf16 micro-kernel (backends/numba_cpu/dwblock.py); fp16 blocks keep
    # float32 1x1 convs, so an fp16 mark would claim what the kernel does not do
    before = _block()
    after = assign_precision(before, Options(precision="bf16"))
    verify(after)
    assert _marks(after) == {"dw": "bf16"}
    assert _marks(assign_precision(before, Options(precision="fp16"))) == {"dw": None}
    assert _marks(assign_precision(before, Options(precision="bf16", keep_fp32=["DepthwiseBlock"]))) == {"dw": None}
