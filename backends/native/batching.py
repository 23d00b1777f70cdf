"""The C of a library with batch buckets (cuvil/batching.py): `session_run_batch`, which runs the
smallest bucket that holds n rows, padding the inputs and slicing the outputs through buffers the
session allocates on its first padded run (sized for the largest bucket, freed by session_destroy).
"""
from __future__ import annotations

import json

from .driver import ERROR_CODES, Entry, c_string


def _row_bytes(graph, names) -> list[int]:
    return [graph.values[n].nbytes // graph.values[n].shape[0] for n in names]


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


def batching_c(prefix: str, entries: list[Entry], batches) -> dict[str, str]:
    """The pieces driver.generate_entries puts in the file (entries in the order of `batches`,
    ascending; run_entry_<k> is the entry of batches[k])."""
    P, E = prefix, ERROR_CODES
    graph = entries[-1].graph
    largest = batches[-1]
    in_rows, out_rows = _row_bytes(graph, graph.inputs), _row_bytes(graph, graph.outputs)
    pad_bytes = sum(_aligned(r * largest) for r in in_rows + out_rows)
    n_in, n_out = max(1, len(in_rows)), max(1, len(out_rows))
    checks = []
    for kind, names in (("inputs", graph.inputs), ("outputs", graph.outputs)):
        for i, name in enumerate(names):
            checks.append(f"    if (!{kind}[{i}]) return fail(s, {E['ERR_NULL_ARGUMENT']}, "
                          f"{c_string(f'{kind[:-1]} {i} ({json.dumps(name)}) is NULL')});")
    stage_in = "\n".join(
        f"        in[{i}] = p; memcpy(p, inputs[{i}], (size_t)n * {r}); memset(p + n * {r}, 0, (size_t)(b - n) * {r});"
        f" p += {_aligned(r * largest)};" for i, r in enumerate(in_rows))
    stage_out = "\n".join(f"        out[{j}] = p; p += {_aligned(r * largest)};" for j, r in enumerate(out_rows))
    copy_out = "\n".join(f"        if (!rc) memcpy(outputs[{j}], out[{j}], (size_t)n * {r});"
                         for j, r in enumerate(out_rows))
    sizes = ", ".join(map(str, batches))
    fields = "    unsigned char* batch_pad;  /* inputs and outputs of a padded run (session_run_batch) */\n"
    destroy = "    free(s->batch_pad);\n"
    tail = f"""
/* -- batch buckets (backends/native/batching.py) -- */
typedef int (*batch_entry_fn)({P}session*, const void* const*, void* const*);
static const batch_entry_fn batch_entries[{len(entries)}] = {{{', '.join(f'run_entry_{k}' for k in range(len(entries)))}}};
static const int64_t batch_sizes[{len(entries)}] = {{{sizes}}};

EXPORT int {P}session_run_batch({P}session* s, int64_t n, const void* const* inputs, void* const* outputs) {{
    if (!s) return {E['ERR_NULL_SESSION']};
    if (n < 1 || n > {largest}) {{
        snprintf(s->error, sizeof s->error, "batch %lld is outside 1..{largest} (this library's batch buckets: "
                 "{sizes}); split the batch or build with a larger bucket", (long long)n);
        return {E['ERR_BAD_ARGUMENT']};
    }}
    if (!inputs || !outputs) return fail(s, {E['ERR_NULL_ARGUMENT']}, "inputs or outputs array is NULL");
{chr(10).join(checks)}
    int k = 0;
    while (batch_sizes[k] < n) k++;
    int64_t b = batch_sizes[k];
    int rc;
    if (b == n) {{
        rc = batch_entries[k](s, inputs, outputs);
    }} else {{
        if (!s->batch_pad) {{
            s->batch_pad = (unsigned char*)aligned_alloc(64, {max(64, pad_bytes)});
            if (!s->batch_pad) return fail(s, {E['ERR_OUT_OF_MEMORY']}, "out of memory for the padded batch "
                                            "({pad_bytes} bytes)");
        }}
        const void* in[{n_in}] = {{0}};
        void* out[{n_out}] = {{0}};
        unsigned char* p = s->batch_pad;
{stage_in}
{stage_out}
        rc = batch_entries[k](s, in, out);
{copy_out}
    }}
    if (rc) return rc;
    s->runs++;
    s->rng[1]++;   /* unseeded random ops: the next run's stream */
    s->error[0] = 0;
    return 0;
}}
"""
    return {"session_fields": fields, "create": "", "destroy": destroy, "tail": tail}


def header_section(prefix: str, batches) -> list[str]:
    """The batch buckets' part of the header."""
    P = prefix.upper()
    return [
        f"/* Batch buckets: a compiled entry for each batch size of {list(batches)}, one weights blob. The batch",
        " * is dim 0 of every input and output. session_run runs the largest bucket (the shapes above);",
        " * session_run_batch runs n rows, 1 <= n <= MAX_BATCH: the inputs and outputs hold n rows each",
        " * (dim 0 = n, the other dims as above); the smallest bucket >= n runs, its rows after n zero-padded",
        " * and its outputs' first n rows copied out. ERR_BAD_ARGUMENT for n outside 1..MAX_BATCH. */",
        f"#define {P}NUM_BATCH_BUCKETS {len(batches)}",
        f"#define {P}BATCH_BUCKETS {{{', '.join(map(str, batches))}}}",
        f"#define {P}MAX_BATCH {batches[-1]}",
        f"int {prefix}session_run_batch({prefix}session* session, int64_t n, const void* const* inputs, "
        f"void* const* outputs);",
        "",
    ]
