"""String tensors (docs/strings.md): every op's C kernel against onnxruntime on models made here,
the C ABI's contract (pointer arrays in, session-owned strings out), and the refusals.

Strings, booleans and integers are compared exactly; LabelEncoder's float outputs too (the kernel
copies a value of the table, it computes nothing).
"""
import ctypes

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import cuvil
from cuvil.errors import CuvilError, RuntimeFailure


def _model(nodes, inputs, outputs, opset=20, ml=False, inits=()):
    graph = helper.make_graph(nodes, "strings", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], initializer=list(inits))
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("ai.onnx.ml", 4)] if ml else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _check(model, feeds, oracle="onnxruntime", **options):
    """cuvil's outputs equal onnxruntime's (or, where onnxruntime is wrong, onnx's reference
    evaluator's), exactly (dtype, shape, values)."""
    if oracle == "reference":
        from onnx.reference import ReferenceEvaluator
        expected = [np.asarray(r) for r in ReferenceEvaluator(model).run(None, feeds)]
    else:
        expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    compiled = cuvil.compile(model, **options)
    got = compiled.run(feeds)
    names = [o.name for o in model.graph.output]
    for name, want in zip(names, expected):
        have = got[name]
        assert have.shape == want.shape, (name, have.shape, want.shape)
        if want.dtype == object:
            assert have.dtype == object
            assert have.tolist() == want.tolist(), name
        else:
            assert have.dtype == want.dtype, (name, have.dtype, want.dtype)
            np.testing.assert_array_equal(have, want, err_msg=name)
    return compiled


def S(*items):
    return np.array(items, dtype=object)


def test_concat_broadcast_utf8_empty():
    model = _model([helper.make_node("StringConcat", ["x", "y"], ["z"])],
                   [("x", T.STRING, [2, 3]), ("y", T.STRING, [3])], [("z", T.STRING, [2, 3])])
    _check(model, {"x": S(["a", "", "日本"], ["über", "x y", "é"]), "y": S("-", "", "語")})


def test_concat_with_a_constant_operand_and_two_threads():
    suffix = numpy_helper.from_array(np.array([".com"], dtype=object), "suffix")
    model = _model([helper.make_node("StringConcat", ["x", "suffix"], ["z"])], [("x", T.STRING, [3])],
                   [("z", T.STRING, [3])], inits=[suffix])
    _check(model, {"x": S("a", "bb", "")}, threads=2)


def test_equal_strings_broadcast():
    model = _model([helper.make_node("Equal", ["x", "y"], ["z"])],
                   [("x", T.STRING, [2, 3]), ("y", T.STRING, [3])], [("z", T.BOOL, [2, 3])], opset=19)
    _check(model, {"x": S(["a", "b", "ç"], ["a", "", "c"]), "y": S("a", "", "ç")})


# onnxruntime's default locale is en_US.UTF-8, not installed here: the oracle runs with C.UTF-8, whose
# case mapping is the same (cuvil takes both, docs/strings.md), and with C (ASCII letters only).
@pytest.mark.parametrize("locale", ["C.UTF-8", "C"])
@pytest.mark.parametrize("action", ["NONE", "LOWER", "UPPER"])
@pytest.mark.parametrize("sensitive", [0, 1])
def test_normalizer_case_and_stopwords(action, sensitive, locale):
    node = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action=action,
                            is_case_sensitive=sensitive, stopwords=["the", "ÉTÉ"], locale=locale)
    model = _model([node], [("x", T.STRING, [8])], [("y", T.STRING, [None])], opset=10)
    _check(model, {"x": S("The", "quick", "été", "ÀÉÎõü µÿ", "Ωμέγα ΑΒΓ ς", "Привет Ёж", "the", "日本 ǅ İı ſ")})


@pytest.mark.parametrize("action", ["LOWER", "UPPER"])
def test_normalizer_maps_every_code_point_below_u0800_as_onnxruntime(action):
    text = "".join(chr(c) for c in range(0x20, 0x800) if not 0xD800 <= c < 0xE000)
    words = np.array([text[i:i + 64] for i in range(0, len(text), 64)], dtype=object)
    node = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action=action, locale="C.UTF-8")
    model = _model([node], [("x", T.STRING, [len(words)])], [("y", T.STRING, [len(words)])], opset=10)
    _check(model, {"x": words})


