"""Depthwise convs on activations stored in 16 bits (passes/assign_precision.py, `narrow_activations`):
a depthwise Conv reads its 16-bit input and writes its 16-bit output (backends/numba_cpu/dwstride.py,
ukernel_lowp.DwRow16Spec: widened on load, float32 FMAs with float32 weights, rounded once on the
store), and so does a DepthwiseBlock (backends/numba_cpu/dwblock.py: t and u stay float32 inside).
Compared with onnxruntime in float32.

The bound is propagated stage by stage, with onnxruntime's float32 values of every tensor as the
reference magnitudes (|.| * |.| below is the convolution of magnitudes, in float64). u = 2^-8 (bf16,
8 significant bits) or 2^-11 (fp16, 11 bits) is the unit roundoff of one rounding to nearest;
gamma(n) = n 2^-24 / (1 - n 2^-24) bounds a float32 sum of n terms. `b` is the bound on a stage's
input (|h - h_ort| <= b), `e` the bound before a stage's store:

    marked conv (bf16/fp16 operands):  e = |W| * b + (r + gamma(K + 1)) (|W| * (|h| + b) + |bias|)
        r = u for W's rounding when h is stored in 16 bits already (exact operand), and
        r = 2u + u^2 when h is a float32 graph input rounded to 16 bits by the conv
    depthwise conv / the block's float32 1x1 convs (float32 weights, exact 16-bit or float32 input):
                                       e = |W| * b + gamma(K + 1) (|W| * (|h| + b) + |bias|)
    a residual r added before the store: e += b_r + gamma(1) (|y| + e)
    stored in 16 bits:                 b_out = e + u (|y_ort| + e)       (one rounding, RNE)

Relu / Clip are 1-Lipschitz and commute with these bounds. K = taps x input channels per group.
"""
import numpy as np
import pytest
from onnx import helper

import cuvil
from cuvil.explain import explain_model
from tests.helpers import cosine, make_model, run_ort

F = np.float32
U = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def gamma(n):
    return n * 2.0 ** -24 / (1 - n * 2.0 ** -24)


def conv64(x, w, stride=1, pads=(0, 0, 0, 0), group=1, dilation=1):
    """Float64 convolution (NCHW, OIHW; pads top, left, bottom, right): the bounds' magnitudes."""
    N, C, H, W = x.shape
    OC, ICg, KH, KW = w.shape
    xp = np.pad(np.asarray(x, np.float64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    OH = (xp.shape[2] - dilation * (KH - 1) - 1) // stride + 1
    OW = (xp.shape[3] - dilation * (KW - 1) - 1) // stride + 1
    y = np.zeros((N, OC, OH, OW))
    ocg = OC // group
    for g in range(group):
        xs = xp[:, g * ICg:(g + 1) * ICg]
        wg = np.asarray(w[g * ocg:(g + 1) * ocg], np.float64)
        for kh in range(KH):
            for kw in range(KW):
                patch = xs[:, :, kh * dilation:kh * dilation + stride * OH:stride,
                           kw * dilation:kw * dilation + stride * OW:stride]
                y[:, g * ocg:(g + 1) * ocg] += np.einsum("nchw,oc->nohw", patch, wg[:, :, kh, kw])
    return y


def stage_error(h, b, w, bias, rel, **geometry):
    """e of one conv (see the module docstring): h its input (onnxruntime's), b h's bound, rel the
    operand roundings' relative error."""
    K = w.shape[1] * w.shape[2] * w.shape[3]
    b = np.broadcast_to(np.asarray(b, np.float64), h.shape)
    mag = conv64(np.abs(h) + b, np.abs(w), **geometry) + np.abs(bias)[None, :, None, None]
    return conv64(b, np.abs(w), **geometry) + (rel + gamma(K + 1)) * mag


def stored(e, y, u):
    return e + u * (np.abs(y) + e)


def weights(oc, icg, k, seed):
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((oc, icg, k, k)) / np.sqrt(icg * k * k)).astype(F),
            (rng.standard_normal(oc) * 0.1).astype(F))


def intermediates(model, feeds, names):
    """onnxruntime's float32 values of the tensors `names` (added as graph outputs)."""
    m = type(model)()
    m.CopyFrom(model)
    m.graph.output.extend(helper.make_tensor_value_info(n, 1, None) for n in names)
    return run_ort(m, feeds)


