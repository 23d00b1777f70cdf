"""The Python runtime's per-call path (`Session.run`): small tensors are copied
through buffers the session owns, large ones passed by address. Every test runs
with both, and with the size limit as shipped, against onnxruntime: repeated
calls with new inputs, fresh outputs, the same errors, any input layout, and a
session shared between threads."""
import threading

import numpy as np
import pytest
from onnx import helper

import cuvil
from cuvil import runtime
from cuvil.errors import RuntimeFailure
from tests.helpers import make_model, rand, run_ort

SMALL, BIG = (2, 8), (64, 128)  # 64 B and 32 KiB of float32


def two_path_model():
    """A small input and output next to a large input and output, so both ways of passing tensors are used."""
    nodes = [helper.make_node("Add", ["x", "b"], ["t"]), helper.make_node("Relu", ["t"], ["y"]),
             helper.make_node("Sigmoid", ["big"], ["z"])]
    return make_model(nodes, [("x", np.float32, list(SMALL)), ("big", np.float32, list(BIG))],
                      [("y", np.float32, list(SMALL)), ("z", np.float32, list(BIG))],
                      {"b": np.linspace(-1, 1, SMALL[1], dtype=np.float32)})


@pytest.fixture(scope="module")
def compiled():
    return cuvil.compile(two_path_model())


@pytest.fixture(params=["shipped", "all_staged", "all_addressed"])
def session(request, compiled, monkeypatch):
    limit = {"shipped": runtime.STAGED_BYTES, "all_staged": 1 << 30, "all_addressed": -1}[request.param]
    monkeypatch.setattr(runtime, "STAGED_BYTES", limit)
    s = compiled.session()
    yield s
    s.close()


def feeds(seed):
    return {"x": rand(*SMALL, seed=seed), "big": rand(*BIG, seed=seed + 1000)}


def assert_close(got, want):
    assert list(got) == list(want)
    for name in want:
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_repeated_calls_with_new_inputs_match_onnxruntime(session):
    model = two_path_model()
    for seed in range(300):
        f = feeds(seed)
        got = session.run(f)
        if seed % 30 == 0:
            assert_close(got, run_ort(model, f))
        else:  # onnxruntime on every call would dominate the test; the formulas are simple
            np.testing.assert_allclose(got["y"], np.maximum(f["x"] + np.linspace(-1, 1, 8, dtype=np.float32), 0),
                                       rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got["z"], 1 / (1 + np.exp(-f["big"])), rtol=1e-5, atol=1e-6)


def test_outputs_are_new_arrays_that_later_calls_leave_alone(session):
    first = session.run(feeds(1))
    kept = {k: v.copy() for k, v in first.items()}
    second = session.run(feeds(2))
    for name in first:
        np.testing.assert_array_equal(first[name], kept[name], err_msg=name)
        assert not np.shares_memory(first[name], second[name])
        assert first[name].flags.writeable and first[name].flags.owndata
    # Writing into a returned array does not reach the next call either.
    second["y"][...] = 123.0
    assert_close(session.run(feeds(2)), run_ort(two_path_model(), feeds(2)))


def test_an_input_changed_in_place_is_read_again(session):
    f = feeds(3)
    before = session.run(f)
    f["x"] += 1.0
    f["big"] *= -1.0
    after = session.run(f)
    assert_close(after, run_ort(two_path_model(), f))
    assert not np.array_equal(before["z"], after["z"])


def test_the_inputs_are_not_written(session):
    f = feeds(4)
    kept = {k: v.copy() for k, v in f.items()}
    session.run(f)
    for name in f:
        np.testing.assert_array_equal(f[name], kept[name])


@pytest.mark.parametrize("bad, message", [
    ({"x": rand(*SMALL).astype(np.float64)}, r"input 'x': dtype float64"),
    ({"big": np.zeros(BIG, np.int32)}, r"input 'big': dtype int32"),
    ({"x": rand(2, 9)}, r"input 'x': shape \[2, 9\]"),
    ({"big": rand(128, 64)}, r"input 'big': shape \[128, 64\]"),
    ({"x": rand(16)}, r"input 'x': shape \[16\]"),
])
def test_wrong_dtype_or_shape_is_a_cuvil_error_naming_the_input(session, bad, message):
    f = dict(feeds(5), **bad)
    for _ in range(2):  # also after the fast path has seen good feeds
        with pytest.raises(cuvil.CuvilError, match=message):
            session.run(f)
        session.run(feeds(5))