def test_normalizer_two_dims_all_dropped_and_no_stopwords():
    drop_all = helper.make_node("StringNormalizer", ["x"], ["y"], stopwords=["a", "b"], locale="C.UTF-8")
    _check(_model([drop_all], [("x", T.STRING, [1, 2])], [("y", T.STRING, [1, None])], opset=10),
           {"x": S(["A", "b"])})
    upper = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action="UPPER", locale="C.UTF-8")
    _check(_model([upper], [("x", T.STRING, [3])], [("y", T.STRING, [3])], opset=10), {"x": S("a", "ß b", "")})


def test_normalizer_refuses_a_locale_it_does_not_implement():
    node = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action="UPPER", locale="tr_TR",
                            name="norm_tr")
    model = _model([node], [("x", T.STRING, [2])], [("y", T.STRING, [2])], opset=10)
    with pytest.raises(CuvilError, match="norm_tr.*locale 'tr_TR'"):
        cuvil.compile(model)


@pytest.mark.parametrize("attrs", [{}, {"delimiter": ""}, {"delimiter": "--"}, {"delimiter": ","},
                                   {"maxsplit": 1}, {"delimiter": ",", "maxsplit": 2}, {"maxsplit": 0}])
def test_split(attrs):
    node = helper.make_node("StringSplit", ["x"], ["y", "n"], **attrs)
    model = _model([node], [("x", T.STRING, [2, 3])], [("y", T.STRING, None), ("n", T.INT64, [2, 3])])
    _check(model, {"x": S([" a  b\tc ", "x--y----z", ",,a,b,"], ["", "日本 語", "one"])})


def test_split_beyond_its_bound_fails_the_run_with_the_node_named():
    node = helper.make_node("StringSplit", ["x"], ["y", "n"], delimiter=",", name="split_csv")
    compiled = cuvil.compile(_model([node], [("x", T.STRING, [1])], [("y", T.STRING, None), ("n", T.INT64, [1])]))
    # a library names its nodes canonically (cuvil/semantic.py): <Op>_<k>
    with pytest.raises(RuntimeFailure, match="code 6: node 'StringSplit_0'.*more than 64 substrings"):
        compiled.run({"x": S("," * 80)})
    assert compiled.run({"x": S("a,b")})["y"].tolist() == [["a", "b"]]   # the session goes on


