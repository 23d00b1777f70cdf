"""GPU convolution kernels (backends/numba_cuda/conv.py) in the CUDA simulator against onnxruntime,
plus ptxas for sm_90 (tests/test_cuda_zoo.py builds sm_80 too): the implicit GEMM (with and without K splits), the depthwise kernel,
and the fused epilogues the GPU passes make (Conv+Relu, Conv+Add+Relu, Conv+Clip)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from backends.numba_cuda import conv as gpu_conv
from tests.cuda_check import assert_gpu_matches_ort
from tests.helpers import make_model

GEMM, SPLIT, SPLIT_SUM, DW = "ConvImplicitGemm", "ConvImplicitGemmSplitK", "ConvSplitKSum", "ConvDepthwise"


def conv_model(x_shape, w_shape, bias=True, after=(), seed=0, w_input=False, **attrs):
    """X -> Conv(W, [B]) -> the `after` ops (each a (op, extra inputs, attrs) applied to the previous
    output) -> Y; returns (model, feeds)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    inits = {} if w_input else {"W": w}
    if bias:
        inits["B"] = rng.standard_normal(w_shape[0]).astype(np.float32)
    inputs = [("X", np.float32, list(x_shape))] + ([("W", np.float32, list(w_shape))] if w_input else [])
    feeds = {"X": x, **({"W": w} if w_input else {})}
    nodes = [helper.make_node("Conv", ["X", "W"] + (["B"] if bias else []), ["c0"], **attrs)]
    for i, (op, extra, op_attrs) in enumerate(after):
        names = []
        for name, value in extra:
            if isinstance(value, tuple):        # a graph input of that shape
                inputs.append((name, np.float32, list(value)))
                feeds[name] = rng.standard_normal(value).astype(np.float32)
            else:
                inits[name] = value
            names.append(name)
        nodes.append(helper.make_node(op, [f"c{i}"] + names, [f"c{i + 1}"], **op_attrs))
    nodes[-1].output[0] = "Y"
    model = make_model(nodes, inputs, [("Y", np.float32, None)], inits)
    return model, feeds


@pytest.fixture(autouse=True)
def one_sm(monkeypatch):
    """The tests' shapes are tiny: sized for a GPU of one SM, they are not split over K
    (test_split_k asks for splits)."""
    monkeypatch.setattr(gpu_conv, "SMS", 1)
    monkeypatch.setattr(gpu_conv, "WARPS_PER_SM", 1)


def check(model, feeds, families):
    return assert_gpu_matches_ort(model, feeds, families=families)


@pytest.mark.parametrize("strides", [[1, 1], [2, 2]])
def test_3x3_pad1(strides):
    check(*conv_model((1, 8, 10, 10), (8, 8, 3, 3), pads=[1, 1, 1, 1], strides=strides), [GEMM])


def test_7x7_stride2_pad3_stem():
    check(*conv_model((1, 3, 12, 12), (8, 3, 7, 7), pads=[3, 3, 3, 3], strides=[2, 2]), [GEMM])


def test_1x1_no_bias():
    check(*conv_model((1, 16, 6, 6), (12, 16, 1, 1), bias=False), [GEMM])


def test_1x1_stride2_batch2():
    check(*conv_model((2, 8, 7, 7), (8, 8, 1, 1), strides=[2, 2]), [GEMM])


def test_dilation2_asymmetric_pads():
    check(*conv_model((1, 4, 9, 11), (6, 4, 3, 3), dilations=[2, 2], pads=[1, 2, 3, 0]), [GEMM])


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_auto_pad(auto_pad):
    check(*conv_model((1, 4, 9, 8), (6, 4, 4, 3), auto_pad=auto_pad, strides=[2, 1]), [GEMM])


def test_groups2_runtime_weights():
    check(*conv_model((1, 8, 8, 8), (6, 4, 3, 3), group=2, pads=[1, 1, 1, 1], w_input=True), [GEMM])


@pytest.mark.parametrize("strides", [[1, 1], [2, 2]])
def test_depthwise_3x3(strides):
    check(*conv_model((1, 8, 9, 9), (8, 1, 3, 3), group=8, pads=[1, 1, 1, 1], strides=strides), [DW])


def test_depthwise_multiplier_no_bias():
    check(*conv_model((1, 4, 7, 7), (8, 1, 3, 3), bias=False, group=4, pads=[0, 1, 2, 1]), [DW])


def test_conv1d():
    check(*conv_model((1, 4, 11), (5, 4, 3), pads=[1, 2], strides=[2]), [GEMM])


