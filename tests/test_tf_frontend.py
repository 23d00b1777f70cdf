"""TensorFlow sources (cuvil/frontends/tensorflow.py): SavedModel folders, Keras .keras/.h5 files,
frozen GraphDef .pb files and in-memory keras.Model / tf.function / ConcreteFunction objects,
converted to ONNX by tf2onnx as a cached export step. TensorFlow's own outputs are the oracle.

Tolerance: every comparison is max|cuvil - tf| <= 1e-5 * max(|tf|, 1). Both engines compute in
float32 (unit roundoff u = 6e-8). The largest reduction here is a Dense over K = 8*8*8 = 512
inputs; a dot product's rounding error under a different summation order is about sqrt(K) * u *
sum|terms| ~ 1.4e-6 * sum|terms|, with sum|terms| of order max|output| for these seeded small
weights (glorot), so 1e-5 leaves about 7x margin. The recurrent models are contractions (sigmoid and
tanh have slopes <= 1 and the gates are < 1), so errors do not grow along the 10 steps. Softmax,
sigmoid and tanh in cuvil are polynomial approximations accurate to a few ulp: below the bound.
"""
import os

import numpy as np
import pytest

import cuvil
from cuvil.build import VariantSpec, build_variants
from cuvil.cache import Cache

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from cuvil.frontends.tensorflow import triton_first  # noqa: E402

triton_first()   # before TensorFlow: Triton imported after it crashes the process (docstring there)
tf = pytest.importorskip("tensorflow", reason="the TensorFlow frontend needs tensorflow (pip install 'cuvil[tf]')")
pytest.importorskip("tf2onnx", reason="the TensorFlow frontend needs tf2onnx (pip install 'cuvil[tf]')")
import keras  # noqa: E402

TOL = 1e-5  # derived in the module docstring


def _close(got, want, tol=TOL):
    want = np.asarray(want)
    assert got.shape == want.shape, f"shape {got.shape} vs {want.shape}"
    err = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    assert err <= tol * max(float(np.max(np.abs(want))), 1.0), f"max abs error {err:.3g}"


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _run_one(compiled, feeds):
    outputs = compiled.run(feeds)
    assert len(outputs) == 1, list(outputs)
    return next(iter(outputs.values()))


def _sequential_cnn():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((16, 16, 3), name="image"),
                             keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                             keras.layers.MaxPooling2D(),
                             keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                             keras.layers.AveragePooling2D(2), keras.layers.Flatten(),
                             keras.layers.Dense(10, activation="softmax")])


def _functional_cnn():
    keras.utils.set_random_seed(2)
    image = keras.Input((16, 16, 3), name="image")
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(image)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU(6.0)(h)
    branch = keras.layers.DepthwiseConv2D(3, padding="same", activation="sigmoid")(h)
    h = keras.layers.Add()([h, branch])
    h = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling2D()(h), keras.layers.GlobalMaxPooling2D()(h)])
    model = keras.Model(image, keras.layers.Dense(5, activation="tanh")(h))
    # non-trivial moving statistics, so the frozen BatchNormalization is not an identity
    bn = model.layers[2]
    bn.moving_mean.assign(_rand(8, seed=3) * 0.1)
    bn.moving_variance.assign(np.abs(_rand(8, seed=4)) + 0.5)
    return model


def _recurrent(layer):
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((10, 4), name="seq"), layer, keras.layers.Dense(3)])


def test_keras_sequential_cnn_from_keras_h5_savedmodel_and_object(tmp_path):
    model = _sequential_cnn()
    x = _rand(2, 16, 16, 3)
    want = model(x).numpy()
    model.save(tmp_path / "cnn.keras")
    model.save(tmp_path / "cnn.h5")
    model.export(str(tmp_path / "cnn_saved"), verbose=False)
    shapes = {"image": [2, 16, 16, 3]}
    for source in (tmp_path / "cnn.keras", tmp_path / "cnn.h5", tmp_path / "cnn_saved", model):
        compiled = cuvil.compile(source, input_shapes=shapes)
        assert compiled.input_names == ["image"] and compiled.output_names == ["output_0"], source
        _close(_run_one(compiled, {"image": x}), want)


def test_keras_functional_cnn_from_savedmodel(tmp_path):
    model = _functional_cnn()
    model.export(str(tmp_path / "saved"), verbose=False)
    x = _rand(1, 16, 16, 3, seed=5)
    compiled = cuvil.compile(tmp_path / "saved", input_shapes={"image": [1, 16, 16, 3]})
    _close(_run_one(compiled, {"image": x}), model(x).numpy())


def test_keras_lstm_from_keras_file_and_savedmodel(tmp_path):
    model = _recurrent(keras.layers.LSTM(8))
    x = _rand(2, 10, 4, seed=6)
    want = model(x).numpy()
    model.save(tmp_path / "lstm.keras")
    model.export(str(tmp_path / "lstm_saved"), verbose=False)
    for source in (tmp_path / "lstm.keras", tmp_path / "lstm_saved"):
        compiled = cuvil.compile(source, input_shapes={"seq": [2, 10, 4]})
        _close(_run_one(compiled, {"seq": x}), want)


