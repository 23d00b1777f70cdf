"""MaxPool / AveragePool GPU kernels (backends/numba_cuda/pool.py) in the CUDA simulator against
onnxruntime, and through ptxas for sm_90 (tests/test_cuda_zoo.py builds sm_80 too)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.cuda_check import assert_gpu_matches_ort
from tests.helpers import make_model


def pool_model(op, x_shape, y_shape, **attrs):
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    return make_model([node], [("x", TensorProto.FLOAT, list(x_shape))], [("y", TensorProto.FLOAT, list(y_shape))])


CASES = [
    ("MaxPool", (1, 3, 9, 9), (1, 3, 5, 5), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("MaxPool", (2, 2, 8, 8), (2, 2, 4, 4), dict(kernel_shape=[2, 2], strides=[2, 2])),
    ("MaxPool", (1, 2, 7, 7), (1, 2, 4, 4), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ("MaxPool", (1, 2, 8, 8), (1, 2, 6, 6), dict(kernel_shape=[2, 2], dilations=[2, 2], pads=[1, 1, 0, 0])),
    ("MaxPool", (1, 2, 10), (1, 2, 5), dict(kernel_shape=[3], strides=[2], auto_pad="SAME_UPPER")),
    ("AveragePool", (1, 3, 9, 9), (1, 3, 5, 5), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("AveragePool", (1, 3, 9, 9), (1, 3, 5, 5), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                                                      count_include_pad=1)),
    ("AveragePool", (1, 2, 4, 6, 6), (1, 2, 2, 3, 3), dict(kernel_shape=[2, 2, 2], strides=[2, 2, 2])),
]


@pytest.mark.parametrize("op, x_shape, y_shape, attrs", CASES)
def test_pool(op, x_shape, y_shape, attrs):
    x = np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)
    assert_gpu_matches_ort(pool_model(op, x_shape, y_shape, **attrs), {"x": x}, families=[op])
