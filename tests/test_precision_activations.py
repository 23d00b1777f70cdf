"""Activations stored in 16 bits between nodes (passes/assign_precision.py, `narrow_activations`):
a marked conv writes its output rounded once to bf16 / fp16 and the next conv copies it into its
phase images; MaxPool and GlobalAveragePool read (and MaxPool writes) the 16-bit tensor; graph
inputs and outputs stay float32. Compared with onnxruntime in float32.

The bound is propagated stage by stage from test_precision_conv.py's per-conv bound, with
onnxruntime's float32 values of each stage (sub-models fed onnxruntime's previous output) as the
reference magnitudes. u = 2^-8 (bf16) or 2^-11 (fp16); `b` is a stage input's bound:

    conv reading h (|h - h_ort| <= b):  (2u + u^2 + 2 gamma(K + 3)) (|W| * (|h_ort| + b) + |bias|
                                        + |R| + b_R + u (|R| + b_R)) + |W| * b + b_R + u (|R| + b_R)
        (rounding h to 16 bits is the operand rounding the 2u already counts; a residual R
        stored in 16 bits adds its own rounding u |R|; Relu is 1-Lipschitz)
    MaxPool:                            max of b over the window (max commutes with a monotone
                                        rounding: no new error), taken by onnxruntime's MaxPool on b
    GlobalAveragePool (of stored h):    mean of b + u (|h_ort| + b), plus the float32 mean's gamma(HW)
"""
import numpy as np
import pytest
from onnx import helper

import cuvil
from cuvil.explain import explain_model
from tests.helpers import make_model, run_ort
from tests.test_precision_conv import U

F = np.float32


def _gamma(n):
    return n * 2.0 ** -24 / (1 - n * 2.0 ** -24)


def _conv64(x, w, stride, pad):
    """Float64 convolution (NCHW, OIHW, group 1): the reference magnitudes of the bounds."""
    N, C, H, W = x.shape
    OC, _, KH, KW = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    OH, OW = (H + 2 * pad - KH) // stride + 1, (W + 2 * pad - KW) // stride + 1
    y = np.zeros((N, OC, OH, OW))
    for kh in range(KH):
        for kw in range(KW):
            patch = xp[:, :, kh:kh + stride * OH:stride, kw:kw + stride * OW:stride]
            y += np.einsum("nchw,oc->nohw", patch, w[:, :, kh, kw].astype(np.float64))
    return y


def _weights(oc, ic, k, seed):
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((oc, ic, k, k)) / np.sqrt(ic * k * k)).astype(F),
            rng.standard_normal(oc).astype(F) * F(0.1))


def _chain(C, H):
    """conv1 (3x3, Relu) -> MaxPool 3x3/2 -> conv2 (3x3) + residual (the MaxPool output) + Relu ->
    conv3 (3x3 stride 2: the strided phase copy) -> GlobalAveragePool. Every tensor between them
    is stored in 16 bits; each stage is also a model of its own (the oracle's stage values)."""
    w1, b1 = _weights(16, C, 3, 1)
    w2, b2 = _weights(16, 16, 3, 2)
    w3, b3 = _weights(24, 16, 3, 3)
    inits = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3}
    conv = lambda x, w, b, y, s=1: helper.make_node("Conv", [x, w, b], [y], strides=[s, s], pads=[1, 1, 1, 1])
    stages = [
        [conv("x", "w1", "b1", "c1"), helper.make_node("Relu", ["c1"], ["h1"])],
        [helper.make_node("MaxPool", ["h1"], ["h2"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])],
        [conv("h2", "w2", "b2", "c2"), helper.make_node("Add", ["c2", "h2"], ["s2"]),
         helper.make_node("Relu", ["s2"], ["h3"])],
        [conv("h3", "w3", "b3", "h4", 2)],
        [helper.make_node("GlobalAveragePool", ["h4"], ["y"])],
    ]
    ins = ["x", "h1", "h2", "h3", "h4"]
    outs = ["h1", "h2", "h3", "h4", "y"]
    used = lambda nodes: {k: v for k, v in inits.items() if any(k in n.input for n in nodes)}
    model = make_model([n for s in stages for n in s], [("x", F, [1, C, H, H])], [("y", F, None)], inits)
    parts = [make_model(s, [(i, F, None)], [(o, F, None)], used(s)) for s, i, o in zip(stages, ins, outs)]
    return model, parts, (w1, b1, w2, b2, w3, b3)


