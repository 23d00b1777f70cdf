"""LSTM, GRU and RNN kernels (backends/numba_cpu/rnn.py) against onnxruntime,
relative tolerance 1e-4: directions, layouts, initial states, run-time and
constant weights and biases, sequence lengths, peepholes, clip, input_forget,
linear_before_reset, non-default activations, omitted outputs; then two
sequence models exported from torch with seeded weights."""
import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper

import cuvil
from cuvil.errors import UnsupportedOpError

from tests.helpers import assert_matches_ort, make_model, rand, run_ort

F32, F64 = np.float32, np.float64
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def check(model, feeds, **options):
    return assert_matches_ort(model, feeds, **options)


def rnn_model(op, T=4, B=3, I=5, H=6, direction="forward", layout=0, outputs=("Y", "Y_h", "Y_c"),
              bias=True, const=True, seq_lens=None, initial=False, peepholes=False, dtype=F32, opset=14, **attrs):
    """One recurrent node; X always a graph input, W/R/B initializers when `const`, else inputs."""
    D = 2 if direction == "bidirectional" else 1
    G = GATES[op]
    x_shape = (T, B, I) if layout == 0 else (B, T, I)
    state_shape = (D, B, H) if layout == 0 else (B, D, H)
    tensors = {"X": rand(*x_shape, seed=1, dtype=dtype),
               "W": rand(D, G * H, I, seed=2, dtype=dtype) * dtype(0.5),
               "R": rand(D, G * H, H, seed=3, dtype=dtype) * dtype(0.5)}
    if bias:
        tensors["B"] = rand(D, 2 * G * H, seed=4, dtype=dtype) * dtype(0.5)
    if seq_lens is not None:
        tensors["sequence_lens"] = np.asarray(seq_lens, np.int32)
    if initial:
        tensors["initial_h"] = rand(*state_shape, seed=5, dtype=dtype)
        if op == "LSTM":
            tensors["initial_c"] = rand(*state_shape, seed=6, dtype=dtype)
    if peepholes:
        tensors["P"] = rand(D, 3 * H, seed=7, dtype=dtype) * dtype(0.5)
    order = ["X", "W", "R", "B", "sequence_lens", "initial_h"] + (["initial_c", "P"] if op == "LSTM" else [])
    names = [n if n in tensors else "" for n in order]
    while names and not names[-1]:
        names.pop()
    weights = {"W", "R", "B", "P"}
    inits = {n: tensors[n] for n in names if n in weights and const}
    feeds = {n: tensors[n] for n in names if n and n not in inits}
    inputs = [(n, v.dtype, list(v.shape)) for n, v in feeds.items()]
    outs = list(outputs[:3 if op == "LSTM" else 2])
    node = helper.make_node(op, names, outs, hidden_size=H, direction=direction, **attrs,
                            **({"layout": layout} if layout else {}))
    model = make_model([node], inputs, [(o, dtype, None) for o in outs if o], initializers=inits, opset=opset)
    return model, feeds


LSTM_CASES = {
    "forward": {},
    "reverse_runtime_weights_y_only": {"direction": "reverse", "const": False, "outputs": ("Y",)},
    "bidirectional_initial_states_no_y": {"direction": "bidirectional", "initial": True, "outputs": ("", "Y_h", "Y_c")},
    "seq_lens_initial_states": {"seq_lens": [4, 2, 3], "initial": True},
    "bidirectional_seq_lens": {"direction": "bidirectional", "seq_lens": [1, 4, 3]},
    "reverse_seq_lens_runtime_bias": {"direction": "reverse", "seq_lens": [2, 4, 1], "const": False},
    "peepholes_clip": {"peepholes": True, "clip": 0.7, "initial": True},
    "bidirectional_peepholes_runtime": {"direction": "bidirectional", "peepholes": True, "const": False},
    "input_forget": {"input_forget": 1, "peepholes": True},
    "no_bias_y_h_only": {"bias": False, "outputs": ("", "Y_h")},
    "activations": {"activations": ["HardSigmoid", "Softsign", "Elu"], "activation_alpha": [0.3, 0.9],
                    "activation_beta": [0.4]},
    "bidirectional_activations": {"direction": "bidirectional",
                                  "activations": ["Sigmoid", "Tanh", "Tanh", "Sigmoid", "Relu", "Softsign"]},
    "opset22": {"opset": 22, "direction": "bidirectional"},
}


@pytest.mark.parametrize("case", list(LSTM_CASES))
def test_lstm(case):
    model, feeds = rnn_model("LSTM", **LSTM_CASES[case])
    check(model, feeds)


GRU_CASES = {
    "forward": {},
    "linear_before_reset": {"linear_before_reset": 1, "initial": True},
    "linear_before_reset_runtime_bias": {"linear_before_reset": 1, "const": False, "direction": "bidirectional"},
    "reverse_runtime_weights": {"direction": "reverse", "const": False, "outputs": ("Y",)},
    "bidirectional_seq_lens_initial": {"direction": "bidirectional", "seq_lens": [3, 4, 1], "initial": True},
    "clip_no_bias": {"clip": 0.5, "bias": False},
    "activations": {"activations": ["HardSigmoid", "LeakyRelu"], "activation_alpha": [0.25, 0.1],
                    "activation_beta": [0.45]},
}


