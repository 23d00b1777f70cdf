"""RoiAlign (backends/numba_cpu/roi_align.py) and DeformConv (deform_conv.py) against onnxruntime.

onnxruntime 1.32 implements RoiAlign up to opset 16 (not 22, whose node tests pass through the
backend) and DeformConv at opset 19/22. Both kernels compute in float64 and round once; onnxruntime
computes in float32: max|diff| / max|ref| within a few float32 ulps (2^-23 ~ 1.2e-7) times the
number of terms summed (RoiAlign: up to 4 x 16 samples, 1e-5; DeformConv: 36 taps of 4 neighbours
times weights, 1e-4)."""
import numpy as np
import pytest
from onnx import helper

from tests.helpers import assert_matches_ort, make_model


def _rois(rng, count, size):
    """Boxes (x1, y1, x2, y2), some reaching past the map and some tiny."""
    a = rng.uniform(-2, size + 1, (count, 2))
    b = a + rng.uniform(0.2, size / 1.5, (count, 2))
    return np.concatenate([a, b], 1).astype(np.float32)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("transform", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_roi_align_vs_onnxruntime(mode, transform, sampling_ratio):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 3, 12, 10)).astype(np.float32)
    rois = _rois(rng, 5, 20)   # in the scale-0.5 image's coordinates
    index = np.array([0, 1, 1, 0, 1], np.int64)
    node = helper.make_node("RoiAlign", ["x", "rois", "index"], ["y"], mode=mode, output_height=3, output_width=4,
                            sampling_ratio=sampling_ratio, spatial_scale=0.5,
                            coordinate_transformation_mode=transform)
    model = make_model([node], [("x", np.float32, [2, 3, 12, 10]), ("rois", np.float32, [5, 4]),
                                ("index", np.int64, [5])], [("y", np.float32, [5, 3, 3, 4])], opset=16)
    assert_matches_ort(model, {"x": x, "rois": rois, "index": index}, tol=1e-5)


def test_roi_align_opset10_has_no_half_pixel_shift():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(1, 2, 8, 8)).astype(np.float32)
    rois = _rois(rng, 3, 8)
    node = helper.make_node("RoiAlign", ["x", "rois", "index"], ["y"], output_height=2, output_width=2)
    model = make_model([node], [("x", np.float32, [1, 2, 8, 8]), ("rois", np.float32, [3, 4]),
                                ("index", np.int64, [3])], [("y", np.float32, [3, 2, 2, 2])], opset=10)
    assert_matches_ort(model, {"x": x, "rois": rois, "index": np.zeros(3, np.int64)}, tol=1e-5)


@pytest.mark.parametrize("group,offset_group,with_bias,with_mask,stride,dilation,pads", [
    (1, 1, False, False, 1, 1, 0),
    (1, 2, True, True, 1, 1, 1),
    (2, 2, True, False, 2, 1, 1),
    (2, 1, False, True, 1, 2, 2),
])
def test_deform_conv_vs_onnxruntime(group, offset_group, with_bias, with_mask, stride, dilation, pads):
    rng = np.random.default_rng(group * 7 + offset_group)
    n, c, h, w, oc, k = 2, 4, 9, 8, 6, 3
    out_h = (h + 2 * pads - dilation * (k - 1) - 1) // stride + 1
    out_w = (w + 2 * pads - dilation * (k - 1) - 1) // stride + 1
    feeds = {"x": rng.normal(size=(n, c, h, w)).astype(np.float32),
             "w": rng.normal(size=(oc, c // group, k, k)).astype(np.float32),
             # offsets up to 3 pixels: many taps land between pixels and some off the map
             "offset": rng.uniform(-3, 3, (n, offset_group * k * k * 2, out_h, out_w)).astype(np.float32)}
    inputs = [("x", np.float32, [n, c, h, w]), ("w", np.float32, [oc, c // group, k, k]),
              ("offset", np.float32, [n, offset_group * k * k * 2, out_h, out_w])]
    names = ["x", "w", "offset", "", ""]
    if with_bias:
        feeds["b"] = rng.normal(size=oc).astype(np.float32)
        inputs.append(("b", np.float32, [oc]))
        names[3] = "b"
    if with_mask:
        feeds["mask"] = rng.uniform(0, 1, (n, offset_group * k * k, out_h, out_w)).astype(np.float32)
        inputs.append(("mask", np.float32, [n, offset_group * k * k, out_h, out_w]))
        names[4] = "mask"
    while names[-1] == "":
        names.pop()
    node = helper.make_node("DeformConv", names, ["y"], group=group, offset_group=offset_group, kernel_shape=[k, k],
                            strides=[stride, stride], dilations=[dilation, dilation], pads=[pads] * 4)
    model = make_model([node], inputs, [("y", np.float32, [n, oc, out_h, out_w])], opset=19)
    assert_matches_ort(model, feeds, tol=1e-4)
