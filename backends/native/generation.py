"""The C of a generation library: the KV cache a session owns, prefill / decode / reset, and
next-token sampling (cuvil/generation.py describes the entries and the tensors' roles).

The cache is one buffer allocated by session_create, one region per past/present pair, bound to
both the pair's input and its output in every entry: GroupQueryAttention writes the new rows in
place and nothing is copied per token. A prompt is prefilled with the smallest bucket that holds
it (the tail padded with the pad token, the mask ones for past + bucket positions: the pads' rows
land after the real ones and the next call overwrites them), in chunks when it is longer than
the largest bucket, and with the decode entry where no bucket fits in what is left of the context.

Sampling (`sample`): temperature <= 0, or top_k == 1, is greedy (the first largest logit).
Otherwise, in double precision: x = logit / temperature; candidates ordered by x descending, then
token id ascending; the first top_k kept (top_k <= 0: all); p = exp(x - x_max) summed in that
order; with 0 < top_p < 1 the shortest prefix whose sum reaches top_p * total is kept; u = (splitmix64
>> 11) * 2^-53 and the token is the first whose running sum exceeds u * total. tests/
test_llm_runtime.py checks it against numpy doing the same.
"""
from __future__ import annotations

import numpy as np

from .driver import ERROR_CODES, Entry

_C_TYPES = {"int64": "int64_t", "int32": "int32_t"}


def _ctype(graph, name) -> str:
    return _C_TYPES[np.dtype(graph.values[name].dtype).name]


def state_regions(entries: list[Entry], layout) -> tuple[dict[str, int], int]:
    """Each past input's byte offset in the session's KV buffer, and the buffer's size."""
    graph = entries[0].graph
    offsets, size = {}, 0
    for past, _ in layout.pairs:
        nbytes = graph.values[past].nbytes
        for entry in entries[1:]:
            if entry.graph.values[past].nbytes != nbytes:
                raise AssertionError(f"{past}: the entries disagree on the cache's size")
        offsets[past] = size
        size += (nbytes + 63) // 64 * 64
    return offsets, size


