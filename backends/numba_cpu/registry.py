"""Every op Cuvil can compile, and the generator that lowers it to kernels.

One readable table, no registration by import side effect. An op missing
here is a CuvilError naming the op, the node and this list.
"""
from __future__ import annotations

from backends.targets import DEFAULT_L1D_WAYS
from cuvil.errors import UnsupportedOpError
from cuvil.ops import CONTROL_OPS, FUSED_DOMAIN, FUSED_OPS, VIEW_OPS

from . import attention_bf16, batchnorm, concat, conv, dwblock, elementwise as ew, gemm, pool, softmax, transpose
from .kernel import Lowered, concat_rows, lowering_for
from .views import lower_view

# rnn.py, convtranspose.py, norm.py, quant.py
from . import convtranspose, norm, quant, rnn

# reduce.py, indexing.py, resize.py
from . import indexing, reduce, resize

# linalg.py (Det), tfidf.py (TfIdfVectorizer)
from . import linalg, tfidf

# widen.py (float16 / bfloat16 through the float32 kernels)
from .widen import in_float32

# ml.py (ai.onnx.ml: Binarizer, ArrayFeatureExtractor, TreeEnsemble), training.py (optimiser steps)
from . import ml, training

# roi_align.py, deform_conv.py (bilinear sampling at computed points)
from . import deform_conv, roi_align

# rng.py (the random ops, on a counter-based generator)
from . import rng

# control.py (a Loop decided at run time, compiled as a C loop)
from . import control

# dynamic.py (ops whose output shapes depend on the data)
from . import dynamic

# fused.py (fused elementwise programs, made by passes/fuse_elementwise.py and fuse_patterns.py)
from . import fused
# prologueconv.py (a conv whose input copy computes such a program: passes/fuse_conv_prologue.py)
from . import prologueconv

# nbits.py (weight-only int4/int8 products: onnxruntime's MatMulNBits and precision: int4)
from cuvil import nbits as nbits_form
from . import nbits_gemm   # many rows: dequantised panels; else nbits.py's packed-code kernel

# gqa.py (onnxruntime's LLM attention ops; cuvil/contrib.py has their forms)
from cuvil import contrib
from . import gqa

# strings.py (string tensors: C kernels defined in the driver; docs/strings.md)
from . import strings


def _cast(node, graph) -> Lowered:
    """Cast and CastLike: to or from strings their own kernel, else the numeric one."""
    if any(strings.is_string(graph.values[n]) for n in (node.inputs[0], node.outputs[0])):
        return strings.lower_cast_strings(node, graph)
    return indexing.lower_cast(node, graph)


def _gather(node, graph) -> Lowered:
    """Gather: of strings its own kernel, else the indexing one."""
    if strings.is_string(graph.values[node.inputs[0]]):
        return strings.lower_gather_strings(node, graph)
    return indexing.lower_gather(node, graph)


def _equal(node, graph) -> Lowered:
    """Equal: on strings its own kernel, else the elementwise one."""
    if strings.is_string(graph.values[node.inputs[0]]):
        return strings.lower_string_equal(node, graph)
    return ew.lower_elementwise(node, graph)

