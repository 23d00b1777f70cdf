/* run_model: run a library built by cuvil from C, with nothing but libc and libdl.
 *
 *   gcc -O2 -o run_model run_model.c -ldl
 *   ./run_model [-o DIR] LIB [PREFIX] INPUT.bin ...
 *
 * LIB     a lib<model>.so built by cuvil (a path: "./libm.so", not "libm.so")
 * PREFIX  its symbol prefix (`symbol_prefix:` in cuvil.yaml), default "cuvil_".
 *         An argument that is not an identifier (it has a '.' or a '/') is the
 *         first input instead, so the prefix can be left out.
 * INPUT   one raw binary file per model input, in the model's input order,
 *         holding exactly the tensor's bytes (float32, C order, native
 *         endianness): numpy's `array.astype(np.float32).tofile(path)`.
 * -o DIR  where the outputs go (default: the current folder): out0.bin,
 *         out1.bin, ... raw bytes of each output, readable with
 *         `np.fromfile(path, np.float32).reshape(shape)`.
 *
 * It prints the model info JSON and a line per tensor. The symbols are looked
 * up with dlsym, so the same program runs any model whatever its prefix; a
 * program built for one model would rather include <model>.h and link with
 * -l<model>. To read tensor names and shapes this file carries a minimal
 * JSON reader: enough for the model info, not a general parser.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPECTED_ABI_VERSION 1
#define MAX_TENSORS 64
#define MAX_RANK 16

typedef int (*abi_version_fn)(void);
typedef const char* (*model_info_fn)(void);
typedef void* (*session_create_fn)(void);
typedef int (*session_run_fn)(void* session, const void* const* inputs, void* const* outputs);
typedef const char* (*session_error_fn)(const void* session);
typedef void (*session_destroy_fn)(void* session);

struct tensor {
    char name[256];
    char dtype[32];
    int64_t shape[MAX_RANK];
    int rank;
    size_t bytes;
};

struct model {
    struct tensor inputs[MAX_TENSORS], outputs[MAX_TENSORS];
    int n_inputs, n_outputs;
};

/* --- a minimal JSON reader: just enough to find the tensors of the model info */