def generation_c(prefix: str, entries: list[Entry], layout, vocab: int) -> dict[str, str]:
    """The pieces driver.generate_entries puts in the file: session fields, what session_create and
    session_destroy do with them, and the generation functions."""
    P = prefix
    graph = entries[0].graph
    regions, kv_bytes = state_regions(entries, layout)
    tokens = layout.entries
    longest = max(tokens)
    C = layout.max_context
    ids_t, mask_t = _ctype(graph, layout.input_ids), _ctype(graph, layout.attention_mask)
    pos_t = _ctype(graph, layout.position_ids) if layout.position_ids else "int64_t"
    presents = {present: past for past, present in layout.pairs}
    # logits rows each entry writes: a prefill entry's every row, or its last real one (LAST_ROW)
    rows = [e.graph.values[layout.logits].shape[1] for e in entries]
    logits_floats = max(rows) * vocab
    E = ERROR_CODES

    binders = []
    for k, entry in enumerate(entries):
        g = entry.graph
        ins = []
        for i, name in enumerate(g.inputs):
            if name == layout.input_ids:
                ins.append("s->ids")
            elif name == layout.attention_mask:
                ins.append("s->mask")
            elif name == layout.position_ids:
                ins.append("s->pos_ids")
            elif name == layout.last_row:
                ins.append("&s->last_row")
            else:
                ins.append(f"s->kv + {regions[name]}")
        outs = []
        for name in g.outputs:
            outs.append("logits" if name == layout.logits else f"s->kv + {regions[presents[name]]}")
        binders.append(f"""static int gen_entry_{k}({P}session* s, float* logits) {{
    const void* in[{max(1, len(ins))}] = {{{', '.join(f'(const void*)({x})' for x in ins)}}};
    void* out[{max(1, len(outs))}] = {{{', '.join(f'(void*)({x})' for x in outs)}}};
    return run_entry_{k}(s, in, out);
}}""")
    fields = f"""    int64_t position;          /* tokens in the KV cache */
    unsigned char* kv;         /* the KV cache: {len(layout.pairs)} regions, {kv_bytes} bytes */
    {ids_t}* ids;              /* [{longest}] the tokens of one entry */
    {mask_t}* mask;            /* [{C}] attention_mask */
    {pos_t}* pos_ids;          /* [{longest}] position_ids */
    float* logits;             /* [{max(rows)} x {vocab}] the prefill entries' logits */
    int64_t last_row;          /* the prompt's last real row in a prefill entry */
"""
    create = f"""    {{
        void {P}session_destroy({P}session* s);
        s->kv = (unsigned char*)aligned_alloc(64, {max(64, kv_bytes)});
        s->ids = ({ids_t}*)aligned_alloc(64, {(longest * 8 + 63) // 64 * 64});
        s->mask = ({mask_t}*)aligned_alloc(64, {(C * 8 + 63) // 64 * 64});
        s->pos_ids = ({pos_t}*)aligned_alloc(64, {(longest * 8 + 63) // 64 * 64});
        s->logits = (float*)aligned_alloc(64, {(logits_floats * 4 + 63) // 64 * 64});
        if (!s->kv || !s->ids || !s->mask || !s->pos_ids || !s->logits) {{
            snprintf(create_error, sizeof create_error, "out of memory for the KV cache (%lld bytes)",
                     (long long){kv_bytes});
            {P}session_destroy(s);
            return NULL;
        }}
        memset(s->kv, 0, {kv_bytes});
        memset(s->mask, 0, {C} * sizeof *s->mask);
    }}
"""
    destroy = "    free(s->kv); free(s->ids); free(s->mask); free(s->pos_ids); free(s->logits);\n"
    entry_list = ", ".join(f"gen_entry_{k}" for k in range(len(entries)))
    tail = f"""
/* -- generation: the KV cache, prefill, decode, sampling (backends/native/generation.py) -- */
#define GEN_CONTEXT {C}LL
#define GEN_VOCAB {vocab}LL
#define GEN_PAD {layout.pad_token}
{chr(10).join(binders)}
typedef int (*gen_entry_fn)({P}session*, float*);
static const gen_entry_fn gen_entries[{len(entries)}] = {{{entry_list}}};
static const int64_t gen_tokens[{len(entries)}] = {{{', '.join(map(str, tokens))}}};
static const int64_t gen_rows[{len(entries)}] = {{{', '.join(map(str, rows))}}};   /* logits rows written */

/* The entry for `left` tokens at cache position `past`: the smallest that holds them, else the
   largest that fits in the context (a chunk); the decode entry (1 token) always fits. */
static int gen_pick(int64_t left, int64_t past) {{
    int best = 0;
    for (int k = 0; k < {len(entries)}; k++) {{
        if (past + gen_tokens[k] > GEN_CONTEXT) break;
        best = k;
        if (gen_tokens[k] >= left) break;
    }}
    return best;
}}

static int gen_run(struct {P}session* s, int k, const int64_t* tokens, int64_t m, float* logits) {{
    int64_t S = gen_tokens[k], past = s->position;
    for (int64_t i = 0; i < S; i++) {{
        s->ids[i] = ({ids_t})(i < m ? tokens[i] : GEN_PAD);
        s->pos_ids[i] = ({pos_t})(past + i);
    }}
    for (int64_t i = 0; i < GEN_CONTEXT; i++) s->mask[i] = i < past + S;
    s->last_row = m - 1;
    int rc = gen_entries[k](s, logits);
    if (rc) return rc;
    s->position = past + m;
    s->runs++;
    s->rng[1]++;   /* unseeded random ops: the next run's stream */
    return 0;
}}

static int gen_check(struct {P}session* s, const int64_t* tokens, int64_t n) {{

    if (s->position + n > GEN_CONTEXT) {{
        snprintf(s->error, sizeof s->error, "context full: %lld tokens in the cache + %lld new > max_context %lld "
                 "(session_reset starts again; build with a larger generate.max_context)",
                 (long long)s->position, (long long)n, (long long)GEN_CONTEXT);
        return {E['ERR_CONTEXT_FULL']};
    }}
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= GEN_VOCAB) {{
            snprintf(s->error, sizeof s->error, "token %lld at index %lld is outside the vocabulary [0, %lld)",
                     (long long)tokens[i], (long long)i, (long long)GEN_VOCAB);
            return {E['ERR_BAD_TOKEN']};
        }}
    return 0;
}}

EXPORT int {P}session_prefill({P}session* s, const int64_t* tokens, int64_t n, float* logits_out) {{
    if (!s) return {E['ERR_NULL_SESSION']};
    if (n < 1) return fail(s, {E['ERR_BAD_ARGUMENT']}, "prefill: n must be at least 1");
    if (!tokens) return fail(s, {E['ERR_NULL_ARGUMENT']}, "prefill: tokens is NULL");
    int rc = gen_check(s, tokens, n);
    if (rc) return rc;
    for (int64_t done = 0; done < n;) {{
        int64_t left = n - done;
        int k = gen_pick(left, s->position);
        int64_t m = left < gen_tokens[k] ? left : gen_tokens[k];
        rc = gen_run(s, k, tokens + done, m, s->logits);
        if (rc) return rc;
        done += m;
        if (done == n && logits_out)
            memcpy(logits_out, s->logits + (gen_rows[k] == 1 ? 0 : m - 1) * GEN_VOCAB, GEN_VOCAB * sizeof(float));
    }}
    s->error[0] = 0;
    return 0;
}}

EXPORT int {P}session_decode({P}session* s, int64_t token, float* logits_out) {{
    if (!s) return {E['ERR_NULL_SESSION']};
    int rc = gen_check(s, &token, 1);
    if (rc) return rc;
    rc = gen_run(s, 0, &token, 1, logits_out ? logits_out : s->logits);
    if (rc) return rc;
    s->error[0] = 0;
    return 0;
}}

EXPORT int {P}session_reset({P}session* s) {{
    if (!s) return {E['ERR_NULL_SESSION']};
    s->position = 0;
    s->error[0] = 0;
    return 0;
}}

EXPORT int64_t {P}session_position(const {P}session* s) {{ return s ? s->position : -1; }}

EXPORT int64_t {P}max_context(void) {{ return GEN_CONTEXT; }}

EXPORT int64_t {P}vocab_size(void) {{ return GEN_VOCAB; }}

EXPORT const void* {P}session_kv_cache(const {P}session* s, int64_t* nbytes) {{
    if (nbytes) *nbytes = s ? {kv_bytes} : 0;
    return s ? s->kv : NULL;
}}

{_SAMPLE.replace("@P@", P)}"""
    return {"session_fields": fields, "create": create, "destroy": destroy, "tail": tail}