def families(info):
    return {"_".join(k.symbol.split("_")[1:-1]) for k in info.kernels}


DEPTHWISE_CASES = {   # C, H, W, kernel, stride, pads (t, l, b, r), dilation
    "3x3_s1": (24, 14, 14, 3, 1, (1, 1, 1, 1), 1),
    "3x3_s2_odd": (20, 15, 17, 3, 2, (1, 1, 1, 1), 1),
    "5x5_s2": (36, 16, 16, 5, 2, (2, 2, 2, 2), 1),
    "3x3_s2_end_pads": (40, 16, 16, 3, 2, (0, 0, 1, 1), 1),
    "3x3_s1_narrow": (40, 7, 7, 3, 1, (1, 1, 1, 1), 1),   # rows narrower than the fp32 kernel's minimum
    "3x3_s1_unpadded": (17, 12, 12, 3, 1, (0, 0, 0, 0), 1),
    "3x3_dilation2": (24, 14, 14, 3, 1, (2, 2, 2, 2), 2),   # no 16-bit rows: widened copies around it
    "7x7_s1": (16, 12, 12, 7, 1, (3, 3, 3, 3), 1),
    "3x3_s1_wide": (8, 6, 45, 3, 1, (1, 1, 1, 1), 1),   # rows of more than 2 x 16 outputs
}


def depthwise_chain(C, H, W, k, stride, pads, dilation):
    """x -> 1x1 conv (marked: writes h1 in 16 bits) -> depthwise conv + Clip(0, 6) (reads h1, writes
    h2 in 16 bits) -> 1x1 conv (marked: reads h2) -> y (float32, a graph output)."""
    w1, b1 = weights(C, 8, 1, 1)
    w2, b2 = weights(C, 1, k, 2)
    w3, b3 = weights(16, C, 1, 3)
    six = np.array(6.0, F)
    zero = np.array(0.0, F)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h1"]),
             helper.make_node("Conv", ["h1", "w2", "b2"], ["d"], group=C, strides=[stride, stride],
                              pads=list(pads), dilations=[dilation, dilation]),
             helper.make_node("Clip", ["d", "zero", "six"], ["h2"]),
             helper.make_node("Conv", ["h2", "w3", "b3"], ["y"])]
    inits = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3, "six": six, "zero": zero}
    model = make_model(nodes, [("x", F, [1, 8, H, W])], [("y", F, None)], inits)
    return model, (w1, b1, w2, b2, w3, b3)


# fp16 cases -m slow (CI budget): they differ from bf16 in the load/store conversions only
@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(DEPTHWISE_CASES))
def test_a_depthwise_conv_between_16_bit_tensors_is_within_the_propagated_bound(case, precision):
    C, H, W, k, stride, pads, dilation = DEPTHWISE_CASES[case]
    model, (w1, b1, w2, b2, w3, b3) = depthwise_chain(C, H, W, k, stride, pads, dilation)
    x = np.random.default_rng(0).standard_normal((1, 8, H, W)).astype(F)
    u = U[precision]
    ort = intermediates(model, {"x": x}, ["h1", "h2"])
    h1, h2, y = (ort[n].astype(np.float64) for n in ("h1", "h2", "y"))
    bound1 = stored(stage_error(x, 0.0, w1, b1, 2 * u + u * u), h1, u)
    bound2 = stored(stage_error(h1, bound1, w2, b2, 0.0, stride=stride, pads=pads, group=C, dilation=dilation), h2, u)
    bound = stage_error(h2, bound2, w3, b3, u)

    # the depthwise conv's own kernel: a bf16 build would fuse the chain into a DepthwiseBlock
    # (pipeline.FUSE_ALL_BLOCKS; the block tests below)
    separate = {"disable_passes": ["fuse_depthwise_block"]}
    got = cuvil.compile(model, precision=precision, **separate).run({"x": x})["y"]
    err = np.abs(got.astype(np.float64) - y)
    assert got.dtype == np.float32 and got.shape == y.shape
    assert np.all(err <= bound), float(np.max(err - bound))
    # the 16-bit tensors really were rounded: float32 throughout stays within ~gamma(K) of the values
    assert np.max(err) > 2.0 ** -20 * np.max(np.abs(y)), (np.max(err), np.max(np.abs(y)))

    info = explain_model(model, precision=precision, **separate)
    assert "depthwiseblock" not in families(info), families(info)
    own = {b[4]: b[1] for b in info.buffers if "__" not in b[4]}
    sizes = sorted(own.values())
    assert 2 * h1.size in sizes and 2 * h2.size in sizes, (own, h1.size, h2.size)   # both stored in 16 bits
    if dilation == 1:   # the depthwise rows read and write them: no widening copy
        assert not any(f.startswith(("cast", "cvt16")) for f in families(info)), families(info)


