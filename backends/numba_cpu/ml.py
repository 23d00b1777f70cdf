"""ai.onnx.ml ops: Binarizer, ArrayFeatureExtractor and TreeEnsemble (opset 5).

TreeEnsemble is a compiled tree walk: the nodes are constant tables packed at build time (per
node: feature, mode, next on true, next on false, missing-tracks-true; a next < 0 is leaf
-next - 1), the split of each node cast to the input's dtype (onnxruntime compares in it), and each
MEMBER node's set as a range of a members table. Each row walks every tree from its root and
aggregates the leaf weights per target. A missing value (NaN) goes the true way where the node's
missing_value_tracks_true says so, and for NEQ (NaN != s, as onnxruntime compares) (SUM, AVERAGE = SUM / trees, MIN, MAX), then applies the
post transform (NONE, LOGISTIC, SOFTMAX, SOFTMAX_ZERO)."""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header

DOMAIN = "ai.onnx.ml"
MODES = ("<=", "<", ">=", ">", "==", "!=")   # mode 6: MEMBER


def lower_binarizer(node, graph) -> Lowered:
    """y = 1 where x > threshold, else 0 (x's dtype)."""
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    t = np.dtype(x.dtype).name
    threshold = float(node.attr("threshold", 0.0))
    src = Source().line(kernel_header(2)).indent().line("for i in range(begin, end):").indent()
    src.line(f"p1[i] = np.{t}(1) if p0[i] > np.{t}({threshold!r}) else np.{t}(0)")
    return Lowered([KernelCall(Kernel("Binarizer", src.text(), (t, t)), [x.name, y.name], int(y.size), node.name)])


def lower_array_feature_extractor(node, graph) -> Lowered:
    """y[..., j] = x[..., indices[j]] (the indices flattened, read at run time; one out of range
    gives 0). A 1-D x gives one row, as onnxruntime does."""
    x, idx, y = (graph.values[n] for n in (node.inputs[0], node.inputs[1], node.outputs[0]))
    width, picks = int(x.shape[-1]), int(idx.size)
    rows = int(x.size) // max(width, 1)
    t = np.dtype(x.dtype).name
    src = Source().line(kernel_header(3)).indent().line("for r in range(begin, end):").indent()
    src.line(f"for j in range({picks}):").indent()
    src.line("k = np.int64(p1[j])")
    src.line(f"p2[r * {picks} + j] = p0[r * {width} + k] if 0 <= k < {width} else np.{t}(0)")
    kernel = Kernel("ArrayFeatureExtractor", src.text(), (t, np.dtype(idx.dtype).name, t))
    return Lowered([KernelCall(kernel, [x.name, idx.name, y.name], rows if y.size else 0, node.name)])


def _tensor_attr(node, name):
    value = node.attr(name)
    return None if value is None else np.asarray(value).reshape(-1)


def _tree_tables(node, dtype):
    """The node table (int64, 5 per node), the splits and the members (dtype), the leaves."""
    features = [int(v) for v in node.attr("nodes_featureids")]
    modes = [int(v) for v in _tensor_attr(node, "nodes_modes")]
    splits = _tensor_attr(node, "nodes_splits").astype(dtype)
    true_ids, false_ids = node.attr("nodes_truenodeids"), node.attr("nodes_falsenodeids")
    true_leaf, false_leaf = node.attr("nodes_trueleafs"), node.attr("nodes_falseleafs")
    missing = node.attr("nodes_missing_value_tracks_true") or [0] * len(features)
    members = _tensor_attr(node, "membership_values")
    member_sets, current = [], []
    for v in ([] if members is None else members):
        if np.isnan(v):
            member_sets.append(current)
            current = []
        else:
            current.append(v)
    if sum(m == 6 for m in modes) != len(member_sets) or any(m < 0 or m > 6 for m in modes):
        raise UnsupportedOpError(f"node '{node.name}' (TreeEnsemble): nodes_modes and membership_values do not agree",
                                 hint="each MEMBER node (mode 6) needs one NaN-terminated set in membership_values")
    table, flat_members, member_at = [], [], iter(member_sets)
    for i, mode in enumerate(modes):
        nxt_true = -int(true_ids[i]) - 1 if true_leaf[i] else int(true_ids[i])
        nxt_false = -int(false_ids[i]) - 1 if false_leaf[i] else int(false_ids[i])
        start = count = 0
        if mode == 6:
            values = next(member_at)
            start, count = len(flat_members), len(values)
            flat_members += values
        table += [features[i], mode, nxt_true, nxt_false, int(missing[i]), start, count]
    return (np.array(table, np.int64), splits, np.array(flat_members + [0], dtype))