def _conv_bound(h, b_in, w, bias, stride, u, residual=None, b_res=None, pad=1):
    K = w.shape[1] * w.shape[2] * w.shape[3]
    b_in = np.broadcast_to(b_in, h.shape)
    mag = _conv64(np.abs(h) + b_in, np.abs(w), stride, pad) + np.abs(bias)[None, :, None, None]
    extra = 0.0
    if residual is not None:
        r_err = b_res + u * (np.abs(residual) + b_res)
        mag = mag + np.abs(residual) + r_err
        extra = r_err
    return (2 * u + u * u + 2 * _gamma(K + 3)) * mag + _conv64(b_in, np.abs(w), stride, pad) + extra


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_chain_through_16_bit_activations_is_within_the_propagated_bound(precision):
    C, H = 5, 20   # an odd channel count: conv1's bf16 pairs repeat the last channel
    model, parts, (w1, b1, w2, b2, w3, b3) = _chain(C, H)
    x = np.random.default_rng(0).standard_normal((1, C, H, H)).astype(F)
    u = U[precision]
    ort = [x]
    for part in parts:
        ort.append(next(iter(run_ort(part, {part.graph.input[0].name: ort[-1]}).values())))
    _, h1, h2, h3, h4, y = ort
    bound1 = _conv_bound(x, 0.0, w1, b1, 1, u)
    pool = make_model([helper.make_node("MaxPool", ["b"], ["m"], kernel_shape=[3, 3], strides=[2, 2],
                                        pads=[1, 1, 1, 1])], [("b", F, None)], [("m", F, None)])
    bound2 = run_ort(pool, {"b": bound1.astype(F)})["m"].astype(np.float64) * (1 + 1e-6)
    bound3 = _conv_bound(h2, bound2, w2, b2, 1, u, residual=h2, b_res=bound2)
    bound4 = _conv_bound(h3, bound3, w3, b3, 2, u)
    plane = h4.shape[2] * h4.shape[3]
    bound_y = (bound4 + u * (np.abs(h4) + bound4)).mean(axis=(2, 3), keepdims=True) \
        + _gamma(plane) * np.abs(h4).mean(axis=(2, 3), keepdims=True)

    lib = cuvil.compile(model, precision=precision)
    got = lib.run({"x": x})["y"]
    err = np.abs(got.astype(np.float64) - y)
    assert got.dtype == np.float32 and got.shape == y.shape
    assert np.all(err <= bound_y), float(np.max(err - bound_y))
    # the 16-bit path really ran: float32 throughout stays within ~gamma(K) ~ 2^-18 of the magnitudes
    # (K <= 144 here); a 16-bit operand rounding moves the output by far more
    assert np.max(err) > 2.0 ** -18 * np.max(np.abs(y)), (np.max(err), np.max(np.abs(y)))

    # every tensor between the nodes is stored in 16 bits: the arena's own buffers of values (not
    # scratch "__" ones; h3 may take over h2's buffer) are 2 bytes per element
    info = explain_model(model, precision=precision)
    own = [b[1] for b in info.buffers if "__" not in b[4]]
    assert len(own) >= 3 and set(own) <= {2 * h.size for h in (h1, h2, h3, h4)}, own
    families = {"_".join(k.symbol.split("_")[1:-1]) for k in info.kernels}
    assert families >= {"convpad_pairs16" if precision == "bf16" else "convpad_copy16"}, families
    assert not any(f.startswith("cvt16") for f in families), families   # no widening copy on this chain


def test_narrow_activations_off_keeps_float32_tensors_and_the_same_kernels_as_before():
    model, _, _ = _chain(4, 12)
    off = explain_model(model, precision="bf16", pass_options={"assign_precision": {"narrow_activations": False}})
    on = explain_model(model, precision="bf16")
    own = lambda info: sorted(b[1] for b in info.buffers if "__" not in b[4])
    assert 4 * 16 * 6 * 6 in own(off) and 4 * 16 * 6 * 6 not in own(on) and 2 * 16 * 6 * 6 in own(on)
    # (on a model this small the convs' float32 tile slots, MR x NR per work item, can outweigh
    # the halved tensors: the arena figures are ResNet's, below and in docs/performance.md)


