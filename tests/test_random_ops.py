"""The random ops (backends/numba_cpu/rng.py) against explicit statistical oracles.

No generator reproduces another's values, so each op is checked against its law with bounds
derived from the sample size n (a false failure at most about once in 10^4 runs for each):

- the Philox4x32-10 bits against Random123's known-answer vectors, and the kernel's values against
  the Python reference of the same mapping (exact);
- uniform and normal draws: the Kolmogorov-Smirnov distance to the distribution's CDF below
  sqrt(ln(2 / alpha) / (2 n)) (Dvoretzky-Kiefer-Wolfowitz, alpha = 1e-4), the mean within 4
  standard errors;
- Bernoulli and Dropout: counts within 4 standard deviations of their binomial mean;
- Multinomial: each class's frequency within 4 standard deviations of n p;
- onnxruntime's own samples pass the same checks (the checks are fair) and have the same shapes
  and dtypes;
- determinism: a seeded op gives the same bits on every run and for 1 or 2 threads; an unseeded
  one new bits on every run, the same sequence in every new session.
"""
import math
import struct

import numpy as np
import pytest
from onnx import helper

import cuvil
from cuvil.errors import UnsupportedOpError
from backends.numba_cpu.rng import philox4x32
from tests.helpers import make_model, run_ort

ALPHA = 1e-4


def _dkw_bound(n: int) -> float:
    return math.sqrt(math.log(2 / ALPHA) / (2 * n))


def _ks(sample, cdf) -> float:
    x = np.sort(np.asarray(sample, np.float64).reshape(-1))
    n = x.size
    f = cdf(x)
    return float(max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(n) / n)))


def _normal_cdf(mean, scale):
    erf = np.vectorize(math.erf)
    return lambda x: 0.5 * (1 + erf((x - mean) / (scale * math.sqrt(2))))


def _check_uniform(y, low, high):
    assert y.min() >= low and y.max() < high
    n = y.size
    assert _ks(y, lambda x: (x - low) / (high - low)) < _dkw_bound(n)
    sd = (high - low) / math.sqrt(12)
    assert abs(float(y.mean()) - (low + high) / 2) < 4 * sd / math.sqrt(n)


def _check_normal(y, mean, scale):
    n = y.size
    assert _ks(y, _normal_cdf(mean, scale)) < _dkw_bound(n)
    assert abs(float(y.mean()) - mean) < 4 * scale / math.sqrt(n)
    # the sample variance's standard error is sigma^2 sqrt(2 / (n - 1)) for a normal law
    assert abs(float(y.var()) - scale ** 2) < 4 * scale ** 2 * math.sqrt(2 / (n - 1))


def _check_binomial(count, n, p):
    assert abs(count - n * p) <= 4 * math.sqrt(n * p * (1 - p)) + 1e-9


def test_philox_known_answers():
    # Random123's kat_vectors for philox4x32_10
    assert philox4x32((0, 0, 0, 0), (0, 0)) == (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)
    assert philox4x32((0xffffffff,) * 4, (0xffffffff,) * 2) == (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)
    assert philox4x32((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0)) == \
        (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)


def _uniform_model(shape, dtype=1, **attrs):
    return make_model([helper.make_node("RandomUniform", [], ["y"], shape=list(shape), dtype=dtype, **attrs)], [],
                      [("y", dtype, list(shape))])


def test_seeded_uniform_is_the_reference_mapping():
    """y[i] = low + (high - low) * ((w0 >> 8) * 2^-24), w = Philox((i, 0, 0, 0), bits of float64(seed))."""
    seed, low, high = 7.0, -2.0, 3.0
    y = cuvil.compile(_uniform_model([64], seed=seed, low=low, high=high)).run({})["y"]
    bits = struct.unpack("<Q", struct.pack("<d", seed))[0]
    key = (bits & 0xFFFFFFFF, bits >> 32)
    want = np.array([np.float32(low + (high - low) * float(np.float32((philox4x32((i, 0, 0, 0), key)[0] >> 8)
                                                                       * 2.0 ** -24))) for i in range(64)],
                    np.float32)
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("dtype,np_dtype", [(1, np.float32), (11, np.float64)])
def test_random_uniform_law_and_onnxruntime(dtype, np_dtype):
    model = _uniform_model([200, 100], dtype=dtype, low=-1.5, high=2.5, seed=3.0)
    y = cuvil.compile(model).run({})["y"]
    ref = run_ort(model, {})["y"]
    assert y.dtype == ref.dtype == np_dtype and y.shape == ref.shape == (200, 100)
    _check_uniform(y, -1.5, 2.5)
    _check_uniform(ref, -1.5, 2.5)