def test_depthwise_convs_keep_float32_tensors_when_narrow_activations_is_off():
    model, _ = depthwise_chain(*DEPTHWISE_CASES["3x3_s1"])
    off = explain_model(model, precision="bf16", pass_options={"assign_precision": {"narrow_activations": False}},
                        disable_passes=["fuse_depthwise_block"])
    assert 4 * 24 * 14 * 14 in [b[1] for b in off.buffers if "__" not in b[4]]


BLOCK_CASES = {   # expand, project, residual, stride, C, H, W, the block reads the graph input
    "expand_project_residual": (True, True, True, 1, 24, 20, 20, False),
    "expand_project_s2": (True, True, False, 2, 24, 20, 20, False),
    "project_only": (False, True, False, 1, 24, 20, 20, False),
    "expand_only_s2": (True, False, False, 2, 24, 20, 20, False),
    # odd channel counts (a last channel pair with a zero weight), odd and unequal widths
    "odd_channels_residual": (True, True, True, 1, 13, 17, 23, False),
    "odd_channels_s2": (True, True, False, 2, 13, 15, 21, False),
    "odd_project_only_s2": (False, True, False, 2, 13, 15, 9, False),
    "small_plane_residual": (True, True, True, 1, 13, 7, 7, False),
    # wide rows: several bands, each a few blocks of expanded channels (dwblock._blocked_band), the
    # rows two bands share kept in the halo store, a last partial block of 39 channels
    "wide_bands_residual": (True, True, True, 1, 13, 24, 110, False),
    "wide_bands_s2": (True, True, False, 2, 13, 25, 110, False),
    # x a float32 graph input (rounded to bf16 into pairs by the block), y a float32 graph output
    "graph_input_output": (True, True, False, 1, 16, 9, 13, True),
}


def block_chain(expand, project, residual, stride, C=24, H=20, W=20, direct=False):
    """x -> 3x3 conv (marked: writes h in 16 bits) -> [expand 1x1 + Clip] -> depthwise 3x3 + Clip ->
    [project 1x1 (+ h)] -> g -> 3x3 conv (marked: reads g) -> y. With min_bytes 0 the middle becomes
    one DepthwiseBlock (passes/fuse_depthwise_block.py) reading h (and the residual h) and writing
    g in 16 bits. `direct`: the block reads the graph input (h = x, C channels, float32) and
    writes the graph output (y = g, float32)."""
    E = 3 * C if expand else C
    inits = {"zero": np.array(0.0, F), "six": np.array(6.0, F)}
    nodes = []
    if not direct:
        inits["w0"], inits["b0"] = weights(C, 4, 3, 10)
        nodes.append(helper.make_node("Conv", ["x", "w0", "b0"], ["h"], pads=[1, 1, 1, 1]))
    h = "x" if direct else "h"
    stages = []   # (input, weights, bias, geometry, output)
    t = h
    if expand:
        inits["we"], inits["be"] = weights(E, C, 1, 11)
        nodes += [helper.make_node("Conv", [h, "we", "be"], ["te"]), helper.make_node("Clip", ["te", "zero", "six"], ["t"])]
        stages.append((h, "we", "be", {}, "t"))
        t = "t"
    inits["wd"], inits["bd"] = weights(E, 1, 3, 12)
    nodes += [helper.make_node("Conv", [t, "wd", "bd"], ["ud"], group=E, strides=[stride, stride], pads=[1, 1, 1, 1]),
              helper.make_node("Clip", ["ud", "zero", "six"], ["u"])]
    stages.append((t, "wd", "bd", {"stride": stride, "pads": (1, 1, 1, 1), "group": E}, "u"))
    g = "u"
    if project:
        inits["wp"], inits["bp"] = weights(C, E, 1, 13)
        nodes.append(helper.make_node("Conv", ["u", "wp", "bp"], ["p"]))
        stages.append(("u", "wp", "bp", {}, "p"))
        g = "p"
        if residual:
            nodes.append(helper.make_node("Add", ["p", h], ["g"]))
            g = "g"
    if direct:
        model = make_model(nodes, [("x", F, [1, C, H, W])], [(g, F, None)], inits)
        return model, inits, stages, g
    w9, b9 = weights(8, C if project else E, 3, 14)   # 3x3: not a project conv the block could take
    inits.update(w9=w9, b9=b9)
    nodes.append(helper.make_node("Conv", [g, "w9", "b9"], ["y"], pads=[1, 1, 1, 1]))
    model = make_model(nodes, [("x", F, [1, 4, H, W])], [("y", F, None)], inits)
    return model, inits, stages, g


