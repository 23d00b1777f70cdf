"""DepthwiseBlock: a depthwise conv with the 1x1 convs before and/or after it, fused by the pass
fuse_depthwise_block and computed in bands of rows (backends/numba_cpu/dwblock.py), against
onnxruntime (relative tolerance 1e-5); and where the pass must not fire."""
import numpy as np
import onnx
import pytest
from onnx import helper

from backends.numba_cpu.ukernel import DwRowSpec, specs_in
from backends.numba_cpu import dwblock
from backends.numba_cpu.registry import lower
from cuvil.frontends.onnx import import_onnx
from passes import resolve_passes, run_passes

from tests.helpers import assert_matches_ort, make_model, rand

F32 = np.float32
ALWAYS = {"fuse_depthwise_block": {"min_bytes": 0}}   # fuse at any size (the default needs >= 1 MiB)


def block(C0, C1, H, W, k=3, s=1, pads=None, bias=(True, True, True), acts=("Clip", "Clip", ""), expand=True,
          project=None, residual=None, also_output=None):
    """x -> [Conv 1x1 C0 -> C1 -> act] = t -> depthwise Conv k x k / s -> act = u
    -> [Conv 1x1 C1 -> project [+ residual] -> act] -> y.
    `residual`: "x" (the block's input) or "input" (an input of its own); `also_output`: "t" or "u"
    is a graph output too."""
    p = k // 2
    pads = pads or [p, p, p, p]
    C1 = C1 if expand else C0
    inits = {"w1": rand(C1, C0, 1, 1, seed=1) * 0.3, "w2": rand(C1, 1, k, k, seed=2) * 0.3,
             "lo": np.float32(0), "hi": np.float32(6)}
    for i, b in enumerate(bias):
        if b:
            inits[f"b{i + 1}"] = rand(C1 if i < 2 else (project or 1), seed=3 + i)
    feeds, inputs, nodes = {"x": rand(1, C0, H, W, seed=5)}, [("x", F32, [1, C0, H, W])], []

    def act(a, out, v):
        if a == "Clip":
            nodes.append(helper.make_node("Clip", [v, "lo", "hi"], [out]))
        elif a:
            nodes.append(helper.make_node(a, [v], [out]))
        else:
            return v
        return out

    t = "x"
    if expand:
        nodes.append(helper.make_node("Conv", ["x", "w1"] + (["b1"] if bias[0] else []), ["e"]))
        t = act(acts[0], "t", "e")
    nodes.append(helper.make_node("Conv", [t, "w2"] + (["b2"] if bias[1] else []), ["d"], group=C1,
                                  kernel_shape=[k, k], strides=[s, s], pads=pads))
    u = act(acts[1], "u", "d")
    last = u
    if project:
        inits["w3"] = rand(project, C1, 1, 1, seed=7) * 0.3
        nodes.append(helper.make_node("Conv", [u, "w3"] + (["b3"] if bias[2] else []), ["q"]))
        last = "q"
        if residual:
            OH, OW = (H + pads[0] + pads[2] - k) // s + 1, (W + pads[1] + pads[3] - k) // s + 1
            if residual == "input":
                inputs.append(("r", F32, [1, project, OH, OW]))
                feeds["r"] = rand(1, project, OH, OW, seed=6)
            nodes.append(helper.make_node("Add", ["q", "x" if residual == "x" else "r"], ["qr"]))
            last = "qr"
        last = act(acts[2], "y3", last)
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    outputs = [("y", F32, None)] + ([({"t": t, "u": u}[also_output], F32, None)] if also_output else [])
    used = {i for n in nodes for i in n.input}
    inits = {k: v for k, v in inits.items() if k in used}
    model = make_model(nodes, inputs, outputs, inits)
    return onnx.shape_inference.infer_shapes(model), feeds


def lowered(model, options=ALWAYS, threads=1):
    graph, _ = import_onnx(model, {})
    graph = run_passes(graph, [p for p in resolve_passes(2) if p != "plan_memory"], options=options)
    return graph, [c for c in lower(graph, threads) if hasattr(c, "kernel")]


def ops(graph):
    return [n.op for n in graph.nodes if n.op != "Identity"]