@pytest.mark.parametrize("op", ["RandomNormal", "RandomNormalLike"])
def test_random_normal_law_and_onnxruntime(op):
    shape = [400, 100]
    if op == "RandomNormal":
        model = make_model([helper.make_node(op, [], ["y"], shape=shape, mean=1.5, scale=0.5, seed=1.0)], [],
                           [("y", np.float32, shape)])
        feeds = {}
    else:
        model = make_model([helper.make_node(op, ["x"], ["y"], mean=1.5, scale=0.5, dtype=11)],
                           [("x", np.float32, shape)], [("y", np.float64, shape)])
        feeds = {"x": np.zeros(shape, np.float32)}
    y = cuvil.compile(model).run(feeds)["y"]
    ref = run_ort(model, feeds)["y"]
    assert y.dtype == ref.dtype and y.shape == ref.shape
    _check_normal(y, 1.5, 0.5)
    _check_normal(ref, 1.5, 0.5)


def test_bernoulli_rate_vs_p():
    p = np.linspace(0.0, 1.0, 11).repeat(2000).astype(np.float32)
    model = make_model([helper.make_node("Bernoulli", ["p"], ["y"], seed=5.0)], [("p", np.float32, [p.size])],
                       [("y", np.float32, [p.size])])
    y = cuvil.compile(model).run({"p": p})["y"]
    ref = run_ort(model, {"p": p})["y"]
    # onnxruntime 1.32 draws ones with probability 1 - p (p = 0 gives all ones), as Bernoulli's
    # function body does (Greater(uniform, p)); the op's definition and onnx's reference give ones
    # with probability p, and so does cuvil. Only onnxruntime's shape and dtype are compared.
    assert y.dtype == ref.dtype and y.shape == ref.shape and set(np.unique(y)) <= {0.0, 1.0}
    for value in np.unique(p):
        _check_binomial(int(y[p == value].sum()), 2000, float(value))


def test_bernoulli_bool_output():
    p = np.full(5000, 0.3, np.float64)
    model = make_model([helper.make_node("Bernoulli", ["p"], ["y"], dtype=9)], [("p", np.float64, [5000])],
                       [("y", np.bool_, [5000])])
    y = cuvil.compile(model).run({"p": p})["y"]
    assert y.dtype == np.bool_
    _check_binomial(int(y.sum()), 5000, 0.3)


def test_multinomial_frequencies_vs_probabilities():
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]], np.float32))
    samples = 20000
    model = make_model([helper.make_node("Multinomial", ["x"], ["y"], sample_size=samples, seed=2.0)],
                       [("x", np.float32, [2, 4])], [("y", np.int32, [2, samples])])
    y = cuvil.compile(model).run({"x": logits})["y"]
    ref = run_ort(model, {"x": logits})["y"]
    assert y.dtype == ref.dtype == np.int32 and y.shape == ref.shape
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    for row in range(2):
        for c in range(4):
            for sample in (y, ref):
                _check_binomial(int((sample[row] == c).sum()), samples, float(probs[row, c]))


