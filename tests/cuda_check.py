"""Checks of GPU kernels without a GPU: numerics in Numba's CUDA simulator against onnxruntime,
and PTX + ptxas for every distinct kernel, for each architecture."""
from __future__ import annotations

import numpy as np
import onnx

from cuvil import pipeline

# The family tests assemble each kernel for sm_90 (NVVM's PTX per kernel is most of a test's
# time); tests/test_cuda_zoo.py builds every zoo model for both sm_80 and sm_90.
ARCHS = ("cuda-sm90",)


def gpu_graph(model: onnx.ModelProto, shapes: dict, opt_level: int = 2):
    graph = pipeline.import_model(model, shapes)
    names, options = pipeline.pass_list(opt_level, gpu=True)
    return pipeline.run_passes(graph, names, options)


def gpu_schedule(graph):
    from backends.numba_cuda.registry import lower
    return lower(graph)


def ort_outputs(model: onnx.ModelProto, feeds: dict) -> dict:
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def assert_gpu_matches_ort(model: onnx.ModelProto, feeds: dict, tol: float = 1e-4, opt_level: int = 2,
                           families=None, ptx: bool = True) -> list:
    """Simulated GPU outputs equal onnxruntime's within `tol` (max abs error relative to
    max(1, max |reference|)); every kernel compiles to PTX that ptxas accepts for ARCHS.
    `families`: kernel families the schedule must use (so a test checks the GPU generator it
    means to, not a portable fallback). Returns the schedule."""
    from backends.numba_cuda.simulate import simulate_schedule
    from backends.schedule import kernel_calls
    shapes = {k: list(np.shape(v)) for k, v in feeds.items()}
    graph = gpu_graph(model, shapes, opt_level)
    schedule = gpu_schedule(graph)
    used = {c.kernel.family for c in kernel_calls(schedule)}
    for family in families or ():
        assert family in used, f"kernel family {family} not used; the schedule has {sorted(used)}"
    got = simulate_schedule(graph, schedule, feeds)
    want = ort_outputs(model, feeds)
    for name, ref in want.items():
        out = got[name]
        assert out.shape == ref.shape, (name, out.shape, ref.shape)
        if ref.dtype.kind == "f":
            err = float(np.max(np.abs(out.astype(np.float64) - ref))) if ref.size else 0.0
            scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
            assert err <= tol * scale, f"{name}: max abs error {err:.3g} > {tol} x {scale:.3g}"
        else:
            np.testing.assert_array_equal(out, ref)
    if ptx:
        assert_ptx(schedule)
    return schedule


def assert_ptx(schedule, archs=ARCHS) -> None:
    """Every distinct kernel compiles to PTX and ptxas accepts it for each architecture."""
    from backends.numba_cuda.emit import kernel_ptx, ptxas
    from backends.schedule import kernel_calls
    from backends.targets import resolve_target
    kernels = {c.kernel.symbol: c.kernel for c in kernel_calls(schedule)}
    for arch in archs:
        target = resolve_target(arch)
        for kernel in kernels.values():
            assert ptxas(kernel_ptx(kernel, target.cc), target.arch)


# -- reduced precision (bf16 / fp16 weight products: backends/numba_cuda/gemm_tc.py) -------------

LOWP_U = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}   # unit roundoff of the 16-bit operand formats
# Half the spacing of the formats' subnormals: below the normal range a rounding is off by this
# much, not by u relative (bf16 has float32's exponent range: negligible; fp16 below 2^-14).
LOWP_ETA = {"bf16": 2.0 ** -134, "fp16": 2.0 ** -25}
U_ACC = 2.0 ** -23      # float32 sums, twice round-to-nearest's 2^-24: a tensor core may truncate


def product_bound(a_abs, w_abs, rest_abs, precision: str):
    """Per output element, the largest |y - y_ort| of act(a @ w + rest) computed with a and w rounded
    to `precision` and float32 sums. A rounding is r(x) = x (1 + d) + e, |d| <= u, |e| <= eta (e only
    below the normal range), so a product is off by at most (2u + u^2) |a||w| + eta (1 + u)(|a| + |w|)
    + eta^2 and is exact in float32; the float32 sum of K + 2 terms is within 1.01 (K + 2) u_acc of
    their magnitudes, here and in onnxruntime. A 1-Lipschitz activation (Relu) keeps the bound.
    docs/cuda.md derives it."""
    a_abs, w_abs = np.asarray(a_abs, np.float64), np.asarray(w_abs, np.float64)
    return bound_of_sums(a_abs @ w_abs, a_abs.sum(axis=-1, keepdims=True) + w_abs.sum(axis=0), w_abs.shape[0],
                         rest_abs, precision)


def bound_of_sums(S, operand_sums, K: int, rest_abs, precision: str):
    """product_bound from its sums: S = sum_k |a||w| and operand_sums = sum_k |a| + |w| of each output
    (a convolution's: the window's and the filter's), K products each."""
    u, eta = LOWP_U[precision], LOWP_ETA[precision]
    underflow = eta * (1 + u) * operand_sums + K * eta * eta
    return (2 * u + u * u) * S + underflow + 2.02 * (K + 2) * U_ACC * (1 + u) ** 2 * (S + rest_abs)


def sequential_bound(module, x, precision: str):
    """product_bound carried through a torch nn.Sequential of Linear and ReLU layers (zoo.mlp): the
    error e of a layer's input adds e |W| to its output's, and its magnitude |h| + e is what is
    rounded. Returns (float64 reference output, bound)."""
    import torch
    h = np.asarray(x, np.float64)
    e = np.zeros_like(h)
    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            w = layer.weight.detach().numpy().astype(np.float64).T
            b = layer.bias.detach().numpy().astype(np.float64) if layer.bias is not None else 0.0
            e = product_bound(np.abs(h) + e, np.abs(w), np.abs(b), precision) + e @ np.abs(w)
            h = h @ w + b
        elif isinstance(layer, torch.nn.ReLU):
            h = np.maximum(h, 0)
        else:
            raise TypeError(f"sequential_bound: no bound for {type(layer).__name__}")
    return h, e
