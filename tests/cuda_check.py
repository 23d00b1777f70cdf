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