@pytest.mark.parametrize("ratio", [0.25, 0.75])
def test_training_dropout_mask_rate_and_scaling(ratio):
    x = np.random.default_rng(0).uniform(0.5, 1.5, (100, 200)).astype(np.float32)
    model = make_model([helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], seed=4)],
                       [("x", np.float32, [100, 200])], [("y", np.float32, [100, 200]), ("mask", np.bool_, [100, 200])],
                       initializers={"r": np.array(ratio, np.float32), "t": np.array(True)}, opset=13)
    out = cuvil.compile(model).run({"x": x})
    y, mask = out["y"], out["mask"]
    assert mask.dtype == np.bool_
    np.testing.assert_allclose(y[mask], x[mask] / np.float32(1 - ratio), rtol=1e-6)  # one float32 rounding
    assert not y[~mask].any()
    _check_binomial(int(mask.sum()), mask.size, 1 - ratio)


def test_training_dropout_without_mask_is_not_a_view():
    """eliminate_identity must not drop a training Dropout (it only drops inference ones)."""
    x = np.ones((64, 64), np.float32)
    model = make_model([helper.make_node("Dropout", ["x", "r", "t"], ["y"], seed=1)],
                       [("x", np.float32, [64, 64])], [("y", np.float32, [64, 64])],
                       initializers={"r": np.array(0.5, np.float32), "t": np.array(True)}, opset=13)
    y = cuvil.compile(model).run({"x": x})["y"]
    assert set(np.unique(y)) == {0.0, 2.0}
    _check_binomial(int((y == 2.0).sum()), y.size, 0.5)


def test_seeded_same_bits_every_run_and_thread_count():
    model = _uniform_model([300, 1000], seed=11.0)   # 1.2 MB: split over the pool at 2 threads
    one, two = cuvil.compile(model, threads=1), cuvil.compile(model, threads=2)
    first = one.run({})["y"]
    assert first.tobytes() == one.run({})["y"].tobytes() == two.run({})["y"].tobytes()


def test_unseeded_new_bits_each_run_same_sequence_per_session():
    model = _uniform_model([300, 1000])
    a, b = cuvil.compile(model, threads=1), cuvil.compile(model, threads=2)
    a1, a2 = a.run({})["y"], a.run({})["y"]
    b1, b2 = b.run({})["y"], b.run({})["y"]
    assert a1.tobytes() != a2.tobytes()
    assert a1.tobytes() == b1.tobytes() and a2.tobytes() == b2.tobytes()
    assert abs(np.corrcoef(a1.reshape(-1), a2.reshape(-1))[0, 1]) < 4 / math.sqrt(a1.size)
    _check_uniform(a2, 0.0, 1.0)


def test_two_unseeded_nodes_draw_different_numbers():
    model = make_model([helper.make_node("RandomUniform", [], ["a"], shape=[1000], name="first"),
                        helper.make_node("RandomUniform", [], ["b"], shape=[1000], name="second")], [],
                       [("a", np.float32, [1000]), ("b", np.float32, [1000])])
    out = cuvil.compile(model).run({})
    assert out["a"].tobytes() != out["b"].tobytes()


def test_training_dropout_of_a_constant_is_not_folded():
    """Neither the importer nor fold_constants evaluates a training Dropout at build time."""
    model = make_model([helper.make_node("Dropout", ["c", "r", "t"], ["y"]), helper.make_node("Add", ["y", "x"], ["z"])],
                       [("x", np.float32, [4000])], [("z", np.float32, [4000])],
                       initializers={"c": np.ones(4000, np.float32), "r": np.array(0.5, np.float32),
                                     "t": np.array(True)}, opset=13)
    compiled = cuvil.compile(model)
    zeros = {"x": np.zeros(4000, np.float32)}
    first, second = compiled.run(zeros)["z"], compiled.run(zeros)["z"]
    assert set(np.unique(first)) == {0.0, 2.0} and first.tobytes() != second.tobytes()
    _check_binomial(int((first == 2.0).sum()), first.size, 0.5)


def test_cuda_target_refuses_random_ops_by_node():
    """The generator state lives in the CPU driver's session: a GPU build says so, naming the node."""
    model = _uniform_model((4, 4), seed=1.0)
    with pytest.raises(UnsupportedOpError, match=r"RandomUniform.*CUDA targets have no random"):
        cuvil.compile(model, target="cuda-sm90")
