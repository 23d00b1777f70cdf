"""The zoo builds for the CUDA targets: every model's kernels compile to PTX that ptxas accepts
for sm_80 and sm_90, and the small models' whole schedules run in the CUDA simulator against
onnxruntime. Small versions of each model run by default; the full-size zoo is -m slow."""
from __future__ import annotations

import numpy as np
import pytest

import cuvil

from tests import zoo
from tests.cuda_check import assert_gpu_matches_ort

SMALL = {
    "mlp": lambda: (zoo.mlp((32, 64, 16)), {"x": (1, 32)}, ()),
    "resnet": lambda: (zoo.resnet((1, 1, 1, 1), width=8, num_classes=10), {"input": (1, 3, 32, 32)}, ()),
    "resnet_bottleneck": lambda: (zoo.resnet((1, 1, 1, 1), bottleneck=True, width=8, num_classes=10),
                                  {"input": (1, 3, 32, 32)}, ()),
    "mobilenet_v2": lambda: (zoo.mobilenet_v2(width_mult=0.25, num_classes=10), {"input": (1, 3, 32, 32)}, ()),
    "bert": lambda: (zoo.bert_encoder(layers=1, d=32, heads=2, ff=64, seq=8), {"ids": (1, 8), "mask": (1, 8)},
                     ("ids",)),
    "gpt2_block": lambda: (zoo.gpt2_block(d=32, heads=2, seq=8), {"x": (1, 8, 32)}, ()),
    "lstm": lambda: (zoo.lstm_model(inp=8, hidden=16, layers=2), {"x": (1, 6, 8)}, ()),
    "gru": lambda: (zoo.gru_model(inp=8, hidden=16), {"x": (2, 5, 8)}, ()),
}
# Whole models in the simulator (a Python thread per CUDA thread): the ones small enough (the
# encoder's: tests/test_cuda_rows.py test_bert_encoder_attention).
SIMULATED = ("mlp", "gpt2_block", "lstm", "gru")


def _feeds(shapes, ints):
    rng = np.random.default_rng(1)
    return {k: (rng.integers(0, 50, size=s).astype(np.int64) if k in ints else
                np.ones(s, np.float32) if k == "mask" else rng.standard_normal(s).astype(np.float32))
            for k, s in shapes.items()}


# The default run keeps one convolutional and one attention model and one simulated recurrence;
# the others take 10-40 s each in the simulator/ptxas and run with -m slow.
DEFAULT_SMALL = ("bert", "gru", "mlp", "resnet")


@pytest.mark.parametrize("name", [n if n in DEFAULT_SMALL else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(SMALL)])
def test_small_zoo_model_for_both_architectures(name, tmp_path):
    module, shapes, ints = SMALL[name]()
    model = zoo.export(module, shapes, int_inputs=ints)
    if name in SIMULATED:
        assert_gpu_matches_ort(model, _feeds(shapes, ints), ptx=False)
    for arch in ("cuda-sm80", "cuda-sm90"):
        compiled = cuvil.compile(model, input_shapes={k: list(v) for k, v in shapes.items()}, target=arch,
                                 cache_dir=tmp_path / "cache", jobs=2, name=name)
        assert compiled.info["target"] == arch and compiled.info["kernels"] > 0


FULL = {
    "resnet18": lambda: (zoo.resnet((2, 2, 2, 2)), {"input": (1, 3, 224, 224)}, ()),
    "resnet50": lambda: (zoo.resnet((3, 4, 6, 3), bottleneck=True), {"input": (1, 3, 224, 224)}, ()),
    "mobilenet_v2": lambda: (zoo.mobilenet_v2(), {"input": (1, 3, 224, 224)}, ()),
    "bert": lambda: (zoo.bert_encoder(layers=2, d=256, heads=4, ff=1024, vocab=1000, seq=128),
                     {"ids": (1, 128), "mask": (1, 128)}, ("ids",)),
    "lstm": lambda: (zoo.lstm_model(inp=64, hidden=128), {"x": (1, 32, 64)}, ()),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FULL))
def test_full_zoo_model_builds_deterministically(name, tmp_path):
    _assert_builds_twice_identically(name, "fp32", tmp_path)


def _assert_builds_twice_identically(name, precision, tmp_path):
    """The full-size model built twice from empty caches, for both architectures: the same bytes."""
    module, shapes, ints = FULL[name]()
    model = zoo.export(module, shapes, int_inputs=ints)
    for arch in ("cuda-sm80", "cuda-sm90"):
        libs = []
        for attempt in (1, 2):
            compiled = cuvil.compile(model, input_shapes={k: list(v) for k, v in shapes.items()}, target=arch,
                                     precision=precision, cache_dir=tmp_path / f"cache{attempt}", jobs=2, name=name)
            libs.append(compiled.artifacts.library.read_bytes())
        assert libs[0] == libs[1], arch


# bf16 / fp16 (docs/cuda.md): the models whose work is weight products (Gemm / MatMul / Conv on tensor
# cores). The MLP runs in the simulator against onnxruntime's float32 within the bound carried through
# its layers (cuda_check.sequential_bound). By default the MLP in bf16 (24 s); the rest -m slow (the small
# ResNet took 190 s on a loaded 2-core machine; conv_tc's kernels have their own default tests).
LOWP = ("mlp", "resnet", "resnet_bottleneck", "mobilenet_v2", "bert")
DEFAULT_LOWP = (("mlp", "bf16"),)


@pytest.mark.parametrize("name,precision", [
    (n, p) if (n, p) in DEFAULT_LOWP else pytest.param(n, p, marks=pytest.mark.slow)
    for n in LOWP for p in ("bf16", "fp16")])
def test_small_zoo_model_in_16_bits_for_both_architectures(name, precision, tmp_path):
    module, shapes, ints = SMALL[name]()
    model = zoo.export(module, shapes, int_inputs=ints)
    feeds = _feeds(shapes, ints)
    if name == "mlp":
        _simulated_mlp_within_bound(model, module, feeds, precision)
    for arch in ("cuda-sm80", "cuda-sm90"):
        compiled = cuvil.compile(model, input_shapes={k: list(v) for k, v in shapes.items()}, target=arch,
                                 precision=precision, cache_dir=tmp_path / "cache", jobs=2, name=name)
        assert compiled.info["precision"] == precision and compiled.info["kernels"] > 0


def _simulated_mlp_within_bound(model, module, feeds, precision):
    from backends.numba_cuda.registry import lower
    from backends.numba_cuda.simulate import simulate_schedule
    from backends.schedule import kernel_calls
    from cuvil import pipeline
    from tests.cuda_check import ort_outputs, sequential_bound
    graph = pipeline.import_model(model, {k: list(v.shape) for k, v in feeds.items()})
    names, options = pipeline.pass_list(2, precision=precision, gpu=True)
    graph = pipeline.run_passes(graph, names, options)
    schedule = lower(graph)
    calls = kernel_calls(schedule)
    assert calls and all(c.precision.startswith(precision) for c in calls), [c.precision for c in calls]
    got = simulate_schedule(graph, schedule, feeds)
    (name, want), = ort_outputs(model, feeds).items()
    _, bound = sequential_bound(module, feeds["x"], precision)
    err = np.abs(got[name].astype(np.float64) - want)
    assert np.all(err <= bound), f"max error {err.max():.3g}, worst ratio to the bound {np.max(err / bound):.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["bert", "mobilenet_v2", "resnet18", "resnet50"])
def test_full_zoo_model_in_16_bits_builds_deterministically(name, precision, tmp_path):
    _assert_builds_twice_identically(name, precision, tmp_path)