static const char* skip_space(const char* p) {
    while (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t') p++;
    return p;
}

/* A string; copies it (escapes kept as written, except \" and \\) into out. NULL on a malformed one. */
static const char* read_string(const char* p, char* out, size_t cap) {
    size_t n = 0;
    if (*p != '"') return NULL;
    for (p++; *p && *p != '"'; p++) {
        char c = *p;
        if (c == '\\') {
            p++;
            if (!*p) return NULL;
            c = (*p == '"' || *p == '\\') ? *p : '?';
            if (*p == 'u') {  /* \uXXXX: shown as one '?' */
                for (int i = 0; i < 4; i++) if (!*++p) return NULL;
            }
        }
        if (out && n + 1 < cap) out[n++] = c;
    }
    if (*p != '"') return NULL;
    if (out && cap) out[n] = '\0';
    return p + 1;
}

static const char* skip_value(const char* p, int depth);

/* Skips an array or object (p at its opening bracket); NULL if malformed. */
static const char* skip_container(const char* p, char close, int depth) {
    if (depth > 64) return NULL;
    p = skip_space(p + 1);
    if (*p == close) return p + 1;
    for (;;) {
        if (close == '}') {
            p = read_string(skip_space(p), NULL, 0);
            if (!p || *(p = skip_space(p)) != ':') return NULL;
            p++;
        }
        p = skip_value(skip_space(p), depth + 1);
        if (!p) return NULL;
        p = skip_space(p);
        if (*p == close) return p + 1;
        if (*p != ',') return NULL;
        p++;
    }
}

static const char* skip_value(const char* p, int depth) {
    p = skip_space(p);
    if (*p == '"') return read_string(p, NULL, 0);
    if (*p == '[') return skip_container(p, ']', depth);
    if (*p == '{') return skip_container(p, '}', depth);
    if (!*p || *p == ',' || *p == ']' || *p == '}') return NULL;
    while (*p && *p != ',' && *p != ']' && *p != '}' && *p != ' ' && *p != '\n' && *p != '\t' && *p != '\r') p++;  /* number, true, null */
    return p;
}

static size_t dtype_size(const char* dtype) {
    static const struct { const char* name; size_t size; } sizes[] = {
        {"float32", 4}, {"float64", 8}, {"float16", 2}, {"bfloat16", 2}, {"int8", 1}, {"uint8", 1},
        {"int16", 2}, {"uint16", 2}, {"int32", 4}, {"uint32", 4}, {"int64", 8}, {"uint64", 8}, {"bool", 1},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (strcmp(dtype, sizes[i].name) == 0) return sizes[i].size;
    return 0;
}

/* One {"dtype": ..., "name": ..., "shape": [...]} object. */
static const char* read_tensor(const char* p, struct tensor* t) {
    char key[64];
    memset(t, 0, sizeof *t);
    if (*(p = skip_space(p)) != '{') return NULL;
    p = skip_space(p + 1);
    while (*p != '}') {
        if (!(p = read_string(p, key, sizeof key)) || *(p = skip_space(p)) != ':') return NULL;
        p = skip_space(p + 1);
        if (strcmp(key, "name") == 0) {
            p = read_string(p, t->name, sizeof t->name);
        } else if (strcmp(key, "dtype") == 0) {
            p = read_string(p, t->dtype, sizeof t->dtype);
        } else if (strcmp(key, "shape") == 0) {
            if (*p != '[') return NULL;
            p = skip_space(p + 1);
            while (*p != ']') {
                char* end;
                long long dim = strtoll(p, &end, 10);
                if (end == p || dim < 0 || t->rank == MAX_RANK) return NULL;
                t->shape[t->rank++] = dim;
                p = skip_space(end);
                if (*p == ',') p = skip_space(p + 1);
                else if (*p != ']') return NULL;
            }
            p++;
        } else {
            p = skip_value(p, 0);
        }
        if (!p) return NULL;
        p = skip_space(p);
        if (*p == ',') p = skip_space(p + 1);
        else if (*p != '}') return NULL;
    }
    size_t count = 1;
    for (int i = 0; i < t->rank; i++) count *= (size_t)t->shape[i];
    t->bytes = count * dtype_size(t->dtype);
    return dtype_size(t->dtype) ? p + 1 : NULL;
}

static const char* read_tensors(const char* p, struct tensor* list, int* count) {
    if (*(p = skip_space(p)) != '[') return NULL;
    p = skip_space(p + 1);
    *count = 0;
    while (*p != ']') {
        if (*count == MAX_TENSORS || !(p = read_tensor(p, &list[(*count)++]))) return NULL;
        p = skip_space(p);
        if (*p == ',') p = skip_space(p + 1);
        else if (*p != ']') return NULL;
    }
    return p + 1;
}

/* The "inputs" and "outputs" of the top-level object; 0 on success. */
static int read_model_info(const char* json, struct model* m) {
    char key[64];
    int seen = 0;
    const char* p = skip_space(json);
    if (*p != '{') return -1;
    p = skip_space(p + 1);
    while (*p != '}') {
        if (!(p = read_string(p, key, sizeof key)) || *(p = skip_space(p)) != ':') return -1;
        p++;
        if (strcmp(key, "inputs") == 0) { p = read_tensors(p, m->inputs, &m->n_inputs); seen |= 1; }
        else if (strcmp(key, "outputs") == 0) { p = read_tensors(p, m->outputs, &m->n_outputs); seen |= 2; }
        else p = skip_value(p, 0);
        if (!p) return -1;
        p = skip_space(p);
        if (*p == ',') p = skip_space(p + 1);
        else if (*p != '}') return -1;
    }
    return seen == 3 ? 0 : -1;
}

/* --- files */

static void* read_file(const char* path, size_t expected) {
    FILE* f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "run_model: cannot open %s: %s\n", path, strerror(errno)); return NULL; }
    void* data = malloc(expected ? expected : 1);
    if (!data) { fprintf(stderr, "run_model: out of memory reading %s\n", path); fclose(f); return NULL; }
    size_t got = fread(data, 1, expected, f);
    int extra = fgetc(f);  /* the file must hold exactly the tensor's bytes */
    int failed = ferror(f);
    fclose(f);
    if (failed || got != expected || extra != EOF) {
        fprintf(stderr, "run_model: %s: expected exactly %zu bytes, %s\n", path, expected,
                failed ? "read error" : got != expected ? "the file is shorter" : "the file is longer");
        free(data);
        return NULL;
    }
    return data;
}

static int write_file(const char* path, const void* data, size_t size) {
    FILE* f = fopen(path, "wb");
    if (!f) { fprintf(stderr, "run_model: cannot create %s: %s\n", path, strerror(errno)); return -1; }
    size_t put = fwrite(data, 1, size, f);
    if (fclose(f) != 0 || put != size) { fprintf(stderr, "run_model: cannot write %s\n", path); return -1; }
    return 0;
}

static void print_tensor(const char* kind, int index, const struct tensor* t) {
    printf("%s %d: %s %s [", kind, index, t->name, t->dtype);
    for (int i = 0; i < t->rank; i++) printf(i ? ", %lld" : "%lld", (long long)t->shape[i]);
    printf("] (%zu bytes)\n", t->bytes);
}