PATTERNS = [
    r"www\.[\w.-]+\.\bcom\b", r"(\W|^)[\w.\-]{0,25}@(yahoo|gmail)\.com(\W|$)", r"[a-c]+x?", r"\d{2,3}-\d+",
    r"(ab|a)*b", r"[^0-9]*", r".+é", r"\s*\S+\s*", r"(?:foo|bar){2}", r"a.*?b", r"^\bword\B.*$", r"(?P<x>[A-Z]){1,}",
    r"", r"a{2,}", r"[\]\-x]+", r"\x41\.\*",
]
TEXTS = ["www.google.com", "www.bbc.co.uk", "account@gmail.com", " a.b@yahoo.com!", "abcabc", "aac", "12-345",
         "123-", "ababb", "ab", "hello", "12", "café", "naïve", "  tok  ", "foobar", "barbar", "aXb", "a\nb",
         "wordy", "word", "ABC", "", "aaa", "]-x", "A.*", "日本"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_full_match(pattern):
    node = helper.make_node("RegexFullMatch", ["x"], ["y"], pattern=pattern)
    model = _model([node], [("x", T.STRING, [len(TEXTS)])], [("y", T.BOOL, [len(TEXTS)])])
    _check(model, {"x": np.array(TEXTS, dtype=object)})


@pytest.mark.parametrize("pattern", [r"a(?=b)", r"(a)\1", r"(?i)abc", r"\p{Greek}", r"[é]"])
def test_regex_refuses_what_its_engine_does_not_take(pattern):
    node = helper.make_node("RegexFullMatch", ["x"], ["y"], pattern=pattern, name="rx")
    model = _model([node], [("x", T.STRING, [1])], [("y", T.BOOL, [1])])
    with pytest.raises(CuvilError, match="rx.*RegexFullMatch"):
        cuvil.compile(model)


LABEL_CASES = [
    # (input type, input, output type, attributes)
    (T.STRING, S("a", "b", "zz", "c"), T.INT64, {"keys_strings": ["c", "a", "b"], "values_int64s": [3, 1, 2],
                                                "default_int64": 7}),
    (T.STRING, S("a", "q", "b"), T.FLOAT, {"keys_strings": ["a", "b"], "values_floats": [0.5, -2.25]}),
    (T.STRING, S("x", "y", "é"), T.STRING, {"keys_strings": ["é", "x"], "values_strings": ["E", "X"],
                                           "default_string": "?"}),
    (T.INT64, np.array([5, -1, 9, 5], np.int64), T.STRING, {"keys_int64s": [9, 5, 0],
                                                           "values_strings": ["nine", "five", "zero"]}),
    (T.FLOAT, np.array([0.5, 1.0, 3.0], np.float32), T.STRING, {"keys_floats": [1.0, 0.5],
                                                               "values_strings": ["one", "half"]}),
    (T.INT64, np.array([1, 2, 3], np.int64), T.FLOAT, {"keys_int64s": [1, 3], "values_floats": [0.1, 0.3]}),
    (T.FLOAT, np.array([np.nan, 2.0, 7.0], np.float32), T.INT64, {"keys_floats": [2.0, 7.0], "values_int64s": [20, 70]}),
    (T.FLOAT, np.array([np.nan, 2.0], np.float32), T.STRING, {"keys_floats": [np.nan, 2.0],
                                                              "values_strings": ["nan", "two"]}),
]


@pytest.mark.parametrize("in_type, x, out_type, attrs", LABEL_CASES)
def test_label_encoder(in_type, x, out_type, attrs):
    node = helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", **attrs)
    model = _model([node], [("x", in_type, list(x.shape))], [("y", out_type, list(x.shape))], ml=True)
    _check(model, {"x": x})


def test_label_encoder_tensor_attributes_into_a_numeric_graph():
    keys = numpy_helper.from_array(np.array(["a", "b", "c"], dtype=object), "keys_tensor")
    values = numpy_helper.from_array(np.array([10, 20, 30], np.int16), "values_tensor")
    default = numpy_helper.from_array(np.array([-5], np.int16), "default_tensor")
    node = helper.make_node("LabelEncoder", ["x"], ["codes"], domain="ai.onnx.ml")
    node.attribute.extend([helper.make_attribute("keys_tensor", keys), helper.make_attribute("values_tensor", values),
                           helper.make_attribute("default_tensor", default)])
    add = helper.make_node("Add", ["codes", "codes"], ["y"])
    model = _model([node, add], [("x", T.STRING, [4])], [("y", T.INT16, [4])], ml=True)
    _check(model, {"x": S("c", "a", "nope", "b")})


def test_identity_and_reshape_of_strings_are_views():
    nodes = [helper.make_node("Identity", ["x"], ["i"]), helper.make_node("Reshape", ["x", "shape"], ["r"])]
    shape = numpy_helper.from_array(np.array([3, 2], np.int64), "shape")
    model = _model(nodes, [("x", T.STRING, [2, 3])], [("i", T.STRING, [2, 3]), ("r", T.STRING, [3, 2])], inits=[shape])
    _check(model, {"x": S(["a", "b", "c"], ["d", "é", ""])})


def test_an_op_without_a_string_kernel_is_refused_by_name():
    node = helper.make_node("Transpose", ["x"], ["y"], name="flip")
    model = _model([node], [("x", T.STRING, [2, 3])], [("y", T.STRING, [3, 2])])
    with pytest.raises(CuvilError, match="flip.*Transpose does not take string tensors"):
        cuvil.compile(model)


def test_runtime_takes_str_arrays_and_refuses_non_strings():
    model = _model([helper.make_node("StringConcat", ["x", "y"], ["z"])],
                   [("x", T.STRING, [2]), ("y", T.STRING, [2])], [("z", T.STRING, [2])])
    compiled = cuvil.compile(model)
    assert compiled.run({"x": np.array(["a", "b"]), "y": ["c", "d"]})["z"].tolist() == ["ac", "bd"]
    with pytest.raises(CuvilError, match="input 'x'.*int"):
        compiled.run({"x": S(1, "b"), "y": S("c", "d")})
    info = compiled.info
    assert [v["dtype"] for v in info["inputs"] + info["outputs"]] == ["string"] * 3


def test_c_abi_pointer_arrays_and_null_elements(tmp_path):
    """Through the C ABI itself: `const char*` arrays in; out, pointers into the session's pool, valid
    until the next run; a NULL element is refused with ERR_NULL_ARGUMENT."""
    model = _model([helper.make_node("StringConcat", ["x", "y"], ["z"])],
                   [("x", T.STRING, [2]), ("y", T.STRING, [2])], [("z", T.STRING, [2])])
    path = cuvil.compile(model).save(tmp_path / "lib")
    header = next(tmp_path.rglob("*.h")).read_text()
    assert "const char*" in header and "string" in header
    lib = ctypes.CDLL(str(path))
    lib.cuvil_session_create.restype = ctypes.c_void_p
    lib.cuvil_session_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuvil_session_error.restype = ctypes.c_char_p
    lib.cuvil_session_error.argtypes = [ctypes.c_void_p]
    lib.cuvil_session_destroy.argtypes = [ctypes.c_void_p]
    session = lib.cuvil_session_create()
    x, y = (ctypes.c_char_p * 2)(b"ab", "é".encode()), (ctypes.c_char_p * 2)(b"c", b"")
    z = (ctypes.c_char_p * 2)()
    inputs = (ctypes.c_void_p * 2)(ctypes.addressof(x), ctypes.addressof(y))
    outputs = (ctypes.c_void_p * 1)(ctypes.addressof(z))
    assert lib.cuvil_session_run(session, inputs, outputs) == 0
    assert [z[0], z[1].decode()] == [b"abc", "é"]
    y[1] = None
    assert lib.cuvil_session_run(session, inputs, outputs) == 2
    assert b"is NULL" in lib.cuvil_session_error(session)
    lib.cuvil_session_destroy(session)


CAST_CASES = [
    (T.FLOAT, np.array([0.1, 1.0, 1e20, -0.0, np.nan, np.inf, -np.inf, 3.4028235e38, 1e-7, 123456789.0, 1 / 3],
                       np.float32)),
    (T.DOUBLE, np.array([0.1, 1.0, 1e20, 1 / 3, 0.1 + 0.2, -2.5e-300], np.float64)),
    (T.INT64, np.array([0, -5, 2**62, -2**63], np.int64)),
    (T.UINT8, np.array([0, 255], np.uint8)),
    (T.BOOL, np.array([True, False])),
]


@pytest.mark.parametrize("elem, x", CAST_CASES)
def test_cast_to_string(elem, x):
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=T.STRING)], [("x", elem, list(x.shape))],
                   [("y", T.STRING, list(x.shape))], opset=19)
    _check(model, {"x": x})


