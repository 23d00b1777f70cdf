"""PrologueConv (passes/fuse_conv_prologue.py, backends/numba_cpu/convprologue.py): an elementwise
program of one input read only by a Conv, computed while the conv copies its input, against
onnxruntime.

Tolerances: each output is a float32 sum of K = channels x taps products of f(x) (f computed in
float32, as FusedElementwise does: onnxruntime's erf and ours differ by an ulp or two, i.e. ~2u
relative per product). The conv's rounding is at most ~K * u * sum|w f(x)| (tests/
test_corpus_kernels.py's derivation: `tol(K) = 4 * K * u` with u = 2**-24, the 4 a margin that
covers f's own few-ulp differences); below 1e-5 we keep 1e-5 as the other conv tests do.
"""
import math

import numpy as np
import pytest
from onnx import helper

from tests.helpers import assert_matches_ort, make_model, rand

U = 2.0 ** -24


def tol(k: int) -> float:
    return max(4 * k * U, 1e-5)


def gelu_nodes(x, y):
    """torch's opset-17 Gelu export (Div, Erf, Add, Mul, Mul): fuse_patterns makes it one FusedElementwise."""
    return [helper.make_node("Div", [x, "sqrt2"], [f"{y}_d"]), helper.make_node("Erf", [f"{y}_d"], [f"{y}_e"]),
            helper.make_node("Add", [f"{y}_e", "one"], [f"{y}_p"]), helper.make_node("Mul", [x, f"{y}_p"], [f"{y}_m"]),
            helper.make_node("Mul", [f"{y}_m", "half"], [y])]


