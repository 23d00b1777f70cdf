"""GPU Gemm / MatMul kernels (backends/numba_cuda/gemm.py) in Numba's CUDA simulator against onnxruntime,
and through ptxas for sm_80 and sm_90: the tile kernel (each tile shape), the gemv kernel (both
lane layouts, and a transposed product), Gemm's attributes, MatMul's broadcasting and 1-D operands,
and the epilogues the fusion passes make."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.numba_cuda import gemm
from tests.cuda_check import assert_gpu_matches_ort

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _model(nodes, inputs: dict, outputs: dict, consts: dict) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()],
        [numpy_helper.from_array(v, n) for n, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _data(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _matmul(a_shape, b_shape, const_b: bool, seed=0):
    rng = np.random.default_rng(seed)
    a, b = _data(rng, a_shape), _data(rng, b_shape)
    out = np.matmul(a, b).shape
    inputs = {"A": list(a_shape)} | ({} if const_b else {"B": list(b_shape)})
    model = _model([helper.make_node("MatMul", ["A", "B"], ["Y"])], inputs, {"Y": list(out)},
                   {"B": b} if const_b else {})
    return model, {"A": a} | ({} if const_b else {"B": b})


@pytest.mark.parametrize("const_b", [True, False])
def test_matmul_odd_sizes_tile(const_b):
    model, feeds = _matmul((37, 29), (29, 53), const_b)
    assert_gpu_matches_ort(model, feeds, families=["MatMul_tile"])


@pytest.mark.parametrize("tile", gemm.TILES, ids=lambda t: f"{t.BM}x{t.BN}x{t.BK}")
def test_each_tile_shape(tile, monkeypatch):
    """Every tile shape, on a product smaller than one tile in m and n and several steps of k."""
    monkeypatch.setattr(gemm, "TILES", (tile,))
    model, feeds = _matmul((21, 35), (35, 19), const_b=True, seed=1)
    assert_gpu_matches_ort(model, feeds, families=["MatMul_tile"])


@pytest.mark.parametrize("const_b", [True, False])
@pytest.mark.parametrize("m", [1, 3])
def test_matmul_gemv(m, const_b):
    """Few rows: the gemv kernel, lanes over k (constant B packed N x K) or over n (a run-time B)."""
    model, feeds = _matmul((m, 70), (70, 20), const_b, seed=m)
    assert_gpu_matches_ort(model, feeds, families=["MatMul_gemv"])


def test_matmul_few_columns_is_a_transposed_gemv():
    model, feeds = _matmul((40, 33), (33, 5), const_b=True)
    assert_gpu_matches_ort(model, feeds, families=["MatMul_gemv"])


@pytest.mark.parametrize("a_shape,b_shape,const_b,family", [
    ((2, 12, 16), (2, 16, 20), False, "MatMul_tile"),        # batched tiles
    ((2, 1, 5, 12), (3, 12, 10), False, "MatMul_gemv"),      # 4-D x 3-D broadcast, few rows
    ((3, 10, 12), (1, 12, 17), True, "MatMul_tile"),         # B shared by the batch: folded into M
    ((4, 9, 11), (11, 6), True, "MatMul_gemv"),              # folded, few columns
    ((1, 2, 9, 7), (2, 1, 7, 12), False, "MatMul_tile"),     # broadcast both ways
])
def test_matmul_batched(a_shape, b_shape, const_b, family):
    model, feeds = _matmul(a_shape, b_shape, const_b)
    assert_gpu_matches_ort(model, feeds, families=[family])


@pytest.mark.parametrize("a_shape,b_shape", [((24,), (24, 13)), ((13, 24), (24,)), ((2, 3, 24), (24,)), ((24,), (2, 24, 10))])
def test_matmul_1d_operands(a_shape, b_shape):
    model, feeds = _matmul(a_shape, b_shape, const_b=False)
    assert_gpu_matches_ort(model, feeds, families=["MatMul_gemv"])


@pytest.mark.parametrize("trans_a,trans_b,const_b", [(0, 0, True), (1, 0, True), (0, 1, True), (1, 1, False), (0, 1, False)])
@pytest.mark.parametrize("m", [2, 19])
def test_gemm_transposes(trans_a, trans_b, const_b, m):
    rng = np.random.default_rng(trans_a * 4 + trans_b * 2 + const_b)
    k, n = 23, 29
    a = _data(rng, (k, m) if trans_a else (m, k))
    b = _data(rng, (n, k) if trans_b else (k, n))
    c = _data(rng, (n,))
    node = helper.make_node("Gemm", ["A", "B", "C"], ["Y"], transA=trans_a, transB=trans_b, alpha=0.75, beta=1.5)
    inputs = {"A": list(a.shape)} | ({} if const_b else {"B": list(b.shape)})
    model = _model([node], inputs, {"Y": [m, n]}, {"C": c} | ({"B": b} if const_b else {}))
    family = "Gemm_gemv" if m <= gemm.GEMV_ROWS else "Gemm_tile"
    assert_gpu_matches_ort(model, {"A": a} | ({} if const_b else {"B": b}), families=[family])


@pytest.mark.parametrize("c_shape", [(29,), (1, 29), (19, 29), (19, 1), ()])
@pytest.mark.parametrize("const_c", [True, False])
def test_gemm_bias_shapes(c_shape, const_c):
    rng = np.random.default_rng(len(c_shape))
    a, b, c = _data(rng, (19, 23)), _data(rng, (23, 29)), _data(rng, c_shape)
    node = helper.make_node("Gemm", ["A", "B", "C"], ["Y"], beta=0.5)
    inputs = {"A": [19, 23]} | ({} if const_c else {"C": list(c_shape)})
    model = _model([node], inputs, {"Y": [19, 29]}, {"B": b} | ({"C": c} if const_c else {}))
    assert_gpu_matches_ort(model, {"A": a} | ({} if const_c else {"C": c}), families=["Gemm_tile"])


def test_gemm_without_bias_runtime_b_alpha():
    rng = np.random.default_rng(5)
    a, b = _data(rng, (4, 30)), _data(rng, (30, 12))
    node = helper.make_node("Gemm", ["A", "B"], ["Y"], alpha=-2.0)
    model = _model([node], {"A": [4, 30], "B": [30, 12]}, {"Y": [4, 12]}, {})
    assert_gpu_matches_ort(model, {"A": a, "B": b}, families=["Gemm_gemv"])


@pytest.mark.parametrize("m", [1, 20])
def test_fused_matmul_add_relu(m):
    """MatMul + bias Add + Relu: fuse_gemm and fuse_activation make one FusedGemm."""
    rng = np.random.default_rng(m)
    w, bias = _data(rng, (24, 40)), _data(rng, (40,))
    nodes = [helper.make_node("MatMul", ["X", "W"], ["h"]), helper.make_node("Add", ["h", "bias"], ["z"]),
             helper.make_node("Relu", ["z"], ["Y"])]
    model = _model(nodes, {"X": [m, 24]}, {"Y": [m, 40]}, {"W": w, "bias": bias})
    family = "Gemm_gemv" if m <= gemm.GEMV_ROWS else "Gemm_tile"
    schedule = assert_gpu_matches_ort(model, {"X": _data(rng, (m, 24))}, families=[family])
    assert len(schedule) == 1


@pytest.mark.parametrize("m", [2, 20])
def test_fused_residual_and_activation(m):
    """act(X @ W + b + residual) with a run-time residual: a FusedGemm with has_residual."""
    rng = np.random.default_rng(10 + m)
    w, bias = _data(rng, (16, 24)), _data(rng, (24,))
    nodes = [helper.make_node("MatMul", ["X", "W"], ["h"]), helper.make_node("Add", ["h", "bias"], ["z"]),
             helper.make_node("Add", ["z", "R"], ["s"]), helper.make_node("LeakyRelu", ["s"], ["Y"], alpha=0.1)]
    model = _model(nodes, {"X": [m, 16], "R": [m, 24]}, {"Y": [m, 24]}, {"W": w, "bias": bias})
    family = "Gemm_gemv" if m <= gemm.GEMV_ROWS else "Gemm_tile"
    feeds = {"X": _data(rng, (m, 16)), "R": _data(rng, (m, 24))}
    schedule = assert_gpu_matches_ort(model, feeds, families=[family])
    assert len(schedule) == 1


def test_fused_batched_matmul_residual_sigmoid():
    """A batched run-time product (attention-like, Q @ K^T) with a residual and a Sigmoid epilogue."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Transpose", ["K"], ["kt"], perm=[0, 2, 1]), helper.make_node("MatMul", ["Q", "kt"], ["s"]),
             helper.make_node("Add", ["s", "R"], ["z"]), helper.make_node("Sigmoid", ["z"], ["Y"])]
    model = _model(nodes, {"Q": [2, 12, 8], "K": [2, 10, 8], "R": [2, 12, 10]}, {"Y": [2, 12, 10]}, {})
    feeds = {"Q": _data(rng, (2, 12, 8)), "K": _data(rng, (2, 10, 8)), "R": _data(rng, (2, 12, 10))}
    assert_gpu_matches_ort(model, feeds, families=["MatMul_tile"])


