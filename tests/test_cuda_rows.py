"""GPU row kernels (Softmax, LogSoftmax, LayerNormalization, reductions, global pooling),
FusedAttention and the elementwise kernels (backends/numba_cuda/rows.py, attention.py,
elementwise.py): Numba's CUDA simulator against onnxruntime, and ptxas for sm_80 and sm_90."""
import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.cuda_check import assert_gpu_matches_ort

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _value(name, shape, dtype=F):
    return helper.make_tensor_value_info(name, dtype, shape)


def _data(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _const(name, array):
    return helper.make_tensor(name, F, array.shape, array.reshape(-1).tolist())


# -- Softmax, LogSoftmax ------------------------------------------------------------------------

@pytest.mark.parametrize("op, shape, axis, opset, family", [
    ("Softmax", [6, 8], -1, 17, "Softmax"),            # lanes in groups of 2: several rows a warp
    ("Softmax", [3, 5, 40], -1, 17, "Softmax"),        # 16 lanes a row, 3 elements each
    ("Softmax", [2, 300], -1, 17, "Softmax"),          # a block per row
    ("Softmax", [2, 3, 4, 5], 1, 17, "Softmax"),       # over channels: a thread per column
    ("Softmax", [2, 3, 4, 5], 1, 11, "Softmax"),       # opset 11 flattens from the axis on
    ("LogSoftmax", [4, 70], -1, 17, "LogSoftmax"),
    ("LogSoftmax", [3, 6, 4], 1, 17, "LogSoftmax"),
])
def test_softmax(op, shape, axis, opset, family):
    model = _model([helper.make_node(op, ["x"], ["y"], axis=axis)], [_value("x", shape)], [_value("y", shape)],
                   opset=opset)
    assert_gpu_matches_ort(model, {"x": 3 * _data(shape)}, families=[family])


# -- LayerNormalization ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape, axis, bias, stats", [
    ([4, 6, 32], -1, True, False),
    ([2, 5, 24], -1, False, False),
    ([2, 3, 4, 6], 2, True, True),     # rows of the last two dims; Mean and InvStdDev outputs
    ([3, 1100], -1, True, False),      # a block per row, elements from global memory each pass
])
def test_layer_normalization(shape, axis, bias, stats):
    norm_shape = shape[axis:]
    scale, shift = 1 + 0.1 * _data(norm_shape, 1), 0.1 * _data(norm_shape, 2)
    inputs = ["x", "scale"] + (["bias"] if bias else [])
    inits = [_const("scale", scale)] + ([_const("bias", shift)] if bias else [])
    outputs = ["y"] + (["mean", "inv"] if stats else [])
    stat_shape = shape[:axis % len(shape)] + [1] * len(norm_shape)
    node = helper.make_node("LayerNormalization", inputs, outputs, axis=axis, epsilon=1e-5)
    out_values = [_value("y", shape)] + ([_value("mean", stat_shape), _value("inv", stat_shape)] if stats else [])
    model = _model([node], [_value("x", shape)], out_values, inits)
    assert_gpu_matches_ort(model, {"x": 2 + _data(shape)}, families=["LayerNormalization"])


# -- reductions, global pooling -------------------------------------------------------------------

@pytest.mark.parametrize("op, shape, axes, keepdims", [
    ("ReduceMean", [3, 4, 20], [-1], 1),
    ("ReduceSum", [3, 4, 20], [1, 2], 0),
    ("ReduceMax", [2, 3, 1, 9], [2, 3], 1),   # a size-1 dim among the reduced ones
    ("ReduceMean", [2, 700], [1], 0),
])
def test_reduce_trailing_axes(op, shape, axes, keepdims):
    out_shape = [1 if a in [x % len(shape) for x in axes] else d for a, d in enumerate(shape)] if keepdims else \
        [d for a, d in enumerate(shape) if a not in [x % len(shape) for x in axes]]
    node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims)
    axes_init = helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes)
    model = _model([node], [_value("x", shape)], [_value("y", out_shape)], [axes_init], opset=18)
    assert_gpu_matches_ort(model, {"x": _data(shape)}, families=[op])