@pytest.mark.slow  # keeps the default TF tests under a minute with a cold kernel cache
def test_keras_gru_returning_sequences_from_savedmodel(tmp_path):
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((10, 4), name="seq"), keras.layers.GRU(6, return_sequences=True)])
    model.export(str(tmp_path / "gru"), verbose=False)
    x = _rand(2, 10, 4, seed=7)
    compiled = cuvil.compile(tmp_path / "gru", input_shapes={"seq": [2, 10, 4]})
    _close(_run_one(compiled, {"seq": x}), model(x).numpy())


@pytest.mark.slow  # keeps the default TF tests under a minute with a cold kernel cache
def test_embedding_and_multi_head_attention_from_keras_object():
    keras.utils.set_random_seed(5)
    ids = keras.Input((12,), dtype="int32", name="ids")
    h = keras.layers.Embedding(50, 16)(ids)
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 8)(h, h))
    model = keras.Model(ids, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
    tokens = np.random.default_rng(8).integers(0, 50, (2, 12)).astype(np.int32)
    compiled = cuvil.compile(model, input_shapes={"ids": [2, 12]})
    _close(_run_one(compiled, {"ids": tokens}), model(tokens).numpy())


def test_two_input_two_output_functional_and_subclassed_keras_models():
    keras.utils.set_random_seed(7)
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Dense(8, activation="gelu")(keras.layers.Concatenate()([a, b]))
    model = keras.Model([a, b], [keras.layers.Dense(2)(h), keras.layers.Dense(3, activation="sigmoid")(h)])
    xa, xb = _rand(5, 6, seed=12), _rand(5, 4, seed=13)
    want = [t.numpy() for t in model([xa, xb])]
    # other names than the model's, as many: taken in order, and the library's inputs carry them
    compiled = cuvil.compile(model, input_shapes={"left": [5, 6], "right": [5, 4]})
    assert compiled.input_names == ["left", "right"] and compiled.output_names == ["output_0", "output_1"]
    got = compiled.run({"left": xa, "right": xb})
    _close(got["output_0"], want[0])
    _close(got["output_1"], want[1])

    class Residual(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(6, activation="tanh")

        def call(self, x):
            return x + self.dense(x)
    subclassed = Residual()
    want = subclassed(xa).numpy()
    _close(_run_one(cuvil.compile(subclassed, input_shapes={"x": [5, 6]}), {"x": xa}), want)


class _Control(tf.Module):
    """tf.cond on run-time data (both branches are computed, Where selects) and a tf.while_loop
    whose trip count is known once the loop is traced (unrolled)."""

    @tf.function(input_signature=[tf.TensorSpec([3, 4], tf.float32, name="x")])
    def __call__(self, x):
        y = tf.cond(tf.reduce_sum(x) > 0.0, lambda: x * 2.0, lambda: tf.abs(x) - 1.0)

        def body(i, y):
            return i + 1, tf.tanh(y) * 1.5 + tf.cast(i, tf.float32) * 0.1
        _, y = tf.while_loop(lambda i, y: i < 5, body, (tf.constant(0), y))
        return y


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_tf_function_with_cond_and_while_loop_from_function_savedmodel_and_frozen_pb(tmp_path, sign):
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    module = _Control()
    x = np.abs(_rand(3, 4, seed=9)) * sign   # the sign decides which branch tf.cond takes
    want = module(x).numpy()
    concrete = module.__call__.get_concrete_function()
    tf.saved_model.save(module, str(tmp_path / "control"), signatures=concrete)
    frozen = convert_variables_to_constants_v2(concrete).graph.as_graph_def()
    tf.io.write_graph(frozen, str(tmp_path), "control.pb", as_text=False)
    for source in (concrete, module.__call__, tmp_path / "control", tmp_path / "control.pb"):
        compiled = cuvil.compile(source, input_shapes={"x": [3, 4]})
        assert compiled.input_names == ["x"], source
        _close(_run_one(compiled, {"x": x}), want)


def test_export_step_is_cached_and_keyed_by_the_savedmodel_files(tmp_path):
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((6,), name="x"), keras.layers.Dense(4, activation="relu")])
    model.export(str(tmp_path / "dense"), verbose=False)
    x = _rand(3, 6, seed=10)
    spec = VariantSpec("dense", str(tmp_path / "dense"), {"x": [3, 6]})
    cache = Cache(tmp_path / "cache")
    arts, dag = build_variants([(spec, tmp_path / "out")], cache)
    assert {s["name"]: s["status"] for s in dag.report()["steps"]}["dense/native/export"] == "ran"
    lib = cuvil.load(arts[0].library)
    _close(lib.run({"x": x})["output_0"], model(x).numpy())
    _, dag = build_variants([(spec, tmp_path / "out")], cache)
    assert all(s["status"] == "cached" for s in dag.report()["steps"])
    # new weights in the variables files: the export runs again
    model.layers[0].kernel.assign(model.layers[0].kernel * 2.0)
    model.export(str(tmp_path / "dense"), verbose=False)
    # (another folder: the first library stays loaded in this process under its path)
    arts, dag = build_variants([(spec, tmp_path / "out2")], cache)
    assert {s["name"]: s["status"] for s in dag.report()["steps"]}["dense/native/export"] == "ran"
    _close(cuvil.load(arts[0].library).run({"x": x})["output_0"], model(x).numpy())