@pytest.mark.parametrize("case", list(GRU_CASES))
def test_gru(case):
    model, feeds = rnn_model("GRU", **GRU_CASES[case])
    check(model, feeds)


RNN_CASES = {
    "forward": {},
    "bidirectional_relu": {"direction": "bidirectional", "activations": ["Relu", "Tanh"], "initial": True},
    "reverse_seq_lens": {"direction": "reverse", "seq_lens": [4, 1, 2], "const": False},
}


@pytest.mark.parametrize("case", list(RNN_CASES))
def test_rnn(case):
    model, feeds = rnn_model("RNN", **RNN_CASES[case])
    check(model, feeds)


# onnxruntime runs neither layout=1 (batch-major) nor float64 recurrent nodes: those
# cases are compared with onnxruntime on the equivalent layout-0 / float32 model.
LAYOUT1_CASES = {
    "lstm_bidirectional": ("LSTM", {"direction": "bidirectional", "initial": True}),
    "lstm_seq_lens": ("LSTM", {"seq_lens": [3, 1, 4], "peepholes": True}),
    "gru_bidirectional_no_y": ("GRU", {"direction": "bidirectional", "outputs": ("", "Y_h"), "initial": True}),
    "rnn_clip": ("RNN", {"clip": 0.4, "direction": "reverse"}),
    "lstm_split_halves_two_threads": ("LSTM", {"H": 72, "B": 2, "initial": True, "threads": 2}),
}


@pytest.mark.parametrize("case", list(LAYOUT1_CASES))
def test_layout1(case):
    op, kwargs = LAYOUT1_CASES[case]
    kwargs = dict(kwargs)
    threads = kwargs.pop("threads", 1)
    batch_major, feeds = rnn_model(op, layout=1, **kwargs)
    time_major, _ = rnn_model(op, layout=0, **kwargs)
    got = cuvil.compile(batch_major, threads=threads).run(feeds)
    to_time_major = {"X": (1, 0, 2), "initial_h": (1, 0, 2), "initial_c": (1, 0, 2)}
    want = run_ort(time_major, {k: v.transpose(to_time_major[k]) if k in to_time_major else v for k, v in feeds.items()})
    to_batch_major = {"Y": (2, 0, 1, 3), "Y_h": (1, 0, 2), "Y_c": (1, 0, 2)}
    for name, ref in want.items():
        ref = ref.transpose(to_batch_major[name])
        assert got[name].shape == ref.shape
        assert np.max(np.abs(got[name] - ref)) <= 1e-4 * np.max(np.abs(ref)), name


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_float64(op):
    kwargs = {"direction": "bidirectional", "initial": True, "seq_lens": [4, 2, 3]}
    model64, feeds64 = rnn_model(op, dtype=F64, **kwargs)
    model32, feeds32 = rnn_model(op, dtype=F32, **kwargs)
    got = cuvil.compile(model64).run(feeds64)
    want = run_ort(model32, feeds32)
    for name, ref in want.items():
        assert got[name].dtype == np.float64
        assert np.max(np.abs(got[name] - ref)) <= 1e-4 * np.max(np.abs(ref)), name


def test_lstm_threads():
    """Batch items are the work range: with two threads each runs its own sequences."""
    model, feeds = rnn_model("LSTM", B=5, direction="bidirectional", seq_lens=[4, 1, 3, 2, 4])
    check(model, feeds, threads=2)


# float32 nodes with constant weights run their products on micro-kernels (rnn_uk.py): batch rows
# in balanced tiles of up to 6 (rnn._balanced_block: B=8 runs as 4 + 4, B=7 as 4 + 3, B=13 as
# 5 + 5 + 3 on one thread and 4 + 4 + 4 + 1 on two), gate rows in panels of 64 (H=40: LSTM's 160
# gate rows end in a partial panel; GRU's z|r group 80 and candidate group 40), input rows of the
# projection in tiles of 6 (T*B=24 and, with layout 1, per batch row T=3) and K passes of 256 (I=300).
PANEL_CASES = {
    "lstm_batch8_bidirectional": ("LSTM", {"B": 8, "H": 40, "direction": "bidirectional", "initial": True}),
    "lstm_batch8_seq_lens_peepholes": ("LSTM", {"B": 8, "H": 20, "seq_lens": [3, 1, 2, 3, 0, 2, 3, 1],
                                                "peepholes": True, "T": 3}),
    "lstm_wide_input": ("LSTM", {"B": 2, "I": 300, "H": 17, "T": 3}),
    "gru_batch8": ("GRU", {"B": 8, "H": 40, "direction": "reverse", "initial": True}),
    "gru_batch7_linear_before_reset": ("GRU", {"B": 7, "H": 40, "linear_before_reset": 1,
                                               "direction": "bidirectional"}),
    "rnn_batch13": ("RNN", {"B": 13, "H": 70, "clip": 2.0}),
}


