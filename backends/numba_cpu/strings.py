"""Kernels of the ops on string tensors: StringConcat, StringNormalizer, StringSplit, RegexFullMatch,
Equal on strings, ai.onnx.ml LabelEncoder, Cast to and from strings and Gather of strings
(docs/strings.md).

A string tensor is an array of `const char*` (NUL-terminated UTF-8), one an element. These kernels
are plain C (Kernel.language "c"), defined in the driver, not Numba code: each one's body sees its
pointer arguments p0, p1... (inputs, then outputs), the session's string pool `S`, and the helpers
of backends/native/strings.py (`str_alloc`, `str_copy`, `strings_error`). A kernel that fails sets
the pool's error and returns; the driver checks it after the call. String constants (stopwords,
LabelEncoder keys, a constant operand) are baked into the kernel's source as C literals.
"""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError
from cuvil.ops import VIEW_OPS

from . import regex
from .kernel import Kernel, KernelCall, Lowered

# What each op's kernel takes; any other op given a string tensor is refused (check_node).
STRING_OPS = ("StringConcat", "StringNormalizer", "StringSplit", "RegexFullMatch", "Equal", "LabelEncoder", "Cast",
              "CastLike", "Gather")

ERR_OUT_OF_MEMORY, ERR_BAD_ARGUMENT = 3, 6   # backends/native/driver.py ERROR_CODES


def is_string(value) -> bool:
    return np.dtype(value.dtype) == np.dtype(object)


def check_node(node, graph) -> None:
    """Refuse a node that reads or writes a string tensor when its op has no string kernel (views
    only move the element pointers, so they take strings as they are)."""
    names = [n for n in list(node.inputs) + list(node.outputs) if n and n in graph.values]
    touched = [n for n in names if is_string(graph.values[n])]
    if not touched or node.op in STRING_OPS or node.op in VIEW_OPS:
        return
    raise UnsupportedOpError(f"node '{node.name}' ({node.op}): op {node.op} does not take string tensors "
                             f"('{touched[0]}' is one)",
                             hint=f"string tensors are taken by {', '.join(STRING_OPS)} and the views "
                                  f"({', '.join(sorted(VIEW_OPS))}); see docs/strings.md")


