"""bf16 / fp16 on CUDA targets (backends/numba_cuda/gemm_tc.py, mma.py): the weight products that
assign_precision marks run on tensor cores (mma.sync m16n8k16) or, for few rows, as a gemv over
16-bit B. In Numba's CUDA simulator (mma.py's twin follows the PTX fragment layout) against
onnxruntime's float32 with the derived bound below, and against numpy with the same operands
rounded the same way (tight); ptxas accepts the kernels for sm_80 and sm_90; the pipeline accepts
bf16 / fp16 for CUDA targets (not int8 / int4) and `cuvil explain` says what computes how.

The bound (docs/cuda.md). An operand rounded to 16 bits (nearest even) is x (1 + d), |d| <= u,
u = 2^-8 (bf16) or 2^-11 (fp16), so one product is off by at most (2u + u^2) |a||b|; the product
of two 16-bit values is exact in float32 (at most 22 significant bits). The sum of the K products
and the epilogue's C and R in float32, in any order, is within gamma(K + 2) = (K + 2) u_acc /
(1 - (K + 2) u_acc) <= 1.01 (K + 2) u_acc of the sum of magnitudes, with u_acc = 2^-23 (2^-24 for
round to nearest; a tensor core may truncate its additions, so the bound takes twice that), and
onnxruntime's float32 result has a like error of its own. Relu and LeakyRelu (slope <= 1) do not
enlarge an error. So, per output element, with S = sum_k |a||b| and T = S + |C| + |R|:

    |y - y_ort| <= (2u + u^2) S + 2.02 (K + 2) u_acc (1 + u)^2 T   (+ an underflow term: below the
                   normal range a rounding is off by eta = 2^-25 for fp16, not u relative:
                   tests/cuda_check.py product_bound)

and against numpy on the rounded operands (float64), only the float32 sums remain:
|y - y_rounded| <= 1.01 (K + 2) u_acc T_rounded.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.numba_cuda import gemm, gemm_tc, mma
from cuvil import pipeline
from cuvil.errors import CuvilError
from tests.cuda_check import U_ACC, assert_ptx, ort_outputs, product_bound

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FMT = {"bf16": "bf16", "fp16": "f16"}


def _model(nodes, inputs: dict, outputs: dict, consts: dict):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()],
        [numpy_helper.from_array(v, n) for n, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _lowered(model, feeds, precision):
    from backends.numba_cuda.registry import lower
    graph = pipeline.import_model(model, {k: list(v.shape) for k, v in feeds.items()})
    names, options = pipeline.pass_list(2, precision=precision, gpu=True)
    graph = pipeline.run_passes(graph, names, options)
    return graph, lower(graph)


def check_product(model, feeds, precision, A, B, C=0.0, R=0.0, act=lambda v: v, family=None, ptx=False):
    """Simulate the model in `precision` and check its one output Y = act(A @ B + C + R) (B with
    alpha folded, C with beta) against onnxruntime (derived bound) and numpy on rounded operands."""
    from backends.numba_cuda.simulate import simulate_schedule
    from backends.schedule import kernel_calls
    graph, schedule = _lowered(model, feeds, precision)
    calls = kernel_calls(schedule)
    families = {c.kernel.family for c in calls}
    assert family in families, f"kernel family {family} not used; the schedule has {sorted(families)}"
    assert all(c.precision.startswith(precision) for c in calls if c.kernel.family == family)
    A, B = np.asarray(A, np.float64), np.asarray(B, np.float64)
    got = simulate_schedule(graph, schedule, feeds)["Y"].astype(np.float64).reshape(-1, B.shape[1])
    want = ort_outputs(model, feeds)["Y"].astype(np.float64).reshape(-1, B.shape[1])
    K = A.shape[-1]
    rest = np.abs(C) + np.abs(R)
    bound = product_bound(np.abs(A), np.abs(B), rest, precision)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"max error {err.max():.3g}, worst ratio to the bound {np.max(err / bound):.3g}"
    # numpy on the operands the kernel rounds: the tile rounds A and B, the gemv B only
    fmt = FMT[precision]
    rounded_a = A if family.endswith("gemv16") else mma.round16(A, fmt).astype(np.float64)
    rounded_b = mma.round16(B, fmt).astype(np.float64)
    reference = act(rounded_a @ rounded_b + C + R)
    tight = 1.01 * (K + 2) * U_ACC * (np.abs(rounded_a) @ np.abs(rounded_b) + rest)
    assert np.all(np.abs(got - reference) <= tight), np.max(np.abs(got - reference) / tight)
    if ptx:
        assert_ptx(schedule, archs=("cuda-sm80", "cuda-sm90"))
    return schedule


def _matmul(m, k, n, seed=0, batch=()):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((*batch, m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["A", "W"], ["Y"])], {"A": list(a.shape)},
                   {"Y": [*batch, m, n]}, {"W": w})
    return model, a, w


# -- the fragment layout -------------------------------------------------------------------------

def test_the_kernels_fragment_registers_follow_the_ptx_layout():
    """gemm_tc's register tables, evaluated for every lane, give the elements the PTX ISA assigns
    (mma.a_element, b_element, c_element: "Matrix Fragments for mma.m16n8k16 with floating point type")."""
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        for reg, (dr, dk) in enumerate(gemm_tc.A_REGS):
            for half in (0, 1):
                assert mma.a_element(lane, 2 * reg + half) == (g + dr, 2 * (t + dk) + half)
        for reg, dk in enumerate(gemm_tc.B_REGS):
            for half in (0, 1):
                assert mma.b_element(lane, 2 * reg + half) == (2 * (t + dk) + half, g)
        for e, (dr, dc) in enumerate(gemm_tc.C_ELEMS):
            assert mma.c_element(lane, e) == (g + dr, 2 * t + dc)
    # every element of A, B and C is held by exactly one (lane, element)
    assert len({mma.a_element(lane, i) for lane in range(32) for i in range(8)}) == 256
    assert len({mma.b_element(lane, i) for lane in range(32) for i in range(4)}) == 128
    assert len({mma.c_element(lane, i) for lane in range(32) for i in range(4)}) == 128


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_simulated_mma_is_the_product_of_the_rounded_fragments(precision):
    """warp_product (the simulator's mma) on registers packed by the layout equals numpy's product
    of the rounded matrices: exact products, one float32 rounding of each sum of 16 (and C)."""
    fmt = FMT[precision]
    rng = np.random.default_rng(3)
    A, B, C = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    a_bits, b_bits = mma.bits16(A, fmt), mma.bits16(B, fmt)
    a_regs = np.zeros((32, 4), np.uint32)
    b_regs = np.zeros((32, 2), np.uint32)
    c = np.zeros((32, 4), np.float32)
    for lane in range(32):
        for i in range(8):
            a_regs[lane, i // 2] |= np.uint32(a_bits[mma.a_element(lane, i)]) << np.uint32(16 * (i % 2))
        for i in range(4):
            b_regs[lane, i // 2] |= np.uint32(b_bits[mma.b_element(lane, i)]) << np.uint32(16 * (i % 2))
        for i in range(4):
            c[lane, i] = np.float32(C[mma.c_element(lane, i)])
    d = mma.warp_product(a_regs, b_regs, c, fmt)
    want = (mma.round16(A, fmt).astype(np.float64) @ mma.round16(B, fmt).astype(np.float64)
            + C.astype(np.float32)).astype(np.float32)
    for lane in range(32):
        for i in range(4):
            assert d[lane, i] == want[mma.c_element(lane, i)]


def test_pack_pairs_puts_even_k_in_the_low_half():
    data = np.array([[1.0, -2.0], [3.0, 0.5], [7.0, 9.0]], np.float32)
    words = mma.pack_pairs(data, "bf16")
    assert words.shape == (2, 2) and words.dtype == np.uint32
    assert np.array_equal(mma.widen16((words & 0xFFFF).astype(np.uint16), "bf16"), data[0::2])
    assert np.array_equal(mma.widen16((words[:1] >> 16).astype(np.uint16), "bf16"), data[1:2])
    assert np.all(words[1] >> 16 == 0)          # the odd K's padding row


# -- the kernels in the simulator ---------------------------------------------------------------

@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_matmul_on_tensor_cores(precision):
    model, a, w = _matmul(37, 40, 53)
    check_product(model, {"A": a}, precision, a, w, family="MatMul_mma", ptx=True)


@pytest.mark.parametrize("tile", gemm_tc.TC_TILES, ids=lambda t: f"{t.BM}x{t.BN}x{t.BK}")
def test_each_tensor_core_tile(tile, monkeypatch):
    """Every tile shape, on a product smaller than one tile in m and n, k not a whole step."""
    monkeypatch.setattr(gemm_tc, "TC_TILES", (tile,))
    model, a, w = _matmul(21, 35, 19, seed=1)
    check_product(model, {"A": a}, "bf16", a, w, family="MatMul_mma")


def test_gemm_transposed_a_alpha_beta_bias_on_tensor_cores():
    """transA (A read along m, not k), transB, alpha folded into the packed B, beta * C in the epilogue."""
    rng = np.random.default_rng(4)
    m, k, n = 19, 23, 29
    a, b, c = rng.standard_normal((k, m)), rng.standard_normal((n, k)), rng.standard_normal((n,))
    a, b, c = a.astype(np.float32), b.astype(np.float32), c.astype(np.float32)
    node = helper.make_node("Gemm", ["A", "B", "C"], ["Y"], transA=1, transB=1, alpha=0.75, beta=1.5)
    model = _model([node], {"A": [k, m]}, {"Y": [m, n]}, {"B": b, "C": c})
    check_product(model, {"A": a}, "fp16", a.T, 0.75 * b.T.astype(np.float64), C=1.5 * c.astype(np.float64),
                  family="Gemm_mma")


def test_fused_bias_residual_relu_on_tensor_cores():
    rng = np.random.default_rng(5)
    m, k, n = 20, 48, 24
    w, bias = rng.standard_normal((k, n)).astype(np.float32), rng.standard_normal((n,)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["X", "W"], ["h"]), helper.make_node("Add", ["h", "bias"], ["z"]),
             helper.make_node("Add", ["z", "R"], ["s"]), helper.make_node("Relu", ["s"], ["Y"])]
    model = _model(nodes, {"X": [m, k], "R": [m, n]}, {"Y": [m, n]}, {"W": w, "bias": bias})
    x, r = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    schedule = check_product(model, {"X": x, "R": r}, "bf16", x, w, C=bias.astype(np.float64),
                             R=r.astype(np.float64), act=lambda v: np.maximum(v, 0), family="Gemm_mma")
    assert len(schedule) == 1


def test_split_k_on_tensor_cores(monkeypatch):
    """Few tiles and a long k: k split over blocks, the partial products summed in order by gemm.py's
    second kernel (the epilogue there)."""
    monkeypatch.setattr(gemm, "SMS", 64)
    monkeypatch.setattr(gemm, "MIN_SPLIT_K", 16)
    rng = np.random.default_rng(7)
    a, w, c = (rng.standard_normal(s).astype(np.float32) for s in ((20, 70), (70, 24), (24,)))
    model = _model([helper.make_node("Gemm", ["A", "W", "C"], ["Y"])], {"A": [20, 70]}, {"Y": [20, 24]},
                   {"W": w, "C": c})
    schedule = check_product(model, {"A": a}, "bf16", a, w, C=c.astype(np.float64), family="Gemm_mma", ptx=True)
    assert [call.kernel.family for call in schedule] == ["Gemm_mma", "Gemm_splitk"]


def test_batched_matmul_with_a_shared_weight_folds_into_rows():
    model, a, w = _matmul(10, 12, 17, seed=8, batch=(3,))
    check_product(model, {"A": a}, "fp16", a.reshape(30, 12), w, family="MatMul_mma")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("m,k", [(1, 300), (3, 71)])
def test_gemv_reads_16_bit_weights(precision, m, k):
    """Few rows: float32 A times B widened from its packed 16-bit pairs (an odd k: the last word's
    upper half is padding)."""
    model, a, w = _matmul(m, k, 20, seed=m)
    check_product(model, {"A": a}, precision, a, w, family="MatMul_gemv16", ptx=(m == 3))


def test_gemm_gemv_with_transposed_a():
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((33, 2)).astype(np.float32), rng.standard_normal((33, 12)).astype(np.float32)
    model = _model([helper.make_node("Gemm", ["A", "B"], ["Y"], transA=1, alpha=2.0)], {"A": [33, 2]},
                   {"Y": [2, 12]}, {"B": b})
    check_product(model, {"A": a}, "bf16", a.T, 2.0 * b.astype(np.float64), family="Gemm_gemv16")


# -- the pipeline -------------------------------------------------------------------------------

def test_cuda_targets_accept_bf16_and_fp16_and_refuse_integer_precisions():
    for precision in ("bf16", "fp16"):
        assert pipeline.resolve_variant_target("cuda-sm80", precision).arch == "sm_80"
    for precision in ("int8", "int4"):
        with pytest.raises(CuvilError, match=f"precision '{precision}' is not supported yet for CUDA targets "
                                             r"\('cuda-sm90'\)"):
            pipeline.resolve_variant_target("cuda-sm90", precision)


def test_gpu_pass_list_keeps_activations_float32():
    _, options = pipeline.pass_list(2, precision="bf16", gpu=True)
    assert options["assign_precision"] == {**options["assign_precision"], "precision": "bf16",
                                           "narrow_activations": False}


def test_explain_names_the_tensor_core_products_and_what_stays_float32():
    """A conv and a MatMul with constant weights on tensor cores; a marked LSTM (its GPU kernel is
    float32) says so."""
    from cuvil.explain import explain_model
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    m = rng.standard_normal((8, 16)).astype(np.float32)
    lstm_w, lstm_r = rng.standard_normal((1, 32, 16)).astype(np.float32), rng.standard_normal((1, 32, 8)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["c", "shape"], ["r"]), helper.make_node("MatMul", ["r", "m"], ["mm"]),
             helper.make_node("Reshape", ["mm", "seq"], ["s"]),
             helper.make_node("LSTM", ["s", "W", "R"], ["Y"], hidden_size=8)]
    consts = {"w": w, "m": m, "shape": np.array([32, 8], np.int64), "seq": np.array([32, 1, 16], np.int64),
              "W": lstm_w, "R": lstm_r}
    model = _model(nodes, {"x": [2, 3, 4, 4]}, {"Y": [32, 1, 1, 8]}, consts)
    kernels = explain_model(model, {"x": [2, 3, 4, 4]}, target="cuda-sm90", precision="bf16").kernels
    by_op = {k.op: k.precision for k in kernels}
    assert by_op["MatMul"] == by_op["Conv"] == "bf16 (mma.sync m16n8k16)"
    assert by_op["LSTM"].startswith("float32 (marked bf16: on CUDA targets only Gemm / MatMul / Conv")


def test_a_bf16_build_is_deterministic_and_keyed_by_its_precision(tmp_path):
    """An MLP for sm_80 in bf16, twice from empty caches: the same bytes, a library other than the
    fp32 one, the precision in its manifest; no accuracy step (it would need a GPU)."""
    import cuvil
    from tests import zoo
    model = zoo.export(zoo.mlp((32, 64, 16)), {"x": (4, 32)})
    libs = {}
    for precision, attempt in (("bf16", 1), ("bf16", 2), ("fp32", 1)):
        compiled = cuvil.compile(model, input_shapes={"x": [4, 32]}, target="cuda-sm80", precision=precision,
                                 cache_dir=tmp_path / f"cache-{precision}-{attempt}", jobs=2, name="mlp")
        assert compiled.info["precision"] == precision and compiled.accuracy is None
        libs[precision, attempt] = compiled.artifacts.library.read_bytes()
    assert libs["bf16", 1] == libs["bf16", 2]
    assert libs["bf16", 1] != libs["fp32", 1]


def test_min_cosine_is_refused_for_a_cuda_build(tmp_path):
    import cuvil
    model, _, _ = _matmul(4, 8, 8)
    with pytest.raises(CuvilError, match="accuracy.min_cosine cannot be checked for CUDA target"):
        cuvil.compile(model, input_shapes={"A": [4, 8]}, target="cuda-sm90", precision="fp16",
                      accuracy={"min_cosine": 0.99}, cache_dir=tmp_path / "cache")


# -- convolutions on tensor cores (conv_tc.py) ----------------------------------------------------

def _conv_np(x, w, stride, pad, group):
    """NCHW 2-D convolution in float64 (numpy), for the bound's sums and the rounded reference."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    n, c, h, wd = x.shape
    oc, icg, kh, kw = w.shape
    ocg = oc // group
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = (h + 2 * pad - kh) // stride + 1, (wd + 2 * pad - kw) // stride + 1
    out = np.zeros((n, oc, oh, ow))
    for g in range(group):
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, g * icg:(g + 1) * icg, i:i + stride * oh:stride, j:j + stride * ow:stride]
                out[:, g * ocg:(g + 1) * ocg] += np.einsum("ncij,oc->noij", patch, w[g * ocg:(g + 1) * ocg, :, i, j])
    return out


