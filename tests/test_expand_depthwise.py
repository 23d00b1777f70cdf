"""ExpandDepthwise: a 1x1 conv and the depthwise conv reading it, fused by the pass
fuse_expand_depthwise and computed in bands of rows (backends/numba_cpu/expanddw.py), against
onnxruntime (relative tolerance 1e-5); and where the pass must not fire."""
import numpy as np
import onnx
import pytest
from onnx import helper

from backends.native.ukernel import DwRowSpec, specs_in
from backends.numba_cpu import expanddw
from backends.numba_cpu.registry import lower
from cuvil.frontends.onnx import import_onnx
from passes import resolve_passes, run_passes

from tests.helpers import assert_matches_ort, make_model, rand

F32 = np.float32
ALWAYS = {"fuse_expand_depthwise": {"min_bytes": 0}}   # fuse at any size (the default needs >= 1 MiB)


def block(C0, C1, H, W, k=3, s=1, pads=None, bias=(True, True), acts=("Clip", "Clip"), extra_reader=False,
          residual=False):
    """x -> Conv 1x1 (C0 -> C1) [-> act] -> depthwise Conv k x k / s [+ r] [-> act] -> y;
    `extra_reader`: the expanded tensor is also a graph output."""
    p = k // 2
    pads = pads or [p, p, p, p]
    inits = {"w1": rand(C1, C0, 1, 1, seed=1) * 0.3, "w2": rand(C1, 1, k, k, seed=2) * 0.3,
             "lo": np.float32(0), "hi": np.float32(6)}
    if bias[0]:
        inits["b1"] = rand(C1, seed=3)
    if bias[1]:
        inits["b2"] = rand(C1, seed=4)
    nodes = [helper.make_node("Conv", ["x", "w1"] + (["b1"] if bias[0] else []), ["e"])]

    def act(a, out, v):
        if a == "Clip":
            nodes.append(helper.make_node("Clip", [v, "lo", "hi"], [out]))
        elif a:
            nodes.append(helper.make_node(a, [v], [out]))
        else:
            return v
        return out
    mid = act(acts[0], "ea", "e")
    nodes.append(helper.make_node("Conv", [mid, "w2"] + (["b2"] if bias[1] else []), ["d"], group=C1,
                                  kernel_shape=[k, k], strides=[s, s], pads=pads))
    last, feeds = "d", {"x": rand(1, C0, H, W, seed=5)}
    inputs = [("x", F32, [1, C0, H, W])]
    if residual:
        OH, OW = (H + pads[0] + pads[2] - k) // s + 1, (W + pads[1] + pads[3] - k) // s + 1
        inputs.append(("r", F32, [1, C1, OH, OW]))
        feeds["r"] = rand(1, C1, OH, OW, seed=6)
        nodes.append(helper.make_node("Add", ["d", "r"], ["dr"]))
        last = "dr"
    nodes.append(helper.make_node("Identity", [act(acts[1], "da", last)], ["y"]))
    outputs = [("y", F32, None)] + ([(mid, F32, None)] if extra_reader else [])
    if not any("Clip" in a for a in acts):
        del inits["lo"], inits["hi"]
    model = make_model(nodes, inputs, outputs, inits)
    return onnx.shape_inference.infer_shapes(model), feeds


def lowered(model, options=ALWAYS, threads=1):
    graph, _ = import_onnx(model, {})
    graph = run_passes(graph, [p for p in resolve_passes(2) if p != "plan_memory"], options=options)
    return graph, [c for c in lower(graph, threads) if hasattr(c, "kernel")]


CASES = {
    # name: (C0, C1, H, W, kwargs)
    "s2_mobilenet_like": (16, 96, 30, 30, {"s": 2}),
    "s1_mobilenet_like": (24, 40, 17, 19, {}),
    "s2_5x5_wide_rows": (8, 20, 9, 70, {"s": 2, "k": 5, "bias": (False, True), "acts": ("Relu", "")}),
    "s1_5x5_asymmetric_pads": (8, 13, 40, 33, {"k": 5, "pads": [2, 1, 0, 2], "bias": (True, False),
                                               "acts": ("", "Relu")}),
    "s1_odd_rows_no_pads": (4, 7, 23, 9, {"pads": [0, 0, 0, 0], "bias": (False, False), "acts": ("Clip", "")}),
    "s2_7x7_one_band_row": (6, 30, 12, 128, {"s": 2, "k": 7, "pads": [3, 2, 3, 3]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_block_matches_ort(case):
    C0, C1, H, W, kw = CASES[case]
    model, feeds = block(C0, C1, H, W, **kw)
    graph, calls = lowered(model)
    assert [n.op for n in graph.nodes if n.op != "Identity"] == ["ExpandDepthwise"]
    assert [c.kernel.family for c in calls] == ["ExpandDepthwise"]
    rows = {s.rows for s in specs_in(calls[0].kernel.source).values() if isinstance(s, DwRowSpec)}
    assert rows == ({1, 2} if kw.get("s", 1) == 1 else {1})
    for threads in (1, 2):
        assert_matches_ort(model, feeds, tol=1e-5, threads=threads, pass_options=ALWAYS)


def test_bands_carry_shared_rows(monkeypatch, tmp_path):
    """Small bands (one or two output rows each): the rows two bands share move to the top of
    the slot and only the new rows are computed; results do not change."""
    monkeypatch.setattr(expanddw, "BAND_BYTES", 1)
    for s in (1, 2):
        model, feeds = block(8, 24, 21, 20, s=s)
        _, calls = lowered(model)
        assert "oh1 = min(oh0 + 1, " in calls[0].kernel.source
        for threads in (1, 3):
            assert_matches_ort(model, feeds, tol=1e-5, threads=threads, pass_options=ALWAYS,
                              cache_dir=tmp_path / f"s{s}t{threads}")


def test_default_size_threshold():
    """By default only an expanded tensor of 1 MiB or more is fused (smaller ones stay in L2)."""
    small, _ = block(8, 24, 20, 20)
    large, _ = block(16, 96, 56, 56)
    assert [n.op for n in lowered(small, options={})[0].nodes if n.op != "Identity"] == ["FusedConv", "FusedConv"]
    assert [n.op for n in lowered(large, options={})[0].nodes if n.op != "Identity"] == ["ExpandDepthwise"]


@pytest.mark.parametrize("kwargs,why", [
    ({"extra_reader": True}, "the expanded tensor is read elsewhere"),
    ({"residual": True}, "the depthwise conv adds a residual"),
    ({"acts": ("Sigmoid", "Clip")}, "an activation the kernels do not apply in registers"),
    ({"acts": ("Clip", "Tanh")}, "an activation the kernels do not apply in registers"),
    ({"pads": [1, 1, 1, 1], "k": 3, "s": 3}, "stride 3"),
])
def test_pass_does_not_fire(kwargs, why):
    model, feeds = block(8, 16, 12, 12, **kwargs)
    graph, _ = lowered(model)
    assert "ExpandDepthwise" not in [n.op for n in graph.nodes], why
    assert_matches_ort(model, feeds, tol=1e-5, pass_options=ALWAYS)


def test_split_when_the_kernel_does_not_take_it():
    """More input channels than one pass of the GEMM micro-kernel: the node is lowered as its two
    convolutions again (the same results)."""
    model, feeds = block(300, 16, 10, 12)
    graph, calls = lowered(model)
    assert [n.op for n in graph.nodes if n.op != "Identity"] == ["ExpandDepthwise"]
    assert "ExpandDepthwise" not in [c.kernel.family for c in calls]
    assert_matches_ort(model, feeds, tol=1e-5, pass_options=ALWAYS)