@pytest.mark.parametrize("elem", [T.FLOAT, T.DOUBLE, T.INT64, T.INT32, T.UINT16])
def test_cast_from_string(elem):
    texts = S("0.1", " 2", "1e3", "-7", "0x10", "1.5abc", "3.4028235e38", "12") if elem in (T.FLOAT, T.DOUBLE) \
        else S("12", "-3", " 7", "40000", "0")
    if elem == T.UINT16:
        texts = S("12", "3", " 7", "40000", "0")
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=elem)], [("x", T.STRING, [len(texts)])],
                   [("y", elem, [len(texts)])], opset=19)
    _check(model, {"x": texts})


def test_a_graph_input_that_is_also_an_output_is_read_after_its_copy():
    """The driver keeps such an input in the output's buffer: it copies it there before the steps that
    read it (a numeric library read the caller's empty output buffer before; a string one crashed)."""
    strings = _model([helper.make_node("StringConcat", ["s", "s"], ["y"])], [("s", T.STRING, [2])],
                     [("y", T.STRING, [2]), ("s", T.STRING, [2])])
    _check(strings, {"s": S("a", "é")})
    numbers = _model([helper.make_node("Relu", ["x"], ["y"])], [("x", T.FLOAT, [4])],
                     [("y", T.FLOAT, [4]), ("x", T.FLOAT, [4])], opset=17)
    _check(numbers, {"x": np.array([-1, 2, -3, 4], np.float32)})


def test_a_string_constant_output():
    table = numpy_helper.from_array(np.array(["k1", "ü"], dtype=object), "table")
    model = _model([helper.make_node("Identity", ["table"], ["y"]), helper.make_node("Neg", ["x"], ["z"])],
                   [("x", T.FLOAT, [2])], [("y", T.STRING, [2]), ("z", T.FLOAT, [2])], inits=[table], opset=17)
    _check(model, {"x": np.array([1, -2], np.float32)})


