"""TfIdfVectorizer (backends/numba_cpu/tfidf.py) against onnxruntime: counts are exact small integers
in float32, and the weights multiply them once, so the results are compared exactly (IDF, TFIDF)."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import cuvil

POOL = dict(ngram_counts=[0, 4], ngram_indexes=[0, 1, 2, 3, 4, 5, 6],
            pool_int64s=[2, 3, 5, 4, 5, 6, 7, 8, 6, 7])  # unigrams 2 3 5 4, bigrams (5,6) (7,8) (6,7)


@pytest.mark.parametrize("mode, weights", [("TF", None), ("IDF", None), ("IDF", [0.5, 1, 2, 3, 4, 5, 6]),
                                           ("TFIDF", [0.5, 1, 2, 3, 4, 5, 6])])
@pytest.mark.parametrize("lengths, skip, shape", [((1, 1), 0, [2, 6]), ((2, 2), 0, [12]), ((1, 2), 3, [2, 6]),
                                                  ((2, 2), 5, [2, 6])])
def test_tfidf_vectorizer(mode, weights, lengths, skip, shape):
    attrs = dict(POOL, mode=mode, min_gram_length=lengths[0], max_gram_length=lengths[1], max_skip_count=skip)
    if weights:
        attrs["weights"] = weights
    graph = helper.make_graph([helper.make_node("TfIdfVectorizer", ["x"], ["y"], **attrs)], "tfidf",
                              [helper.make_tensor_value_info("x", TensorProto.INT32, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = np.array([1, 1, 3, 3, 3, 7, 8, 6, 7, 5, 6, 8], np.int32).reshape(shape)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = cuvil.compile(model).run({"x": x})["y"]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