@pytest.mark.parametrize("case", list(PANEL_CASES))
def test_micro_kernel_tiles(case):
    op, kwargs = PANEL_CASES[case]
    model, feeds = rnn_model(op, **kwargs)
    check(model, feeds)


def test_micro_kernel_layout1_batch_rows():
    batch_major, feeds = rnn_model("LSTM", layout=1, B=7, T=3, H=24, initial=True)
    time_major, _ = rnn_model("LSTM", layout=0, B=7, T=3, H=24, initial=True)
    got = cuvil.compile(batch_major).run(feeds)
    to_time_major = {"X": (1, 0, 2), "initial_h": (1, 0, 2), "initial_c": (1, 0, 2)}
    want = run_ort(time_major, {k: v.transpose(to_time_major[k]) for k, v in feeds.items()})
    to_batch_major = {"Y": (2, 0, 1, 3), "Y_h": (1, 0, 2), "Y_c": (1, 0, 2)}
    for name, ref in want.items():
        ref = ref.transpose(to_batch_major[name])
        assert np.max(np.abs(got[name] - ref)) <= 1e-4 * np.max(np.abs(ref)), name


@pytest.mark.parametrize("target", ["x86_64-avx2", "generic"])
def test_micro_kernel_narrow_vectors(target):
    """The recurrent product's 16-float vectors are split by LLVM for 8- and 4-wide targets."""
    model, feeds = rnn_model("GRU", B=7, H=40, linear_before_reset=1, initial=True)
    check(model, feeds, target=target)


def test_micro_kernel_threads_identical():
    """Work items (directions x gate panels, batch tiles) give the same bits for any thread count."""
    model, feeds = rnn_model("LSTM", B=13, H=40, T=5, direction="bidirectional", initial=True)
    one = cuvil.compile(model, threads=1).run(feeds)
    two = cuvil.compile(model, threads=2).run(feeds)
    for name in one:
        assert np.array_equal(one[name], two[name]), name
    check(model, feeds, threads=2)


# An LSTM whose batch is one work item runs each step in two halves of the hidden units (rnn.py's
# _unit_split), on two threads at once when the library has them: H=128 (one panel per gate and
# half), H=100 (the second half 36 units, a masked panel), H=192 (halves of 128 and 64 units); with
# layout=1 in LAYOUT1_CASES.
SPLIT_CASES = {
    "h128": dict(H=128, B=1, T=6, I=16),
    "h100_batch3_bidirectional_initial": dict(H=100, B=3, T=4, I=8, direction="bidirectional", initial=True),
    "h192_reverse_peepholes_clip": dict(H=192, B=2, T=3, I=8, direction="reverse", peepholes=True, clip=3.0),
    "h96_input_forget_only_y_h": dict(H=96, B=1, T=5, I=8, input_forget=1, outputs=("", "Y_h", "")),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_steps(case):
    """Both thread counts against onnxruntime, and the same bits on one thread and on two."""
    model, feeds = rnn_model("LSTM", **SPLIT_CASES[case])
    _, one = check(model, feeds, threads=1)
    _, two = check(model, feeds, threads=2)
    for name in one:
        assert np.array_equal(one[name], two[name]), name


def test_split_steps_when_a_thread_is_late():
    """A thread whose partner has not claimed the other half runs both halves (the pool's caller
    may run both work items). Three sessions at once on a small machine make pool threads late:
    every run still gives the bits of the single-thread library."""
    from concurrent.futures import ThreadPoolExecutor
    model, feeds = rnn_model("LSTM", H=128, B=1, T=8, I=16, initial=True)
    want = cuvil.compile(model, threads=1).run(feeds)
    lib = cuvil.compile(model, threads=2)

    def runs(_):
        session = lib.session()
        try:
            return [session.run(feeds) for _ in range(100)]
        finally:
            session.close()
    with ThreadPoolExecutor(3) as pool:
        results = [out for outs in pool.map(runs, range(3)) for out in outs]
    for got in results:
        for name in want:
            assert np.array_equal(got[name], want[name]), name


def test_unknown_activation_is_refused():
    model, _ = rnn_model("RNN", activations=["Gelu"])
    with pytest.raises(UnsupportedOpError, match="activation Gelu"):
        cuvil.compile(model)


# ---------------------------------------------------------------- torch sequence models

torch = pytest.importorskip("torch")


def _export(module, shape):
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (torch.zeros(shape),), buf, dynamo=False, opset_version=17, input_names=["x"])
    return onnx.load_model_from_string(buf.getvalue())


class _StackedLSTM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y)


class _BiGRU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(12, 20, bidirectional=True)

    def forward(self, x):
        return self.rnn(x)


def test_torch_two_layer_lstm():
    torch.manual_seed(0)
    model = _export(_StackedLSTM(), (2, 8, 16))
    assert [n.op_type for n in model.graph.node].count("LSTM") == 2
    assert_matches_ort(model, {"x": rand(2, 8, 16, seed=11)})


def test_torch_bidirectional_gru():
    torch.manual_seed(1)
    model = _export(_BiGRU(), (6, 3, 12))
    assert "GRU" in [n.op_type for n in model.graph.node]
    assert_matches_ort(model, {"x": rand(6, 3, 12, seed=12)})