@pytest.fixture
def split_small(monkeypatch):
    """Split k on small products: a GPU of 64 SMs and splits of at least 16 values of k."""
    monkeypatch.setattr(gemm, "SMS", 64)
    monkeypatch.setattr(gemm, "MIN_SPLIT_K", 16)


def test_split_k_gemm_epilogue(split_small):
    """Split k, the second pass applying alpha, a run-time beta * C, a residual and an activation."""
    rng = np.random.default_rng(7)
    a, w, c, r = _data(rng, (20, 70)), _data(rng, (70, 24)), _data(rng, (1, 24)), _data(rng, (20, 24))
    nodes = [helper.make_node("Gemm", ["A", "W", "C"], ["g"], alpha=0.5, beta=2.0), helper.make_node("Add", ["g", "R"], ["s"]),
             helper.make_node("Relu", ["s"], ["Y"])]
    model = _model(nodes, {"A": [20, 70], "C": [1, 24], "R": [20, 24]}, {"Y": [20, 24]}, {"W": w})
    schedule = assert_gpu_matches_ort(model, {"A": a, "C": c, "R": r}, families=["Gemm_tile", "Gemm_splitk"])
    assert len(schedule) == 2


def test_split_k_batched_matmul(split_small):
    model, feeds = _matmul((2, 12, 50), (2, 50, 18), const_b=False, seed=8)
    assert_gpu_matches_ort(model, feeds, families=["MatMul_tile", "MatMul_splitk"])
