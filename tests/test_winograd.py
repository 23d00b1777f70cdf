"""3x3 stride-1 convolutions by Winograd F(4x4, 3x3) and F(2x2, 3x3) (backends/numba_cpu/winograd.py)
against onnxruntime, relative tolerance 1e-4.

Each case first checks which transform the conv takes (or, for the ineligible shapes, that it
takes none), then compares: even and odd output sizes (a last tile row or column half used),
asymmetric and large pads, no padding, batch 2, fused epilogues (bias, residual broadcast or
not, activations), two threads."""
import os

import numpy as np
import onnx
import pytest
from onnx import helper

from backends.numba_cpu import winograd
from backends.numba_cpu.registry import lower
from cuvil.frontends.onnx import import_onnx
from cuvil.runtime import Library
from passes import resolve_passes, run_passes

from tests.helpers import assert_matches_ort, make_model, rand

F32 = np.float32


def conv_model(x_shape, oc, pads=(0, 0, 0, 0), bias=True, residual=None, act=None, **attrs):
    """Conv(x, w[, b]) [+ r] [-> act]; `residual`: the shape of r (broadcast onto the output)."""
    inits = {"w": rand(oc, x_shape[1] // attrs.get("group", 1), 3, 3, seed=1) * 0.3}
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
    # name: (x shape, out channels, kwargs, tile size m of the transform chosen)
    "f4_same_even": ((1, 16, 16, 16), 16, {"pads": [1, 1, 1, 1]}, 4),
    "f4_same_odd_batch2": ((2, 17, 15, 13), 19, {"pads": [1, 1, 1, 1]}, 4),    # last tiles 3 x 1
    "f4_valid_no_bias": ((1, 16, 20, 19), 24, {"bias": False}, 4),              # 18 x 17: tiles 2 x 1
    "f4_asymmetric_pads": ((1, 32, 17, 18), 20, {"pads": [0, 1, 2, 0]}, 4),
    "f4_residual_relu": ((1, 16, 18, 18), 16, {"pads": [1, 1, 1, 1], "residual": (1, 16, 18, 18),
                                               "act": "Relu"}, 4),
    "f4_clip_compact_rows": ((1, 24, 14, 14), 32, {"pads": [1, 1, 1, 1], "act": "Clip"}, 4),
    "f2_same_odd": ((2, 17, 9, 7), 19, {"pads": [1, 1, 1, 1]}, 2),
    "f2_7x7": ((1, 32, 7, 7), 16, {"pads": [1, 1, 1, 1]}, 2),
    "f2_valid_no_bias": ((1, 16, 10, 11), 24, {"bias": False}, 2),
    "f2_asymmetric_pads": ((1, 32, 9, 9), 20, {"pads": [0, 1, 2, 0]}, 2),
    "f2_pads_beyond_half_kernel": ((1, 16, 6, 9), 16, {"pads": [2, 2, 2, 2]}, 2),
    "f2_one_output_row": ((1, 16, 3, 40), 16, {}, 2),
    "f2_residual_relu": ((1, 16, 10, 10), 16, {"pads": [1, 1, 1, 1], "residual": (1, 16, 10, 10), "act": "Relu"}, 2),
    "f2_residual_broadcast_sigmoid": ((1, 16, 9, 11), 12, {"pads": [1, 1, 1, 1], "residual": (1, 1, 1, 11),
                                                           "act": "Sigmoid"}, 2),
    "f2_per_channel_residual_no_bias": ((1, 16, 9, 9), 16, {"pads": [1, 1, 1, 1], "residual": (1, 16, 1, 1),
                                                            "bias": False}, 2),
}


def chosen(model):
    graph, _ = import_onnx(model, {})
    conv = [n for n in graph.nodes if n.op == "Conv"][0]
    X, W, Y = (graph.values[v] for v in (conv.inputs[0], conv.inputs[1], conv.outputs[0]))
    return winograd.choose(np.float32, X, W, 1, (3, 3), (1, 1), (1, 1), Y)


# Covered in part by the fast cases (partial tiles, pads, no bias); run with -m slow. Each F(4x4)
# case compiles its own transform kernels, 5-9 s on 2 cores.
SLOW_CASES = {"f4_same_even", "f4_valid_no_bias", "f4_asymmetric_pads", "f2_same_odd", "f2_valid_no_bias",
              "f2_asymmetric_pads"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c
                                  for c in sorted(CASES)])
def test_winograd_conv(case):
    x_shape, oc, kwargs, m = CASES[case]
    model, feeds = conv_model(x_shape, oc, **kwargs)
    assert chosen(model).m == m
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
def test_direct_where_winograd_does_not_pay_or_is_not_marked(why, x_shape, oc, attrs):
    model, feeds = conv_model(x_shape, oc, **attrs)
    assert "WinoIn" not in families(model), why
    assert_matches_ort(model, feeds)


