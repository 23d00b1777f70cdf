"""ONNX's backend node tests through cuvil.backend (STYLE.md principle 5:
conformance is measured, and the exclude list is the honest record).

- `test_node_sample`: a fixed sample of core-op-set tests that pass, in the
  default (fast) suite.
- `test_node` (slow): every node test onnx generates. A test in EXCLUDE is
  expected to fail for the reason given (strict: once it passes, take it off
  the list), and to fail with a CuvilError or an OutputMismatch: any other
  exception (AssertionError, KeyError, a numpy error...) escaping cuvil is a bug
  and fails the test. `python scripts/conformance.py` runs the same tests in
  parallel, writes docs/conformance.md and prints this table (`--exclude-block`)
  and the tests that raised an internal exception.
- `test_former_internal_exceptions`: node tests that once crashed the compiler with
  an internal exception, in the default suite: each passes or raises a CuvilError.
"""
import pytest

from cuvil.backend import OutputMismatch, internal_exception, load_node_tests, run_node_test
from cuvil.errors import CuvilError

# Passing core-op-set tests of the default suite, a few per op (the ops other
# engineers are still landing are left out of the sample).
FAST_SAMPLE = [
    'test_add', 'test_add_int16', 'test_and2d', 'test_and4d', 'test_argmax_default_axis_example',
    'test_argmax_keepdims_example_select_last_index', 'test_averagepool_1d_default',
    'test_averagepool_2d_pads_count_include_pad', 'test_batchnorm_epsilon', 'test_batchnorm_example',
    'test_cast_DOUBLE_to_FLOAT', 'test_cast_FLOAT16_to_DOUBLE', 'test_clip', 'test_clip_default_int8_min_expanded',
    'test_concat_1d_axis_0', 'test_concat_2d_axis_negative_1', 'test_constant_pad', 'test_constantofshape_float_ones',
    'test_constantofshape_int_shape_zero', 'test_cumsum_1d', 'test_cumsum_1d_reverse', 'test_div', 'test_div_int16',
    'test_einsum_batch_diagonal', 'test_einsum_inner_prod', 'test_equal', 'test_equal_int16', 'test_erf', 'test_exp',
    'test_exp_example', 'test_expand_dim_changed', 'test_expand_dim_unchanged', 'test_flatten_axis0',
    'test_flatten_axis3', 'test_gather_0', 'test_gather_1', 'test_gemm_all_attributes',
    'test_gemm_default_matrix_bias', 'test_globalaveragepool', 'test_globalaveragepool_precomputed', 'test_greater',
    'test_greater_int16', 'test_hardsigmoid', 'test_hardsigmoid_default_expanded_ver18', 'test_hardswish',
    'test_hardswish_expanded', 'test_leakyrelu', 'test_leakyrelu_default_expanded', 'test_less', 'test_less_int16',
    'test_matmul_1d_1d', 'test_matmul_2d', 'test_max_example', 'test_max_int16', 'test_maxpool_1d_default',
    'test_min_example', 'test_mul', 'test_neg', 'test_not_2d', 'test_pow', 'test_range_bfloat16_type_positive_delta',
    'test_reduce_max_bool_inputs', 'test_reduce_mean_default_axes_keepdims_example',
    'test_reduce_sum_default_axes_keepdims_example', 'test_relu', 'test_reshape_allowzero_reordered',
    'test_resize_downsample_scales_cubic', 'test_shape', 'test_sigmoid', 'test_slice', 'test_softmax_axis_0',
    'test_split_1d_uneven_split_opset18', 'test_sqrt', 'test_squeeze', 'test_sub', 'test_tanh', 'test_top_k',
    'test_transpose_all_permutations_0', 'test_unsqueeze_axis_0', 'test_where_example',
]

EXCLUDE = {
    # Reduced-precision attention (all 12 of Attention's failing tests: 6 cases and their _expanded
    # forms, which fail identically): cuvil computes the products and the softmax in float32 and rounds once;
    # onnx's reference, which made the expected outputs, rounds to bfloat16/float16 after every op
    # (Q * sqrt(scale), K * sqrt(scale), the product, the mask add, exp, sum, divide). 23-78 of 192
    # elements differ, by at most 2 ulps of the output dtype, above the tests' rtol 1e-3. Against a
    # float64 evaluation of the same inputs cuvil is the closer one (4d_causal_bf16: max error 3.4e-3
    # vs the expected output's 4.4e-3; 4d_causal_fp16: 4.0e-4 vs 4.9e-4; 3d_causal_bf16: 2.9e-3 vs
    # 3.6e-3). Attention's other float16 tests (4d_fp16, gqa fp16: 6 with _expanded) pass.
    'OutputMismatch: bfloat16/float16 attention, at most 2 ulps from the per-op-rounded reference': [
        'test_attention_3d_causal_bf16', 'test_attention_3d_causal_bf16_expanded',
        'test_attention_4d_attn_mask_causal_bf16', 'test_attention_4d_attn_mask_causal_bf16_expanded',
        'test_attention_4d_causal_bf16', 'test_attention_4d_causal_bf16_expanded',
        'test_attention_4d_causal_padded_kv_bf16', 'test_attention_4d_causal_padded_kv_bf16_expanded',
        'test_attention_4d_padded_kv_bf16', 'test_attention_4d_padded_kv_bf16_expanded',
        'test_attention_4d_causal_fp16', 'test_attention_4d_causal_fp16_expanded',
    ],
    # onnxruntime (the oracle) scatters the indices into output_shape, as cuvil does; the reference
    # evaluator, which made the expected output, scatters into the inferred shape and pads
    'OutputMismatch: MaxUnpool output_shape (onnxruntime agrees with cuvil)': [
        'test_maxunpool_export_with_output_shape',
    ],
    "ShapeError: the shape of output '…' cannot be inferred statically": [
        'op:ImageDecoder',
    ],
}