def c_literal(text) -> str:
    """A C string literal of `text`'s UTF-8 bytes (octal escapes: no hex escape runs on)."""
    data = text if isinstance(text, bytes) else str(text).encode("utf-8")
    out = []
    for byte in data:
        ch = chr(byte)
        out.append(ch if 32 <= byte < 127 and ch not in '\\"?' else f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _table(name: str, texts) -> str:
    items = ", ".join(c_literal(t) for t in texts) or '""'
    return f"    static const char* const {name}[] = {{{items}}};"


def _kernel(family, body, arg_types) -> Kernel:
    return Kernel(family, body, tuple(arg_types), language="c")


class _Operands:
    """The kernel's pointer arguments as they are added; a constant string operand is a table in the
    source instead."""

    def __init__(self):
        self.names, self.types, self.lines = [], [], []

    def strings(self, value, c_name: str) -> None:
        if value.is_const:
            self.lines.append(_table(c_name, np.asarray(value.data, dtype=object).reshape(-1)))
        else:
            self.lines.append(f"    const char* const* {c_name} = (const char* const*)p{len(self.names)};")
            self.names.append(value.name)
            self.types.append("object")

    def output(self, value, c_name: str, c_type: str) -> None:
        self.lines.append(f"    {c_type}* {c_name} = ({c_type}*)p{len(self.names)};")
        self.names.append(value.name)
        self.types.append("object" if c_type == "const char*" else np.dtype(value.dtype).name)


def _broadcast_index(out_shape, in_shapes, names) -> tuple[list[str], list[str]]:
    """C that makes, for output element `i`, the index `names[k]` into input k (numpy broadcasting):
    declarations before the loop, statements inside it."""
    rank = len(out_shape)
    if all(tuple(s) == tuple(out_shape) for s in in_shapes):
        return [], [f"        const int64_t {n} = i;" for n in names]
    decl = [f"    static const int64_t dims[] = {{{', '.join(map(str, out_shape)) or '0'}}};"]
    for shape, n in zip(in_shapes, names):
        padded = (1,) * (rank - len(shape)) + tuple(shape)
        strides, step = [], 1
        for d in reversed(padded):
            strides.append(step if d != 1 else 0)
            step *= d
        decl.append(f"    static const int64_t {n}_stride[] = {{{', '.join(map(str, reversed(strides))) or '0'}}};")
    body = [f"        int64_t {', '.join(f'{n} = 0' for n in names)}, rest = i;",
            f"        for (int d = {rank - 1}; d >= 0; d--) {{",
            "            const int64_t q = rest % dims[d];",
            "            rest /= dims[d];",
            *[f"            {n} += q * {n}_stride[d];" for n in names],
            "        }"]
    return decl, body


def _binary(node, graph, family, make) -> Lowered:
    a, b = (graph.values[n] for n in node.inputs[:2])
    out = graph.values[node.outputs[0]]
    if not (is_string(a) and is_string(b)):
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): both inputs must be strings, got "
                                 f"{np.dtype(a.dtype).name} and {np.dtype(b.dtype).name}")
    ops = _Operands()
    ops.strings(a, "x")
    ops.strings(b, "y")
    ops.output(out, "z", "const char*" if is_string(out) else "unsigned char")
    decl, index = _broadcast_index(out.shape, [a.shape, b.shape], ["ia", "ib"])
    body = "\n".join(ops.lines + decl + [f"    for (int64_t i = 0; i < {out.size}; i++) {{", *index,
                                          *make(), "    }"])
    kernel = _kernel(family, body, ops.types)
    return Lowered([KernelCall(kernel, ops.names, 1, node=node.name, n_outputs=1)])


def lower_string_concat(node, graph) -> Lowered:
    def make():
        return ["        const size_t la = strlen(x[ia]), lb = strlen(y[ib]);",
                "        char* t = str_alloc(S, la + lb + 1);",
                "        if (!t) return;",
                "        memcpy(t, x[ia], la);",
                "        memcpy(t + la, y[ib], lb + 1);",
                "        z[i] = t;"]
    return _binary(node, graph, "string_concat", make)


def lower_string_equal(node, graph) -> Lowered:
    return _binary(node, graph, "string_equal", lambda: ["        z[i] = strcmp(x[ia], y[ib]) == 0;"])


# -- StringNormalizer -----------------------------------------------------------------------------

# The locales StringNormalizer takes, and which case mapping each means. onnxruntime maps one code
# point at a time with the locale's towupper / towlower: in "C" / "POSIX" only ASCII letters change; in
# a UTF-8 locale (and by default: onnxruntime's default is en_US.UTF-8) every letter with a one-code-
# point mapping does. Cuvil's UTF-8 mapping is Unicode's simple case mapping of the code points below
# U+0800 (Latin, Greek, Cyrillic, Armenian...; tested against onnxruntime in the C.UTF-8 locale);
# letters from U+0800 on are left as they are (docs/strings.md).
ASCII_LOCALES = ("C", "POSIX")
UTF8_LOCALES = ("", "C.UTF-8", "C.utf8", "en_US", "en_US.UTF-8", "en_US.utf8", "en_GB.UTF-8", "en_GB.utf8")
UTF8_LIMIT = 0x800


def case_map(direction: str, ascii_only: bool) -> dict[int, int]:
    """code point -> its upper (direction "UPPER") or lower case, where that is one code point."""
    table = {}
    for cp in range(0x41, 0x80 if ascii_only else UTF8_LIMIT):
        ch = chr(cp)
        mapped = ch.upper() if direction == "UPPER" else ch.lower()
        if len(mapped) == 1 and mapped != ch and ord(mapped) < 0x10000:
            table[cp] = ord(mapped)
    if direction == "LOWER" and not ascii_only:
        table[0x130] = 0x69   # İ: Unicode's full mapping is two code points, towlower's simple one 'i'
    return dict(sorted(table.items()))