def test_savedmodel_source_and_signature_in_cuvil_yaml(tmp_path):
    from cuvil.config import load_config
    from cuvil.project import build_project
    module = _Control()
    tf.saved_model.save(module, str(tmp_path / "control"),
                        signatures={"predict": module.__call__.get_concrete_function()})
    (tmp_path / "cuvil.yaml").write_text("version: 1\nmodels:\n  - name: control\n    source: control\n"
                                         "    signature: predict\n")
    result = build_project(load_config(tmp_path / "cuvil.yaml"), progress=None)
    x = _rand(3, 4, seed=11)
    _close(cuvil.load(result.artifacts[0].library).run({"x": x})["output_0"], module(x).numpy())


def test_bad_tensorflow_sources_are_clear_errors(tmp_path):
    model = _recurrent(keras.layers.GRU(4))
    model.export(str(tmp_path / "saved"), verbose=False)
    with pytest.raises(cuvil.CuvilError, match="input seq has shape \\[\\?, 10, 4\\].*unknown dims"):
        cuvil.compile(tmp_path / "saved")
    with pytest.raises(cuvil.CuvilError, match="no signature 'predict'.*serving_default"):
        cuvil.compile(tmp_path / "saved", input_shapes={"seq": [1, 10, 4]}, signature="predict")
    with pytest.raises(cuvil.CuvilError, match="input seq has shape \\[\\?, 10, 4\\] in the model but \\[1, 9, 4\\]"):
        cuvil.compile(model, input_shapes={"seq": [1, 9, 4]})
    lgamma = tf.function(lambda x: tf.math.lgamma(x) * 2.0,
                         input_signature=[tf.TensorSpec([3], tf.float32, name="x")]).get_concrete_function()
    with pytest.raises(cuvil.CuvilError, match="no ONNX conversion \\(tf2onnx\\): Lgamma \\(node"):
        cuvil.compile(lgamma)
    (tmp_path / "empty").mkdir()
    with pytest.raises(cuvil.CuvilError, match="not a TensorFlow SavedModel"):
        cuvil.compile(tmp_path / "empty")
    (tmp_path / "junk.pb").write_bytes(b"\x08\x96\x01 not a graph")
    with pytest.raises(cuvil.CuvilError, match="junk.pb: not a frozen TensorFlow GraphDef"):
        cuvil.compile(tmp_path / "junk.pb")
    (tmp_path / "junk.keras").write_bytes(b"not a zip")
    with pytest.raises(cuvil.CuvilError, match="junk.keras: cannot be loaded as a Keras model"):
        cuvil.compile(tmp_path / "junk.keras")


def test_cuvil_yaml_source_must_be_a_model_file_or_a_savedmodel_folder(tmp_path):
    from cuvil.config import load_config
    from cuvil.errors import ConfigError
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "cuvil.yaml").write_text("version: 1\nmodels:\n  - name: m\n    source: not_a_model\n")
    with pytest.raises(ConfigError, match="cuvil.yaml:4:.*folder is not a TensorFlow SavedModel"):
        load_config(tmp_path / "cuvil.yaml")
    (tmp_path / "cuvil.yaml").write_text("version: 1\nmodels:\n  - name: m\n    source: model.tflite\n")
    with pytest.raises(ConfigError, match=r"must end in one of .*\.keras.*or be a TensorFlow SavedModel folder"):
        load_config(tmp_path / "cuvil.yaml")


def test_onnx_builds_do_not_import_tensorflow():
    """TensorFlow costs seconds to import: only a TensorFlow source may load it."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    code = ("import sys; from cuvil import pipeline; "
            "pipeline.import_any('examples/models/tiny_cnn.onnx', {'input': [1, 3, 32, 32]}); "
            "print(sorted(m for m in ('tensorflow', 'tf2onnx', 'keras') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


class _DataWhile(tf.Module):
    """A tf.while_loop whose condition reads the data: tf2onnx writes a Loop whose condition is known
    only at run time, which cuvil compiles as a loop (not unrolled)."""

    @tf.function(input_signature=[tf.TensorSpec([3, 4], tf.float32, name="x")])
    def __call__(self, x):
        def body(i, y):
            return i + 1, y * 1.25 + 0.5
        _, y = tf.while_loop(lambda i, y: tf.reduce_sum(y) < 200.0, body, (tf.constant(0), x))
        return y


def test_tf_while_loop_on_run_time_data_is_compiled_as_a_loop():
    module = _DataWhile()
    compiled = cuvil.compile(module.__call__.get_concrete_function(), input_shapes={"x": [3, 4]})
    for scale in (0.1, 1.0, 5.0, 40.0):   # 0..15 iterations: one library
        x = np.abs(_rand(3, 4, seed=4)) * scale
        _close(_run_one(compiled, {"x": x}), module(x).numpy())