def test_a_conv_without_a_16_bit_kernel_widens_its_stored_input_and_keeps_the_outputs():
    # conv2 is tiny (2 x 2 outputs): the backend gives it to a float32 kernel, so its 16-bit input
    # and output go through widening / narrowing copies (conv.py, Cvt16). It computes in float32 on
    # the stored (rounded) h1, inside the bound's 2u operand rounding; the chain's bound as above.
    w1, b1 = _weights(8, 3, 3, 1)
    w2, b2 = _weights(8, 8, 3, 2)
    w3, b3 = _weights(8, 8, 1, 3)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h1"], pads=[1, 1, 1, 1], strides=[4, 4]),
             helper.make_node("Conv", ["h1", "w2", "b2"], ["h2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Conv", ["h2", "w3", "b3"], ["y"])]
    inits = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3}
    model = make_model(nodes, [("x", F, [1, 3, 16, 16])], [("y", F, None)], inits)
    info = explain_model(model, precision="bf16")
    families = ["_".join(k.symbol.split("_")[1:-1]) for k in info.kernels]
    assert "cvt16" in families, families
    assert 2 * 8 * 4 * 4 in [b[1] for b in info.buffers if "__" not in b[4]]   # h1, stored in bf16
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(F)
    got = cuvil.compile(model, precision="bf16").run({"x": x})["y"]
    u = U["bf16"]
    h1 = run_ort(make_model(nodes[:1], [("x", F, None)], [("h1", F, None)], {"w1": w1, "b1": b1}), {"x": x})["h1"]
    h2 = run_ort(make_model(nodes[1:2], [("h1", F, None)], [("h2", F, None)], {"w2": w2, "b2": b2}), {"h1": h1})["h2"]
    want = run_ort(model, {"x": x})["y"]
    bound1 = _conv_bound(x, 0.0, w1, b1, 4, u)
    bound2 = _conv_bound(h1, bound1, w2, b2, 2, u)
    bound = _conv_bound(h2, bound2, w3, b3, 1, u, pad=0)
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), float(np.max(err - bound))


def test_resnet18_arena_in_bf16_is_at_most_055_of_float32():
    pytest.importorskip("torch")
    from tests import zoo
    model = zoo.export(zoo.resnet(), {"x": (1, 3, 224, 224)})
    fp32 = explain_model(model).memory["arena_bytes"]
    bf16 = explain_model(model, precision="bf16").memory["arena_bytes"]
    assert bf16 <= 0.55 * fp32, (bf16, fp32, bf16 / fp32)


@pytest.mark.slow   # two uncached plans of ResNet-50 (~40 s of CPU)
def test_resnet50_arena_in_bf16_is_at_most_055_of_float32():
    # 0.569 while stride-1 1x1 convs copied their bf16 X into pair-interleaved phase images (stage
    # 2's first conv: a 1.6 MB copy beside its 1.6 MB input was the peak); they read X in place now
    # (convgemm in_place_x) and the peak is a bf16 Winograd band of stage 1: 0.520
    pytest.importorskip("torch")
    from tests import zoo
    model = zoo.export(zoo.resnet((3, 4, 6, 3), bottleneck=True), {"x": (1, 3, 224, 224)})
    fp32 = explain_model(model).memory["arena_bytes"]
    bf16 = explain_model(model, precision="bf16").memory["arena_bytes"]
    assert bf16 <= 0.55 * fp32, (bf16, fp32, bf16 / fp32)


def test_a_graph_with_16_bit_activations_comes_back_from_the_step_cache_with_its_dtypes():
    # the passes' graph is cached serialised (cuvil/ir_io.py): bfloat16's numpy type string "<V2"
    # would come back as raw bytes (a later build from the cache then refused the conv)
    import ml_dtypes
    from cuvil import ir_io
    from cuvil.frontends.onnx import import_onnx
    from passes.assign_precision import Options, assign_precision
    graph, _ = import_onnx(_chain(4, 12)[0])
    for precision, stored in (("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)):
        after = assign_precision(graph, Options(precision=precision))
        back = ir_io.loads(ir_io.dumps(after))
        assert {k: np.dtype(v.dtype) for k, v in back.values.items()} == \
            {k: np.dtype(v.dtype) for k, v in after.values.items()}
        assert np.dtype(stored) in {np.dtype(v.dtype) for v in back.values.values()}