GENERATORS = {
    # elementwise (elementwise.py)
    **{op: ew.lower_elementwise for op in ew.UNARY if op != "Identity"},
    **{op: ew.lower_elementwise for op in ew.BINARY},
    "Clip": ew.lower_clip,
    "LeakyRelu": ew.lower_leaky_relu,
    "HardSigmoid": ew.lower_hard_sigmoid,
    "HardSwish": ew.lower_hard_swish,
    "Where": ew.lower_where,
    # views: the output shares the input's bytes (views.py); Dropout also writes its mask when asked
    **{op: lower_view for op in sorted(VIEW_OPS - {"Dropout"})},
    "Dropout": indexing.lower_dropout,
    # dense linear algebra (gemm.py, conv.py)
    "Gemm": in_float32(gemm.lower_gemm),
    "MatMul": in_float32(gemm.lower_matmul),
    "Conv": in_float32(conv.lower_conv, conv.reads_stored16),
    # fused epilogues, domain "cuvil" (made by the fusion passes; see epilogue.py)
    "FusedGemm": in_float32(gemm.lower_gemm),
    "FusedMatMul": in_float32(gemm.lower_matmul),
    "FusedConv": in_float32(conv.lower_conv, conv.reads_stored16),
    "PrologueConv": prologueconv.lower_prologue_conv,
    "DepthwiseBlock": dwblock.lower_depthwise_block,
    "FusedAttention": attention_bf16.lower_fused_attention,   # float32: attention.lower_attention
    # fused elementwise loops, domain "cuvil" (fused.py)
    "FusedElementwise": fused.lower_fused_elementwise,
    # a loop compiled as a loop, domain "cuvil" (control.py)
    "LoopBegin": control.lower_loop_begin,
    "LoopEnd": control.lower_loop_end,
    # normalisation, pooling, layout (batchnorm.py, pool.py, softmax.py, transpose.py, concat.py)
    "BatchNormalization": batchnorm.lower_batchnorm,
    "MaxPool": pool.lower_maxpool,
    "AveragePool": pool.lower_averagepool,
    "GlobalAveragePool": pool.lower_global_averagepool,
    "GlobalMaxPool": pool.lower_global_maxpool,
    "Softmax": in_float32(softmax.lower_softmax),
    "Transpose": transpose.lower_transpose,
    "Concat": concat.lower_concat,
    # recurrent networks (rnn.py)
    "LSTM": rnn.lower_lstm,
    "GRU": rnn.lower_gru,
    "RNN": rnn.lower_rnn,
    # transposed convolution (convtranspose.py)
    "ConvTranspose": convtranspose.lower_convtranspose,
    # normalisations and Gelu (norm.py)
    "LayerNormalization": norm.lower_layer_normalization,
    "InstanceNormalization": norm.lower_instance_normalization,
    "MeanVarianceNormalization": norm.lower_mean_variance_normalization,
    "LpNormalization": norm.lower_lp_normalization,
    "Gelu": norm.lower_gelu,
    "SimplifiedLayerNormalization": norm.lower_simplified_layer_normalization,  # onnxruntime's RMSNorm
    # linear quantisation (quant.py)
    "QuantizeLinear": quant.lower_quantize_linear,
    "DequantizeLinear": quant.lower_dequantize_linear,
    "DynamicQuantizeLinear": quant.lower_dynamic_quantize_linear,
    "MatMulInteger": quant.lower_matmul_integer,
    "QLinearMatMul": quant.lower_qlinear_matmul,
    "ConvInteger": quant.lower_conv_integer,
    "QLinearConv": quant.lower_qlinear_conv,
    "FusedMatMulInteger": quant.lower_fused_matmul_integer,   # domain "cuvil" (passes/fold_qdq.py)
    "QLinearAdd": quant.lower_qlinear_add,                     # domain "cuvil" (passes/fold_qdq.py)
    "QLookup": quant.lower_qlookup,                            # domain "cuvil" (passes/fold_qdq.py)
    # elementwise ops with attributes (elementwise.py)
    "Elu": ew.lower_elu,
    "Selu": ew.lower_selu,
    "Celu": ew.lower_celu,
    "ThresholdedRelu": ew.lower_thresholded_relu,
    "Shrink": ew.lower_shrink,
    "Swish": ew.lower_swish,
    "IsInf": ew.lower_is_inf,
    "Mod": ew.lower_mod,
    "BitShift": ew.lower_bit_shift,
    # reductions (reduce.py)
    **{op: reduce.lower_reduce for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                                           "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")},
    "ArgMax": reduce.lower_arg_extreme,
    "ArgMin": reduce.lower_arg_extreme,
    "CumSum": reduce.lower_cumsum,
    "CumProd": reduce.lower_cumsum,
    "NegativeLogLikelihoodLoss": reduce.lower_nll_loss,
    "SoftmaxCrossEntropyLoss": reduce.lower_softmax_cross_entropy,
    "TopK": reduce.lower_topk,
    "LogSoftmax": reduce.lower_log_softmax,
    "Hardmax": reduce.lower_hardmax,
    "LRN": reduce.lower_lrn,
    "DFT": reduce.lower_dft,
    # data movement and indexing (indexing.py)
    "Cast": _cast,
    "CastLike": _cast,
    "Expand": indexing.lower_expand,
    "Tile": indexing.lower_tile,
    "Slice": indexing.lower_slice,
    "Pad": indexing.lower_pad,
    "Split": indexing.lower_split,
    "Gather": _gather,
    "GatherElements": indexing.lower_gather_elements,
    "GatherND": indexing.lower_gather_nd,
    "ScatterElements": indexing.lower_scatter_elements,
    "Scatter": indexing.lower_scatter_elements,
    "ScatterND": indexing.lower_scatter_nd,
    "TensorScatter": indexing.lower_tensor_scatter,
    "Trilu": indexing.lower_trilu,
    "EyeLike": indexing.lower_eye_like,
    "OneHot": indexing.lower_one_hot,
    "DepthToSpace": indexing.lower_depth_to_space,
    "SpaceToDepth": indexing.lower_space_to_depth,
    "Einsum": indexing.lower_einsum,
    "ReverseSequence": indexing.lower_reverse_sequence,
    "BitCast": lower_view,  # same bit width, same shape: the bytes are the result
    # pooling with a p-norm (pool.py)
    "LpPool": pool.lower_lppool,
    "MaxUnpool": pool.lower_max_unpool,
    "Col2Im": pool.lower_col2im,
    # interpolation (resize.py)
    "Resize": resize.lower_resize,
    "Upsample": resize.lower_resize,
    "GridSample": resize.lower_grid_sample,
    "AffineGrid": resize.lower_affine_grid,
    # data-dependent output shapes: upper-bound buffers, the actual shape in a dims value (dynamic.py)
    # linear algebra (linalg.py)
    "Det": linalg.lower_det,
    "TfIdfVectorizer": tfidf.lower_tfidf_vectorizer,
    "NonZero": dynamic.lower_nonzero,
    "Compress": dynamic.lower_compress,
    "Unique": dynamic.lower_unique,
    "NonMaxSuppression": dynamic.lower_non_max_suppression,
    # string tensors (strings.py)
    "Equal": _equal,
    "StringConcat": strings.lower_string_concat,
    "StringNormalizer": strings.lower_string_normalizer,
    "StringSplit": strings.lower_string_split,
    "RegexFullMatch": strings.lower_regex_full_match,
    # random numbers (rng.py; training Dropout is there too)
    **{op: rng.lower_random for op in ("RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike")},
    "Bernoulli": rng.lower_bernoulli,
    "Multinomial": rng.lower_multinomial,
    # bilinear sampling at computed points (roi_align.py, deform_conv.py)
    "RoiAlign": roi_align.lower_roi_align,
    "DeformConv": deform_conv.lower_deform_conv,
}