def map_text(text, direction: str, ascii_only: bool) -> str:
    table = case_map(direction, ascii_only)
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
    return "".join(chr(table.get(ord(c), ord(c))) for c in text)


def _case_function(name: str, table: dict[int, int]) -> list[str]:
    """C statements declaring `name`'s table (sorted code points and their images) for _case_copy."""
    keys = ", ".join(str(k) for k in table) or "0"
    values = ", ".join(str(v) for v in table.values()) or "0"
    return [f"    static const uint16_t {name}_from[] = {{{keys}}};",
            f"    static const uint16_t {name}_to[] = {{{values}}};"]


def _case_copy(name: str, size: int) -> list[str]:
    """C statements: `t` := the pool copy of `src` with each code point below U+0800 mapped by the
    table `name` (binary search); a two-byte code point may map to a three-byte one (ɐ -> Ɐ), so the
    copy has room for twice the bytes."""
    return [
        "            const unsigned char* u = (const unsigned char*)src;",
        "            const size_t n = strlen(src);",
        "            char* t = str_alloc(S, 2 * n + 1);",
        "            if (!t) return;",
        "            size_t k = 0, o = 0;",
        "            while (k < n) {",
        "                uint32_t c = u[k];",
        "                size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;",
        "                if (k + len > n || (len == 2 && (u[k + 1] & 0xC0) != 0x80)) len = 1;",
        "                if (len <= 2 && (len == 2 || c < 0x80)) {",
        "                    if (len == 2) c = ((c & 0x1F) << 6) | (u[k + 1] & 0x3F);",
        f"                    int64_t lo = 0, hi = {size} - 1;",
        "                    while (lo <= hi) {",
        "                        const int64_t mid = (lo + hi) / 2;",
        f"                        if ({name}_from[mid] == c) {{ c = {name}_to[mid]; break; }}",
        f"                        if ({name}_from[mid] < c) lo = mid + 1; else hi = mid - 1;",
        "                    }",
        "                    if (c < 0x80) t[o++] = (char)c;",
        "                    else if (c < 0x800) { t[o++] = (char)(0xC0 | (c >> 6)); t[o++] = (char)(0x80 | (c & 0x3F)); }",
        "                    else { t[o++] = (char)(0xE0 | (c >> 12)); t[o++] = (char)(0x80 | ((c >> 6) & 0x3F));",
        "                           t[o++] = (char)(0x80 | (c & 0x3F)); }",
        "                } else {",
        "                    memcpy(t + o, u + k, len); o += len;",
        "                }",
        "                k += len;",
        "            }",
        "            t[o] = 0;",
    ]