_SAMPLE = r"""
#include <math.h>
typedef struct @P@sampling { float temperature; int32_t top_k; float top_p; } @P@sampling;

static uint64_t gen_splitmix64(uint64_t* state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

typedef struct { double x; int64_t id; } gen_cand;

/* a before b: larger x, then smaller id */
static int gen_before(const gen_cand* a, const gen_cand* b) { return a->x > b->x || (a->x == b->x && a->id < b->id); }
static int gen_order(const void* a, const void* b) {
    return gen_before((const gen_cand*)a, (const gen_cand*)b) ? -1 : gen_before((const gen_cand*)b, (const gen_cand*)a);
}

/* heap of the k best so far, the worst at its root */
static void gen_sift(gen_cand* h, int64_t k, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, w = i;
        if (l < k && gen_before(&h[w], &h[l])) w = l;
        if (r < k && gen_before(&h[w], &h[r])) w = r;
        if (w == i) return;
        gen_cand t = h[i]; h[i] = h[w]; h[w] = t;
        i = w;
    }
}

EXPORT int64_t @P@sample(const float* logits, const @P@sampling* p, uint64_t* rng_state) {
    if (!logits) return -1;
    if (!p || !(p->temperature > 0) || p->top_k == 1) {
        int64_t best = 0;
        for (int64_t i = 1; i < GEN_VOCAB; i++) if (logits[i] > logits[best]) best = i;
        return best;
    }
    if (!rng_state) return -1;
    int64_t k = p->top_k > 0 && p->top_k < GEN_VOCAB ? p->top_k : GEN_VOCAB;
    gen_cand* c = (gen_cand*)malloc((size_t)k * sizeof *c);
    if (!c) return -1;
    double t = (double)p->temperature;
    for (int64_t i = 0; i < k; i++) { c[i].x = (double)logits[i] / t; c[i].id = i; }
    if (k < GEN_VOCAB) {
        for (int64_t i = k / 2 - 1; i >= 0; i--) gen_sift(c, k, i);
        for (int64_t i = k; i < GEN_VOCAB; i++) {
            gen_cand n = {(double)logits[i] / t, i};
            if (gen_before(&n, &c[0])) { c[0] = n; gen_sift(c, k, 0); }
        }
    }
    qsort(c, (size_t)k, sizeof *c, gen_order);
    double top = c[0].x, total = 0;
    for (int64_t i = 0; i < k; i++) { c[i].x = exp(c[i].x - top); total += c[i].x; }
    if (p->top_p > 0 && p->top_p < 1) {
        double sum = 0, want = (double)p->top_p * total;
        for (int64_t i = 0; i < k; i++) {
            sum += c[i].x;
            if (sum >= want) { k = i + 1; break; }
        }
        total = sum;
    }
    double u = (double)(gen_splitmix64(rng_state) >> 11) * (1.0 / 9007199254740992.0);
    double target = u * total, sum = 0;
    int64_t token = c[k - 1].id;
    for (int64_t i = 0; i < k; i++) {
        sum += c[i].x;
        if (target < sum) { token = c[i].id; break; }
    }
    free(c);
    return token;
}
"""