# Ops of other domains (com.microsoft contrib ops), by (domain, op).
DOMAIN_GENERATORS = {
    (nbits_form.DOMAIN, nbits_form.OP): nbits_gemm.lower_matmul_nbits,
    (contrib.MS, "GroupQueryAttention"): gqa.lower_group_query_attention,
    (contrib.MS, "RotaryEmbedding"): gqa.lower_rotary_embedding,
    (contrib.MS, "SimplifiedLayerNormalization"): norm.lower_simplified_layer_normalization,
    (contrib.MS, "SkipSimplifiedLayerNormalization"): norm.lower_skip_simplified_layer_normalization,
    ("ai.onnx.ml", "LabelEncoder"): strings.lower_label_encoder,
    (ml.DOMAIN, "Binarizer"): ml.lower_binarizer,
    (ml.DOMAIN, "ArrayFeatureExtractor"): ml.lower_array_feature_extractor,
    (ml.DOMAIN, "TreeEnsemble"): ml.lower_tree_ensemble,
    (training.DOMAIN, "Adagrad"): training.lower_adagrad,
    (training.DOMAIN, "Momentum"): training.lower_momentum,
    (training.DOMAIN, "Adam"): training.lower_adam,
}


def supported_ops() -> list[str]:
    return sorted(GENERATORS)




def generator_for(node):
    if node.domain == FUSED_DOMAIN and (node.op in FUSED_OPS or node.op in CONTROL_OPS):
        return GENERATORS[node.op]
    if (node.domain, node.op) in DOMAIN_GENERATORS:
        return DOMAIN_GENERATORS[node.domain, node.op]
    if node.domain not in ("", "ai.onnx"):
        others = ", ".join(f"{domain}::{op}" for domain, op in sorted(DOMAIN_GENERATORS))
        raise UnsupportedOpError(f"node '{node.name}': op {node.domain}::{node.op} is not supported",
                                 hint=f"besides the default ONNX domain, cuvil compiles {others}")
    gen = GENERATORS.get(node.op)
    if gen is None:
        raise UnsupportedOpError(f"node '{node.name}': op {node.op} is not supported",
                                 hint=f"supported ops: {', '.join(supported_ops())}")
    return gen


def lower(graph, threads: int = 1, l1d_ways: int = DEFAULT_L1D_WAYS, target=None) -> list:
    """The schedule: kernel calls and views in the graph's (topological) node order, work split
    for a session of `threads` threads, on a target whose L1 data cache has `l1d_ways` ways (the
    target's own when it is given: its features choose the reduced-precision instructions)."""
    schedule = []
    with lowering_for(threads, target.l1d_ways if target is not None else l1d_ways, target), \
            concat_rows(concat.strided_inputs(graph)):
        for node in graph.nodes:
            strings.check_node(node, graph)   # a string tensor where the op has no string kernel
            schedule.extend(generator_for(node)(node, graph).calls)
        schedule.extend(strings.lower_constant_outputs(graph))
    return schedule
