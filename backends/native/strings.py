"""String tensors in the driver (docs/strings.md): the session's string pool and the C the run
adds around the string kernels.

A string tensor is an array of `const char*`, one NUL-terminated UTF-8 string per element, C order,
8 bytes an element wherever it lives (arena, inputs, outputs). The kernels that make strings
(backends/numba_cpu/strings.py: C defined in this driver, not Numba objects) copy their bytes into
the session's pool; a run empties the pool when it starts, so what a run returns stays valid until
the session's next run or its destruction. Only a library with a string tensor has any of this:
a numeric library's driver is byte-identical to one made before strings existed.
"""
from __future__ import annotations

import json

import numpy as np

ERR_NULL_ARGUMENT, ERR_OUT_OF_MEMORY = 2, 3   # driver.ERROR_CODES

# The pool, and the helpers every string kernel may call. `free` is _aligned_free on Windows
# (driver.py), so the chunks come from aligned_alloc too.
PRELUDE = r"""
/* String tensors: arrays of const char* (NUL-terminated UTF-8), the bytes the run makes in a pool
   the session owns, emptied when the next run starts (docs/strings.md). */
struct strings_chunk { struct strings_chunk* next; size_t used, size; char data[]; };
struct strings { struct strings_chunk* head; int code; char message[256]; };

static void strings_reset(struct strings* S) {
    struct strings_chunk* c = S->head;
    if (c) {   /* keep the newest (largest) chunk for the next run, free the others */
        struct strings_chunk* rest = c->next;
        while (rest) { struct strings_chunk* next = rest->next; free(rest); rest = next; }
        c->next = NULL;
        c->used = 0;
    }
    S->code = 0;
    S->message[0] = 0;
}

static void strings_free(struct strings* S) {
    struct strings_chunk* c = S->head;
    while (c) { struct strings_chunk* next = c->next; free(c); c = next; }
    S->head = NULL;
}

static char* str_alloc(struct strings* S, size_t n) {
    struct strings_chunk* c = S->head;
    n = (n + 7) & ~(size_t)7;
    if (!c || c->size - c->used < n) {
        size_t size = c && 2 * c->size > n ? 2 * c->size : (n > 4096 ? n : 4096);
        size_t bytes = (sizeof *c + size + 63) / 64 * 64;
        c = (struct strings_chunk*)aligned_alloc(64, bytes);
        if (!c) {
            S->code = 3;
            snprintf(S->message, sizeof S->message, "out of memory for the strings of the run (%lld bytes)",
                     (long long)n);
            return NULL;
        }
        c->next = S->head; c->used = 0; c->size = bytes - sizeof *c; S->head = c;
    }
    char* p = c->data + c->used;
    c->used += n;
    return p;
}

/* A copy of the n bytes at a, NUL-terminated, in the pool (NULL when out of memory). */
static char* str_copy(struct strings* S, const char* a, size_t n) {
    char* p = str_alloc(S, n + 1);
    if (!p) return NULL;
    memcpy(p, a, n);
    p[n] = 0;
    return p;
}

static void strings_error(struct strings* S, int code, const char* node, const char* what) {
    S->code = code;
    snprintf(S->message, sizeof S->message, "node '%s': %s", node, what);
}

/* The graph's string outputs are copied into the pool at the end of the run: whatever element
   pointers the kernels and views left (into the inputs, the constants), the caller gets strings
   the session owns, back to back in element order in one block (docs/strings.md). */
static int strings_own(struct strings* S, const char** out, int64_t n) {
    size_t total = 0;
    for (int64_t i = 0; i < n; i++) total += strlen(out[i] ? out[i] : "") + 1;
    char* block = str_alloc(S, total ? total : 1);
    if (!block) return S->code;
    for (int64_t i = 0; i < n; i++) {
        const char* t = out[i] ? out[i] : "";
        const size_t len = strlen(t) + 1;
        memcpy(block, t, len);
        out[i] = block;
        block += len;
    }
    return 0;
}
"""

# The header's words on string tensors (only a library that has one says them).
HEADER_NOTE = [
    " *",
    " *   A string tensor is an array of const char*, one NUL-terminated UTF-8 string per element. An input's",
    " *   strings need to live until session_run returns (a NULL element: ERR_NULL_ARGUMENT); an output's array",
    " *   gets pointers into memory the session owns, valid until its next session_run or session_destroy,",
    " *   the strings back to back in element order (each right after the previous one's NUL).",
]

SESSION_FIELD = "    struct strings strings;   /* the bytes of the run's string tensors */\n"
DESTROY = "    strings_free(&s->strings);\n"


def is_string(dtype) -> bool:
    return np.dtype(dtype) == np.dtype(object)


def uses_strings(graph, schedule) -> bool:
    from backends.schedule import KernelCall
    return any(is_string(v.dtype) for v in graph.values.values()) or \
        any(isinstance(c, KernelCall) and c.kernel.language == "c" for c in schedule)


def run_start(graph, c_string) -> list[str]:
    """C at the start of a run: the pool emptied, every element pointer of a string input checked
    (`c_string`: driver.c_string)."""
    lines = ["    strings_reset(&s->strings);"]
    for i, name in enumerate(graph.inputs):
        value = graph.values[name]
        if is_string(value.dtype) and value.size:
            message = c_string(f"input {i} ({json.dumps(name)}): a string element is NULL (pass \"\" for an empty string)")
            lines += [f"    for (int64_t k = 0; k < {value.size}; k++)",
                      f"        if (!((const char* const*)inputs[{i}])[k]) return fail(s, {ERR_NULL_ARGUMENT}, {message});"]
    return lines


def run_end(graph) -> list[str]:
    """C at the end of a run: the string outputs' bytes copied into the pool."""
    lines = []
    for i, name in enumerate(graph.outputs):
        value = graph.values[name]
        if is_string(value.dtype) and value.size:
            lines.append(f"    if (strings_own(&s->strings, (const char**)outputs[{i}], {value.size})) "
                         "return fail(s, s->strings.code, s->strings.message);")
    return lines


def call(symbol: str, args: str, work: int, comment: str) -> list[str]:
    """A C string kernel's call (it takes the pool first) and the check of its error."""
    return [f"    {symbol}(&s->strings, {args}, 0, {work}); /* {comment} */",
            "    if (s->strings.code) return fail(s, s->strings.code, s->strings.message);"]


def definitions(c_kernels: dict) -> str:
    """The C kernels' definitions: symbol -> (number of pointer arguments, body)."""
    out = []
    for symbol, (n, body) in sorted(c_kernels.items()):
        params = ", ".join(f"void* p{k}" for k in range(n))
        out.append(f"static void {symbol}(struct strings* S, {params}, int64_t begin, int64_t end) {{\n"
                   f"    (void)S; (void)begin; (void)end;\n{body}\n}}")
    return "\n\n".join(out)
