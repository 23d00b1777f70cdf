"""TfIdfVectorizer (integer pools): each row's n-gram counts over the pool's n-grams, weighted.

The n-grams of a row are taken at every skip distance d = 1 .. max_skip_count + 1 (items
s, s+d, ..., s+(n-1)d), for n from min_gram_length to max_gram_length; unigrams are counted at d = 1
only (onnxruntime's and the reference's walk). Each row is a work item; the pool's n-grams are a
constant table packed at build time: per n-gram (length, offset in the items, output index)."""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header


def _pool(node):
    """The pool's n-grams of lengths min..max as {tuple: output index} (a repeated n-gram: the last)."""
    items = [int(v) for v in (node.attr("pool_int64s") or [])]
    counts = [int(c) for c in node.attr("ngram_counts")]
    indexes = [int(i) for i in node.attr("ngram_indexes")]
    lo, hi = int(node.attr("min_gram_length")), int(node.attr("max_gram_length"))
    grams, gram_id = {}, 0
    for i, start in enumerate(counts):
        end = counts[i + 1] if i + 1 < len(counts) else len(items)
        size = i + 1
        n = (end - start) // size
        if lo <= size <= hi:
            for j in range(n):
                grams[tuple(items[start + j * size:start + (j + 1) * size])] = indexes[gram_id + j]
        gram_id += n
    return grams


def lower_tfidf_vectorizer(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    if node.attr("pool_strings"):
        raise UnsupportedOpError(f"node '{node.name}' (TfIdfVectorizer): string pools are not supported")
    if np.dtype(x.dtype) not in (np.int32, np.int64) or len(x.shape) > 2:
        raise UnsupportedOpError(f"node '{node.name}' (TfIdfVectorizer): input must be int32/int64 of rank 1 or 2")
    rows, width = (1, int(x.shape[0])) if len(x.shape) == 1 else (int(x.shape[0]), int(x.shape[1]))
    out_size = int(y.shape[-1])
    grams = _pool(node)
    lo, hi = int(node.attr("min_gram_length")), int(node.attr("max_gram_length"))
    mode = str(node.attr("mode"))
    weights = [float(w) for w in (node.attr("weights") or [])]
    flat, meta = [], []
    for gram, index in grams.items():
        meta += [len(gram), len(flat), index]
        flat += list(gram)
    table = np.array(meta + flat + [0], np.int64)   # meta first, then the items (offsets after the meta)
    items_at = len(meta)
    weight_table = np.array(weights + [0.0], np.float32)
    src = Source().line(kernel_header(4)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"ob = w * {out_size}").line(f"xb = w * {width}")
    src.line(f"for i in range({out_size}):").indent().line("p3[ob + i] = np.float32(0.0)").dedent()
    src.line(f"for d in range(1, {int(node.attr('max_skip_count', 0)) + 2}):").indent()
    src.line(f"start_n = {lo} if d == 1 else {max(lo, 2)}")
    src.line(f"if start_n > {hi}:").indent().line("break").dedent()
    src.line(f"for s in range({width}):").indent()
    src.line(f"for g in range({len(grams)}):").indent()
    src.line("n = p1[3 * g]")
    src.line(f"if n < start_n or s + (n - 1) * d >= {width}:").indent().line("continue").dedent()
    src.line(f"off = {items_at} + p1[3 * g + 1]")
    src.line("ok = True")
    src.line("for t in range(n):").indent()
    src.line("if np.int64(p0[xb + s + t * d]) != p1[off + t]:").indent().line("ok = False").line("break").dedent()
    src.dedent()
    src.line("if ok:").indent().line("p3[ob + p1[3 * g + 2]] += np.float32(1.0)").dedent()
    src.dedent().dedent().dedent()
    if mode == "IDF":
        value = "p2[i]" if weights else "np.float32(1.0)"
        src.line(f"for i in range({out_size}):").indent()
        src.line(f"p3[ob + i] = {value} if p3[ob + i] > np.float32(0.0) else np.float32(0.0)").dedent()
    elif mode == "TFIDF" and weights:
        src.line(f"for i in range({out_size}):").indent().line("p3[ob + i] = p3[ob + i] * p2[i]").dedent()
    elif mode not in ("TF", "TFIDF"):
        raise UnsupportedOpError(f"node '{node.name}' (TfIdfVectorizer): mode {mode!r} is not TF, IDF or TFIDF")
    kernel = Kernel("TfIdfVectorizer", src.text(), (np.dtype(x.dtype).name, "int64", "float32", "float32"))
    return Lowered([KernelCall(kernel, [x.name, table, weight_table, y.name], rows, node.name)])