def block_bound(case, precision, x, ort):
    """The bound on |y - y_ort| of block_chain(case) (see the module docstring), ort: onnxruntime's
    float32 values of x's chain (h, the stages' outputs, g, y).

    Inside a bf16 block (marked bf16 by passes/assign_precision.py, backends/numba_cpu/dwblock.py)
    the 1x1 convs run on the bf16 micro-kernel: their weights are rounded to bf16 (r = u; x too
    when it is a float32 graph input the block rounds into pairs: r = 2u + u^2), t stays float32,
    and u is rounded once to bf16 when the project conv reads it (stored()). An fp16 block keeps
    float32 1x1 convs on float32 t and u (r = 0, u not rounded)."""
    expand, project, residual, stride, C, H, W, direct = BLOCK_CASES[case]
    u = U[precision]
    inside = u if precision == "bf16" else 0.0
    if direct:
        bound = {"x": np.zeros(x.shape)}
    else:
        bound = {"h": stored(stage_error(x, 0.0, INITS_OF[case]["w0"], INITS_OF[case]["b0"], 2 * u + u * u,
                                         pads=(1, 1, 1, 1)), ort["h"], u)}
    inits = INITS_OF[case]
    for src, w, b, geometry, out in STAGES_OF[case]:
        rel = 0.0 if geometry else (2 * u + u * u if direct and src == "x" and precision == "bf16" else inside)
        here = ort[src] if src in ort else x.astype(np.float64)
        bound[out] = stage_error(here, bound[src], inits[w], inits[b], rel, **geometry)
        if out == "u" and project and precision == "bf16":
            # u's bf16 pairs; with AVX512-BF16 rounded by vcvtneps2bf16, which flushes a float32
            # subnormal to zero: 2^-126 more (ukernel_lowp.store_rounding; the avx2 target's exact
            # rounding is within this bound too)
            bound["u"] = stored(bound["u"], ort["u"], u) + 2.0 ** -126
    g = GS_OF[case]
    e = bound[STAGES_OF[case][-1][4]]
    if residual:
        e = e + bound["x" if direct else "h"] + gamma(1) * (np.abs(ort[g]) + e)
    if direct:
        return e
    b_g = stored(e, ort[g], u)
    if project and precision == "bf16":
        # y rounded by the project GEMM in registers (dwblock_out16.py: ukernel_lowp.store_rounding's
        # vcvtneps2bf16 with AVX512-BF16, which flushes a float32 subnormal to zero): 2^-126 more
        b_g = b_g + 2.0 ** -126
    return stage_error(ort[g], b_g, inits["w9"], inits["b9"], u, pads=(1, 1, 1, 1))


INITS_OF, STAGES_OF, GS_OF, MODEL_OF = {}, {}, {}, {}
for _case, _params in BLOCK_CASES.items():
    expand, project, residual, stride, C, H, W, direct = _params
    MODEL_OF[_case], INITS_OF[_case], STAGES_OF[_case], GS_OF[_case] = block_chain(
        expand, project, residual, stride, C, H, W, direct)


def block_input(case):
    expand, project, residual, stride, C, H, W, direct = BLOCK_CASES[case]
    return np.random.default_rng(0).standard_normal((1, C if direct else 4, H, W)).astype(F)