def test_many_runs_reuse_the_pool_and_sessions_run_concurrently():
    import threading
    node = helper.make_node("StringSplit", ["x"], ["y", "n"], delimiter=",")
    compiled = cuvil.compile(_model([node], [("x", T.STRING, [2])], [("y", T.STRING, None), ("n", T.INT64, [2])]))
    library = cuvil.load(compiled.artifacts.library)
    errors = []

    def work(seed):
        session = library.session()
        for k in range(300):
            text = ",".join(str(seed * 1000 + k + j) * (1 + (k % 5)) for j in range(1 + k % 7))
            got = session.run({"x": S(text, "")})
            if got["y"][0].tolist() != text.split(",") or got["n"].tolist() != [len(text.split(",")), 0]:
                errors.append((seed, k))
    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_the_graph_key_hashes_string_constants_by_their_text():
    """Two imports of one model (distinct str objects, distinct addresses) have one graph key; another
    constant text, another key (an object array's bytes are pointers: cuvil/semantic.py hashes text)."""
    def build(suffix):
        table = numpy_helper.from_array(np.array(["p", suffix], dtype=object), "c")
        return _model([helper.make_node("StringConcat", ["x", "c"], ["z"])], [("x", T.STRING, [2])],
                      [("z", T.STRING, [2])], inits=[table])
    keys = [cuvil.compile(build(s)).info["graph_sha256"] for s in ("".join(["q", "r"]), "qr", "qs")]
    assert keys[0] == keys[1] != keys[2]


_HARNESS = r"""
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
typedef void* (*create_fn)(void);
typedef int (*run_fn)(void*, const void* const*, void* const*);
typedef const char* (*error_fn)(const void*);
typedef void (*destroy_fn)(void*);
int main(int argc, char** argv) {
    void* lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    create_fn create = (create_fn)dlsym(lib, "cuvil_session_create");
    run_fn run = (run_fn)dlsym(lib, "cuvil_session_run");
    error_fn error = (error_fn)dlsym(lib, "cuvil_session_error");
    destroy_fn destroy = (destroy_fn)dlsym(lib, "cuvil_session_destroy");
    const char* texts[3][4] = {{"The a,b", "x@gmail.com", "", "été,ÉTÉ"},
                               {"un,deux,trois", "the", "12", "y@yahoo.com"},
                               {"", "", "", ""}};
    const char* concat[4]; const char* normal[4]; const char* pieces[4 * 4]; int64_t counts[4];
    unsigned char match[4]; int64_t codes[4]; const char* printed[4];
    void* outputs[] = {concat, normal, pieces, counts, match, codes, printed};
    void* s = create();
    for (int round = 0; round < 6; round++) {
        const void* inputs[] = {texts[round % 3]};
        if (run(s, inputs, outputs) != 0) { fprintf(stderr, "%s\n", error(s)); return 1; }
        for (int i = 0; i < 4; i++) printf("%s|%s|%s|%d|%lld|%s\n", concat[i], normal[i], pieces[i * 2], match[i],
                                           (long long)codes[i], printed[i]);
    }
    destroy(s);
    dlclose(lib);
    return 0;
}
"""


def _every_string_op():
    nodes = [helper.make_node("StringConcat", ["x", "x"], ["concat"]),
             helper.make_node("StringNormalizer", ["x"], ["normal"], case_change_action="UPPER", stopwords=["the"]),
             helper.make_node("StringSplit", ["x"], ["pieces", "counts"], delimiter=",", maxsplit=3),
             helper.make_node("RegexFullMatch", ["x"], ["match"], pattern=r"[\w.]+@(gmail|yahoo)\.com"),
             helper.make_node("LabelEncoder", ["x"], ["codes"], domain="ai.onnx.ml", keys_strings=["12", "the"],
                              values_int64s=[12, 1]),
             helper.make_node("Cast", ["codes"], ["printed"], to=T.STRING)]
    return _model(nodes, [("x", T.STRING, [4])],
                  [("concat", T.STRING, [4]), ("normal", T.STRING, None), ("pieces", T.STRING, None),
                   ("counts", T.INT64, [4]), ("match", T.BOOL, [4]), ("codes", T.INT64, [4]),
                   ("printed", T.STRING, [4])], ml=True)