# Node tests that crashed the compiler with an internal exception (issue 24): an inlined Scan body
# with two unnamed MatMuls ("value ... has no storage"), an If nested in an If branch (KeyError),
# bfloat16 reductions (ValueError from np.iinfo), sequence inputs and outputs.
FORMER_INTERNAL_EXCEPTIONS = [
    'test_linear_attention_linear', 'test_linear_attention_gated_delta_gqa', 'test_affine_grid_2d_expanded',
    'test_affine_grid_3d_align_corners_expanded', 'test_attention_4d_attn_mask_causal_bf16', 'test_if_opt',
    'test_if_seq', 'test_sequence_map_add_2_sequences',
]


def _reason(name: str, op: str) -> str | None:
    for reason, entries in EXCLUDE.items():
        if name in entries or f"op:{op}" in entries:
            return reason
    return None


CASES = {case.name: (case, op) for case, op in load_node_tests()}


@pytest.mark.parametrize("name", FAST_SAMPLE)
def test_node_sample(name):
    run_node_test(CASES[name][0])


def _all_params():
    params = []
    for name, (_, op) in CASES.items():
        reason = _reason(name, op)
        marks = [pytest.mark.xfail(reason=reason, strict=True, raises=(CuvilError, OutputMismatch))] if reason else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("name", _all_params())
def test_node(name):
    run_node_test(CASES[name][0])


@pytest.mark.parametrize("name", FORMER_INTERNAL_EXCEPTIONS)
def test_former_internal_exceptions(name):
    try:
        run_node_test(CASES[name][0])
    except Exception as exc:  # noqa: BLE001 - the point is which exceptions escape
        assert not internal_exception(exc), f"{type(exc).__name__} escaped cuvil: {exc}"
        assert _reason(name, CASES[name][1]) is not None, f"{name} fails ({exc}) but is not in EXCLUDE"


def test_exclude_entries_name_real_tests_and_ops():
    ops = {op for _, op in CASES.values()}
    for reason, entries in EXCLUDE.items():
        assert reason.strip(), "every entry needs a reason"
        for entry in entries:
            assert (entry[3:] in ops) if entry.startswith("op:") else (entry in CASES), entry


def test_sample_is_not_excluded():
    assert len(FAST_SAMPLE) <= 80
    for name in FAST_SAMPLE:
        assert _reason(name, CASES[name][1]) is None, name


# The backend itself -------------------------------------------------------------------------------

def test_backend_feeds_inputs_in_order_and_skips_initializers():
    import numpy as np
    from onnx import helper

    from cuvil.backend import CuvilBackend
    from tests.helpers import make_model
    model = make_model([helper.make_node("Add", ["a", "w"], ["s"]), helper.make_node("Mul", ["s", "b"], ["y"])],
                       [("a", np.float32, [2, 3]), ("w", np.float32, [2, 3]), ("b", np.float32, [2, 3])],
                       [("y", np.float32, [2, 3]), ("s", np.float32, [2, 3])],
                       initializers={"w": np.ones((2, 3), np.float32)})
    assert CuvilBackend.supports_device("CPU") and not CuvilBackend.supports_device("CUDA")
    rep = CuvilBackend.prepare(model, "CPU")
    a, b = np.full((2, 3), 2, np.float32), np.full((2, 3), 3, np.float32)
    y, s = rep.run([a, b])
    np.testing.assert_array_equal(s, a + 1)
    np.testing.assert_array_equal(y, (a + 1) * b)
    np.testing.assert_array_equal(CuvilBackend.run_model(model, {"a": a, "b": b})[0], y)


def test_backend_specialises_shape_inputs_per_value():
    import numpy as np
    from onnx import helper

    from cuvil.backend import CuvilBackend, build_time_inputs
    from tests.helpers import make_model
    model = make_model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                       [("x", np.float32, [2, 6]), ("shape", np.int64, [2])], [("y", np.float32, None)])
    assert build_time_inputs(model) == ["shape"]
    rep = CuvilBackend.prepare(model)
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    assert rep.run([x, np.array([3, 4])])[0].shape == (3, 4)
    assert rep.run([x, np.array([4, -1])])[0].shape == (4, 3)
    assert len(rep._libraries) == 2