def check_conv(precision, n, c, hw, oc, k, stride=1, pad=0, group=1, residual=False, seed=0, family="ConvMma",
               ptx=False):
    """act(conv(x, w) + bias (+ r)), Relu, in the simulator: the derived bound against onnxruntime's
    float32 (S and the operand sums from the convolution of magnitudes) and numpy on rounded operands."""
    from backends.numba_cuda.simulate import simulate_schedule
    from backends.schedule import kernel_calls
    from tests.cuda_check import bound_of_sums
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, hw, hw)).astype(np.float32)
    w = rng.standard_normal((oc, c // group, k, k)).astype(np.float32)
    bias = rng.standard_normal((oc,)).astype(np.float32)
    conv = _conv_np(x, w, stride, pad, group)
    out_shape = list(conv.shape)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[stride] * 2, pads=[pad] * 4, group=group)]
    feeds, rest = {"x": x}, np.abs(bias)[None, :, None, None]
    inputs = {"x": list(x.shape)}
    r = np.zeros(out_shape)
    if residual:
        r = rng.standard_normal(out_shape).astype(np.float32)
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
        feeds["r"], inputs["r"], rest = r, out_shape, rest + np.abs(r)
    nodes.append(helper.make_node("Relu", ["s" if residual else "c"], ["Y"]))
    model = _model(nodes, inputs, {"Y": out_shape}, {"w": w, "b": bias})
    graph, schedule = _lowered(model, feeds, precision)
    calls = kernel_calls(schedule)
    assert family in {c.kernel.family for c in calls}, sorted({c.kernel.family for c in calls})
    assert all(c.precision == f"{precision} (mma.sync m16n8k16)" for c in calls)
    got = simulate_schedule(graph, schedule, feeds)["Y"].astype(np.float64)
    want = ort_outputs(model, feeds)["Y"].astype(np.float64)
    K = (c // group) * k * k
    S = _conv_np(np.abs(x), np.abs(w), stride, pad, group)
    sums = _conv_np(np.abs(x), np.ones_like(w), stride, pad, group) + np.abs(w).sum(axis=(1, 2, 3))[None, :, None, None]
    bound = bound_of_sums(S, sums, K, rest, precision)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"max error {err.max():.3g}, worst ratio to the bound {np.max(err / bound):.3g}"
    fmt = FMT[precision]
    xr, wr = mma.round16(x, fmt), mma.round16(w, fmt)
    reference = np.maximum(_conv_np(xr, wr, stride, pad, group) + bias[None, :, None, None] + r, 0)
    tight = 1.01 * (K + 2) * U_ACC * (_conv_np(np.abs(xr), np.abs(wr), stride, pad, group) + rest)
    assert np.all(np.abs(got - reference) <= tight), np.max(np.abs(got - reference) / tight)
    if ptx:
        assert_ptx(schedule, archs=("cuda-sm80", "cuda-sm90"))
    return calls


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_conv3x3_bias_relu_on_tensor_cores(precision):
    check_conv(precision, n=2, c=8, hw=6, oc=12, k=3, pad=1, ptx=True)


def test_pointwise_conv_on_tensor_cores():
    check_conv("bf16", n=1, c=16, hw=5, oc=24, k=1, seed=1)


def test_grouped_strided_conv_with_residual_on_tensor_cores():
    check_conv("fp16", n=1, c=8, hw=7, oc=8, k=3, stride=2, pad=1, group=2, residual=True, seed=2)


def test_split_k_conv_on_tensor_cores():
    """K = 288 in 9 steps, 16 x 16 outputs: too few tiles, k split in two, conv.py's sum kernel."""
    calls = check_conv("bf16", n=1, c=32, hw=4, oc=16, k=3, pad=1, seed=3, family="ConvMmaSplitK", ptx=True)
    assert [c.kernel.family for c in calls] == ["ConvMmaSplitK", "ConvSplitKSum"]