def lower_tree_ensemble(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    t = np.dtype(x.dtype).name
    if t not in ("float32", "float64") or len(x.shape) != 2:
        raise UnsupportedOpError(f"node '{node.name}' (TreeEnsemble): the input must be a float32/float64 matrix")
    table, splits, members = _tree_tables(node, np.dtype(t))
    roots = [int(r) for r in node.attr("tree_roots")]
    n_targets = int(node.attr("n_targets"))
    leaf_targets = np.array([int(v) for v in node.attr("leaf_targetids")], np.int64)
    leaf_weights = _tensor_attr(node, "leaf_weights").astype(np.float64)
    aggregate, post = int(node.attr("aggregate_function", 1)), int(node.attr("post_transform", 0))
    if aggregate not in (0, 1, 2, 3) or post not in (0, 1, 2, 3):
        raise UnsupportedOpError(f"node '{node.name}' (TreeEnsemble): aggregate_function {aggregate} / "
                                 f"post_transform {post} is not supported", hint="PROBIT is not compiled yet")
    # A root whose both branches are the same leaf is that leaf (the reference's degenerate tree).
    root_codes = []
    for r in roots:
        _, _, nt, nf = table[7 * r:7 * r + 4]
        root_codes.append(int(nt) if nt < 0 and nt == nf else r)
    features = int(x.shape[1])
    init = {0: f"np.{t}(0.0)", 1: f"np.{t}(0.0)", 2: repr(float(np.finfo(t).max)), 3: repr(float(np.finfo(t).min))}[aggregate]
    src = Source().line(kernel_header(9)).indent()
    # (accumulated in the output, in x's dtype, as the reference does)
    # p0 x, p1 node table, p2 splits, p3 members, p4 roots, p5 leaf targets, p6 leaf weights, p7 x's bits (the NaN test), p8 y
    src.line("for row in range(begin, end):").indent()
    src.line(f"xb = row * {features}").line(f"yb = row * {n_targets}")
    src.line(f"for k in range({n_targets}):").indent().line(f"p8[yb + k] = {init}").dedent()
    src.line(f"for tree in range({len(roots)}):").indent()
    src.line("at = p4[tree]")
    src.line("while at >= 0:").indent()
    src.line("b = 7 * at").line("v = p0[xb + p1[b]]").line("mode = p1[b + 1]").line("s = p2[at]")
    # NaN from the bits: kernels compile with fastmath, which folds `v != v` to False
    bits_type, exp_mask, abs_mask = ("uint32", 0x7F800000, 0x7FFFFFFF) if t == "float32" else \
        ("uint64", 0x7FF0000000000000, 0x7FFFFFFFFFFFFFFF)
    src.line(f"if (p7[xb + p1[b]] & np.{bits_type}({abs_mask})) > np.{bits_type}({exp_mask}):").indent()
    src.line(f"go = p1[b + 4] != 0 or mode == {MODES.index('!=')}").dedent()   # NaN != s is true
    for mode, op in enumerate(MODES):
        src.line(f"elif mode == {mode}:").indent().line(f"go = v {op} s").dedent()
    src.line("else:").indent().line("go = False")
    src.line("for m in range(p1[b + 5], p1[b + 5] + p1[b + 6]):").indent()
    src.line("if v == p3[m]:").indent().line("go = True").line("break").dedent().dedent().dedent()
    src.line("at = p1[b + 2] if go else p1[b + 3]").dedent()
    src.line("leaf = -at - 1").line("k = p5[leaf]").line(f"w = np.{t}(p6[leaf])")
    src.line({0: "p8[yb + k] += w", 1: "p8[yb + k] += w", 2: "p8[yb + k] = min(p8[yb + k], w)", 3: "p8[yb + k] = max(p8[yb + k], w)"}[aggregate])
    src.dedent()
    if aggregate in (2, 3):   # a target no leaf reached is 0 (onnxruntime), not the start value
        src.line(f"for k in range({n_targets}):").indent()
        src.line(f"if p8[yb + k] == {init}:").indent().line(f"p8[yb + k] = np.{t}(0.0)").dedent().dedent()
    if aggregate == 0:
        src.line(f"for k in range({n_targets}):").indent().line(f"p8[yb + k] = p8[yb + k] / {len(roots)}").dedent()
    if post == 2:
        src.line(f"for k in range({n_targets}):").indent().line("p8[yb + k] = 1.0 / (1.0 + math.exp(-p8[yb + k]))").dedent()
    elif post in (1, 3):
        src.line("top = p8[yb]")
        src.line(f"for k in range(1, {n_targets}):").indent().line("top = max(top, p8[yb + k])").dedent()
        src.line("total = 0.0")
        src.line(f"for k in range({n_targets}):").indent()
        # SOFTMAX_ZERO: a zero score stays zero and does not count
        src.line("p8[yb + k] = 0.0 if p8[yb + k] == 0.0 else math.exp(p8[yb + k] - top)" if post == 3 else
                 "p8[yb + k] = math.exp(p8[yb + k] - top)")
        src.line("total += p8[yb + k]").dedent()
        src.line(f"for k in range({n_targets}):").indent().line("p8[yb + k] = p8[yb + k] / total if total > 0.0 else 0.0")
        src.dedent()
    kernel = Kernel("TreeEnsemble", src.text(), (t, "int64", t, t, "int64", "int64", "float64", bits_type, t))
    args = [x.name, table, splits, members, np.array(root_codes, np.int64), leaf_targets, leaf_weights, x.name,
            y.name]
    return Lowered([KernelCall(kernel, args, int(x.shape[0]), node.name)])