def test_conv3d():
    check(*conv_model((1, 2, 4, 5, 5), (3, 2, 3, 3, 3), pads=[1, 1, 1, 1, 1, 1]), [GEMM])


def test_depthwise_1d_broadcast_residual():
    model, feeds = conv_model((2, 6, 10), (6, 1, 3), group=6, pads=[1, 1],
                              after=[("Add", [("R", (1, 6, 1))], {}), ("Relu", [], {})])
    check(model, feeds, [DW])


def test_depthwise_5x5_dilated_residual():
    model, feeds = conv_model((1, 4, 9, 10), (4, 1, 5, 5), group=4, pads=[2, 2, 2, 2], dilations=[1, 2],
                              after=[("Add", [("R", (1, 4, 9, 6))], {})])
    check(model, feeds, [DW])


def test_fused_relu():
    schedule = check(*conv_model((1, 8, 8, 8), (8, 8, 3, 3), pads=[1, 1, 1, 1], after=[("Relu", [], {})]), [GEMM])
    assert len(schedule) == 1


def test_fused_residual_relu():
    model, feeds = conv_model((1, 8, 8, 8), (8, 8, 3, 3), pads=[1, 1, 1, 1],
                              after=[("Add", [("R", (1, 8, 8, 8))], {}), ("Relu", [], {})])
    assert len(check(model, feeds, [GEMM])) == 1


def test_fused_clip_depthwise():
    clip = ("Clip", [("lo", np.array(0, np.float32)), ("hi", np.array(6, np.float32))], {})
    model, feeds = conv_model((1, 8, 8, 8), (8, 1, 3, 3), group=8, pads=[1, 1, 1, 1], after=[clip])
    feeds["X"] *= 8   # so that both bounds clip
    assert len(check(model, feeds, [DW])) == 1


@pytest.mark.parametrize("tile", gpu_conv.TILES, ids=lambda t: f"{t.bm}x{t.bn}")
def test_every_tile(tile, monkeypatch):
    """Each block tile, on a conv that leaves partial tiles in M and N, with a fused residual + Relu."""
    monkeypatch.setattr(gpu_conv, "TILES", (tile,))
    model, feeds = conv_model((1, 12, 7, 5), (20, 12, 3, 3), pads=[1, 1, 1, 1],
                              after=[("Add", [("R", (1, 20, 7, 5))], {}), ("Relu", [], {})])
    check(model, feeds, [GEMM])


def test_split_k_with_broadcast_residual(monkeypatch):
    """A conv with few output tiles and a long K splits K (partials summed in order, then the epilogue)."""
    monkeypatch.setattr(gpu_conv, "SMS", 132)
    monkeypatch.setattr(gpu_conv, "WARPS_PER_SM", 8)
    monkeypatch.setattr(gpu_conv, "MIN_SPLIT_TILES", 2)
    model, feeds = conv_model((1, 32, 3, 3), (16, 32, 3, 3), pads=[1, 1, 1, 1],
                              after=[("Add", [("R", (1, 16, 1, 3))], {}), ("Relu", [], {})])
    check(model, feeds, [SPLIT, SPLIT_SUM])


def test_split_k_groups_batch2(monkeypatch):
    monkeypatch.setattr(gpu_conv, "SMS", 132)
    monkeypatch.setattr(gpu_conv, "WARPS_PER_SM", 8)
    monkeypatch.setattr(gpu_conv, "MIN_SPLIT_TILES", 2)
    check(*conv_model((2, 16, 3, 4), (8, 8, 3, 3), group=2, pads=[1, 0, 1, 2]), [SPLIT, SPLIT_SUM])


def test_tile_choice_fills_the_gpu(monkeypatch):
    """Late ResNet layers (512 channels x 7x7) split K; wide early layers need no split."""
    monkeypatch.setattr(gpu_conv, "SMS", 132)
    monkeypatch.setattr(gpu_conv, "WARPS_PER_SM", 8)

    def shape(c, oc, hw, k):
        return gpu_conv.ConvShape(1, c, oc, 1, [hw, hw], [hw, hw], [k, k], [1, 1], [1, 1], [k // 2] * 2,
                                  True, None, gpu_conv.Epilogue())
    tile, splits = gpu_conv.choose_tile(shape(512, 512, 7, 3))
    assert splits > 1 and gpu_conv.ceil_div(512, tile.bm) * gpu_conv.ceil_div(49, tile.bn) * splits >= gpu_conv.SMS
    tile, splits = gpu_conv.choose_tile(shape(64, 64, 112, 3))
    assert splits == 1 and gpu_conv.ceil_div(112 * 112, tile.bn) >= gpu_conv.SMS