static int is_identifier(const char* s) {
    if (!*s || (*s >= '0' && *s <= '9')) return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_')) return 0;
    return 1;
}

static void* symbol(void* lib, const char* prefix, const char* name) {
    char full[256];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    void* address = dlsym(lib, full);
    if (!address) fprintf(stderr, "run_model: symbol %s not found: %s\n", full, dlerror());
    return address;
}

static int usage(void) {
    fprintf(stderr, "usage: run_model [-o DIR] LIB [PREFIX] INPUT.bin ...\n");
    return 2;
}

int main(int argc, char** argv) {
    const char* out_dir = ".";
    const char* args[256];
    int n_args = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-o") == 0) {
            if (++i == argc) return usage();
            out_dir = argv[i];
        } else if (n_args < 256) {
            args[n_args++] = argv[i];
        } else {
            return usage();
        }
    }
    if (n_args < 1) return usage();
    const char* lib_path = args[0];
    const char* prefix = "cuvil_";
    int first_input = 1;
    if (n_args > 1 && is_identifier(args[1])) { prefix = args[1]; first_input = 2; }

    void* lib = dlopen(lib_path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "run_model: cannot load %s: %s\n", lib_path, dlerror()); return 1; }
    abi_version_fn abi_version = (abi_version_fn)symbol(lib, prefix, "abi_version");
    model_info_fn model_info = (model_info_fn)symbol(lib, prefix, "model_info");
    session_create_fn session_create = (session_create_fn)symbol(lib, prefix, "session_create");
    session_run_fn session_run = (session_run_fn)symbol(lib, prefix, "session_run");
    session_error_fn session_error = (session_error_fn)symbol(lib, prefix, "session_error");
    session_destroy_fn session_destroy = (session_destroy_fn)symbol(lib, prefix, "session_destroy");
    if (!abi_version || !model_info || !session_create || !session_run || !session_error || !session_destroy) {
        fprintf(stderr, "run_model: %s is not a cuvil library with symbol prefix \"%s\"\n", lib_path, prefix);
        dlclose(lib);
        return 1;
    }
    if (abi_version() != EXPECTED_ABI_VERSION) {
        fprintf(stderr, "run_model: %s has ABI version %d, this program reads version %d\n",
                lib_path, abi_version(), EXPECTED_ABI_VERSION);
        dlclose(lib);
        return 1;
    }

    const char* info = model_info();
    static struct model m;
    if (!info || read_model_info(info, &m) != 0) {
        fprintf(stderr, "run_model: cannot read the model info of %s\n", lib_path);
        dlclose(lib);
        return 1;
    }
    printf("%s\n", info);
    for (int i = 0; i < m.n_inputs; i++) print_tensor("input", i, &m.inputs[i]);
    for (int i = 0; i < m.n_outputs; i++) print_tensor("output", i, &m.outputs[i]);
    if (n_args - first_input != m.n_inputs) {
        fprintf(stderr, "run_model: the model takes %d input(s), %d file(s) given\n", m.n_inputs, n_args - first_input);
        dlclose(lib);
        return 2;
    }

    int status = 1;
    const void* inputs[MAX_TENSORS] = {0};
    void* outputs[MAX_TENSORS] = {0};
    void* session = NULL;
    for (int i = 0; i < m.n_inputs; i++)
        if (!(inputs[i] = read_file(args[first_input + i], m.inputs[i].bytes))) goto done;
    for (int i = 0; i < m.n_outputs; i++) {
        if (!(outputs[i] = malloc(m.outputs[i].bytes ? m.outputs[i].bytes : 1))) {
            fprintf(stderr, "run_model: out of memory for output %d\n", i);
            goto done;
        }
    }
    session = session_create();
    if (!session) {
        fprintf(stderr, "run_model: session_create failed: %s\n", session_error(NULL));
        goto done;
    }
    int code = session_run(session, inputs, outputs);
    if (code != 0) {
        fprintf(stderr, "run_model: session_run failed with code %d: %s\n", code, session_error(session));
        goto done;
    }
    for (int i = 0; i < m.n_outputs; i++) {
        char path[4096];
        int n = snprintf(path, sizeof path, "%s/out%d.bin", out_dir, i);
        if (n < 0 || (size_t)n >= sizeof path) { fprintf(stderr, "run_model: output path too long\n"); goto done; }
        if (write_file(path, outputs[i], m.outputs[i].bytes) != 0) goto done;
        printf("wrote %s (%s)\n", path, m.outputs[i].name);
    }
    status = 0;

done:
    if (session) session_destroy(session);
    for (int i = 0; i < MAX_TENSORS; i++) { free((void*)inputs[i]); free(outputs[i]); }
    dlclose(lib);
    return status;
}