def lower_string_normalizer(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    action = str(node.attr("case_change_action", "NONE") or "NONE").upper()
    sensitive = int(node.attr("is_case_sensitive", 0))
    stopwords = list(node.attr("stopwords", []) or [])
    locale = str(node.attr("locale", "") or "")
    if action not in ("NONE", "LOWER", "UPPER"):
        raise UnsupportedOpError(f"node '{node.name}' (StringNormalizer): case_change_action {action!r} is not "
                                 "one of NONE, LOWER, UPPER")
    if locale not in ASCII_LOCALES + UTF8_LOCALES:
        raise UnsupportedOpError(f"node '{node.name}' (StringNormalizer): locale {locale!r} is not supported",
                                 hint=f"supported locales: {', '.join(repr(l) for l in ASCII_LOCALES + UTF8_LOCALES)} "
                                      "(see docs/strings.md for their case mapping)")
    if not is_string(x):
        raise UnsupportedOpError(f"node '{node.name}' (StringNormalizer): the input must be strings")
    ascii_only = locale in ASCII_LOCALES
    ops = _Operands()
    ops.strings(x, "x")
    ops.output(y, "y", "const char*")
    dims = y.shape_from
    if dims:
        ops.output(graph.values[dims], "dims", "int64_t")
    lines = list(ops.lines)
    fold = not sensitive and bool(stopwords)   # stopwords compare in lower case
    if fold:
        stopwords = [map_text(w, "LOWER", ascii_only) for w in stopwords]
        table = case_map("LOWER", ascii_only)
        lines += _case_function("fold", table)
    if action != "NONE":
        table_change = case_map(action, ascii_only)
        lines += _case_function("change", table_change)
    lines += [_table("stop", stopwords),
              "    int64_t kept = 0;",
              f"    for (int64_t i = 0; i < {x.size}; i++) {{",
              "        const char* word = x[i];"]
    if fold:
        lines += ["        {", "            const char* src = word;", *_case_copy("fold", len(table)),
                  "            word = t;", "        }"]
    if stopwords:
        lines += ["        int stopped = 0;",
                  f"        for (int w = 0; w < {len(stopwords)}; w++) if (strcmp(word, stop[w]) == 0) {{ stopped = 1; break; }}",
                  "        if (stopped) continue;"]
    if action == "NONE":
        lines += ["        y[kept++] = x[i];"]
    else:
        lines += ["        {", "            const char* src = x[i];", *_case_copy("change", len(table_change)),
                  "            y[kept++] = t;", "        }"]
    lines.append("    }")
    if dims:   # every element dropped: onnxruntime returns one empty string
        lines += ["    if (kept == 0) y[kept++] = \"\";",
                  f"    for (int64_t i = kept; i < {y.size}; i++) y[i] = \"\";",
                  *(["    dims[0] = 1;", "    dims[1] = kept;"] if len(y.shape) == 2 else ["    dims[0] = kept;"])]
    else:
        lines.append("    (void)kept;")
    kernel = _kernel("string_normalizer", "\n".join(lines), ops.types)
    return Lowered([KernelCall(kernel, ops.names, 1, node=node.name, n_outputs=2 if dims else 1)])


# -- StringSplit ----------------------------------------------------------------------------------

def lower_string_split(node, graph) -> Lowered:
    x = graph.values[node.inputs[0]]
    y, z = graph.values[node.outputs[0]], graph.values[node.outputs[1]]
    if not is_string(x):
        raise UnsupportedOpError(f"node '{node.name}' (StringSplit): the input must be strings")
    delimiter = node.attr("delimiter", "") or ""
    delimiter = delimiter.encode("utf-8") if isinstance(delimiter, str) else bytes(delimiter)
    maxsplit = node.attr("maxsplit")
    limit = int(maxsplit) if maxsplit is not None and int(maxsplit) >= 0 else -1
    bound = int(y.shape[-1])
    ops = _Operands()
    ops.strings(x, "x")
    ops.output(y, "y", "const char*")
    ops.output(z, "counts", "int64_t")
    ops.output(graph.values[y.shape_from], "dims", "int64_t")
    n = x.size
    # split(src, emit): `emit` runs with piece [p, q) for each piece, in order
    if delimiter:
        d = c_literal(delimiter)
        scan = [f"            const char* p = src; int64_t splits = 0;",
                "            if (*p) for (;;) {   /* an empty string has no substrings (as onnxruntime) */",
                f"                const char* q = (splits != {limit}) ? strstr(p, {d}) : NULL;",
                "                if (!q) { q = p + strlen(p); EMIT; break; }",
                f"                EMIT; splits++; p = q + {len(delimiter)};",
                "            }"]
    else:   # runs of spaces (' ' only, as onnxruntime), none at either end
        scan = ["            const char* p = src; int64_t splits = 0;",
                "            for (;;) {",
                "                while (*p && SPACE(*p)) p++;",
                "                if (!*p) break;",
                "                const char* q = p;",
                f"                if (splits == {limit}) {{",
                "                    q = p + strlen(p);",
                "                    while (q > p && SPACE(q[-1])) q--;",
                "                    EMIT; break;",
                "                }",
                "                while (*q && !SPACE(*q)) q++;",
                "                EMIT; splits++; p = q;",
                "            }"]
    count_pass = [line.replace("EMIT", "pieces++") for line in scan]
    write_pass = [line.replace("EMIT", "{ char* t = str_copy(S, p, (size_t)(q - p)); if (!t) return; "
                                       "y[i * width + k++] = t; }") for line in scan]
    message = c_literal(f"a string splits into more than {bound} substrings, the most this library was "
                        "built for (give StringSplit a maxsplit to raise the bound)")
    lines = [*ops.lines,
             "#define SPACE(c) ((c) == ' ')",
             "    int64_t width = 0;",
             f"    for (int64_t i = 0; i < {n}; i++) {{",
             "        int64_t pieces = 0;",
             "        const char* src = x[i];",
             "        {", *count_pass, "        }",
             "        counts[i] = pieces;",
             "        if (pieces > width) width = pieces;",
             "    }",
             f"    if (width > {bound}) {{ strings_error(S, {ERR_BAD_ARGUMENT}, {c_literal(node.name)}, {message}); return; }}",
             f"    for (int64_t i = 0; i < {y.size}; i++) y[i] = \"\";",
             f"    for (int64_t i = 0; i < {n}; i++) {{",
             "        int64_t k = 0;",
             "        const char* src = x[i];",
             "        {", *write_pass, "        }",
             "    }",
             *[f"    dims[{k}] = {d};" for k, d in enumerate(x.shape)],
             f"    dims[{len(x.shape)}] = width;",
             "#undef SPACE"]
    kernel = _kernel("string_split", "\n".join(lines), ops.types)
    return Lowered([KernelCall(kernel, ops.names, 1, node=node.name, n_outputs=3)])


# -- RegexFullMatch -------------------------------------------------------------------------------

def lower_regex_full_match(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    if not is_string(x):
        raise UnsupportedOpError(f"node '{node.name}' (RegexFullMatch): the input must be strings")
    pattern = node.attr("pattern", "")
    try:
        program = regex.compile_pattern(pattern if isinstance(pattern, str) else bytes(pattern).decode("utf-8"))
    except regex.PatternError as error:
        raise UnsupportedOpError(f"node '{node.name}' (RegexFullMatch): pattern {pattern!r}: {error}",
                                 hint="cuvil's regex engine takes RE2's syntax without flags, look-arounds, back "
                                      "references or Unicode classes (docs/strings.md)") from None
    ops = _Operands()
    ops.strings(x, "x")
    ops.output(y, "y", "unsigned char")
    lines = [*ops.lines, *regex.c_matcher(program, x.size)]
    kernel = _kernel("regex_full_match", "\n".join(lines), ops.types)
    return Lowered([KernelCall(kernel, ops.names, 1, node=node.name, n_outputs=1)])


# -- LabelEncoder (ai.onnx.ml) -------------------------------------------------------------------

_C_TYPES = {"int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t", "uint8": "uint8_t",
            "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t", "float32": "float", "float64": "double"}


def _encoder_table(node, kind: str):
    """(array of the keys or values, its dtype) from the *_strings / *_int64s / *_floats / *_tensor
    attribute; None when none is given."""
    for suffix, dtype in (("strings", object), ("int64s", np.int64), ("floats", np.float32)):
        got = node.attr(f"{kind}_{suffix}")
        if got is not None and len(got):
            return np.array(list(got), dtype=dtype)
    tensor = node.attr(f"{kind}_tensor")
    if tensor is not None:
        arr = np.asarray(tensor).reshape(-1)
        return arr.astype(object) if arr.dtype.kind in "OSU" else arr
    return None


def _numbers(arr, c_type) -> str:
    if c_type in ("float", "double"):
        items = [repr(float(v)) if np.isfinite(v) else ("NAN" if np.isnan(v) else ("INFINITY" if v > 0 else "-INFINITY"))
                 for v in arr]
        return ", ".join(items) or "0"
    return ", ".join(f"{int(v)}" + ("LL" if c_type.endswith("64_t") else "") for v in arr) or "0"


def lower_label_encoder(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    keys, values = _encoder_table(node, "keys"), _encoder_table(node, "values")
    if keys is None or values is None or len(keys) != len(values):
        raise UnsupportedOpError(f"node '{node.name}' (LabelEncoder): keys and values must both be given, of "
                                 "one length")
    x_string, y_string = is_string(x), is_string(y)
    x_type = None if x_string else _C_TYPES.get(np.dtype(x.dtype).name)
    y_type = None if y_string else _C_TYPES.get(np.dtype(y.dtype).name)
    if (not x_string and x_type is None) or (not y_string and y_type is None):
        raise UnsupportedOpError(f"node '{node.name}' (LabelEncoder): {np.dtype(x.dtype).name} -> "
                                 f"{np.dtype(y.dtype).name} is not supported",
                                 hint="keys and values: strings, integers or floats")
    # the default: default_tensor, else default_string / default_int64 / default_float
    default = node.attr("default_tensor")
    if default is not None:
        default = np.asarray(default).reshape(-1)[0]
    elif y_string:
        default = node.attr("default_string", "_Unused")
    elif np.dtype(y.dtype).kind == "f":
        default = node.attr("default_float", -0.0)
    else:
        default = node.attr("default_int64", -1)
    # keys sorted (C's strcmp order is the bytes' order) for a binary search; a repeated key: the first
    if x_string:
        encoded = [k.encode("utf-8") if isinstance(k, str) else bytes(k) for k in keys]
        order = sorted(range(len(encoded)), key=lambda i: (encoded[i], i))
        key_table = _table("keys", [encoded[i] for i in order])
        compare = "strcmp(v, keys[mid])"
        read = "const char* v = x[i];"
        nan_key = None
    else:
        numeric = np.asarray(keys).astype(np.dtype(x.dtype))
        finite = [i for i in range(len(numeric)) if not (numeric.dtype.kind == "f" and np.isnan(numeric[i]))]
        order = sorted(finite, key=lambda i: (numeric[i], i))
        nans = sorted(set(range(len(numeric))) - set(finite))
        nan_key = nans[0] if nans else None
        key_table = f"    static const {x_type} keys[] = {{{_numbers(numeric[order], x_type)}}};"
        compare = "(v < keys[mid] ? -1 : v > keys[mid] ? 1 : 0)"
        read = f"const {x_type} v = x[i];"
    ordered_values = [values[i] for i in order]
    if y_string:
        value_table = _table("vals", [v if isinstance(v, (str, bytes)) else str(v) for v in ordered_values])
        default_c = c_literal(default if isinstance(default, (str, bytes)) else str(default))
        nan_value = c_literal(values[nan_key]) if nan_key is not None else None
    else:
        typed = np.asarray(ordered_values).astype(np.dtype(y.dtype))
        value_table = f"    static const {y_type} vals[] = {{{_numbers(typed, y_type)}}};"
        default_c = f"({y_type}){_numbers(np.asarray([default]).astype(np.dtype(y.dtype)), y_type)}"
        nan_value = (f"({y_type}){_numbers(np.asarray([values[nan_key]]).astype(np.dtype(y.dtype)), y_type)}"
                     if nan_key is not None else None)
    ops = _Operands()
    if x_string:
        ops.strings(x, "x")
    else:
        ops.lines.append(f"    const {x_type}* x = (const {x_type}*)p0;")
        ops.names.append(x.name)
        ops.types.append(np.dtype(x.dtype).name)
    ops.output(y, "y", "const char*" if y_string else y_type)
    lines = [*ops.lines, key_table, value_table,
             f"    for (int64_t i = 0; i < {x.size}; i++) {{",
             f"        {read}",
             f"        int64_t lo = 0, hi = {len(order)} - 1, found = -1;"]
    if not x_string and np.dtype(x.dtype).kind == "f":   # NaN: a NaN key's value, else the default
        lines.append(f"        if (v != v) {{ y[i] = {nan_value if nan_value is not None else default_c}; continue; }}")
    lines += ["        while (lo <= hi) {",
              "            const int64_t mid = lo + (hi - lo) / 2;",
              f"            const int c = {compare};",
              "            if (c == 0) { found = mid; hi = mid - 1; } else if (c < 0) hi = mid - 1; else lo = mid + 1;",
              "        }",
              f"        y[i] = found >= 0 ? vals[found] : {default_c};",
              "    }"]
    kernel = _kernel("label_encoder", "\n".join(lines), ops.types)
    return Lowered([KernelCall(kernel, ops.names, 1, node=node.name, n_outputs=1)])


# -- Cast to and from strings ---------------------------------------------------------------------

_INT_FORMATS = {"int8": "%lld", "int16": "%lld", "int32": "%lld", "int64": "%lld",
                "uint8": "%lld", "uint16": "%lld", "uint32": "%lld", "uint64": "%llu"}


def lower_cast_strings(node, graph) -> Lowered:
    """Cast (and CastLike) with a string side, as onnxruntime: numbers to text with "%.8g" (NaN,
    INF, -INF), integers in decimal, bool as 1 / 0; text to floats with strtof / strtod and to
    integers with strtoll / strtoull (leading spaces skipped, trailing text ignored)."""
    from .kernel import lowering_target
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    ops = _Operands()
    if is_string(x) and is_string(y):
        ops.strings(x, "x")
        ops.output(y, "y", "const char*")
        lines = [*ops.lines, f"    for (int64_t i = 0; i < {x.size}; i++) y[i] = x[i];"]
    elif is_string(y):
        name = np.dtype(x.dtype).name
        c_type = "unsigned char" if name == "bool" else _C_TYPES.get(name)
        if c_type is None:
            raise UnsupportedOpError(f"node '{node.name}' (Cast): {name} to string is not supported",
                                     hint="cast to float32 first")
        target = lowering_target()
        if (name.startswith("float") or name == "uint64") and getattr(target, "arch", "") == "wasm32":
            raise UnsupportedOpError(f"node '{node.name}' (Cast): {name} to strings needs the C library's "
                                     "printf, which a wasm32 library does not link")
        ops.lines.append(f"    const {c_type}* x = (const {c_type}*)p0;")
        ops.names.append(x.name)
        ops.types.append(name)
        ops.output(y, "y", "const char*")
        if name.startswith("float"):
            text = ["        const double v = (double)x[i];",
                    "        if (v != v) { y[i] = \"NaN\"; continue; }",
                    "        if (v > 1.79e308 || v < -1.79e308) { y[i] = v > 0 ? \"INF\" : \"-INF\"; continue; }",
                    "        char buffer[48];",
                    "        const int n = snprintf(buffer, sizeof buffer, \"%.8g\", v);"]
        elif name == "bool":
            text = ["        char buffer[2] = {x[i] ? '1' : '0', 0};", "        const int n = 1;"]
        else:
            cast = "(long long)" if _INT_FORMATS[name] == "%lld" else "(unsigned long long)"
            text = ["        char buffer[24];",
                    f"        const int n = snprintf(buffer, sizeof buffer, \"{_INT_FORMATS[name]}\", {cast}x[i]);"]
        lines = [*ops.lines, f"    for (int64_t i = 0; i < {x.size}; i++) {{", *text,
                 "        char* t = str_copy(S, buffer, (size_t)n);",
                 "        if (!t) return;",
                 "        y[i] = t;",
                 "    }"]
    else:
        name = np.dtype(y.dtype).name
        c_type = _C_TYPES.get(name)
        if c_type is None:
            raise UnsupportedOpError(f"node '{node.name}' (Cast): string to {name} is not supported",
                                     hint="cast to float32, float64 or an integer type")
        parse = {"float": "strtof(x[i], NULL)", "double": "strtod(x[i], NULL)"}.get(
            c_type, "strtoull(x[i], NULL, 10)" if name.startswith("uint") else "strtoll(x[i], NULL, 10)")
        ops.strings(x, "x")
        ops.output(y, "y", c_type)
        lines = [*ops.lines, f"    for (int64_t i = 0; i < {x.size}; i++) y[i] = ({c_type}){parse};"]
    kernel = _kernel("cast_string", "\n".join(lines), ops.types)
    return Lowered([KernelCall(kernel, ops.names, 1, node=node.name, n_outputs=1)])


def lower_constant_outputs(graph) -> list:
    """A graph output that is a string constant: a kernel writes its table's pointers into the
    output (a string constant is C literals, not bytes of the weights blob)."""
    calls = []
    for name in dict.fromkeys(graph.outputs):
        value = graph.values[name]
        if value.is_const and is_string(value):
            ops = _Operands()
            ops.strings(value, "x")
            ops.output(value, "y", "const char*")
            body = "\n".join([*ops.lines, f"    for (int64_t i = 0; i < {value.size}; i++) y[i] = x[i];"])
            calls.append(KernelCall(_kernel("string_constant", body, ops.types), ops.names, 1,
                                    node=f"constant {name}", n_outputs=1))
    return calls


# -- Gather of strings ----------------------------------------------------------------------------

def lower_gather_strings(node, graph) -> Lowered:
    """Gather over a string tensor (a constant one too: class labels picked by an ArgMax): the element
    pointers are copied; an index outside [-n, n) fails the run, as onnxruntime's."""
    data, indices = graph.values[node.inputs[0]], graph.values[node.inputs[1]]
    y = graph.values[node.outputs[0]]
    index_type = _C_TYPES.get(np.dtype(indices.dtype).name)
    if index_type not in ("int32_t", "int64_t"):
        raise UnsupportedOpError(f"node '{node.name}' (Gather): indices of {np.dtype(indices.dtype).name}")
    rank = len(data.shape)
    axis = int(node.attr("axis", 0))
    axis = axis + rank if axis < 0 else axis
    outer = int(np.prod(data.shape[:axis], dtype=np.int64))
    n = int(data.shape[axis])
    inner = int(np.prod(data.shape[axis + 1:], dtype=np.int64))
    ops = _Operands()
    ops.strings(data, "x")
    if indices.is_const:
        ops.lines.append(f"    static const {index_type} ind[] = {{{_numbers(np.asarray(indices.data).reshape(-1), index_type)}}};")
    else:
        ops.lines.append(f"    const {index_type}* ind = (const {index_type}*)p{len(ops.names)};")
        ops.names.append(indices.name)
        ops.types.append(np.dtype(indices.dtype).name)
    ops.output(y, "y", "const char*")
    message = c_literal(f"an index is outside [-{n}, {n})")
    lines = [*ops.lines,
             f"    for (int64_t j = 0; j < {indices.size}; j++) {{",
             f"        int64_t at = (int64_t)ind[j];",
             f"        if (at < 0) at += {n};",
             f"        if (at < 0 || at >= {n}) {{ strings_error(S, {ERR_BAD_ARGUMENT}, {c_literal(node.name)}, {message}); return; }}",
             f"        for (int64_t o = 0; o < {outer}; o++)",
             f"            for (int64_t k = 0; k < {inner}; k++)",
             f"                y[(o * {indices.size} + j) * {inner} + k] = x[(o * {n} + at) * {inner} + k];",
             "    }"]
    kernel = _kernel("gather_strings", "\n".join(lines), ops.types)
    return Lowered([KernelCall(kernel, ops.names, 1, node=node.name, n_outputs=1)])
