"""onnxruntime's contrib ops of LLM decoders (onnxruntime-genai's model builder writes them): their
output shapes, and the checks of what Cuvil compiles. ONNX's shape inference does not know these ops;
the frontend asks `infer` instead (MatMulNBits has its own form, cuvil/nbits.py).

    GroupQueryAttention (com.microsoft)
        inputs  query [B, S, D] (packed QKV when key/value are omitted: D = (N + 2 Nkv) H),
                key/value [B, S, Nkv H], past_key/past_value [B, Nkv, P, H], seqlens_k int32 [B]
                (total length - 1), total_sequence_length int32 (a constant here), cos_cache/sin_cache
                [max_pos, R/2] (do_rotary=1)
        outputs output [B, S, N H], present_key/present_value [B, Nkv, max(P, total), H]
        Semantics (onnxruntime's CPU kernel): past_seqlen = seqlens_k[b] + 1 - S (0 for a first prompt,
        S == total); the S new key/value rows (K after rotary) go to rows past_seqlen.. of present; query
        row i attends to rows 0 .. past_seqlen + i; rotary position of row i is past_seqlen + i.
    RotaryEmbedding (com.microsoft)
        input [B, S, hidden] or [B, N, S, H], position_ids int64 [B, S] (or [1]: a start position),
        cos_cache/sin_cache [max_pos, R/2]; output like the input.
    SimplifiedLayerNormalization (onnxruntime registers it in the default domain)
        y = x / sqrt(mean(x^2) + epsilon) * scale over the last axes from `axis`
    SkipSimplifiedLayerNormalization (com.microsoft)
        s = input + skip (+ bias); y = s / sqrt(mean(s^2) + epsilon) * gamma;
        outputs y, mean (unsupported), inv_std_var (unsupported), s
"""
from __future__ import annotations

import numpy as np

from .errors import UnsupportedOpError

MS = "com.microsoft"
GQA_INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
              "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink")


def _fail(node, why, hint=None):
    domain = f"{node.domain}::" if node.domain else ""
    raise UnsupportedOpError(f"node '{node.name}' ({domain}{node.op}): {why}", hint=hint)


def _input(node, values, pos):
    name = node.inputs[pos] if len(node.inputs) > pos else ""
    return values[name] if name else None


def _float32(node, value, what):
    if value is None:
        _fail(node, f"input {what} is missing")
    if np.dtype(value.dtype) != np.float32:
        _fail(node, f"input {what} is {np.dtype(value.dtype).name}",
              hint="Cuvil compiles this op in float32 (build the model with -p fp32 or int4 and -e cpu)")


def _rotary_tables(node, values, cos_pos, what="cos_cache/sin_cache"):
    cos, sin = _input(node, values, cos_pos), _input(node, values, cos_pos + 1)
    if cos is None or sin is None:
        _fail(node, f"rotary needs {what}")
    for v in (cos, sin):
        _float32(node, v, f"'{v.name}'")
        if not v.is_const:
            _fail(node, f"'{v.name}' is computed at run time", hint="the rotary tables must be initializers")
    if len(cos.shape) != 2 or cos.shape != sin.shape:
        _fail(node, f"cos_cache {list(cos.shape)} and sin_cache {list(sin.shape)} must both be [max_position, rotary_dim / 2]")
    return cos, sin


