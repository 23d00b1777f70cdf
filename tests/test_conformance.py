"""ONNX's backend node tests through cuvil.backend (STYLE.md principle 5:
conformance is measured, and the exclude list is the honest record).

- `test_node_sample`: a fixed sample of core-op-set tests that pass, in the
  default (fast) suite.
- `test_node` (slow): every node test onnx generates. A test in EXCLUDE is
  expected to fail for the reason given (strict: once it passes, take it off
  the list). `python scripts/conformance.py` runs the same tests in parallel,
  writes docs/conformance.md and prints this table (`--exclude-block`).
"""
import pytest

from cuvil.backend import load_node_tests, run_node_test

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
    'UnsupportedOpError: op Attention is not supported': [
        'test_attention_23_boolmask_fullymasked_row_nan_robustness',
        'test_attention_23_fullymasked_qk_matmul_output_mode3_zero',
        'test_attention_24_fullymasked_qk_matmul_output_mode3_zero',
        'test_attention_24_qk_matmul_output_mode3_softmax_precision', 'test_attention_3d',
        'test_attention_3d_attn_mask', 'test_attention_3d_causal', 'test_attention_3d_diff_heads_sizes',
        'test_attention_3d_diff_heads_sizes_attn_mask', 'test_attention_3d_diff_heads_sizes_causal',
        'test_attention_3d_diff_heads_sizes_scaled', 'test_attention_3d_diff_heads_sizes_softcap',
        'test_attention_3d_diff_heads_with_past_and_present', 'test_attention_3d_gqa',
        'test_attention_3d_gqa_attn_mask', 'test_attention_3d_gqa_causal', 'test_attention_3d_gqa_scaled',
        'test_attention_3d_gqa_softcap', 'test_attention_3d_gqa_with_past_and_present',
        'test_attention_3d_local_window', 'test_attention_3d_scaled', 'test_attention_3d_softcap',
        'test_attention_3d_transpose_verification', 'test_attention_3d_with_past_and_present',
        'test_attention_3d_with_past_and_present_qk_matmul', 'test_attention_3d_with_past_and_present_qk_matmul_bias',
        'test_attention_3d_with_past_and_present_qk_matmul_softcap',
        'test_attention_3d_with_past_and_present_qk_matmul_softmax', 'test_attention_4d',
        'test_attention_4d_attn_mask', 'test_attention_4d_attn_mask_3d', 'test_attention_4d_attn_mask_3d_causal',
        'test_attention_4d_attn_mask_4d', 'test_attention_4d_attn_mask_4d_causal', 'test_attention_4d_attn_mask_bool',
        'test_attention_4d_attn_mask_bool_4d', 'test_attention_4d_causal', 'test_attention_4d_causal_fp16',
        'test_attention_4d_causal_nonpad_attn_mask_composition', 'test_attention_4d_causal_nonpad_batch_prefill',
        'test_attention_4d_causal_nonpad_continued_prefill',
        'test_attention_4d_causal_nonpad_negative_offset_structural_empty',
        'test_attention_4d_causal_with_past_and_present', 'test_attention_4d_diff_heads_mask4d_padded_kv',
        'test_attention_4d_diff_heads_sizes', 'test_attention_4d_diff_heads_sizes_attn_mask',
        'test_attention_4d_diff_heads_sizes_causal', 'test_attention_4d_diff_heads_sizes_scaled',
        'test_attention_4d_diff_heads_sizes_softcap', 'test_attention_4d_diff_heads_with_past_and_present',
        'test_attention_4d_diff_heads_with_past_and_present_mask3d',
        'test_attention_4d_diff_heads_with_past_and_present_mask4d', 'test_attention_4d_fp16',
        'test_attention_4d_gqa', 'test_attention_4d_gqa_attn_mask', 'test_attention_4d_gqa_causal',
        'test_attention_4d_gqa_causal_nonpad_decode', 'test_attention_4d_gqa_causal_nonpad_decode_fp16',
        'test_attention_4d_gqa_scaled', 'test_attention_4d_gqa_softcap',
        'test_attention_4d_gqa_with_past_and_present', 'test_attention_4d_gqa_with_past_and_present_fp16',
        'test_attention_4d_scaled', 'test_attention_4d_softcap', 'test_attention_4d_softcap_neginf_mask',
        'test_attention_4d_softcap_neginf_mask_poison', 'test_attention_4d_with_past_and_present',
        'test_attention_4d_with_past_and_present_qk_matmul', 'test_attention_4d_with_past_and_present_qk_matmul_bias',
        'test_attention_4d_with_past_and_present_qk_matmul_bias_3d_mask',
        'test_attention_4d_with_past_and_present_qk_matmul_bias_3d_mask_causal',
        'test_attention_4d_with_past_and_present_qk_matmul_bias_4d_mask',
        'test_attention_4d_with_past_and_present_qk_matmul_bias_4d_mask_causal', 'test_attention_4d_with_qk_matmul',
        'test_attention_4d_with_qk_matmul_bias', 'test_attention_4d_with_qk_matmul_softcap',
        'test_attention_4d_with_qk_matmul_softmax', 'test_attention_bidirectional_window',
        'test_attention_causal_boolmask_nan_robustness', 'test_attention_local_window',
        'test_attention_local_window_default', 'test_attention_local_window_ext_cache_float16_mask',
        'test_attention_local_window_ext_cache_rank2_mask', 'test_attention_local_window_ext_cache_rank3_head_mask',
        'test_attention_local_window_ext_cache_rank4_batch_mask', 'test_attention_local_window_gqa_rank4_mask',
        'test_attention_local_window_rank1_boolean_mask', 'test_attention_local_window_with_past',
    ],
    "UnsupportedOpError: input '…': tensors of element type INTN are not supported": [
        'test_cast_INT2_to_FLOAT', 'test_cast_INT2_to_FLOAT16', 'test_cast_INT2_to_INT8', 'test_cast_INT4_to_FLOAT',
        'test_cast_INT4_to_FLOAT16', 'test_cast_INT4_to_INT8', 'test_castlike_FLOAT16_to_INT2',
        'test_castlike_FLOAT16_to_INT2_expanded', 'test_castlike_FLOAT16_to_INT4',
        'test_castlike_FLOAT16_to_INT4_expanded', 'test_castlike_FLOAT_to_INT2',
        'test_castlike_FLOAT_to_INT2_expanded', 'test_castlike_FLOAT_to_INT4', 'test_castlike_FLOAT_to_INT4_expanded',
        'test_castlike_INT2_to_FLOAT', 'test_castlike_INT2_to_FLOAT16', 'test_castlike_INT2_to_FLOAT16_expanded',
        'test_castlike_INT2_to_FLOAT_expanded', 'test_castlike_INT2_to_INT8', 'test_castlike_INT2_to_INT8_expanded',
        'test_castlike_INT4_to_FLOAT', 'test_castlike_INT4_to_FLOAT16', 'test_castlike_INT4_to_FLOAT16_expanded',
        'test_castlike_INT4_to_FLOAT_expanded', 'test_castlike_INT4_to_INT8', 'test_castlike_INT4_to_INT8_expanded',
        'test_dequantizelinear_int2', 'test_dequantizelinear_int4', 'test_quantizelinear_int2',
        'test_quantizelinear_int4',
    ],
    "UnsupportedOpError: input '…': tensors of element type UINTN are not supported": [
        'test_cast_UINT2_to_FLOAT', 'test_cast_UINT2_to_FLOAT16', 'test_cast_UINT2_to_UINT8',
        'test_cast_UINT4_to_FLOAT', 'test_cast_UINT4_to_FLOAT16', 'test_cast_UINT4_to_UINT8',
        'test_castlike_FLOAT16_to_UINT2', 'test_castlike_FLOAT16_to_UINT2_expanded', 'test_castlike_FLOAT16_to_UINT4',
        'test_castlike_FLOAT16_to_UINT4_expanded', 'test_castlike_FLOAT_to_UINT2',
        'test_castlike_FLOAT_to_UINT2_expanded', 'test_castlike_FLOAT_to_UINT4',
        'test_castlike_FLOAT_to_UINT4_expanded', 'test_castlike_UINT2_to_FLOAT', 'test_castlike_UINT2_to_FLOAT16',
        'test_castlike_UINT2_to_FLOAT16_expanded', 'test_castlike_UINT2_to_FLOAT_expanded',
        'test_castlike_UINT2_to_UINT8', 'test_castlike_UINT2_to_UINT8_expanded', 'test_castlike_UINT4_to_FLOAT',
        'test_castlike_UINT4_to_FLOAT16', 'test_castlike_UINT4_to_FLOAT16_expanded',
        'test_castlike_UINT4_to_FLOAT_expanded', 'test_castlike_UINT4_to_UINT8',
        'test_castlike_UINT4_to_UINT8_expanded', 'test_dequantizelinear_uint2', 'test_dequantizelinear_uint4',
        'test_quantizelinear_uint2', 'test_quantizelinear_uint4',
    ],
    "UnsupportedOpError: input '…': tensors of element type FLOATNENMNFNUZ are not supported": [
        'test_cast_FLOAT8E4M3FNUZ_to_FLOAT', 'test_cast_FLOAT8E4M3FNUZ_to_FLOAT16',
        'test_cast_FLOAT8E5M2FNUZ_to_FLOAT', 'test_cast_FLOAT8E5M2FNUZ_to_FLOAT16',
        'test_castlike_FLOAT16_to_FLOAT8E4M3FNUZ', 'test_castlike_FLOAT16_to_FLOAT8E4M3FNUZ_expanded',
        'test_castlike_FLOAT16_to_FLOAT8E5M2FNUZ', 'test_castlike_FLOAT16_to_FLOAT8E5M2FNUZ_expanded',
        'test_castlike_FLOAT8E4M3FNUZ_to_FLOAT', 'test_castlike_FLOAT8E4M3FNUZ_to_FLOAT16',
        'test_castlike_FLOAT8E4M3FNUZ_to_FLOAT16_expanded', 'test_castlike_FLOAT8E4M3FNUZ_to_FLOAT_expanded',
        'test_castlike_FLOAT8E5M2FNUZ_to_FLOAT', 'test_castlike_FLOAT8E5M2FNUZ_to_FLOAT16',
        'test_castlike_FLOAT8E5M2FNUZ_to_FLOAT16_expanded', 'test_castlike_FLOAT8E5M2FNUZ_to_FLOAT_expanded',
        'test_castlike_FLOAT_to_FLOAT8E4M3FNUZ', 'test_castlike_FLOAT_to_FLOAT8E4M3FNUZ_expanded',
        'test_castlike_FLOAT_to_FLOAT8E5M2FNUZ', 'test_castlike_FLOAT_to_FLOAT8E5M2FNUZ_expanded',
        'test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ',
        'test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ_expanded',
        'test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ',
        'test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ_expanded',
        'test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ',
        'test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ_expanded',
        'test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ',
        'test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ_expanded',
    ],
    "UnsupportedOpError: input '…': tensors of element type BFLOATN are not supported": [
        'test_attention_3d_causal_bf16', 'test_attention_3d_causal_bf16_expanded',
        'test_attention_4d_attn_mask_causal_bf16', 'test_attention_4d_attn_mask_causal_bf16_expanded',
        'test_attention_4d_causal_bf16', 'test_attention_4d_causal_bf16_expanded',
        'test_attention_4d_causal_padded_kv_bf16', 'test_attention_4d_causal_padded_kv_bf16_expanded',
        'test_attention_4d_padded_kv_bf16', 'test_attention_4d_padded_kv_bf16_expanded',
        'test_cast_BFLOAT16_to_FLOAT', 'test_castlike_BFLOAT16_to_FLOAT', 'test_castlike_BFLOAT16_to_FLOAT_expanded',
        'test_castlike_FLOAT_to_BFLOAT16', 'test_castlike_FLOAT_to_BFLOAT16_expanded', 'test_celu_bfloat16',
        'test_celu_bfloat16_expanded', 'test_compress_bfloat16', 'test_einsum_batch_matmul_bfloat16',
        'test_einsum_sum_bfloat16', 'test_einsum_transpose_bfloat16', 'test_onehot_with_bfloat16_values',
        'test_reversesequence_bfloat16', 'test_unique_bfloat16_sorted_without_axis',
    ],
    "ShapeError: the shape of output '…' cannot be inferred statically": [
        'test_compress_0', 'test_compress_1', 'test_compress_default_axis', 'test_compress_negative_axis',
        'test_group_normalization_epsilon', 'test_group_normalization_example', 'op:ImageDecoder', 'test_loop11',
        'test_maxunpool_export_with_output_shape', 'op:NonMaxSuppression', 'op:NonZero', 'op:Scan',
        'op:SplitToSequence', 'test_unique_length_1', 'test_unique_not_sorted_without_axis',
        'test_unique_sorted_with_axis', 'test_unique_sorted_with_axis_3d', 'test_unique_sorted_with_negative_axis',
        'test_unique_sorted_without_axis',
    ],
    'UnsupportedOpError: op RMSNormalization is not supported': [
        'test_rms_normalization_2d_axis0', 'test_rms_normalization_2d_axis1',
        'test_rms_normalization_2d_axis_negative_1', 'test_rms_normalization_2d_axis_negative_2',
        'test_rms_normalization_3d_axis0_epsilon', 'test_rms_normalization_3d_axis1_epsilon',
        'test_rms_normalization_3d_axis2_epsilon', 'test_rms_normalization_3d_axis_negative_1_epsilon',
        'test_rms_normalization_3d_axis_negative_2_epsilon', 'test_rms_normalization_3d_axis_negative_3_epsilon',
        'test_rms_normalization_4d_axis0', 'test_rms_normalization_4d_axis1', 'test_rms_normalization_4d_axis2',
        'test_rms_normalization_4d_axis3', 'test_rms_normalization_4d_axis_negative_1',
        'test_rms_normalization_4d_axis_negative_2', 'test_rms_normalization_4d_axis_negative_3',
        'test_rms_normalization_4d_axis_negative_4', 'test_rms_normalization_default_axis',
    ],
    "UnsupportedOpError: input '…': tensors of element type FLOATNENMNFN are not supported": [
        'test_cast_FLOAT8E4M3FN_to_FLOAT', 'test_cast_FLOAT8E4M3FN_to_FLOAT16',
        'test_castlike_FLOAT16_to_FLOAT8E4M3FN', 'test_castlike_FLOAT16_to_FLOAT8E4M3FN_expanded',
        'test_castlike_FLOAT8E4M3FN_to_FLOAT', 'test_castlike_FLOAT8E4M3FN_to_FLOAT16',
        'test_castlike_FLOAT8E4M3FN_to_FLOAT16_expanded', 'test_castlike_FLOAT8E4M3FN_to_FLOAT_expanded',
        'test_castlike_FLOAT_to_FLOAT8E4M3FN', 'test_castlike_FLOAT_to_FLOAT8E4M3FN_expanded',
        'test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FN',
        'test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FN_expanded',
        'test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FN', 'test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FN_expanded',
        'test_dequantizelinear_e4m3fn', 'test_dequantizelinear_e4m3fn_float16',
        'test_dequantizelinear_e4m3fn_zero_point', 'test_quantizelinear_e4m3fn',
    ],
    'UnsupportedOpError: a non-constant weight W is not supported (weights are packed at build time)': [
        'test_causal_conv_with_state_b1_c1_degenerate_expanded', 'test_causal_conv_with_state_basic_expanded',
        'test_causal_conv_with_state_decode_step_expanded', 'test_causal_conv_with_state_fp16_expanded',
        'test_causal_conv_with_state_kernel_size_one_expanded',
        'test_causal_conv_with_state_short_input_no_past_state_expanded', 'test_causal_conv_with_state_silu_expanded',
        'test_causal_conv_with_state_silu_fp16_expanded', 'test_causal_conv_with_state_silu_with_past_state_expanded',
        'test_causal_conv_with_state_swish_alias_expanded',
        'test_causal_conv_with_state_with_bias_and_past_state_expanded',
        'test_causal_conv_with_state_with_bias_expanded', 'test_causal_conv_with_state_with_past_state_expanded',
        'op:Conv',
    ],
    "UnsupportedOpError: input '…': tensors of element type FLOATNENMN are not supported": [
        'test_cast_FLOAT4E2M1_to_FLOAT', 'test_cast_FLOAT4E2M1_to_FLOAT16', 'test_cast_e8m0_FLOAT8E8M0_to_FLOAT',
        'test_cast_e8m0_FLOAT8E8M0_to_FLOAT16', 'test_castlike_FLOAT16_to_FLOAT4E2M1',
        'test_castlike_FLOAT16_to_FLOAT4E2M1_expanded', 'test_castlike_FLOAT4E2M1_to_FLOAT',
        'test_castlike_FLOAT4E2M1_to_FLOAT16', 'test_castlike_FLOAT4E2M1_to_FLOAT16_expanded',
        'test_castlike_FLOAT4E2M1_to_FLOAT_expanded', 'test_castlike_FLOAT_to_FLOAT4E2M1',
        'test_castlike_FLOAT_to_FLOAT4E2M1_expanded', 'test_dequantizelinear_float4e2m1',
        'test_quantizelinear_float4e2m1',
    ],
    'UnsupportedOpError: op LinearAttention is not supported': [
        'test_linear_attention_decode_step', 'test_linear_attention_delta', 'test_linear_attention_explicit_scale',
        'test_linear_attention_fp16', 'test_linear_attention_gated', 'test_linear_attention_gated_delta',
        'test_linear_attention_gated_delta_beta_scalar', 'test_linear_attention_gated_delta_gqa',
        'test_linear_attention_gated_delta_mqa', 'test_linear_attention_gated_per_head_decay',
        'test_linear_attention_linear', 'test_linear_attention_linear_t1_no_past',
        'test_linear_attention_no_past_explicit_zeros', 'test_linear_attention_prefill_with_past',
    ],
    'UnsupportedOpError: op CausalConvWithState is not supported': [
        'test_causal_conv_with_state_b1_c1_degenerate', 'test_causal_conv_with_state_basic',
        'test_causal_conv_with_state_decode_step', 'test_causal_conv_with_state_fp16',
        'test_causal_conv_with_state_kernel_size_one', 'test_causal_conv_with_state_short_input_no_past_state',
        'test_causal_conv_with_state_silu', 'test_causal_conv_with_state_silu_fp16',
        'test_causal_conv_with_state_silu_with_past_state', 'test_causal_conv_with_state_swish_alias',
        'test_causal_conv_with_state_with_bias', 'test_causal_conv_with_state_with_bias_and_past_state',
        'test_causal_conv_with_state_with_past_state',
    ],
    "AssertionError: value '…' has no storage": [
        'test_affine_grid_2d_align_corners_expanded', 'test_linear_attention_decode_step_expanded',
        'test_linear_attention_delta_expanded', 'test_linear_attention_explicit_scale_expanded',
        'test_linear_attention_gated_delta_beta_scalar_expanded', 'test_linear_attention_gated_delta_expanded',
        'test_linear_attention_gated_expanded', 'test_linear_attention_gated_per_head_decay_expanded',
        'test_linear_attention_linear_expanded', 'test_linear_attention_linear_t1_no_past_expanded',
        'test_linear_attention_no_past_explicit_zeros_expanded', 'test_linear_attention_prefill_with_past_expanded',
    ],
    "UnsupportedOpError: input '…' is not a tensor (sequences and maps are not supported)": [
        'test_identity_opt', 'test_identity_sequence', 'test_loop16_seq_none',
        'test_optional_get_element_optional_sequence', 'test_optional_get_element_optional_tensor',
        'test_optional_get_element_sequence', 'test_optional_has_element_empty_optional_input',
        'test_optional_has_element_optional_input', 'test_optional_has_element_tensor_input',
        'test_sequence_map_add_1_sequence_1_tensor', 'test_sequence_map_identity_1_sequence',
    ],
    "KeyError: '…'": [
        'test_affine_grid_2d_expanded', 'test_affine_grid_3d_expanded', 'test_dropout_default_mask',
        'test_dropout_default_mask_ratio', 'test_training_dropout_default_mask', 'test_training_dropout_mask',
        'test_training_dropout_zero_ratio_mask', 'test_linear_attention_fp16_expanded',
        'test_linear_attention_gated_delta_gqa_expanded', 'test_linear_attention_gated_delta_mqa_expanded',
    ],
    'ValueError: setting an array element with a sequence. The requested array has an inhomogeneous shape after N dimensions. The detected shape was (N,) + i': [
        'op:SequenceInsert', 'test_sequence_map_add_2_sequences', 'test_sequence_map_add_2_sequences_expanded',
        'test_sequence_map_extract_shapes', 'test_sequence_map_extract_shapes_expanded',
        'test_sequence_map_identity_1_sequence_1_tensor', 'test_sequence_map_identity_1_sequence_1_tensor_expanded',
        'test_sequence_map_identity_2_sequences', 'test_sequence_map_identity_2_sequences_expanded',
    ],
    "UnsupportedOpError:  output '…': tensors of element type FLOATNENMNFNUZ are not supported": [
        'test_cast_FLOAT16_to_FLOAT8E4M3FNUZ', 'test_cast_FLOAT16_to_FLOAT8E5M2FNUZ',
        'test_cast_FLOAT_to_FLOAT8E4M3FNUZ', 'test_cast_FLOAT_to_FLOAT8E5M2FNUZ',
        'test_cast_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ', 'test_cast_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ',
        'test_cast_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ', 'test_cast_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ',
    ],
    'UnsupportedOpError: op RotaryEmbedding is not supported': [
        'test_rotary_embedding', 'test_rotary_embedding_3d_input', 'test_rotary_embedding_interleaved',
        'test_rotary_embedding_no_position_ids', 'test_rotary_embedding_no_position_ids_interleaved',
        'test_rotary_embedding_no_position_ids_rotary_dim', 'test_rotary_embedding_with_interleaved_rotary_dim',
        'test_rotary_embedding_with_rotary_dim',
    ],
    "UnsupportedOpError: input '…': tensors of element type STRING are not supported": [
        'test_equal_string', 'test_equal_string_broadcast', 'op:LabelEncoder', 'op:RegexFullMatch', 'op:StringConcat',
        'op:StringNormalizer', 'op:StringSplit',
    ],
    'UnsupportedOpError: op CenterCropPad is not supported': [
        'test_center_crop_pad_crop', 'test_center_crop_pad_crop_and_pad', 'test_center_crop_pad_crop_axes_chw',
        'test_center_crop_pad_crop_axes_hwc', 'test_center_crop_pad_crop_negative_axes_hwc',
        'test_center_crop_pad_pad',
    ],
    'UnsupportedOpError: op ai.onnx.preview::FlexAttention is not supported': [
        'test_flexattention', 'test_flexattention_diff_head_sizes', 'test_flexattention_double',
        'test_flexattention_fp16', 'test_flexattention_gqa', 'test_flexattention_scaled',
    ],
    'UnsupportedOpError: the model imports no version of the default ONNX domain': [
        'op:Adagrad', 'op:Adam', 'op:ArrayFeatureExtractor', 'op:Binarizer', 'op:Momentum', 'op:TreeEnsemble',
    ],
    "UnsupportedOpError:  (FlexAttention) has a subgraph attribute '…'; control flow is not supported yet": [
        'test_flexattention_causal_mask', 'test_flexattention_prob_mod', 'test_flexattention_relative_positional',
        'test_flexattention_score_mod', 'test_flexattention_soft_cap',
    ],
    "UnsupportedOpError: dtype floatN of '…' is not supported": [
        'test_attention_4d_causal_fp16_expanded', 'test_attention_4d_fp16_expanded',
        'test_attention_4d_gqa_causal_nonpad_decode_fp16_expanded',
        'test_attention_4d_gqa_with_past_and_present_fp16_expanded',
        'test_attention_local_window_ext_cache_float16_mask_expanded',
    ],
    "UnsupportedOpError:  output '…': tensors of element type FLOATNENMN are not supported": [
        'test_cast_FLOAT16_to_FLOAT4E2M1', 'test_cast_FLOAT_to_FLOAT4E2M1', 'test_cast_e8m0_FLOAT16_to_FLOAT8E8M0',
        'test_cast_e8m0_FLOAT_to_FLOAT8E8M0',
    ],
    "UnsupportedOpError:  output '…': tensors of element type FLOATNENMNFN are not supported": [
        'test_cast_FLOAT16_to_FLOAT8E4M3FN', 'test_cast_FLOAT_to_FLOAT8E4M3FN',
        'test_cast_no_saturate_FLOAT16_to_FLOAT8E4M3FN', 'test_cast_no_saturate_FLOAT_to_FLOAT8E4M3FN',
    ],
    "UnsupportedOpError:  output '…': tensors of element type INTN are not supported": [
        'test_cast_FLOAT16_to_INT2', 'test_cast_FLOAT16_to_INT4', 'test_cast_FLOAT_to_INT2',
        'test_cast_FLOAT_to_INT4',
    ],
    "UnsupportedOpError:  output '…': tensors of element type UINTN are not supported": [
        'test_cast_FLOAT16_to_UINT2', 'test_cast_FLOAT16_to_UINT4', 'test_cast_FLOAT_to_UINT2',
        'test_cast_FLOAT_to_UINT4',
    ],
    'UnsupportedOpError: op Bernoulli is not supported': [
        'test_bernoulli', 'test_bernoulli_double', 'test_bernoulli_seed',
    ],
    'UnsupportedOpError: op RandomUniformLike is not supported': [
        'test_bernoulli_double_expanded', 'test_bernoulli_expanded', 'test_bernoulli_seed_expanded',
    ],
    'UnsupportedOpError: op SwiGLU is not supported': [
        'test_swiglu', 'test_swiglu_alpha', 'test_swiglu_float16',
    ],
    'AssertionError: wrong values': [
        'test_training_dropout', 'test_training_dropout_default',
    ],
    "AttributeError: '…' object has no attribute '…'": [
        'test_if_opt', 'test_if_seq',
    ],
    "ModelError: evaluating it at build time failed: Issues with types […] and attributes […] and linked attributes=[…] (operator '…').": [
        'test_sequence_map_add_1_sequence_1_tensor_expanded', 'test_sequence_map_identity_1_sequence_expanded',
    ],
    'UnsupportedOpError: op OptionalHasElement is not supported': [
        'test_optional_has_element_empty_no_input_optional_input',
        'test_optional_has_element_empty_no_input_tensor_input',
    ],
    'UnsupportedOpError: training_mode=N is not supported (inference only)': [
        'test_batchnorm_epsilon_training_mode', 'test_batchnorm_example_training_mode',
    ],
    'BuildError: compiling kernel cuvilk_matmul_NaNeNbNbNfNd (MatMul) failed: NotImplementedError: floatN': [
        'test_attention_24_qk_matmul_output_mode3_softmax_precision_expanded',
    ],
    'BuildError: compiling kernel cuvilk_matmul_afdNaaNdNecd (MatMul) failed: NotImplementedError: floatN': [
        'test_flexattention_fp16_expanded_ver26',
    ],
    "CuvilError: input '…': every dim of the shape […] must be positive": [
        'test_loop13_seq',
    ],
    "ModelError: the model is malformed: KeyError: '…'": [
        'test_affine_grid_3d_align_corners_expanded',
    ],
    "UnsupportedOpError:  output '…': tensors of element type BFLOATN are not supported": [
        'test_cast_FLOAT_to_BFLOAT16',
    ],
    "UnsupportedOpError: dtype floatN_eNmN of '…' is not supported (intN, intN, intN, uintN, uintN)": [
        'test_dequantizelinear_e5m2',
    ],
    "UnsupportedOpError: dtype floatN_eNmN of '…' is not supported (intN, intN, uintN, uintN)": [
        'test_quantizelinear_e5m2',
    ],
    'UnsupportedOpError: op DeformConv is not supported': [
        'op:DeformConv',
    ],
    'UnsupportedOpError: op Det is not supported': [
        'op:Det',
    ],
    'UnsupportedOpError: op OptionalGetElement is not supported': [
        'test_optional_get_element_tensor',
    ],
    'UnsupportedOpError: op RoiAlign is not supported': [
        'op:RoiAlign',
    ],
    'UnsupportedOpError: op STFT is not supported': [
        'op:STFT',
    ],
    'UnsupportedOpError: op TensorScatter is not supported': [
        'op:TensorScatter',
    ],
    'UnsupportedOpError: op TfIdfVectorizer is not supported': [
        'op:TfIdfVectorizer',
    ],
}


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
        marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("name", _all_params())
def test_node(name):
    run_node_test(CASES[name][0])


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