CASES = {
    # name: (C0, C1, H, W, kwargs)
    "expand_s2": (16, 96, 30, 30, {"s": 2}),
    "expand_s1": (24, 40, 17, 19, {}),
    "expand_s2_5x5_wide_rows": (8, 20, 9, 70, {"s": 2, "k": 5, "bias": (False, True, True), "acts": ("Relu", "", "")}),
    "expand_s1_5x5_asymmetric_pads": (8, 13, 40, 33, {"k": 5, "pads": [2, 1, 0, 2], "bias": (True, False, True),
                                                      "acts": ("", "Relu", "")}),
    "expand_s1_odd_rows_no_pads": (4, 7, 23, 9, {"pads": [0, 0, 0, 0], "bias": (False, False, True),
                                                 "acts": ("Clip", "", "")}),
    "expand_s2_7x7": (6, 30, 12, 128, {"s": 2, "k": 7, "pads": [3, 2, 3, 3]}),
    "expand_project_residual_x": (16, 96, 20, 22, {"project": 16, "residual": "x"}),
    "expand_project_s2_relu": (16, 50, 19, 21, {"s": 2, "project": 24, "acts": ("Clip", "Clip", "Relu")}),
    "project_only": (32, 32, 24, 20, {"expand": False, "project": 16, "bias": (False, True, False)}),
    "project_only_s2_residual": (16, 16, 20, 20, {"expand": False, "s": 2, "project": 20, "residual": "input"}),
    "many_channels_k_passes": (300, 272, 10, 12, {"project": 20, "acts": ("Relu", "Relu", "Clip")}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_block_matches_ort(case):
    C0, C1, H, W, kw = CASES[case]
    model, feeds = block(C0, C1, H, W, **kw)
    graph, calls = lowered(model)
    assert ops(graph) == ["DepthwiseBlock"]
    assert [c.kernel.family for c in calls] == ["DepthwiseBlock"]
    rows = {s.rows for s in specs_in(calls[0].kernel.source).values() if isinstance(s, DwRowSpec)}
    assert rows == ({1, 2} if kw.get("s", 1) == 1 else {1})
    for threads in (1, 2):
        assert_matches_ort(model, feeds, tol=1e-5, threads=threads, pass_options=ALWAYS)


def test_bands_carry_shared_rows(monkeypatch, tmp_path):
    """Small bands (one output row each): the rows two bands share move to the top of the
    scratch and only the new rows are computed; results do not change."""
    monkeypatch.setattr(dwblock, "BAND_BYTES", 1)
    for s in (1, 2):
        model, feeds = block(8, 24, 21, 20, s=s, project=12)
        _, calls = lowered(model)
        assert "oh1 = min(oh0 + 1, " in calls[0].kernel.source
        for threads in (1, 3):
            assert_matches_ort(model, feeds, tol=1e-5, threads=threads, pass_options=ALWAYS,
                               cache_dir=tmp_path / f"s{s}t{threads}")


def test_default_size_threshold():
    """By default a 1x1 conv joins only when the tensor between it and the depthwise conv has
    1 MiB or more (smaller ones stay in L2)."""
    small, _ = block(8, 24, 20, 20, project=8)
    large, _ = block(16, 96, 112, 112, s=2, project=24)   # t: 4.8 MB, u: 1.2 MB
    assert ops(lowered(small, options={})[0]) == ["FusedConv", "FusedConv", "Conv"]
    graph = lowered(large, options={})[0]
    assert ops(graph) == ["DepthwiseBlock"] and graph.nodes[0].inputs[1] and graph.nodes[0].inputs[5]
    graph = lowered(large, options={"fuse_depthwise_block": {"min_bytes": 2 << 20}})[0]
    assert ops(graph) == ["DepthwiseBlock", "Conv"]       # u (1.2 MB) is below 2 MiB: no project
    assert graph.nodes[0].inputs[1] and not graph.nodes[0].inputs[5]


def test_chain_of_blocks_claims_each_conv_once():
    """dw -> 1x1 -> dw -> 1x1 (MobileNet v1): the middle 1x1 conv is the first block's project
    conv, so the second block has none before it."""
    C, H = 8, 12
    inits = {f"w{i}": rand(*shape, seed=i) * 0.3 for i, shape in
             enumerate([(C, 1, 3, 3), (C, C, 1, 1), (C, 1, 3, 3), (C, C, 1, 1)])}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"], group=C, kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["a", "w1"], ["b"]),
             helper.make_node("Conv", ["b", "w2"], ["c"], group=C, kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c", "w3"], ["y"])]
    model = onnx.shape_inference.infer_shapes(make_model(nodes, [("x", F32, [1, C, H, H])], [("y", F32, None)],
                                                         inits))
    graph, _ = lowered(model)
    assert ops(graph) == ["DepthwiseBlock", "DepthwiseBlock"]
    assert [bool(n.inputs[1]) for n in graph.nodes] == [False, False]
    assert_matches_ort(model, {"x": rand(1, C, H, H, seed=9)}, tol=1e-5, pass_options=ALWAYS)


@pytest.mark.parametrize("kwargs,expected,why", [
    ({"also_output": "t"}, ["FusedConv", "FusedConv"], "t is read elsewhere"),
    ({"also_output": "u", "project": 8}, ["DepthwiseBlock", "Conv"], "u is read elsewhere"),
    ({"acts": ("Sigmoid", "Clip", "")}, ["FusedConv", "FusedConv"], "an activation not in registers"),
    ({"acts": ("Clip", "Tanh", "")}, ["FusedConv", "FusedConv"], "an activation not in registers"),
    ({"project": 16, "residual": "x", "acts": ("Clip", "Clip", "Relu")}, ["DepthwiseBlock", "FusedConv"],
     "an activation after the residual"),
    ({"s": 3}, ["FusedConv", "FusedConv"], "stride 3"),
])
def test_pass_does_not_fire(kwargs, expected, why):
    model, feeds = block(16, 16, 12, 12, **kwargs)
    graph, _ = lowered(model)
    assert ops(graph) == expected, why
    assert_matches_ort(model, feeds, tol=1e-5, pass_options=ALWAYS)


def test_explain_names_the_fused_convs():
    from cuvil.explain import computes
    model, _ = block(16, 32, 12, 12, s=2, project=16)
    graph, _ = lowered(model)
    assert computes(graph.nodes[0]) == "DepthwiseBlock[Conv1x1 + Clip -> DepthwiseConv3x3/2 + Clip -> Conv1x1]"
    model, _ = block(16, 16, 12, 12, expand=False, project=16, residual="x", acts=("", "Relu", ""))
    graph, _ = lowered(model)
    assert computes(graph.nodes[0]) == "DepthwiseBlock[DepthwiseConv3x3/1 + Relu -> Conv1x1 + Add(residual)]"


@pytest.mark.parametrize("target", ["x86_64-avx2", "generic"])
def test_narrower_targets_compute_the_same(target):
    """8- and 4-wide vectors: the same micro-kernels split in narrower chunks."""
    for kwargs in ({"s": 2, "project": 12}, {"project": 16, "residual": "x"}):
        model, feeds = block(16, 40, 15, 21, **kwargs)
        assert_matches_ort(model, feeds, tol=1e-5, target=target, pass_options=ALWAYS)
