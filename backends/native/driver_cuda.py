"""The generated C driver of a CUDA library: the same C ABI as the CPU driver (driver.py), one
device arena, the weights uploaded once per session, every kernel launched on one stream.

The library links no CUDA library: session_create loads the driver API (`libcuda.so.1`) with
dlopen, so the .so loads anywhere, and on a machine without an NVIDIA driver or GPU
session_create returns NULL and session_error(NULL) says why. Each kernel is an embedded
fatbin (machine code for the target's architecture and its PTX, see numba_cuda/emit.py) loaded
with cuModuleLoadData. `session_run` (host pointers) stages inputs and outputs through pinned
buffers; its kernels are captured as a CUDA graph on the first run and replayed after.
`session_run_device` takes device pointers and a stream, for callers that keep data on the GPU.
"""
from __future__ import annotations

import json

from backends.schedule import KernelCall, View

from .driver import ABI_VERSION, ERROR_CODES, c_string, output_shape_tables, storage

CUDA_ERROR_CODES = {**ERROR_CODES, "ERR_DEVICE": 4}


def header(prefix: str, model_name: str, info: dict) -> str:
    """The CPU header plus the device-pointer entry point."""
    from .driver import header as cpu_header
    text = cpu_header(prefix, model_name, info)
    extra = "\n".join([
        f"#define {prefix.upper()}ERR_DEVICE {CUDA_ERROR_CODES['ERR_DEVICE']}",
        "/* Device pointers (CUdeviceptr values) for every input and output, on `stream` (a CUstream;",
        "   NULL: the session's own). Returns once the work is queued: synchronise the stream before",
        "   reading the outputs. */",
        f"int {prefix}session_run_device({prefix}session* session, const void* const* inputs, void* const* outputs,",
        "                                void* stream);",
        ""])
    marker = f"void {prefix}session_destroy({prefix}session* session);\n"
    return text.replace(marker, marker + extra)


# The driver API functions the library calls (dlsym names; the _v2 ones are what cuda.h maps to).
_API = [
    ("cuInit", "int (*)(unsigned)"),
    ("cuDeviceGetCount", "int (*)(int*)"),
    ("cuDeviceGet", "int (*)(int*, int)"),
    ("cuDeviceGetAttribute", "int (*)(int*, int, int)"),
    ("cuDevicePrimaryCtxRetain", "int (*)(void**, int)"),
    ("cuDevicePrimaryCtxRelease_v2", "int (*)(int)"),
    ("cuCtxSetCurrent", "int (*)(void*)"),
    ("cuModuleLoadData", "int (*)(void**, const void*)"),
    ("cuModuleUnload", "int (*)(void*)"),
    ("cuModuleGetFunction", "int (*)(void**, void*, const char*)"),
    ("cuMemAlloc_v2", "int (*)(uint64_t*, size_t)"),
    ("cuMemFree_v2", "int (*)(uint64_t)"),
    ("cuMemAllocHost_v2", "int (*)(void**, size_t)"),
    ("cuMemFreeHost", "int (*)(void*)"),
    ("cuMemcpyHtoD_v2", "int (*)(uint64_t, const void*, size_t)"),
    ("cuMemcpyHtoDAsync_v2", "int (*)(uint64_t, const void*, size_t, void*)"),
    ("cuMemcpyDtoHAsync_v2", "int (*)(void*, uint64_t, size_t, void*)"),
    ("cuMemcpyDtoDAsync_v2", "int (*)(uint64_t, uint64_t, size_t, void*)"),
    ("cuMemsetD8Async", "int (*)(uint64_t, unsigned char, size_t, void*)"),
    ("cuStreamCreate", "int (*)(void**, unsigned)"),
    ("cuStreamDestroy_v2", "int (*)(void*)"),
    ("cuStreamSynchronize", "int (*)(void*)"),
    ("cuLaunchKernel", "int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, "
                       "void**, void**)"),
    ("cuStreamBeginCapture_v2", "int (*)(void*, int)"),
    ("cuStreamEndCapture", "int (*)(void*, void**)"),
    ("cuGraphInstantiateWithFlags", "int (*)(void**, void*, unsigned long long)"),
    ("cuGraphLaunch", "int (*)(void*, void*)"),
    ("cuGraphDestroy", "int (*)(void*)"),
    ("cuGraphExecDestroy", "int (*)(void*)"),
    ("cuGetErrorString", "int (*)(int, const char**)"),
]
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_STREAM_NON_BLOCKING = 1
CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1


_PLACES = {"output": "OUT({})", "input": "IN({})", "weights": "(s->d_weights + {})", "arena": "(s->d_arena + {})"}


