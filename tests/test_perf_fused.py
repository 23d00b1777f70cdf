"""Fused epilogues (domain "cuvil": FusedConv, FusedGemm, FusedMatMul) against onnxruntime
on the unfused model.

The fused graph is made by a small fusion written here (registered as a pass for
the test only, under a name that hashes this file, so cached steps never go
stale): Conv/Gemm/MatMul [-> Add(residual)] [-> activation] becomes one node.
"""
import hashlib
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

import cuvil
import passes as passes_pkg
from passes import resolve_passes
from tests.helpers import make_model, rand, run_ort

ACTS = {"Relu", "Clip", "Sigmoid", "HardSwish", "HardSigmoid", "LeakyRelu", "Tanh"}
PASS_NAME = "test_fuse_" + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def fuse(graph):
    g = graph.copy()
    fused_any = False
    for node in list(g.nodes):
        if node.op not in ("Conv", "Gemm", "MatMul") or node.domain:
            continue
        users = g.consumers()
        out = node.outputs[0]
        if out in g.outputs or len(users.get(out, [])) != 1:
            continue
        nxt = users[out][0]
        residual, remove = None, []
        if nxt.op == "Add":
            other = nxt.inputs[1] if nxt.inputs[0] == out else nxt.inputs[0]
            if g.values[nxt.outputs[0]].shape != g.values[out].shape or other == out:
                continue
            residual, remove = other, [nxt]
            out = nxt.outputs[0]
            nxt = users.get(out, [None])[0] if out not in g.outputs and len(users.get(out, [])) == 1 else None
        act, params = "", []
        if nxt is not None and nxt.op in ACTS:
            act = nxt.op
            if act == "Clip":
                lo = g.values[nxt.inputs[1]].data if len(nxt.inputs) > 1 and nxt.inputs[1] else -np.inf
                hi = g.values[nxt.inputs[2]].data if len(nxt.inputs) > 2 and nxt.inputs[2] else np.inf
                params = [float(lo), float(hi)]
            elif act == "LeakyRelu":
                params = [float(nxt.attr("alpha", 0.01))]
            elif act == "HardSigmoid":
                params = [float(nxt.attr("alpha", 0.2)), float(nxt.attr("beta", 0.5))]
            remove.append(nxt)
            out = nxt.outputs[0]
        if not remove:
            continue
        node.op = "Fused" + node.op
        node.domain = "cuvil"
        node.attrs.update(activation=act, activation_params=params, has_residual=int(residual is not None))
        if residual is not None:
            node.inputs.append(residual)
        node.outputs = [out]
        g.nodes = [n for n in g.nodes if all(n is not r for r in remove)]
        fused_any = True
    assert fused_any, "the test model has nothing to fuse"
    return g


@pytest.fixture(autouse=True)
def _fuse_pass(monkeypatch):
    monkeypatch.setitem(passes_pkg.PASSES, PASS_NAME, fuse)


def check(model, feeds, tol=1e-4, threads=1):
    names = [n for n in resolve_passes(1) if n != "plan_memory"] + [PASS_NAME]
    names += [n for n in resolve_passes(1) if n == "plan_memory"]
    compiled = cuvil.compile(model, passes=names, threads=threads)
    fused = [p for p in compiled.info["passes"] if p == PASS_NAME]
    assert fused
    got = compiled.run(feeds)
    want = run_ort(model, feeds)
    for name, ref in want.items():
        scale = max(float(np.max(np.abs(ref))), 1e-6)
        err = float(np.max(np.abs(got[name].astype(np.float64) - ref)))
        assert err / scale <= tol, f"{name}: {err / scale:.3g}"
    return compiled


def act_node(act, x, y):
    if act == "Clip":
        return [helper.make_node("Clip", [x, "clip_lo", "clip_hi"], [y])], {"clip_lo": np.float32(-0.5), "clip_hi": np.float32(0.75)}
    if act == "LeakyRelu":
        return [helper.make_node("LeakyRelu", [x], [y], alpha=0.1)], {}
    if act == "HardSigmoid":
        return [helper.make_node("HardSigmoid", [x], [y], alpha=0.3, beta=0.4)], {}
    return [helper.make_node(act, [x], [y])], {}


def conv_model(act, residual, kernel=3, stride=1, pad=1, group=1, cin=8, cout=8, hw=(9, 11), bias=True,
               res_shape=None):
    inits = {"w": rand(cout, cin // group, kernel, kernel, seed=1) * 0.3}
    if bias:
        inits["b"] = rand(cout, seed=2)
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["c"], kernel_shape=[kernel, kernel],
                              strides=[stride, stride], pads=[pad] * 4, group=group)]
    oh = (hw[0] + 2 * pad - kernel) // stride + 1
    ow = (hw[1] + 2 * pad - kernel) // stride + 1
    out_shape = (1, cout, oh, ow)
    inputs = [("x", np.float32, (1, cin) + tuple(hw))]
    last = "c"
    if residual:
        shape = res_shape or out_shape
        inputs.append(("r", np.float32, shape))
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
        last = "s"
    if act:
        extra, more = act_node(act, last, "y")
        nodes += extra
        inits.update(more)
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    model = make_model(nodes, inputs, [("y", np.float32, None)], inits)
    feeds = {"x": rand(1, cin, *hw, seed=3)}
    if residual:
        feeds["r"] = rand(*(res_shape or out_shape), seed=4)
    return model, feeds