def test_pass_marks_only_3x3_stride_1_convs_with_constant_weights():
    from passes.winograd import winograd as mark
    inits = {"w3": rand(8, 8, 3, 3), "w5": rand(8, 8, 5, 5)}
    nodes = [helper.make_node("Conv", ["x", "w3"], ["a"], name="same", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["a", "w3"], ["b"], name="stride2", strides=[2, 2]),
             helper.make_node("Conv", ["x", "w5"], ["c"], name="k5"),
             helper.make_node("Conv", ["x", "wr"], ["d"], name="runtime_w", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w3"], ["e"], name="dilated", dilations=[2, 2]),
             helper.make_node("Conv", ["x", "w3"], ["f"], name="same_upper", auto_pad="SAME_UPPER")]
    model = make_model(nodes, [("x", F32, [1, 8, 12, 12]), ("wr", F32, [8, 8, 3, 3])],
                       [(y, F32, None) for y in "bcdef"], inits)
    graph, _ = import_onnx(model, {})
    after = mark(graph)
    assert {n.name for n in after.nodes if n.attr("winograd", 0)} == {"same", "same_upper"}
    assert not any(n.attr("winograd", 0) for n in graph.nodes)   # the input graph is left as it was


def test_disabling_the_pass_keeps_convs_direct():
    """`disable_passes: [winograd]`: the direct kernels, and their results, for a user who wants
    the direct sum's rounding or a smaller session."""
    model, feeds = conv_model((1, 64, 28, 28), 64, pads=[1, 1, 1, 1])
    graph, _ = import_onnx(model, {})
    graph = run_passes(graph, [p for p in resolve_passes(2, disable=("winograd",)) if p != "plan_memory"])
    assert "WinoIn" not in [c.kernel.family for c in lower(graph, 1) if hasattr(c, "kernel")]
    assert_matches_ort(model, feeds, disable_passes=("winograd",))


def test_transformed_weights_are_made_once_shared_by_the_sessions_not_stored():
    """U (36/9 of W's floats for F(4x4, 3x3)) is computed by a run-once call when the first
    session of the loaded library is created, into a block every session shares and the last
    one frees: the library holds W, as the direct build does, and a session's arena does not
    hold U. Two Winograd convs and a residual add: every run, other sessions, and a session
    made after all were closed (U made again) give the same bytes."""
    C = 256
    inits = {"w1": rand(C, C, 3, 3, seed=1) * 0.05, "w2": rand(C, C, 3, 3, seed=2) * 0.05, "b": rand(C, seed=3)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "x"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    model = make_model(nodes, [("x", F32, [1, C, 14, 14])], [("y", F32, None)], inits)
    feeds = {"x": rand(1, C, 14, 14, seed=4)}
    assert chosen(model).m == 4
    wino, first = assert_matches_ort(model, feeds)
    direct, _ = assert_matches_ort(model, feeds, disable_passes=("winograd",))
    u_bytes = 2 * 36 * C * C * 4
    size = lambda compiled: os.path.getsize(compiled.artifacts.library)
    assert size(wino) < size(direct) + u_bytes / 8
    memory = wino.info["memory"]
    assert memory["shared_bytes"] >= u_bytes > memory["arena_bytes"]
    assert direct.info["memory"]["shared_bytes"] == 0
    for _ in range(3):
        np.testing.assert_array_equal(wino.run(feeds)["y"], first["y"])
    library = Library(wino.artifacts.library)
    sessions = [library.session() for _ in range(3)]
    for s in sessions:
        np.testing.assert_array_equal(s.run(feeds)["y"], first["y"])
    wino.close()
    for s in sessions:
        s.close()
    np.testing.assert_array_equal(library.session().run(feeds)["y"], first["y"])


@pytest.mark.parametrize("t", [winograd.F2, winograd.F4], ids=["F2", "F4"])
def test_transforms_match_direct_sums(t):
    """The tables: A^T (U * V) A over one tile, U = G w G^T and V = B^T d B, equals the direct 3x3
    sums (float64)."""
    rng = np.random.default_rng(0)
    a = t.a
    w = rng.standard_normal((2, 3, 3, 3))
    d = rng.standard_normal((3, a, a))
    BT, AT = np.zeros((a, a)), np.zeros((t.m, a))
    for i, row in enumerate(t.BT):
        for j, c in row:
            BT[i, j] = c
    for i, row in enumerate(t.AT):
        for j, c in row:
            AT[i, j] = c
    G = np.array(t.G, dtype=np.float64)
    U = np.einsum("ai,ocij,bj->aboc", G, w, G)
    V = np.einsum("ai,cij,bj->abc", BT, d, BT)
    for oc in range(2):
        M = np.einsum("abc,abc->ab", U[:, :, oc], V)
        got = AT @ M @ AT.T
        want = np.array([[np.sum(w[oc] * d[:, i:i + 3, j:j + 3]) for j in range(t.m)] for i in range(t.m)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_output_transform_vectorises(tmp_path):
    """WinoOut loads one stream per position (36 for F(4x4, 3x3)): LLVM vectorises that loop only
    when told the pointers do not alias (emit.NOALIAS_MARK); behind run-time overlap checks it
    stayed scalar (56x56x64 on Zen 4: 0.20 -> 0.14 ms)."""
    import subprocess

    from backends.numba_cpu.emit import NOALIAS_MARK, emit_object, kernel_ir
    from backends.targets import resolve_target
    from backends.numba_cpu.epilogue import Epilogue
    t, T = winograd.F4, 14 * 15
    kernel = winograd.out_kernel(t, 64, T, 14, 15, 56, 56, 64 * T + winograd.XI_SKEW, True, None,
                                  Epilogue("Relu"), np.float32)
    for source, vector in ((kernel.source, True), (kernel.source.replace(NOALIAS_MARK, ""), False)):
        obj = emit_object(kernel_ir(source, kernel.arg_types), "k", resolve_target("x86_64-avx512"), source)
        path = tmp_path / "k.o"
        path.write_bytes(obj)
        asm = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout
        assert ("zmm" in asm) == vector