def test_reduce_over_a_leading_axis_stays_portable():
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)
    axes_init = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    model = _model([node], [_value("x", [4, 6])], [_value("y", [6])], [axes_init], opset=18)
    assert_gpu_matches_ort(model, {"x": _data([4, 6])})


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pool(op):
    shape = [2, 3, 5, 7]
    model = _model([helper.make_node(op, ["x"], ["y"])], [_value("x", shape)], [_value("y", [2, 3, 1, 1])])
    assert_gpu_matches_ort(model, {"x": _data(shape)}, families=[op])


# -- FusedAttention -------------------------------------------------------------------------------

def _attention_model(B, H, T, S, D, mask_shape, scale_op="Div", k_transposed=False):
    """Scaled dot-product attention over head-split inputs q [B, T, H, D], k [B, S, H, D]
    (or, k_transposed, Kt [B, H, D, S] as it is), v [B, S, H, D], as exporters write it (the
    Transposes are absorbed as strides)."""
    nodes = [helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["v"], ["vt"], perm=[0, 2, 1, 3]),
             helper.make_node("MatMul", ["qt", "k" if k_transposed else "kt"], ["s"]),
             helper.make_node(scale_op, ["s", "scale"], ["ss"])]
    if not k_transposed:
        nodes.insert(1, helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1]))
    last = "ss"
    k_shape = [B, H, D, S] if k_transposed else [B, S, H, D]
    inputs = [_value("q", [B, T, H, D]), _value("k", k_shape), _value("v", [B, S, H, D])]
    if mask_shape:
        nodes.append(helper.make_node("Add", ["ss", "mask"], ["sm"]))
        inputs.append(_value("mask", mask_shape))
        last = "sm"
    nodes += [helper.make_node("Softmax", [last], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vt"], ["o"]),
              helper.make_node("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3])]
    scale = np.array(D ** 0.5 if scale_op == "Div" else D ** -0.5, np.float32)
    inits = [helper.make_tensor("scale", F, [], [float(scale)])]
    return _model(nodes, inputs, [_value("y", [B, T, H, D])], inits)


@pytest.mark.parametrize("B, H, T, S, D, mask_shape, scale_op, k_transposed", [
    (1, 2, 8, 8, 16, [1, 1, 1, 8], "Div", False),   # BERT's padding mask
    (2, 1, 5, 40, 8, [5, 40], "Mul", False),        # keys past S in the block, a [T, S] mask, T past a tile
    (1, 2, 6, 70, 40, None, "Div", False),          # two blocks of 64 keys, no mask; head dims past 32
    (1, 1, 9, 36, 20, [1, 1, 9, 36], "Div", True),  # K given transposed (keys contiguous), a full mask
])
def test_fused_attention(B, H, T, S, D, mask_shape, scale_op, k_transposed):
    model = _attention_model(B, H, T, S, D, mask_shape, scale_op, k_transposed)
    k_shape = [B, H, D, S] if k_transposed else [B, S, H, D]
    feeds = {"q": _data([B, T, H, D], 1), "k": _data(k_shape, 2), "v": _data([B, S, H, D], 3)}
    if mask_shape:
        mask = _data(mask_shape, 4)
        mask[..., -2:] = -10000.0
        feeds["mask"] = mask
    assert_gpu_matches_ort(model, feeds, families=["FusedAttention"])


@pytest.mark.slow   # ~20 s in the simulator; test_fused_attention covers the kernel by default
def test_bert_encoder_attention():
    """A BERT-style encoder from the zoo: its attention is one FusedAttention kernel; its
    LayerNorms and residual adds the row and elementwise kernels."""
    from tests import zoo
    seq = 8
    model = zoo.export(zoo.bert_encoder(layers=1, d=32, heads=2, ff=64, seq=seq), {"ids": (1, seq), "mask": (1, seq)},
                       int_inputs=("ids",))
    ids = np.random.default_rng(2).integers(0, 100, (1, seq)).astype(np.int64)
    mask = np.ones((1, seq), np.float32)
    mask[0, 6:] = 0
    assert_gpu_matches_ort(model, {"ids": ids, "mask": mask}, families=["FusedAttention", "LayerNormalization"])


# -- elementwise ----------------------------------------------------------------------------------

def test_broadcast_add_then_relu():
    shape = [2, 3, 4, 5]
    model = _model([helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
                   [_value("a", shape), _value("b", [3, 1, 1])], [_value("y", shape)])
    assert_gpu_matches_ort(model, {"a": _data(shape), "b": _data([3, 1, 1], 1)}, opt_level=2, families=["Add", "Relu"])


@pytest.mark.parametrize("op, attrs", [("LeakyRelu", {"alpha": 0.2}), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
                                       ("HardSwish", {}), ("Elu", {"alpha": 0.7}), ("Sigmoid", {}), ("Tanh", {}),
                                       ("Erf", {}), ("Softplus", {}), ("Floor", {}), ("Round", {})])
def test_unary_activations(op, attrs):
    shape = [3, 4, 6]
    model = _model([helper.make_node(op, ["x"], ["y"], **attrs)], [_value("x", shape)], [_value("y", shape)])
    assert_gpu_matches_ort(model, {"x": 3 * _data(shape)}, opt_level=1, families=[op])


def test_clip_where_compare_and_variadic():
    shape = [2, 3, 4]
    lo, hi = helper.make_tensor("lo", F, [], [-0.5]), helper.make_tensor("hi", F, [], [0.75])
    nodes = [helper.make_node("Clip", ["a", "lo", "hi"], ["c"]),
             helper.make_node("Greater", ["a", "b"], ["g"]),
             helper.make_node("Where", ["g", "c", "b"], ["w"]),
             helper.make_node("Max", ["w", "a", "b"], ["y"]),
             helper.make_node("Abs", ["a"], ["m"]),
             helper.make_node("Pow", ["m", "b"], ["p"])]
    model = _model(nodes, [_value("a", shape), _value("b", [4])],
                   [_value("y", shape), _value("g", shape, TensorProto.BOOL), _value("p", shape)], [lo, hi])
    a = _data(shape)
    assert_gpu_matches_ort(model, {"a": a, "b": np.abs(_data([4], 1)) + 0.5}, opt_level=1,
                           families=["Clip", "Greater", "Where", "Max", "Pow"])


def test_integer_ops_stay_portable():
    shape = [2, 5]
    model = _model([helper.make_node("Div", ["a", "b"], ["y"])], [_value("a", shape, TensorProto.INT64),
                   _value("b", [5], TensorProto.INT64)], [_value("y", shape, TensorProto.INT64)])
    a = np.arange(-5, 5, dtype=np.int64).reshape(shape)
    assert_gpu_matches_ort(model, {"a": a, "b": np.array([1, 2, 3, -4, 7], np.int64)}, opt_level=1)


def test_fused_gelu_chain_with_broadcast():
    """x * 0.5 * (1 + erf((x + bias) / sqrt 2)) style chains become one FusedElementwise (opt level 3)."""
    shape = [2, 3, 8]
    bias = _const("bias", _data([8], 4))
    nodes = [helper.make_node("Add", ["x", "bias"], ["h"]),
             helper.make_node("Div", ["h", "sqrt2"], ["d"]),
             helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]),
             helper.make_node("Mul", ["h", "e1"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["g"]),
             helper.make_node("Mul", ["g", "z"], ["y"])]
    inits = [bias, helper.make_tensor("sqrt2", F, [], [2 ** 0.5]), helper.make_tensor("one", F, [], [1.0]),
             helper.make_tensor("half", F, [], [0.5])]
    model = _model(nodes, [_value("x", shape), _value("z", [3, 1])], [_value("y", shape)], inits)
    schedule = assert_gpu_matches_ort(model, {"x": _data(shape), "z": _data([3, 1], 5)}, opt_level=3,
                                      families=["FusedElementwise"])
    assert len(schedule) <= 2