def gqa_form(node, values) -> dict:
    """Everything the lowering needs of a GroupQueryAttention node, checked."""
    n_in = len(node.inputs)
    if n_in > len(GQA_INPUTS):
        _fail(node, f"takes at most {len(GQA_INPUTS)} inputs, got {n_in}")
    for pos in (9, 10, 11):
        if n_in > pos and node.inputs[pos]:
            _fail(node, f"input {GQA_INPUTS[pos]} is not supported",
                  hint="Cuvil compiles GroupQueryAttention with positions from seqlens_k and a causal mask only")
    if len(node.outputs) > 3 and node.outputs[3]:
        _fail(node, "output output_qk is not supported")
    for attr, ok, text in (("local_window_size", lambda v: int(v) == -1, "-1 (no sliding window)"),
                           ("softcap", lambda v: float(v) == 0.0, "0"),
                           ("smooth_softmax", lambda v: int(v) == 0, "0"),
                           ("qk_output", lambda v: int(v) == 0, "0")):
        if attr in node.attrs and not ok(node.attrs[attr]):
            _fail(node, f"{attr}={node.attrs[attr]} is not supported", hint=f"supported: {attr} = {text}")
    heads, kv_heads = int(node.attrs.get("num_heads", 0)), int(node.attrs.get("kv_num_heads", 0))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        _fail(node, f"num_heads={heads}, kv_num_heads={kv_heads}: both must be positive, num_heads a multiple of kv_num_heads")
    q = _input(node, values, 0)
    _float32(node, q, "query")
    if len(q.shape) != 3:
        _fail(node, f"query has shape {list(q.shape)}; expected [batch, sequence, hidden]")
    B, S, D = q.shape
    key, value = _input(node, values, 1), _input(node, values, 2)
    packed = key is None and value is None
    if packed:
        if D % (heads + 2 * kv_heads):
            _fail(node, f"packed query width {D} is not a multiple of num_heads + 2 kv_num_heads = {heads + 2 * kv_heads}")
        H = D // (heads + 2 * kv_heads)
    else:
        if key is None or value is None:
            _fail(node, "key and value must both be given, or both omitted (packed QKV)")
        if D % heads:
            _fail(node, f"query width {D} is not a multiple of num_heads={heads}")
        H = D // heads
        for v, what in ((key, "key"), (value, "value")):
            _float32(node, v, what)
            if tuple(v.shape) != (B, S, kv_heads * H):
                _fail(node, f"{what} has shape {list(v.shape)}; expected [{B}, {S}, {kv_heads * H}]")
    past_k, past_v = _input(node, values, 3), _input(node, values, 4)
    if (past_k is None) != (past_v is None):
        _fail(node, "past_key and past_value must both be given or both omitted")
    P = 0
    if past_k is not None:
        for v, what in ((past_k, "past_key"), (past_v, "past_value")):
            _float32(node, v, what)
            if len(v.shape) != 4 or v.shape[0] != B or v.shape[1] != kv_heads or v.shape[3] != H:
                _fail(node, f"{what} has shape {list(v.shape)}; expected [{B}, {kv_heads}, past_length, {H}]",
                      hint="Cuvil compiles the BNSH past/present layout")
        P = int(past_k.shape[2])
        if past_v.shape != past_k.shape:
            _fail(node, f"past_value {list(past_v.shape)} and past_key {list(past_k.shape)} differ")
    seqlens = _input(node, values, 5)
    if seqlens is None or np.dtype(seqlens.dtype) != np.int32 or seqlens.size != B:
        _fail(node, f"seqlens_k must be int32 [{B}]")
    total_v = _input(node, values, 6)
    if total_v is None or total_v.size != 1:
        _fail(node, "total_sequence_length must be a one-element tensor")
    if not total_v.is_const:
        _fail(node, f"total_sequence_length ('{total_v.name}') is computed at run time",
              hint="give attention_mask a static shape: total_sequence_length is its length")
    total = int(np.asarray(total_v.data).reshape(-1)[0])
    if total < S:
        _fail(node, f"total_sequence_length {total} is shorter than the sequence length {S}")
    do_rotary = int(node.attrs.get("do_rotary", 0)) == 1
    rotary_dim = 0
    cos = sin = None
    if do_rotary:
        cos, sin = _rotary_tables(node, values, 7)
        rotary_dim = 2 * int(cos.shape[1])
        if rotary_dim > H or rotary_dim == 0:
            _fail(node, f"rotary dim {rotary_dim} (from cos_cache) is not in 1..head_size={H}")
    present = max(P, total)
    first_prompt = S > 1 and S == total
    if P == 0 and not first_prompt and past_k is None and S != total:
        _fail(node, "without past_key/past_value the sequence must be the whole total_sequence_length")
    scale = float(node.attrs.get("scale", 0.0)) or 1.0 / float(np.sqrt(H))
    return dict(B=B, S=S, H=H, heads=heads, kv_heads=kv_heads, packed=packed, past=P, present=present,
                total=total, first_prompt=first_prompt, do_rotary=do_rotary, rotary_dim=rotary_dim,
                interleaved=int(node.attrs.get("rotary_interleaved", 0)) == 1, scale=scale, cos=cos, sin=sin)


def _gqa(node, values):
    f = gqa_form(node, values)
    kv = (f["B"], f["kv_heads"], f["present"], f["H"])
    return [((f["B"], f["S"], f["heads"] * f["H"]), np.dtype(np.float32)), (kv, np.dtype(np.float32)),
            (kv, np.dtype(np.float32))]