def block_reference(case, x):
    """onnxruntime's float32 values of the chain's tensors (float64)."""
    names = ([] if BLOCK_CASES[case][7] else ["h"]) + [s[4] for s in STAGES_OF[case]]
    g = GS_OF[case]
    names += [g] if g not in names else []
    ort = intermediates(MODEL_OF[case], {"x": x}, [n for n in names if n != g or not BLOCK_CASES[case][7]])
    return {k: v.astype(np.float64) for k, v in ort.items()}


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_a_depthwise_block_between_16_bit_tensors_is_within_the_propagated_bound(case, precision):
    model, direct, g = MODEL_OF[case], BLOCK_CASES[case][7], GS_OF[case]
    x = block_input(case)
    ort = block_reference(case, x)
    limit = block_bound(case, precision, x, ort)
    want = ort[g] if direct else ort["y"]

    options = {"fuse_depthwise_block": {"min_bytes": 0}}
    info = explain_model(model, precision=precision, pass_options=options)
    assert "depthwiseblock" in families(info), families(info)
    assert not any(f.startswith(("cast", "cvt16")) for f in families(info)), families(info)
    blocks = [k for k in info.kernels if k.symbol.split("_")[1] == "depthwiseblock"]
    if precision == "bf16":   # the 1x1 convs on the bf16 micro-kernel (vdpbf16ps on this machine's target)
        assert all(k.precision.startswith("bf16 (") for k in blocks), [k.precision for k in blocks]
    own = sorted(b[1] for b in info.buffers if "__" not in b[4])
    if not direct:
        assert 2 * ort["h"].size in own and 2 * ort[g].size in own, (own, ort["h"].size, ort[g].size)

    got = cuvil.compile(model, precision=precision, pass_options=options).run({"x": x})[g if direct else "y"]
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= limit), float(np.max(err - limit))
    if not (direct and precision == "fp16"):   # (an fp16 block between float32 graph tensors rounds nothing)
        assert np.max(err) > 2.0 ** -20 * np.max(np.abs(want)), (np.max(err), np.max(np.abs(want)))


@pytest.mark.parametrize("case", ["odd_channels_residual", "odd_channels_s2", "graph_input_output",
                                  "small_plane_residual"])
def test_a_bf16_depthwise_block_for_a_target_without_avx512_bf16_is_within_the_same_bound(case):
    # x86_64-avx2: the bf16 micro-kernels' "widen" method (pairs split into float32, two FMAs) and
    # the pair stores of 8-lane vectors; the same roundings, so the same bound
    model, direct, g = MODEL_OF[case], BLOCK_CASES[case][7], GS_OF[case]
    x = block_input(case)
    ort = block_reference(case, x)
    limit = block_bound(case, "bf16", x, ort)
    options = {"fuse_depthwise_block": {"min_bytes": 0}}
    info = explain_model(model, precision="bf16", pass_options=options, target="x86_64-avx2")
    blocks = [k for k in info.kernels if k.symbol.split("_")[1] == "depthwiseblock"]
    assert blocks and all(k.precision == "bf16 (widen)" for k in blocks), [k.precision for k in blocks]
    got = cuvil.compile(model, precision="bf16", pass_options=options, target="x86_64-avx2").run({"x": x})
    err = np.abs(got[g if direct else "y"].astype(np.float64) - (ort[g] if direct else ort["y"]))
    assert np.all(err <= limit), float(np.max(err - limit))


# 25 + 13 s of cold kernel builds: -m slow to keep CI's budget (the default run keeps every conv and
# block case in bf16 and the arena check of the full MobileNetV2)
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_small_mobilenet_v2_keeps_its_conv_chain_in_16_bits_and_itscosine(precision):
    pytest.importorskip("torch")
    from tests import zoo
    model = zoo.export(zoo.mobilenet_v2(width_mult=0.35, num_classes=100), {"x": (1, 3, 96, 96)})
    x = zoo.sample_input((1, 3, 96, 96))
    want = next(iter(run_ort(model, {"x": x}).values()))
    got = next(iter(cuvil.compile(model, precision=precision).run({"x": x}).values()))
    # (cosine >= 0.999 is the bar for a reduced-precision model against float32)
    assert cosine(got, want) >= 0.999, cosine(got, want)
    # no depthwise conv widens its tensors into float32 copies (widen.in_float32's Cast kernels); the
    # tiny 3x3-plane 1x1 convs at the end take float32 kernels with their own copies (cvt16, conv.py)
    info = explain_model(model, precision=precision)
    assert not any(f.startswith("cast") for f in families(info)), families(info)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mobilenet_v2_at_224_keeps_its_cosine_to_float32(precision):
    pytest.importorskip("torch")
    from tests import zoo
    model = zoo.export(zoo.mobilenet_v2(), {"x": (1, 3, 224, 224)})
    x = zoo.sample_input((1, 3, 224, 224))
    want = next(iter(run_ort(model, {"x": x}).values()))
    got = next(iter(cuvil.compile(model, precision=precision).run({"x": x}).values()))
    assert cosine(got, want) >= 0.999, cosine(got, want)
    assert got.argmax() == want.argmax()