def test_missing_unknown_and_non_dict_feeds_are_cuvil_errors(session):
    with pytest.raises(cuvil.CuvilError, match=r"missing input\(s\) \['big'\]"):
        session.run({"x": rand(*SMALL)})
    with pytest.raises(cuvil.CuvilError, match=r"unknown input\(s\) \['w'\]"):
        session.run({"x": rand(*SMALL), "w": rand(*BIG)})  # as many feeds as inputs, one of them wrong
    with pytest.raises(cuvil.CuvilError, match="feeds must be a dict"):
        session.run([rand(*SMALL), rand(*BIG)])
    assert_close(session.run(feeds(6)), run_ort(two_path_model(), feeds(6)))


def misaligned(a):
    raw = np.zeros(a.nbytes + 1, np.uint8)[1:]
    out = raw.view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def readonly(a):
    a = a.copy()
    a.setflags(write=False)
    return a


@pytest.mark.parametrize("layout", [
    np.asfortranarray,
    lambda a: np.repeat(a, 2, axis=1)[:, ::2],                     # strided
    lambda a: a[::-1, ::-1].copy()[::-1, ::-1],                    # negative strides
    lambda a: np.broadcast_to(a, (3,) + a.shape)[1],               # read-only view
    readonly,
    misaligned,
    lambda a: a.astype(">f4"),                                     # big-endian: a dtype error, not a silent cast
    lambda a: a.tolist(),                                          # not an array
    lambda a: a.view(np.matrix) if a.ndim == 2 else a,             # an ndarray subclass
])
def test_any_input_layout_gives_the_same_result(session, layout):
    f = feeds(7)
    given = {k: layout(v) for k, v in f.items()}
    if getattr(given["x"], "dtype", None) == np.dtype(">f4"):
        with pytest.raises(cuvil.CuvilError, match="dtype >f4"):
            session.run(given)
        return
    assert_close(session.run(given), run_ort(two_path_model(), f))
    assert_close(session.run(f), run_ort(two_path_model(), f))


def test_a_library_shared_between_threads_gives_each_call_its_own_result(compiled):
    inputs = [feeds(seed) for seed in range(8)]
    want = [compiled.run(f) for f in inputs]
    failures = []

    def worker(k):
        for i in range(60):
            j = (k + i) % len(inputs)
            got = compiled.run(inputs[j])
            if not all(np.array_equal(got[n], want[j][n]) for n in got):
                failures.append((k, i))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_a_closed_session_fails_cleanly(compiled):
    s = compiled.session()
    s.close()
    with pytest.raises(RuntimeFailure, match="run failed"):
        s.run(feeds(8))


def test_a_dropped_session_is_destroyed_at_once_and_its_run_keeps_it(compiled):
    """The fast path's closure holds no reference to its session: a session nobody holds is
    destroyed when its last reference goes (no cycle left for the garbage collector), while a
    bound `run` kept alone (cuvil.bench's functools.partial) keeps its session alive."""
    import weakref
    s = compiled.session()
    gone = weakref.ref(s)
    del s
    assert gone() is None
    run = compiled.session().run
    assert_close(run(feeds(9)), run_ort(two_path_model(), feeds(9)))


@pytest.mark.parametrize("limit", [16 * 1024, -1])
def test_an_output_listed_twice_is_returned_once(limit, monkeypatch):
    monkeypatch.setattr(runtime, "STAGED_BYTES", limit)
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [2, 3])],
                       [("y", np.float32, [2, 3]), ("y", np.float32, [2, 3])])
    session = cuvil.compile(model).session()
    for seed in range(3):
        x = rand(2, 3, seed=seed)
        got = session.run({"x": x})
        assert list(got) == ["y"]
        np.testing.assert_array_equal(got["y"], np.maximum(x, 0))
