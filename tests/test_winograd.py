"""3x3 stride-1 convolutions by Winograd F(2x2, 3x3) (backends/numba_cpu/winograd.py) against
onnxruntime, relative tolerance 1e-4 (the transforms' constants are 0, +-1 and 1/2).

Each case first checks that the conv takes the Winograd steps (or, for the ineligible shapes,
does not), then compares: even and odd output sizes (a last tile row or column half used),
asymmetric and large pads, no padding, batch 2, fused epilogues (bias, residual broadcast or
not, activations), two threads."""
import numpy as np
import onnx
import pytest
from onnx import helper

from backends.numba_cpu import winograd
from backends.numba_cpu.registry import lower
from cuvil.frontends.onnx import import_onnx
from passes import resolve_passes, run_passes

from tests.helpers import assert_matches_ort, make_model, rand

F32 = np.float32


def conv_model(x_shape, oc, pads=(0, 0, 0, 0), bias=True, residual=None, act=None, **attrs):
    """Conv(x, w[, b]) [+ r] [-> act]; `residual`: the shape of r (broadcast onto the output)."""
    inits = {"w": rand(oc, x_shape[1], 3, 3, seed=1) * 0.3}
    if bias:
        inits["b"] = rand(oc, seed=2)
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["c"], pads=list(pads), **attrs)]
    inputs, feeds = [("x", F32, list(x_shape))], {"x": rand(*x_shape, seed=3)}
    last = "c"
    if residual is not None:
        inputs.append(("r", F32, list(residual)))
        feeds["r"] = rand(*residual, seed=4)
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
        last = "s"
    if act == "Clip":
        inits.update(lo=np.float32(0.0), hi=np.float32(6.0))
        nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["y"]))
    elif act:
        nodes.append(helper.make_node(act, [last], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    model = make_model(nodes, inputs, [("y", F32, None)], inits)
    return onnx.shape_inference.infer_shapes(model), feeds


def families(model, threads=1) -> list[str]:
    graph, _ = import_onnx(model, {})
    graph = run_passes(graph, [p for p in resolve_passes(2) if p != "plan_memory"])
    return [c.kernel.family for c in lower(graph, threads) if hasattr(c, "kernel")]


CASES = {
    # name: (x shape, out channels, kwargs)
    "same_even": ((1, 16, 8, 8), 16, {"pads": [1, 1, 1, 1]}),
    "same_odd_batch2": ((2, 17, 9, 7), 19, {"pads": [1, 1, 1, 1]}),
    "valid_no_bias": ((1, 16, 10, 11), 24, {"bias": False}),
    "asymmetric_pads": ((1, 32, 9, 9), 20, {"pads": [0, 1, 2, 0]}),
    "pads_beyond_half_kernel": ((1, 16, 6, 9), 16, {"pads": [2, 2, 2, 2]}),
    "one_output_row": ((1, 16, 3, 40), 16, {}),
    "residual_relu": ((1, 16, 10, 10), 16, {"pads": [1, 1, 1, 1], "residual": (1, 16, 10, 10), "act": "Relu"}),
    "residual_broadcast_sigmoid": ((1, 16, 9, 11), 12, {"pads": [1, 1, 1, 1], "residual": (1, 1, 1, 11),
                                                       "act": "Sigmoid"}),
    "per_channel_residual_no_bias": ((1, 16, 9, 9), 16, {"pads": [1, 1, 1, 1], "residual": (1, 16, 1, 1),
                                                       "bias": False}),
    "clip": ((1, 24, 12, 12), 32, {"pads": [1, 1, 1, 1], "act": "Clip"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_winograd_conv(case):
    x_shape, oc, kwargs = CASES[case]
    model, feeds = conv_model(x_shape, oc, **kwargs)
    assert "WinoIn" in families(model)
    assert_matches_ort(model, feeds)


def test_winograd_threads_identical():
    model, feeds = conv_model((1, 32, 14, 14), 32, pads=[1, 1, 1, 1], residual=(1, 32, 14, 14), act="Relu")
    assert "WinoGemm" in families(model, threads=2)
    _, one = assert_matches_ort(model, feeds)
    _, two = assert_matches_ort(model, feeds, threads=2)
    np.testing.assert_array_equal(one["y"], two["y"])


@pytest.mark.parametrize("why, x_shape, oc, attrs", [
    ("stride 2", (1, 16, 16, 16), 16, {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("dilation 2", (1, 16, 16, 16), 16, {"dilations": [2, 2], "pads": [2, 2, 2, 2]}),
    ("groups", (1, 16, 16, 16), 16, {"group": 2, "pads": [1, 1, 1, 1]}),
    ("few input channels", (1, 4, 16, 16), 16, {"pads": [1, 1, 1, 1]}),
    ("few output channels", (1, 16, 16, 16), 4, {"pads": [1, 1, 1, 1]}),
    ("few tiles", (1, 16, 6, 6), 16, {"pads": [1, 1, 1, 1]}),
])
def test_direct_where_winograd_does_not_pay(why, x_shape, oc, attrs):
    if "group" in attrs:
        inits = {"w": rand(oc, x_shape[1] // attrs["group"], 3, 3, seed=1)}
        node = helper.make_node("Conv", ["x", "w"], ["y"], **attrs)
        model = onnx.shape_inference.infer_shapes(make_model([node], [("x", F32, list(x_shape))],
                                                             [("y", F32, None)], inits))
        feeds = {"x": rand(*x_shape, seed=3)}
    else:
        model, feeds = conv_model(x_shape, oc, **attrs)
    assert "WinoIn" not in families(model), why
    assert_matches_ort(model, feeds)


def test_weight_transform_matches_direct_sums():
    """A^T (U * V) A over one tile equals the direct 3x3 sums (float64, to rounding)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 3, 3, 3))
    d = rng.standard_normal((3, 4, 4))
    BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], float)
    AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], float)
    U = winograd.transform_weights(w).astype(np.float64).reshape(4, 4, 2, 3)
    V = np.einsum("ai,cij,bj->abc", BT, d, BT)
    for oc in range(2):
        M = np.einsum("abc,abc->ab", U[:, :, oc], V)
        got = AT @ M @ AT.T
        want = np.array([[np.sum(w[oc] * d[:, i:i + 3, j:j + 3]) for j in range(2)] for i in range(2)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