def chain_model(C, L, OC, k, seed=0, **attrs):
    """x -> Conv (k3, C -> C) -> Gelu -> Conv (k, C -> OC, attrs) -> y: wav2vec2's layers."""
    inits = {"w0": (rand(C, C, 3, seed=seed + 1) / np.sqrt(3 * C)).astype(np.float32),
             "w1": (rand(OC, C, k, seed=seed + 2) / np.sqrt(k * C)).astype(np.float32),
             "b1": rand(OC, seed=seed + 3),
             "sqrt2": np.array(math.sqrt(2), np.float32), "one": np.array(1, np.float32),
             "half": np.array(0.5, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"])] + gelu_nodes("c0", "g") \
        + [helper.make_node("Conv", ["g", "w1", "b1"], ["y"], **attrs)]
    return make_model(nodes, [("x", np.float32, (1, C, L))], [("y", np.float32, None)], inits), \
        {"x": rand(1, C, L, seed=seed + 4)}


def schedule_families(model, **options):
    """The kernel families of the model's build (its explain: one per step)."""
    from cuvil import pipeline
    graph = pipeline.import_any(model, None)
    names, opts = pipeline.pass_list(options.get("opt_level", 2), None, options.get("disable_passes", ()), None,
                                     "fp32", gpu=False)
    graph = pipeline.run_passes(graph, names, opts)
    planned = pipeline.plan(graph, pipeline.VariantParams("m", pipeline.resolve_variant_target("native", "fp32"), 1,
                                                          pipeline.memory_options(names, opts)))
    return [c.kernel.family for c in planned.calls if hasattr(c, "kernel")]


@pytest.mark.parametrize("C,L,OC,k,attrs", [
    (64, 401, 64, 3, dict(strides=[2])),              # wav2vec2's k3 s2: gathered phases, the Gelu in place
    (48, 203, 40, 2, dict(strides=[2])),              # k2 s2, odd length
    (32, 130, 24, 3, dict(pads=[1, 1])),              # stride 1 with padding: contiguous copy, zeros kept
    (24, 100, 32, 3, dict(pads=[1, 1], strides=[2])),  # Whisper's second conv: stride 2 and padding
])
@pytest.mark.parametrize("threads", [1, 2])
def test_gelu_in_the_conv_input_copy(C, L, OC, k, attrs, threads):
    model, feeds = chain_model(C, L, OC, k, **attrs)
    fams = schedule_families(model)
    assert "FusedElementwise" not in fams and fams.count("ConvPad") >= 1
    assert_matches_ort(model, feeds, tol=tol(k * C), threads=threads)


def test_padding_stays_zero_and_other_conv_paths_fall_back():
    """f(0) != 0 (x + 3 then Sigmoid, one FusedElementwise at opt 3): the padding must pad f(x) with
    zeros, not hold f(0). And a 1x1 conv (no phase images) runs the program first, into a scratch."""
    inits = {"w": (rand(16, 8, 3, seed=1) / np.sqrt(24)).astype(np.float32), "three": np.array(3, np.float32),
             "w1": (rand(8, 16, 1, seed=2) / 4).astype(np.float32)}
    nodes = [helper.make_node("Add", ["x", "three"], ["a"]), helper.make_node("Sigmoid", ["a"], ["s"]),
             helper.make_node("Conv", ["s", "w"], ["c"], pads=[2, 2]),
             helper.make_node("Add", ["c", "three"], ["a1"]), helper.make_node("Sigmoid", ["a1"], ["s1"]),
             helper.make_node("Conv", ["s1", "w1"], ["y"])]
    model = make_model(nodes, [("x", np.float32, (1, 8, 50))], [("y", np.float32, None)], inits)
    feeds = {"x": rand(1, 8, 50, seed=3)}
    from cuvil import pipeline
    graph = pipeline.run_passes(pipeline.import_any(model, None), pipeline.pass_list(3)[0], pipeline.pass_list(3)[1])
    assert [n.op for n in graph.nodes] == ["PrologueConv", "PrologueConv"]
    # K = 24 then 16 products; the second conv's input went through the first's rounding too
    assert_matches_ort(model, feeds, tol=tol(24 + 16), opt_level=3)
    assert_matches_ort(model, feeds, tol=tol(24 + 16), opt_level=3, threads=2)


def test_pass_leaves_other_readers_and_reduced_precision_alone():
    from cuvil import pipeline
    from passes.fuse_conv_prologue import fuse_conv_prologue
    model, _ = chain_model(16, 40, 16, 3, strides=[2])
    graph = pipeline.import_any(model, None)
    names, opts = pipeline.pass_list(2, None, ("fuse_conv_prologue",), None, "fp32")
    graph = pipeline.run_passes(graph, names, opts)
    g = graph.copy()
    g.outputs = g.outputs + [next(n.outputs[0] for n in g.nodes if n.op == "FusedElementwise")]
    assert fuse_conv_prologue(g) is g                       # the Gelu is a graph output too: no fusion
    assert "fuse_conv_prologue" not in pipeline.pass_list(2, precision="bf16")[0]
    assert "fuse_conv_prologue" not in pipeline.pass_list(2, gpu=True)[0]


def norm_chain_model(C, L, OC, k, N=1, seed=0, spatial=None, **attrs):
    """x -> InstanceNormalization (per-channel scale, bias: wav2vec2's GroupNorm after
    fold_batchnorm) -> Gelu -> Conv (k, C -> OC, attrs) -> y; `spatial` (H, W): a 2-D k x k conv."""
    w_shape = (OC, C, k) if spatial is None else (OC, C, k, k)
    x_shape = (N, C, L) if spatial is None else (N, C, *spatial)
    inits = {"s": rand(C, seed=seed + 1), "z": rand(C, seed=seed + 2),
             "w1": (rand(*w_shape, seed=seed + 3) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32),
             "sqrt2": np.array(math.sqrt(2), np.float32), "one": np.array(1, np.float32),
             "half": np.array(0.5, np.float32)}
    nodes = [helper.make_node("InstanceNormalization", ["x", "s", "z"], ["n"])] + gelu_nodes("n", "g") \
        + [helper.make_node("Conv", ["g", "w1"], ["y"], **attrs)]
    return make_model(nodes, [("x", np.float32, x_shape)], [("y", np.float32, None)], inits), \
        {"x": (rand(*x_shape, seed=seed + 4) * 3 + 1).astype(np.float32)}


# The normalised values carry the plane's moments' rounding (sums of L values: ~L * u relative,
# the fold_batchnorm tests' 4 x plane x u), then K products: tol = 4 * (K + L) * u.
@pytest.mark.parametrize("C,L,OC,k,N,attrs", [
    (64, 401, 48, 3, 1, dict(strides=[2])),            # wav2vec2's first GroupNorm -> Gelu -> k3 s2
    (32, 150, 40, 3, 2, dict(pads=[1, 1])),            # two images, stride 1 with padding
    (16, 9 * 11, 24, 3, 1, dict(pads=[1, 1, 1, 1], strides=[2, 2], spatial=(9, 11))),   # 2-D planes
])
@pytest.mark.parametrize("threads", [1, 2])
def test_instance_norm_and_gelu_in_the_conv_input_copy(C, L, OC, k, N, attrs, threads):
    model, feeds = norm_chain_model(C, L, OC, k, N=N, **attrs)
    fams = schedule_families(model)
    assert fams.count("ConvPad") == 1 and "InstanceNormalization" not in fams and "FusedElementwise" not in fams
    taps = k * k if "spatial" in attrs else k
    assert_matches_ort(model, feeds, tol=4 * (taps * C + L) * U, threads=threads)


@pytest.mark.parametrize("C,k,attrs", [
    (64, 1, {}),                 # a 1x1 conv: no phase images, the norm and program run first
    (4, 3, dict(strides=[2])),   # 4 planes: ConvPad's items are row blocks, not whole planes
])
def test_instance_norm_prologue_falls_back(C, k, attrs):
    model, feeds = norm_chain_model(C, 120, 16, k, **attrs)
    fams = schedule_families(model)
    assert "InstanceNormalization" in fams and "FusedElementwise" in fams
    assert_matches_ort(model, feeds, tol=4 * (k * C + 120) * U)
    assert_matches_ort(model, feeds, tol=4 * (k * C + 120) * U, threads=2)


@pytest.mark.parametrize("target", ["x86_64-avx2", "generic"])
def test_prologue_on_narrower_targets(target):
    model, feeds = norm_chain_model(32, 201, 24, 3, strides=[2])
    assert_matches_ort(model, feeds, tol=4 * (3 * 32 + 201) * U, target=target, threads=2)
