"""The op vocabulary: each family of ops that a pass, a generator or the planner
means, named once. Import a family from here wherever it is meant; a new op
joins a family by being added here, and every user of the family follows.

ONNX op names are kept as they are; FUSED_OPS are cuvil's own domain "cuvil"
(the fusion passes make them; no ONNX model contains them).
"""
from __future__ import annotations

# Ops whose output is the input's bytes under another shape (no code runs).
RESHAPE_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})
# Ops whose output shares the input's storage in inference: the reshapes, Identity, and Dropout
# (an identity when not training).
VIEW_OPS = RESHAPE_OPS | {"Identity", "Dropout"}

# cuvil's own domain: what the fusion passes make.
FUSED_DOMAIN = "cuvil"
FUSED_OPS = frozenset({"FusedGemm", "FusedMatMul", "FusedConv", "FusedElementwise", "DepthwiseBlock", "PrologueConv",
                       "FusedAttention", "FusedMatMulInteger",
                       "QLinearAdd", "QLookup"})
# cuvil's own control flow (frontends/control_flow.py): a Loop whose trip count or condition is known
# only at run time is the nodes of its body between a LoopBegin and a LoopEnd, compiled as a C loop.
CONTROL_OPS = frozenset({"LoopBegin", "LoopEnd"})
# Matrix products (domain, op): the ops whose second operand may be a weight matrix.
PRODUCTS = frozenset({("", "MatMul"), ("", "Gemm"), (FUSED_DOMAIN, "FusedMatMul"), (FUSED_DOMAIN, "FusedGemm")})
# The products an activation (and a residual Add) can fuse into, and the fused op each becomes.
EPILOGUE_ANCHORS = {"Conv": "FusedConv", "Gemm": "FusedGemm", "MatMul": "FusedMatMul"}
# Activations a fused product's epilogue computes (FusedConv/FusedGemm/FusedMatMul `activation`).
EPILOGUE_ACTIVATIONS = ("Relu", "Clip", "Sigmoid", "HardSwish", "HardSigmoid", "LeakyRelu", "Tanh")
# Of those, what the GEMM micro-kernel computes on its accumulators in registers
# (numba_cpu/ukernel.py); the others run in the kernel's output loop.
REGISTER_ACTIVATIONS = ("Relu", "Clip")

# Elementwise ops one FusedElementwise program computes (passes/fuse_elementwise.py makes the
# program, numba_cpu/fused.py compiles it), and the attributes kept for those that have some
# (with ONNX's defaults).
FUSIBLE_UNARY = frozenset({"Relu", "Neg", "Abs", "Sqrt", "Exp", "Log", "Tanh", "Erf", "Sigmoid", "Reciprocal",
                           "Floor", "Ceil", "Sin", "Cos", "Softplus", "Softsign", "Identity", "HardSwish", "Silu"})
FUSIBLE_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "PRelu"})
FUSIBLE_WITH_ATTRS = {"LeakyRelu": {"alpha": 0.01}, "HardSigmoid": {"alpha": 0.2, "beta": 0.5},
                      "Elu": {"alpha": 1.0}, "Gelu": {"approximate": "none"}, "Clip": {}}
FUSIBLE = FUSIBLE_UNARY | FUSIBLE_BINARY | set(FUSIBLE_WITH_ATTRS)

# Elementwise ops whose kernels read input element i only in the iteration that writes output
# element i (numba_cpu/elementwise.py, fused.py, norm.py's Gelu): their output may take over an
# input's buffer (Kernel.in_place).
IN_PLACE_OPS = frozenset({
    "Relu", "Neg", "Abs", "Sqrt", "Exp", "Log", "Tanh", "Erf", "Sigmoid", "Reciprocal", "Floor", "Ceil",
    "Sin", "Cos", "Softplus", "Softsign", "Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "PRelu", "Sum",
    "Mean", "Clip", "LeakyRelu", "HardSigmoid", "HardSwish", "Gelu", "FusedElementwise",
})

# The random ops (backends/numba_cpu/rng.py): never folded, each run draws new numbers unless seeded.
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                        "Bernoulli"})
# The value a random op without a `seed` reads its generator state from: two uint64 words (the
# session's seed, the number of runs so far) that the driver keeps in the session.
RNG_STATE = "__cuvil_rng_state__"


def is_random_dropout(node, graph) -> bool:
    """A Dropout in training mode with a non-zero ratio: random, so not an identity or a view.
    (Both inputs must be constants to compile it; a computed one counts as random here.)"""
    if node.op != "Dropout" or node.domain:
        return False

    def const(pos):
        if len(node.inputs) <= pos or not node.inputs[pos]:
            return None
        value = graph.values[node.inputs[pos]]
        return value.data if value.is_const else "computed"

    training, ratio = const(2), const(1)
    if training is None or (not isinstance(training, str) and not bool(training.reshape(-1)[0])):
        return False
    return ratio is None or isinstance(ratio, str) or float(ratio.reshape(-1)[0]) != 0.0