@pytest.mark.parametrize("act", ["Relu", "Clip", "Sigmoid", "HardSwish", "HardSigmoid", "LeakyRelu", "Tanh"])
def test_fused_conv3x3_activations(act):
    check(*conv_model(act, residual=False))


@pytest.mark.parametrize("case", [
    dict(kernel=3, act="Relu"),                              # 3x3 + bias + residual + Relu (ResNet block end)
    dict(kernel=1, pad=0, act="Relu", cout=16),              # 1x1 as GEMM + residual + Relu
    dict(kernel=1, pad=0, act="", cout=16),                  # 1x1 + residual only
    dict(kernel=3, stride=2, act="Clip", hw=(12, 13)),       # strided
    dict(kernel=3, group=8, act="Clip"),                     # depthwise
    dict(kernel=1, pad=0, act="Relu", res_shape=(1, 8, 1, 1)),   # per-channel residual
    dict(kernel=1, pad=0, act="Tanh", res_shape=(1, 1, 9, 1)),   # residual broadcast along W only
    dict(kernel=3, act="Sigmoid", res_shape=(1, 1, 1, 11)),      # ... along H and C
])
def test_fused_conv_residual(case):
    case = dict(case)
    act = case.pop("act")
    check(*conv_model(act, residual=True, **case))


def test_fused_conv_threads_identical():
    model, feeds = conv_model("Relu", residual=True, cin=16, cout=16, hw=(14, 14))
    one = check(model, feeds, threads=1).run(feeds)["y"]
    two = check(model, feeds, threads=2).run(feeds)["y"]
    np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("case", [
    dict(M=5, K=7, N=9, transB=1, bias=True, act="Relu", residual=False),
    dict(M=1, K=64, N=33, transB=0, bias=True, act="Sigmoid", residual=True),
    dict(M=6, K=16, N=20, transB=1, bias=False, act="", residual=True),
    dict(M=4, K=40, N=10, transB=1, bias=True, act="Clip", residual=True, const_b=False),  # dot form
    dict(M=3, K=8, N=12, transB=0, bias=True, act="HardSwish", residual=True, res_shape=(12,)),
])
def test_fused_gemm(case):
    M, K, N = case["M"], case["K"], case["N"]
    const_b = case.get("const_b", True)
    b_shape = (N, K) if case["transB"] else (K, N)
    inits = {"bias": rand(N, seed=5)} if case["bias"] else {}
    inputs = [("a", np.float32, (M, K))]
    if const_b:
        inits["bmat"] = rand(*b_shape, seed=6)
    else:
        inputs.append(("bmat", np.float32, b_shape))
    nodes = [helper.make_node("Gemm", ["a", "bmat"] + (["bias"] if case["bias"] else []), ["g"],
                              transB=case["transB"], alpha=0.5)]
    last = "g"
    res_shape = case.get("res_shape", (M, N))
    if case["residual"]:
        inputs.append(("r", np.float32, res_shape))
        nodes.append(helper.make_node("Add", ["r", "g"], ["s"]))
        last = "s"
    if case["act"]:
        extra, more = act_node(case["act"], last, "y")
        nodes += extra
        inits.update(more)
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    model = make_model(nodes, inputs, [("y", np.float32, None)], inits)
    feeds = {"a": rand(M, K, seed=7)}
    if not const_b:
        feeds["bmat"] = rand(*b_shape, seed=8)
    if case["residual"]:
        feeds["r"] = rand(*res_shape, seed=9)
    check(model, feeds)


@pytest.mark.parametrize("case", [
    dict(a=(2, 5, 16), b=(16, 24), r=(2, 5, 24), act="Tanh"),       # batch folded into M
    dict(a=(2, 5, 16), b=(16, 24), r=(5, 24), act="Relu"),          # residual not linear in the folded rows
    dict(a=(3, 4, 8), b=(3, 8, 6), r=(1, 4, 6), act="LeakyRelu"),   # batched, residual broadcast over batch
    dict(a=(1, 32), b=(32, 48), r=(1, 48), act="HardSigmoid"),
])
def test_fused_matmul(case):
    inputs = [("a", np.float32, case["a"]), ("r", np.float32, case["r"])]
    inits = {"bm": rand(*case["b"], seed=10)}
    nodes = [helper.make_node("MatMul", ["a", "bm"], ["m"]), helper.make_node("Add", ["m", "r"], ["s"])]
    extra, more = act_node(case["act"], "s", "y")
    nodes += extra
    inits.update(more)
    model = make_model(nodes, inputs, [("y", np.float32, None)], inits)
    check(model, {"a": rand(*case["a"], seed=11), "r": rand(*case["r"], seed=12)})