@pytest.mark.skipif(__import__("shutil").which("valgrind") is None or __import__("shutil").which("gcc") is None,
                    reason="needs valgrind and gcc")
def test_every_string_kernel_under_valgrind(tmp_path):
    """Every string kernel, the pool over several runs (growing, emptied) and the session's end under
    memcheck: no invalid read or write, no leak."""
    import subprocess
    model = _every_string_op()
    library = cuvil.compile(model, target="x86_64-avx2").save(tmp_path / "lib")   # valgrind: no AVX-512
    (tmp_path / "harness.c").write_text(_HARNESS)
    subprocess.run(["gcc", "-O1", "-g", "-o", str(tmp_path / "harness"), str(tmp_path / "harness.c"), "-ldl"],
                   check=True)
    result = subprocess.run(["valgrind", "--error-exitcode=99", "--leak-check=full",
                             "--errors-for-leak-kinds=definite,indirect", str(tmp_path / "harness"), str(library)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 24 and lines[:4] == lines[12:16]
    # the same values as the Python runtime (itself checked against onnxruntime above)
    got = cuvil.compile(model).run({"x": S("The a,b", "x@gmail.com", "", "été,ÉTÉ")})
    assert lines[1].split("|")[:2] == [got["concat"][1], got["normal"][1]]


def test_a_text_pipeline_into_numbers():
    """Lower-case, compare with a constant, encode, and add: string kernels feeding numeric ones."""
    target = numpy_helper.from_array(np.array(["yes"], dtype=object), "target")
    nodes = [helper.make_node("StringNormalizer", ["x"], ["low"], case_change_action="LOWER", locale="C.UTF-8"),
             helper.make_node("Equal", ["low", "target"], ["is_yes"]),
             helper.make_node("LabelEncoder", ["low"], ["code"], domain="ai.onnx.ml", keys_strings=["yes", "no"],
                              values_floats=[1.0, -1.0], default_float=0.0),
             helper.make_node("Cast", ["is_yes"], ["yes_f"], to=T.FLOAT),
             helper.make_node("Add", ["code", "yes_f"], ["y"])]
    model = _model(nodes, [("x", T.STRING, [5])], [("y", T.FLOAT, [5]), ("is_yes", T.BOOL, [5])], ml=True,
                   inits=[target])
    _check(model, {"x": S("YES", "No", "maybe", "yes", "ÝES")})


# onnxruntime 1.32 gathers strings along axis 0 wrongly when a slice holds several elements (it copies
# the first of each and leaves "" in the others): there the reference evaluator is the oracle.
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_strings(axis):
    data = numpy_helper.from_array(np.array([["a", "b", "c"], ["d", "é", ""]], dtype=object), "labels")
    nodes = [helper.make_node("Gather", ["labels", "i"], ["picked"], axis=axis),
             helper.make_node("Gather", ["s", "i"], ["moved"], axis=axis)]
    count = 2 if axis == 0 else 3
    model = _model(nodes, [("s", T.STRING, [2, 3]), ("i", T.INT64, [2])],
                   [("picked", T.STRING, None), ("moved", T.STRING, None)], inits=[data], opset=13)
    _check(model, {"s": S(["p", "q", "r"], ["s", "t", "u"]), "i": np.array([count - 1, -1], np.int64)},
           oracle="reference" if axis == 0 else "onnxruntime")


def test_class_labels_of_an_argmax():
    """A classifier's label lookup: Gather of constant class names at the ArgMax of the scores."""
    labels = numpy_helper.from_array(np.array(["cat", "dog", "bird"], dtype=object), "labels")
    nodes = [helper.make_node("ArgMax", ["scores"], ["best"], axis=1, keepdims=0),
             helper.make_node("Gather", ["labels", "best"], ["label"])]
    model = _model(nodes, [("scores", T.FLOAT, [4, 3])], [("label", T.STRING, [4])], inits=[labels], opset=13)
    _check(model, {"scores": np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)})
    compiled = cuvil.compile(_model([helper.make_node("Gather", ["labels", "i"], ["y"])], [("i", T.INT64, [1])],
                                    [("y", T.STRING, [1])], inits=[labels], opset=13))
    with pytest.raises(RuntimeFailure, match=r"outside \[-3, 3\)"):
        compiled.run({"i": np.array([3], np.int64)})