def header_section(prefix: str, layout, vocab: int) -> list[str]:
    """The generation part of the header."""
    P = prefix
    return [
        "/* Generation (a decoder with a static KV cache of max_context tokens, which each session owns).",
        f" * Prefill entries for {list(layout.buckets)} tokens (a prompt goes to the smallest that holds it,",
        " * padded; longer prompts in chunks) and a one-token decode entry; the cache is written in place.",
        " * Errors: ERR_CONTEXT_FULL when the tokens would not fit (session_reset starts again),",
        " * ERR_BAD_TOKEN for an id outside [0, vocab_size), ERR_BAD_ARGUMENT for n < 1; session_error says more.",
        " * session_run runs the decode entry on tensors the caller gives (the model's own inputs). */",
        f"#define {P.upper()}MAX_CONTEXT {layout.max_context}",
        f"#define {P.upper()}VOCAB_SIZE {vocab}",
        f"int64_t {P}max_context(void);",
        f"int64_t {P}vocab_size(void);",
        "/* Append n >= 1 prompt tokens to the cache; logits_out (vocab_size floats, or NULL) gets the",
        "   logits after the last one. Returns 0 or an error code. */",
        f"int {P}session_prefill({P}session* session, const int64_t* tokens, int64_t n, float* logits_out);",
        "/* Append one token; logits_out (vocab_size floats, or NULL) gets the logits after it. */",
        f"int {P}session_decode({P}session* session, int64_t token, float* logits_out);",
        "/* Empty the cache (position 0). */",
        f"int {P}session_reset({P}session* session);",
        "/* Tokens in the cache. */",
        f"int64_t {P}session_position(const {P}session* session);",
        "/* The KV cache (read-only, for inspection): its address and its size in *nbytes. */",
        f"const void* {P}session_kv_cache(const {P}session* session, int64_t* nbytes);",
        "/* Next-token choice. temperature <= 0 or top_k == 1: greedy (the first largest logit). Else",
        "   logits / temperature, the top_k largest (top_k <= 0: all), softmax, with 0 < top_p < 1 the",
        "   smallest set whose probability reaches top_p, one draw from *rng_state (splitmix64; any seed",
        "   value, advanced by the call). params NULL: greedy. Returns the token id, or -1 (NULL logits,",
        "   NULL rng_state when sampling, out of memory). */",
        f"typedef struct {P}sampling {{ float temperature; int32_t top_k; float top_p; }} {P}sampling;",
        f"int64_t {P}sample(const float* logits, const {P}sampling* params, uint64_t* rng_state);",
        "",
    ]