def _pointer(name, plan, weights_offsets, input_index, output_index):
    """The device address of a value, as a C expression of type uint64_t."""
    kind, where = storage(name, plan, weights_offsets, input_index, output_index)
    if kind not in _PLACES:   # a CUDA plan has no host-side shared block
        raise ValueError(f"value {name!r} has no storage on the device ({kind})")
    return _PLACES[kind].format(where)


def generate(graph, schedule, plan, weights_offsets, weights_bytes: int, info: dict, prefix: str,
             target) -> str:
    """The driver's C for a CUDA target (backends.targets.CudaTarget)."""
    input_index = {n: i for i, n in enumerate(graph.inputs)}
    output_index = {}
    for i, n in enumerate(graph.outputs):
        output_index.setdefault(n, i)
    ptr = lambda n: _pointer(n, plan, weights_offsets, input_index, output_index)

    kernels = []      # symbols, in first-use order
    for call in schedule:
        if isinstance(call, KernelCall):
            if call.once or call.in_place is not None or call.kernel.block <= 0:
                raise ValueError(f"call for '{call.node}' is not a GPU kernel call")
            if call.kernel.symbol not in kernels:
                kernels.append(call.kernel.symbol)
    fn_index = {sym: i for i, sym in enumerate(kernels)}

    body = []
    for call in schedule:
        if isinstance(call, View):
            if call.dst in output_index and ptr(call.dst) != ptr(call.src):
                body.append(f"    CK(api.cuMemcpyDtoDAsync_v2({ptr(call.dst)}, {ptr(call.src)}, "
                            f"{graph.values[call.dst].nbytes}, st)); /* {_comment(call.node)} */")
            continue
        block = call.kernel.block
        grid = max(1, -(-call.work // block))
        args = [ptr(a) for a in call.args]
        decl = "".join(f" uint64_t a{i} = {a};" for i, a in enumerate(args))
        params = ", ".join([f"&a{i}" for i in range(len(args))] + ["&n"])
        body.append(f"    {{{decl} int64_t n = {call.work}; void* p[] = {{{params}}};\n"
                    f"      CK(api.cuLaunchKernel(s->fn[{fn_index[call.kernel.symbol]}], {grid}, 1, 1, {block}, 1, 1, 0, "
                    f"st, p, NULL)); }} /* {_comment(call.node)} */")
    written = {a for c in schedule if isinstance(c, KernelCall) for a in c.args[len(c.args) - c.n_outputs:]}
    for i, name in enumerate(graph.outputs):
        first = output_index[name]
        if i != first or (name not in written and not any(isinstance(c, View) and c.dst == name for c in schedule)):
            src = f"OUT({first})" if i != first else _source_pointer(name, plan, weights_offsets, input_index)
            body.append(f"    CK(api.cuMemcpyDtoDAsync_v2(OUT({i}), {src}, {graph.values[name].nbytes}, st));")

    n_in, n_out = len(graph.inputs), len(graph.outputs)
    in_bytes = [graph.values[n].nbytes for n in graph.inputs]
    out_bytes = [graph.values[n].nbytes for n in graph.outputs]
    io_sizes = in_bytes + out_bytes
    io_offsets, total = [], 0
    for size in io_sizes:
        io_offsets.append(total)
        total += (max(size, 1) + 255) // 256 * 256
    io_total = max(total, 256)
    null_checks = []
    for kind, names in (("inputs", graph.inputs), ("outputs", graph.outputs)):
        for i, name in enumerate(names):
            null_checks.append(f"    if (!{kind}[{i}]) return fail(s, {ERROR_CODES['ERR_NULL_ARGUMENT']}, "
                               f"{c_string(f'{kind[:-1]} {i} ({json.dumps(name)}) is NULL')});")
    P = prefix
    api_fields = "\n".join(f"    {sig.replace('(*)', '(*' + name + ')', 1)};" for name, sig in _API)
    api_loads = "\n".join(f"    LOAD({name});" for name, _ in _API)
    fatbins = "\n".join(f"extern const unsigned char {sym}_fatbin[] HIDDEN;" for sym in kernels)
    fatbin_table = ", ".join(f"{sym}_fatbin" for sym in kernels) or "NULL"
    name_table = ", ".join(c_string(sym) for sym in kernels) or "NULL"
    n_k = max(1, len(kernels))
    io_off = ", ".join(str(o) for o in io_offsets) or "0"
    io_len = ", ".join(str(s) for s in io_sizes) or "0"
    cc_major, cc_minor = target.cc
    return f"""/* Generated by cuvil for {target.name} ({target.arch}). Do not edit. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HIDDEN __attribute__((visibility("hidden")))
#define EXPORT __attribute__((visibility("default")))
#define ARENA_BYTES {max(plan.arena_bytes, 256)}
#define WEIGHTS_BYTES {max(weights_bytes, 1)}
#define NUM_KERNELS {len(kernels)}
#define NUM_IN {n_in}
#define NUM_OUT {n_out}
#define IO_BYTES {io_total}

extern const unsigned char {P}weights[] HIDDEN;
{fatbins}

static const unsigned char* const fatbin_of[{n_k}] = {{ {fatbin_table} }};
static const char* const kernel_name[{n_k}] = {{ {name_table} }};
/* Inputs then outputs: their offsets in the session's device I/O block and pinned staging, and sizes. */
static const size_t io_offset[{max(1, n_in + n_out)}] = {{ {io_off} }};
static const size_t io_bytes[{max(1, n_in + n_out)}] = {{ {io_len} }};

/* The CUDA driver API, loaded at run time: the library links no CUDA library. */
static struct {{
{api_fields}
}} api;
static pthread_once_t api_once = PTHREAD_ONCE_INIT;
static char api_error[256];

static void load_api(void) {{
    /* CUVIL_CUDA_LIBRARY: another path to the driver library (tests name a missing one) */
    const char* path = getenv("CUVIL_CUDA_LIBRARY");
    void* h = dlopen(path && path[0] ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {{
        snprintf(api_error, sizeof api_error, "the NVIDIA driver (%s) is not installed: this library runs "
                 "on an NVIDIA GPU ({target.arch} or newer)", path && path[0] ? path : "libcuda.so.1");
        return;
    }}
#define LOAD(f) do {{ *(void**)&api.f = dlsym(h, #f); if (!api.f) {{ snprintf(api_error, sizeof api_error, \\
        "libcuda.so.1 lacks %s: the NVIDIA driver is too old for this library (CUDA 12 or newer needed)", #f); return; }} }} while (0)
{api_loads}
#undef LOAD
    int rc = api.cuInit(0);
    if (rc != 0) {{
        const char* why = NULL;
        api.cuGetErrorString(rc, &why);
        snprintf(api_error, sizeof api_error, "cuInit failed (%d: %s): no usable NVIDIA GPU", rc, why ? why : "?");
    }}
}}

typedef struct {P}session {P}session;
struct {P}session {{
    int device;
    void* ctx;
    void* stream;
    void* module[{n_k}];
    void* fn[{n_k}];
    uint64_t d_arena, d_weights, d_io;
    unsigned char* h_io;          /* pinned staging for session_run's inputs and outputs */
    void* graph;                  /* session_run's launches, captured after the first run */
    void* graph_exec;
    int runs;
    char error[512];
}};

static const char model_info[] =
    {c_string(json.dumps(info, sort_keys=True))};

static char create_error[512];

static int fail({P}session* s, int code, const char* message) {{
    snprintf(s->error, sizeof s->error, "%s", message);
    return code;
}}

static const char* cu_error(int rc) {{
    const char* why = NULL;
    if (api.cuGetErrorString) api.cuGetErrorString(rc, &why);
    return why ? why : "unknown CUDA error";
}}

EXPORT int {P}abi_version(void) {{ return {ABI_VERSION}; }}

EXPORT const char* {P}model_info(void) {{ return model_info; }}

EXPORT void {P}session_destroy({P}session* s);

#define CREATE_CHECK(call, what) do {{ int rc_ = (call); if (rc_ != 0) {{ \\
        snprintf(create_error, sizeof create_error, "%s failed (%d: %s)", what, rc_, cu_error(rc_)); \\
        {P}session_destroy(s); return NULL; }} }} while (0)

EXPORT {P}session* {P}session_create(void) {{
    pthread_once(&api_once, load_api);
    if (api_error[0]) {{ snprintf(create_error, sizeof create_error, "%s", api_error); return NULL; }}
    {P}session* s = ({P}session*)calloc(1, sizeof *s);
    if (!s) {{ snprintf(create_error, sizeof create_error, "out of memory for the session"); return NULL; }}
    s->device = -1;
    const char* dev_env = getenv("CUVIL_CUDA_DEVICE");
    int ordinal = dev_env ? atoi(dev_env) : 0, count = 0;
    CREATE_CHECK(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (ordinal < 0 || ordinal >= count) {{
        snprintf(create_error, sizeof create_error, "no CUDA device %d (this machine has %d; set CUVIL_CUDA_DEVICE)",
                 ordinal, count);
        free(s); return NULL;
    }}
    int dev = 0, major = 0, minor = 0;
    CREATE_CHECK(api.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
    api.cuDeviceGetAttribute(&major, {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR}, dev);
    api.cuDeviceGetAttribute(&minor, {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR}, dev);
    if (major * 10 + minor < {cc_major * 10 + cc_minor}) {{
        snprintf(create_error, sizeof create_error, "this library was built for {target.name} ({target.arch}), but "
                 "CUDA device %d is sm_%d%d: build it for that GPU's target", ordinal, major, minor);
        free(s); return NULL;
    }}
    CREATE_CHECK(api.cuDevicePrimaryCtxRetain(&s->ctx, dev), "cuDevicePrimaryCtxRetain");
    s->device = dev;
    CREATE_CHECK(api.cuCtxSetCurrent(s->ctx), "cuCtxSetCurrent");
    CREATE_CHECK(api.cuStreamCreate(&s->stream, {CU_STREAM_NON_BLOCKING}), "cuStreamCreate");
    for (int k = 0; k < NUM_KERNELS; k++) {{
        CREATE_CHECK(api.cuModuleLoadData(&s->module[k], fatbin_of[k]), kernel_name[k]);
        CREATE_CHECK(api.cuModuleGetFunction(&s->fn[k], s->module[k], kernel_name[k]), kernel_name[k]);
    }}
    CREATE_CHECK(api.cuMemAlloc_v2(&s->d_arena, ARENA_BYTES), "allocating the device arena");
    CREATE_CHECK(api.cuMemAlloc_v2(&s->d_weights, WEIGHTS_BYTES), "allocating the device weights");
    CREATE_CHECK(api.cuMemcpyHtoD_v2(s->d_weights, {P}weights, WEIGHTS_BYTES), "uploading the weights");
    CREATE_CHECK(api.cuMemAlloc_v2(&s->d_io, IO_BYTES), "allocating the device inputs and outputs");
    CREATE_CHECK(api.cuMemAllocHost_v2((void**)&s->h_io, IO_BYTES), "allocating pinned staging memory");
    return s;
}}

EXPORT void {P}session_destroy({P}session* s) {{
    if (!s) return;
    if (s->ctx) {{
        api.cuCtxSetCurrent(s->ctx);
        if (s->stream) api.cuStreamSynchronize(s->stream);
        if (s->graph_exec) api.cuGraphExecDestroy(s->graph_exec);
        if (s->graph) api.cuGraphDestroy(s->graph);
        if (s->h_io) api.cuMemFreeHost(s->h_io);
        if (s->d_io) api.cuMemFree_v2(s->d_io);
        if (s->d_weights) api.cuMemFree_v2(s->d_weights);
        if (s->d_arena) api.cuMemFree_v2(s->d_arena);
        for (int k = 0; k < NUM_KERNELS; k++) if (s->module[k]) api.cuModuleUnload(s->module[k]);
        if (s->stream) api.cuStreamDestroy_v2(s->stream);
        api.cuDevicePrimaryCtxRelease_v2(s->device);
    }}
    free(s);
}}

EXPORT const char* {P}session_error(const {P}session* s) {{
    if (!s) return create_error[0] ? create_error : "session is NULL (session_create failed or was not called)";
    return s->error;
}}

/* The CUDA target has no data-dependent output shapes: every output has its static shape. */
{output_shape_tables(info, [-1] * len(info["outputs"]))}

EXPORT const int64_t* {P}session_output_shape(const {P}session* s, int index) {{
    if (!s || index < 0 || index >= {len(info["outputs"])}) return NULL;
    return output_slot[index] < 0 ? output_dims + output_dims_at[index] : NULL;
}}

#define CK(call) do {{ int rc_ = (call); if (rc_ != 0) return rc_; }} while (0)

/* Every kernel of the model, queued on `st`; in_dev/out_dev: where the inputs and outputs live. */
static int launch_all({P}session* s, const uint64_t* in_dev, const uint64_t* out_dev, void* st) {{
#define IN(i) in_dev[i]
#define OUT(i) out_dev[i]
    (void)in_dev; (void)out_dev;
{chr(10).join(body)}
#undef IN
#undef OUT
    return 0;
}}

static int device_fail({P}session* s, int rc, const char* what) {{
    snprintf(s->error, sizeof s->error, "%s failed (%d: %s)", what, rc, cu_error(rc));
    return {CUDA_ERROR_CODES['ERR_DEVICE']};
}}

EXPORT int {P}session_run({P}session* s, const void* const* inputs, void* const* outputs) {{
    if (!s) return {ERROR_CODES['ERR_NULL_SESSION']};
    if (!inputs || !outputs) return fail(s, {ERROR_CODES['ERR_NULL_ARGUMENT']}, "inputs or outputs array is NULL");
{chr(10).join(null_checks)}
    int rc = api.cuCtxSetCurrent(s->ctx);
    if (rc) return device_fail(s, rc, "cuCtxSetCurrent");
    uint64_t in_dev[NUM_IN + 1], out_dev[NUM_OUT + 1];
    for (int i = 0; i < NUM_IN; i++) {{
        in_dev[i] = s->d_io + io_offset[i];
        memcpy(s->h_io + io_offset[i], inputs[i], io_bytes[i]);
        if ((rc = api.cuMemcpyHtoDAsync_v2(in_dev[i], s->h_io + io_offset[i], io_bytes[i], s->stream)))
            return device_fail(s, rc, "copying an input to the GPU");
    }}
    for (int i = 0; i < NUM_OUT; i++) out_dev[i] = s->d_io + io_offset[NUM_IN + i];
    if (s->graph_exec) {{
        if ((rc = api.cuGraphLaunch(s->graph_exec, s->stream))) return device_fail(s, rc, "cuGraphLaunch");
    }} else if (s->runs >= 1 && !getenv("CUVIL_CUDA_NO_GRAPH")) {{
        /* the second run captures the launches (their addresses never change) and replays them */
        if ((rc = api.cuStreamBeginCapture_v2(s->stream, {CU_STREAM_CAPTURE_MODE_THREAD_LOCAL}))) return device_fail(s, rc, "cuStreamBeginCapture");
        int launch_rc = launch_all(s, in_dev, out_dev, s->stream);
        rc = api.cuStreamEndCapture(s->stream, &s->graph);
        if (launch_rc) return device_fail(s, launch_rc, "launching a kernel (capture)");
        if (rc) return device_fail(s, rc, "cuStreamEndCapture");
        if ((rc = api.cuGraphInstantiateWithFlags(&s->graph_exec, s->graph, 0))) return device_fail(s, rc, "cuGraphInstantiate");
        if ((rc = api.cuGraphLaunch(s->graph_exec, s->stream))) return device_fail(s, rc, "cuGraphLaunch");
    }} else {{
        if ((rc = launch_all(s, in_dev, out_dev, s->stream))) return device_fail(s, rc, "launching a kernel");
    }}
    for (int i = 0; i < NUM_OUT; i++)
        if ((rc = api.cuMemcpyDtoHAsync_v2(s->h_io + io_offset[NUM_IN + i], out_dev[i], io_bytes[NUM_IN + i], s->stream)))
            return device_fail(s, rc, "copying an output from the GPU");
    if ((rc = api.cuStreamSynchronize(s->stream))) return device_fail(s, rc, "running the model on the GPU");
    for (int i = 0; i < NUM_OUT; i++) memcpy(outputs[i], s->h_io + io_offset[NUM_IN + i], io_bytes[NUM_IN + i]);
    s->runs++;
    s->error[0] = 0;
    return 0;
}}

EXPORT int {P}session_run_device({P}session* s, const void* const* inputs, void* const* outputs, void* stream) {{
    if (!s) return {ERROR_CODES['ERR_NULL_SESSION']};
    if (!inputs || !outputs) return fail(s, {ERROR_CODES['ERR_NULL_ARGUMENT']}, "inputs or outputs array is NULL");
{chr(10).join(null_checks)}
    int rc = api.cuCtxSetCurrent(s->ctx);
    if (rc) return device_fail(s, rc, "cuCtxSetCurrent");
    uint64_t in_dev[NUM_IN + 1], out_dev[NUM_OUT + 1];
    for (int i = 0; i < NUM_IN; i++) in_dev[i] = (uint64_t)(uintptr_t)inputs[i];
    for (int i = 0; i < NUM_OUT; i++) out_dev[i] = (uint64_t)(uintptr_t)outputs[i];
    if ((rc = launch_all(s, in_dev, out_dev, stream ? stream : s->stream))) return device_fail(s, rc, "launching a kernel");
    s->runs++;
    s->error[0] = 0;
    return 0;
}}
"""


def _source_pointer(name, plan, weights_offsets, input_index):
    """Where a graph output that no kernel writes (an input or a constant) is read from."""
    if name in input_index:
        return f"IN({input_index[name]})"
    return _pointer(name, plan, weights_offsets, input_index, {})


def _comment(text: str) -> str:
    return text.replace("*/", "* /")