def test_mobilenet_v2_arena_in_bf16_is_at_most_055_of_float32():
    pytest.importorskip("torch")
    from tests import zoo
    model = zoo.export(zoo.mobilenet_v2(), {"x": (1, 3, 224, 224)})
    fp32 = explain_model(model).memory["arena_bytes"]
    info = explain_model(model, precision="bf16")
    bf16 = info.memory["arena_bytes"]
    assert bf16 <= 0.55 * fp32, (bf16, fp32, bf16 / fp32)
    # every one of its 17 blocks fused (pipeline.FUSE_ALL_BLOCKS), each on the bf16 micro-kernel (the
    # bands' scratch of the small late blocks grows only where it leaves the arena's peak as it is)
    blocks = [k.precision for k in info.kernels if k.symbol.split("_")[1] == "depthwiseblock"]
    assert len(blocks) == 17 and all(p.startswith("bf16 (") for p in blocks), blocks


@pytest.mark.parametrize("case", [pytest.param("expand_project_s2", marks=pytest.mark.slow), "odd_channels_s2",
                                  pytest.param("wide_bands_s2", marks=pytest.mark.slow)])   # (16 s and 32 s in CI)
def test_bf16_stride_2_blocks_on_phase_split_rows_give_the_shuffling_rows_bits(case, monkeypatch, tmp_path):
    # a stride-2 bf16 block with an expand conv from a bf16 x copies x's rows phase-split (even
    # columns, then odd), so t's are too and every depthwise tap is a plain load (dwphase.py): the
    # same taps summed in the same order as the rows that shuffle lanes, so the same bits (their
    # error bound: the block test above). Odd widths (21: 11 even columns, 10 odd), several bands.
    # On two threads the small planes (odd_channels_s2) are split by channels (dwblock_pairs.py),
    # and take the phase-split rows there too.
    from backends.numba_cpu import dwblock, dwblock_pairs, dwphase
    model, x = MODEL_OF[case], block_input(case)
    options = {"fuse_depthwise_block": {"min_bytes": 0}}
    for threads in (1, 2):
        made = []
        for module in (dwblock, dwblock_pairs):
            monkeypatch.setattr(module, "PhaseRowCalls", lambda *a: made.append(a) or dwphase.PhaseRowCalls(*a))
            monkeypatch.setattr(module, "PHASE_ROWS", True)
        phase = cuvil.compile(model, precision="bf16", threads=threads, pass_options=options,
                              cache_dir=tmp_path / f"phase{threads}").run({"x": x})["y"]
        assert made, "the block took the shuffling rows"
        for module in (dwblock, dwblock_pairs):
            monkeypatch.setattr(module, "PHASE_ROWS", False)
        shuffled = cuvil.compile(model, precision="bf16", threads=threads, pass_options=options,
                                 cache_dir=tmp_path / f"shuffle{threads}").run({"x": x})["y"]
        assert len(made) == 1 and np.array_equal(phase, shuffled)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_small_plane_blocks_computed_a_plane_a_call_give_the_rows_bits(threads, monkeypatch, tmp_path):
    # a 7 x 7 plane (one band on one thread, split by channels on two) runs its depthwise conv a
    # channel's plane a call, outputs flat (dwphase.PlaneRowCalls): the rows' taps in the rows'
    # order, so the same bits as the row calls (their error bound: the block test above)
    from backends.numba_cpu import dwblock, dwblock_pairs, dwphase
    model, x = MODEL_OF["small_plane_residual"], block_input("small_plane_residual")
    options = {"fuse_depthwise_block": {"min_bytes": 0}}
    made = []
    for module in (dwblock, dwblock_pairs):
        monkeypatch.setattr(module, "PlaneRowCalls", lambda *a: made.append(a) or dwphase.PlaneRowCalls(*a))
    plane = cuvil.compile(model, precision="bf16", threads=threads, pass_options=options,
                          cache_dir=tmp_path / "plane").run({"x": x})["y"]
    assert made, "the block took the row calls"
    monkeypatch.setattr(dwblock, "PLANE_ROWS", False)
    monkeypatch.setattr(dwblock_pairs, "PLANE_ROWS", False)
    rows = cuvil.compile(model, precision="bf16", threads=threads, pass_options=options,
                         cache_dir=tmp_path / "rows").run({"x": x})["y"]
    assert len(made) == 1 and np.array_equal(plane, rows)


