"""Data-dependent output shapes (NonZero, Unique, NonMaxSuppression, Compress): upper-bound buffers,
the actual shape through session_output_shape, compared with onnxruntime (exact: integer outputs and
copied floats, no arithmetic)."""
from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import cuvil
from cuvil.errors import UnsupportedOpError


def _model(nodes, inputs, outputs, opset=17):
    graph = helper.make_graph(nodes, "dynamic", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _out(name, elem=TensorProto.INT64):
    return helper.make_tensor_value_info(name, elem, None)


def _check(model, feeds, threads=1):
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    compiled = cuvil.compile(model, threads=threads)
    got = compiled.run(feeds)
    for name, want in zip([o.name for o in model.graph.output], expected):
        assert got[name].shape == want.shape, name
        assert got[name].dtype == want.dtype, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    return compiled


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_nonzero(dtype):
    x = helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), [3, 4, 5])
    model = _model([helper.make_node("NonZero", ["x"], ["y"])], [x], [_out("y")])
    rng = np.random.default_rng(0)
    compiled = None
    for density in (0.0, 0.3, 1.0):  # one library: every run has its own count
        data = (rng.random((3, 4, 5)) < density).astype(dtype) * (rng.integers(1, 5, (3, 4, 5)).astype(dtype))
        expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": data})[0]
        compiled = compiled or cuvil.compile(model)
        got = compiled.run({"x": data})["y"]
        assert got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    assert compiled.info["outputs"][0]["dynamic"] is True
    assert compiled.info["outputs"][0]["shape"] == [3, 60]  # the upper bound


@pytest.mark.parametrize("is_sorted", [0, 1])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_unique(is_sorted, axis):
    attrs = {"sorted": is_sorted} if axis is None else {"sorted": is_sorted, "axis": axis}
    node = helper.make_node("Unique", ["x"], ["y", "indices", "inverse", "counts"], **attrs)
    model = _model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
                   [_out("y", TensorProto.FLOAT), _out("indices"), _out("inverse"), _out("counts")])
    rng = np.random.default_rng(1)
    x = rng.integers(0, 3, (4, 6)).astype(np.float32)
    x[2] = x[0]          # a repeated row and column for the axis cases
    x[:, 4] = x[:, 1]
    _check(model, {"x": x})


def test_unique_some_outputs_omitted():
    node = helper.make_node("Unique", ["x"], ["y", "", "", "counts"], sorted=1)
    model = _model([node], [helper.make_tensor_value_info("x", TensorProto.INT64, [10])],
                   [_out("y"), _out("counts")])
    _check(model, {"x": np.array([5, 3, 5, 1, 1, 1, 9, 3, 0, 5], np.int64)})


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_compress_runtime_condition(axis, threads):
    attrs = {} if axis is None else {"axis": axis}
    model = _model([helper.make_node("Compress", ["x", "cond"], ["y"], **attrs)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 3]),
                    helper.make_tensor_value_info("cond", TensorProto.BOOL, [3])],
                   [_out("y", TensorProto.FLOAT)])
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    compiled = None
    for cond in ([True, False, True], [False, False, False], [True, True, True]):
        feeds = {"x": x, "cond": np.array(cond)}
        expected = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
        compiled = compiled or cuvil.compile(model, threads=threads)
        got = compiled.run(feeds)["y"]
        assert got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


def _nms_model(center_point_box=0):
    node = helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "score_t"], ["selected"],
                            center_point_box=center_point_box)
    return _model([node], [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [2, 20, 4]),
                           helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 3, 20]),
                           helper.make_tensor_value_info("max_out", TensorProto.INT64, [1]),
                           helper.make_tensor_value_info("iou", TensorProto.FLOAT, [1]),
                           helper.make_tensor_value_info("score_t", TensorProto.FLOAT, [1])],
                  [_out("selected")])


@pytest.mark.parametrize("center_point_box", [0, 1])
def test_non_max_suppression(center_point_box):
    rng = np.random.default_rng(2)
    corner = rng.random((2, 20, 2)).astype(np.float32) * 10
    size = rng.random((2, 20, 2)).astype(np.float32) * 4 + 0.5
    boxes = np.concatenate([corner, corner + size], -1) if not center_point_box else np.concatenate([corner, size], -1)
    scores = rng.permutation(2 * 3 * 20).reshape(2, 3, 20).astype(np.float32) / 120  # distinct: no ties
    model = _nms_model(center_point_box)
    compiled = None
    for max_out, iou, score_t in ((5, 0.3, 0.2), (20, 0.5, 0.0), (0, 0.5, 0.0), (3, 0.0, 0.9)):
        feeds = {"boxes": boxes, "scores": scores, "max_out": np.array([max_out], np.int64),
                 "iou": np.array([iou], np.float32), "score_t": np.array([score_t], np.float32)}
        expected = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
        compiled = compiled or cuvil.compile(model)
        got = compiled.run(feeds)["selected"]
        assert got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


def test_session_output_shape_through_the_c_abi(tmp_path):
    """The C ABI on its own: outputs[0] holds the upper bound; session_output_shape gives the shape
    of the last run (and the static shape of a static output); NULL out of range."""
    model = _model([helper.make_node("NonZero", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["z"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], [_out("y"), _out("z", TensorProto.FLOAT)])
    compiled = cuvil.compile(model)
    path = compiled.save(tmp_path / "nonzero")
    headers = list(path.parent.glob("*.h"))
    assert len(headers) == 1 and "session_output_shape" in headers[0].read_text()
    lib = ctypes.CDLL(str(path))
    prefix = compiled.prefix
    create, run, shape_of, destroy = (getattr(lib, prefix + n) for n in
                                      ("session_create", "session_run", "session_output_shape", "session_destroy"))
    create.restype = ctypes.c_void_p
    run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    shape_of.restype, shape_of.argtypes = ctypes.POINTER(ctypes.c_int64), [ctypes.c_void_p, ctypes.c_int]
    destroy.argtypes = [ctypes.c_void_p]
    session = create()
    x = np.array([[0, 2, 0], [4, 0, 6]], np.float32)
    y, z = np.full(2 * 6, -1, np.int64), np.empty((2, 3), np.float32)
    ins = (ctypes.c_void_p * 1)(x.ctypes.data)
    outs = (ctypes.c_void_p * 2)(y.ctypes.data, z.ctypes.data)
    assert run(session, ins, outs) == 0
    dims = shape_of(session, 0)
    assert (dims[0], dims[1]) == (2, 3)
    np.testing.assert_array_equal(y[:6].reshape(2, 3), np.stack(np.nonzero(x)))
    static = shape_of(session, 1)
    assert (static[0], static[1]) == (2, 3)
    assert not shape_of(session, 2)
    destroy(session)


def test_a_consumer_of_a_data_dependent_shape_is_a_clear_error():
    model = _model([helper.make_node("NonZero", ["x"], ["y"]), helper.make_node("Neg", ["y"], ["z"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], [_out("z")])
    with pytest.raises(UnsupportedOpError, match="depends on the data"):
        cuvil.compile(model)