def rotary_form(node, values) -> dict:
    x = _input(node, values, 0)
    _float32(node, x, "input")
    if int(node.attrs.get("is_packed_batching", 0)):
        _fail(node, "is_packed_batching=1 is not supported")
    cos, sin = _rotary_tables(node, values, 2)
    pos = _input(node, values, 1)
    if pos is None or np.dtype(pos.dtype).kind not in "iu":
        _fail(node, "position_ids must be an integer tensor")
    half = int(cos.shape[1])
    heads = int(node.attrs.get("num_heads", 0))
    if len(x.shape) == 4:
        B, N, S, H = x.shape
        layout = "bnsh"
    elif len(x.shape) == 3:
        B, S, hidden = x.shape
        H = hidden // heads if heads else 2 * half
        if hidden % H:
            _fail(node, f"hidden size {hidden} is not a multiple of the head size {H}")
        N = hidden // H
        layout = "bsnh"
    else:
        _fail(node, f"input has shape {list(x.shape)}; expected [B, S, hidden] or [B, N, S, H]")
    rotary_dim = int(node.attrs.get("rotary_embedding_dim", 0)) or H
    if rotary_dim != 2 * half or rotary_dim > H:
        _fail(node, f"rotary_embedding_dim {rotary_dim} does not match cos_cache [.., {half}] and head size {H}")
    if pos.size not in (1, B * S):
        _fail(node, f"position_ids has shape {list(pos.shape)}; expected [{B}, {S}] or [1]")
    return dict(B=B, S=S, N=N, H=H, layout=layout, rotary_dim=rotary_dim, cos=cos, sin=sin,
                interleaved=int(node.attrs.get("interleaved", 0)) == 1, scale=float(node.attrs.get("scale", 1.0)),
                start_only=pos.size == 1 and B * S != 1)


def _rotary(node, values):
    f = rotary_form(node, values)
    x = _input(node, values, 0)
    if f["scale"] != 1.0:
        _fail(node, f"scale={f['scale']} is not supported", hint="supported: scale = 1")
    return [(tuple(x.shape), np.dtype(np.float32))]


def norm_form(node, values, skip: bool) -> dict:
    x = _input(node, values, 0)
    _float32(node, x, "input")
    if skip:
        s, gamma, bias = _input(node, values, 1), _input(node, values, 2), _input(node, values, 3)
        _float32(node, s, "skip")
        if tuple(s.shape) != tuple(x.shape):
            _fail(node, f"skip {list(s.shape)} must have the input's shape {list(x.shape)}")
        if len(node.outputs) > 1 and node.outputs[1] or len(node.outputs) > 2 and node.outputs[2]:
            _fail(node, "outputs mean and inv_std_var are not supported", hint="onnxruntime-genai's models leave them out")
        size = int(x.shape[-1])
    else:
        gamma, bias = _input(node, values, 1), None
        axis = int(node.attrs.get("axis", -1))
        axis = axis + len(x.shape) if axis < 0 else axis
        size = int(np.prod(x.shape[axis:], dtype=np.int64))
        if len(node.outputs) > 1 and any(node.outputs[1:]):
            _fail(node, "outputs beyond the first (inv_std_var) are not supported")
    _float32(node, gamma, "scale")
    if gamma.size != size:
        _fail(node, f"scale has {gamma.size} values; expected {size}")
    if bias is not None:
        _float32(node, bias, "bias")
        if bias.size != size:
            _fail(node, f"bias has {bias.size} values; expected {size}")
    return dict(size=size, rows=x.size // size, epsilon=float(node.attrs.get("epsilon", 1e-5)))


def _norm(node, values):
    norm_form(node, values, skip=False)
    x = _input(node, values, 0)
    return [(tuple(x.shape), np.dtype(np.float32))] + [((), np.dtype(np.float32))] * (len(node.outputs) - 1)


def _skip_norm(node, values):
    norm_form(node, values, skip=True)
    x = _input(node, values, 0)
    out = (tuple(x.shape), np.dtype(np.float32))
    return [out, ((), np.dtype(np.float32)), ((), np.dtype(np.float32)), out][:len(node.outputs)]


RULES = {
    (MS, "GroupQueryAttention"): _gqa,
    (MS, "RotaryEmbedding"): _rotary,
    ("", "SimplifiedLayerNormalization"): _norm,
    (MS, "SimplifiedLayerNormalization"): _norm,
    (MS, "SkipSimplifiedLayerNormalization"): _skip_norm,
}


def infer(node, values) -> list[tuple[tuple[int, ...], np.dtype]] | None:
    """The outputs' (shape, dtype) of a contrib op this module knows (None for other ops)."""
    rule = RULES.get((node.domain or "", node.op))
    return rule(node, values) if rule else None