@pytest.mark.parametrize("case,calls", [("expand_project_residual", 1), ("odd_channels_s2", 2), ("wide_bands_s2", 1),
                                        ("small_plane_residual", 2), ("graph_input_output", 2)])
def test_a_16_bit_depthwise_block_gives_the_same_bits_on_two_threads(case, calls):
    # each work item has its own scratch (the pairs of x and u and the float32 band of y included):
    # the result does not depend on which thread computes what (dwblock.py). A plane whose share per
    # thread is small is split by channels on two threads, in two calls (dwblock_pairs.py): the same
    # sums in the same order as the one-thread bands, so the same bits
    model, direct, g = MODEL_OF[case], BLOCK_CASES[case][7], GS_OF[case]
    x = block_input(case)
    options = {"fuse_depthwise_block": {"min_bytes": 0}}
    info = explain_model(model, precision="bf16", pass_options=options, threads=2)
    blocks = [k for k in info.kernels if k.symbol.split("_")[1] == "depthwiseblock"]
    assert len(blocks) == calls and all(k.precision.startswith("bf16 (") for k in blocks), blocks
    out = g if direct else "y"
    one = cuvil.compile(model, precision="bf16", threads=1, pass_options=options).run({"x": x})[out]
    two = cuvil.compile(model, precision="bf16", threads=2, pass_options=options).run({"x": x})[out]
    assert np.array_equal(one, two)   # (the one-thread build's error bound: the block test above)


@pytest.mark.parametrize("stride,width", [(1, 14), (2, 15), (1, 5)])
def test_a_float16_models_depthwise_conv_reads_and_writes_float16_rows(stride, width):
    # a float16 ONNX model (no precision option): its depthwise conv takes the 16-bit rows directly
    # instead of float32 copies (widen.in_float32). Both engines sum in float32 from the same fp16
    # values and round once to fp16, so they differ by at most one fp16 ulp of the result:
    # 2^-10 |y| (normal range), plus 2^-24 (the subnormal ulp) near zero.
    from onnx import TensorProto, numpy_helper
    import onnxruntime as ort
    C, H16 = 24, TensorProto.FLOAT16
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((C, 1, 3, 3)) / 3).astype(np.float16)
    b = (rng.standard_normal(C) * 0.1).astype(np.float16)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=C, pads=[1, 1, 1, 1], strides=[stride, stride])
    graph = helper.make_graph([node], "f16", [helper.make_tensor_value_info("x", H16, [1, C, width, width])],
                              [helper.make_tensor_value_info("y", H16, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = rng.standard_normal((1, C, width, width)).astype(np.float16)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = cuvil.compile(model).run({"x": x})["y"]
    assert got.dtype == np.float16 and got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert np.all(err <= 2.0 ** -10 * np.abs(want.astype(np.float64)) + 2.0 ** -24), float(err.max())
    assert not any(f.startswith("cast") for f in families(explain_model(model))), families(explain_model(model))


def test_a_bf16_build_fuses_every_depthwise_block_unless_its_options_say_otherwise():
    from cuvil import pipeline
    assert pipeline.pass_list(2, precision="bf16")[1]["fuse_depthwise_block"]["min_bytes"] == 0
    for precision in ("fp32", "fp16"):
        assert pipeline.pass_list(2, precision=precision)[1]["fuse_depthwise_block"]["min_bytes"] == 1 << 20
    given = {"fuse_depthwise_block": {"min_bytes": 4096}}
    assert pipeline.pass_list(2, pass_options=given, precision="bf16")[1]["fuse_depthwise_block"]["min_bytes"] == 4096
    assert "fuse_depthwise_block" not in pipeline.pass_list(2, precision="bf16", gpu=True)[1]
