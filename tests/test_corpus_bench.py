"""benchmarks/corpus.py without timing: the corpus's size, the shape classes of its per-op
accounting, the mapping of profiled node names to the exported model's nodes, and (slow) that
every model of the corpus exports and runs in onnxruntime."""
import numpy as np
import onnx
import pytest
from onnx import helper

from benchmarks import corpus
from benchmarks.corpus_models import CORPUS, QUICK
from tests.helpers import make_model, rand


def test_corpus_size():
    assert len(CORPUS) >= 25
    assert set(QUICK) <= set(CORPUS)
    assert all(big > 1 for _, big in CORPUS.values())


def _model():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="stft", strides=[128]),
             helper.make_node("Relu", ["c"], ["r"], name="act"),
             helper.make_node("Conv", ["img", "pw"], ["p"], name="patch", strides=[16, 16]),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "m"], ["y"], name="proj")]
    inits = {"w": rand(258, 1, 256), "pw": rand(8, 3, 16, 16), "m": rand(8 * 4, 10)}
    return make_model(nodes, [("x", np.float32, [1, 1, 1024]), ("img", np.float32, [1, 3, 32, 32])],
                      [("r", np.float32, None), ("y", np.float32, None)], inits)


def test_shape_classes_and_names(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_model(), path)
    classes, producers = corpus.onnx_classes(path, {"x": (1, 1, 1024), "img": (1, 3, 32, 32)})
    assert classes["stft"] == ("Conv", "1d k256 s128 cin<8 out<=16")
    assert classes["patch"] == ("Conv", "2d patch16x16 s16 cin<8 out<=16")
    assert classes["proj"] == ("MatMul", "x@W M<=16 N%16")
    resolve = lambda name, op: corpus.resolve(name, op, classes, producers)
    assert resolve("proj/MatMulAddFusion", "Gemm") == classes["proj"]       # onnxruntime's fused names
    assert resolve("r_nchwc", "Conv") == classes["stft"]                   # NCHWc: the conv the Relu joined
    assert resolve("act", "Relu") == classes["act"]
    assert resolve("ReorderOutput", "ReorderOutput") is None               # onnxruntime's own nodes


@pytest.mark.slow
def test_every_corpus_model_exports_and_runs(tmp_path):
    import onnxruntime as ort
    for name in CORPUS:
        path = tmp_path / f"{name}.onnx"
        shapes = corpus.export(name, 1, path)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        out = sess.run(None, {k: rand(*s) for k, s in shapes.items()})[0]
        assert np.isfinite(out).all(), name


def test_profile_scaling_table(capsys):
    """benchmarks/profile.py's thread-scaling table on given profiles (no timing): per-step minima
    and the ms each step loses against perfect scaling, worst first."""
    from benchmarks import profile
    one = [(0, 1.0, "Conv", "a"), (1, 0.4, "Concat", "b")]
    assert profile._minima(one, [(0, 0.8, "Conv", "a"), (1, 0.5, "Concat", "b")]) == \
        [(0, 0.8, "Conv", "a"), (1, 0.4, "Concat", "b")]
    two = [(0, 0.5, "Conv", "a"), (1, 0.4, "Concat", "b")]     # the Conv scales, the Concat does not
    profile._print_scaling("m", [1, 2], {1: (1.4, one), 2: (0.9, two)}, "test", 5)
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(("#", " step"))]
    assert lines[0].split()[-2:] == ["Concat", "b"] and float(lines[0].split()[-3]) == pytest.approx(0.2)
    assert float(lines[1].split()[-3]) == pytest.approx(0.0)
