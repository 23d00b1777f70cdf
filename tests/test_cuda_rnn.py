"""LSTM / GRU / RNN GPU kernels (backends/numba_cuda/rnn.py) in the CUDA simulator against
onnxruntime, and through ptxas for sm_90 (tests/test_cuda_zoo.py builds sm_80 too). Shapes stay small: the simulator runs every
GPU thread as a Python thread."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from backends.numba_cuda import rnn as gpu_rnn
from cuvil.errors import UnsupportedOpError
from tests import zoo
from tests.cuda_check import assert_gpu_matches_ort, assert_ptx, gpu_graph, gpu_schedule, ort_outputs
from tests.helpers import make_model

F = TensorProto.FLOAT
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _rng(seed):
    return np.random.default_rng(seed)


def rnn_model(cell, T, B, I, H, direction="forward", layout=0, bias=True, h0=False, c0=False, peep=False,
              seq=None, outputs=("Y", "Y_h", "Y_c"), runtime_weights=False, seed=0, **attrs):
    """A single-node model; weights are initializers (or graph inputs with runtime_weights) and
    the returned feeds hold x, the initial states and every runtime input."""
    rng = _rng(seed)
    D = 2 if direction == "bidirectional" else 1
    G = GATES[cell]
    s = 1 / np.sqrt(H)
    consts = {"W": (rng.uniform(-s, s, (D, G * H, I))).astype(np.float32),
              "R": (rng.uniform(-s, s, (D, G * H, H))).astype(np.float32)}
    if bias:
        consts["B"] = rng.uniform(-s, s, (D, 2 * G * H)).astype(np.float32)
    x_shape = [T, B, I] if layout == 0 else [B, T, I]
    state = [D, B, H] if layout == 0 else [B, D, H]
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    inputs = [("x", F, x_shape)]
    names = ["x", "W", "R", "B" if bias else "", "", "", "", ""]
    if seq is not None:
        feeds["seq"] = np.array(seq, np.int32)
        inputs.append(("seq", TensorProto.INT32, [B]))
        names[4] = "seq"
    if h0:
        feeds["h0"] = rng.standard_normal(state).astype(np.float32)
        inputs.append(("h0", F, state))
        names[5] = "h0"
    if c0:
        feeds["c0"] = rng.standard_normal(state).astype(np.float32)
        inputs.append(("c0", F, state))
        names[6] = "c0"
    if peep:
        consts["P"] = rng.uniform(-0.5, 0.5, (D, 3 * H)).astype(np.float32)
        names[7] = "P"
    if runtime_weights:
        for name in ("W", "R", "B"):
            if name in consts:
                feeds[name] = consts.pop(name)
                inputs.append((name, F, list(feeds[name].shape)))
    while names and not names[-1]:
        names.pop()
    y_shape = [T, D, B, H] if layout == 0 else [B, T, D, H]
    shapes = {"Y": y_shape, "Y_h": state, "Y_c": state}
    out_names = [o if o in outputs else "" for o in ("Y", "Y_h", "Y_c")[:3 if cell == "LSTM" else 2]]
    while out_names and not out_names[-1]:
        out_names.pop()
    node = helper.make_node(cell, names, out_names, hidden_size=H, direction=direction,
                            **({"layout": layout} if layout else {}), **attrs)
    model = make_model([node], inputs, [(o, F, shapes[o]) for o in out_names if o], initializers=consts,
                       opset=14)
    return model, feeds


def check(cell, *args, **kwargs):
    model, feeds = rnn_model(cell, *args, **kwargs)
    assert_gpu_matches_ort(model, feeds, families=[cell, f"{cell}Projection"])


def check_layout1(cell, *args, **kwargs):
    """onnxruntime runs no layout=1 (batch-major) recurrent node: the GPU's batch-major outputs
    against onnxruntime on the time-major model, inputs and outputs transposed."""
    from backends.numba_cuda.simulate import simulate_schedule
    batch_major, feeds = rnn_model(cell, *args, layout=1, **kwargs)
    time_major, _ = rnn_model(cell, *args, layout=0, **kwargs)
    graph = gpu_graph(batch_major, {k: list(v.shape) for k, v in feeds.items()})
    schedule = gpu_schedule(graph)
    got = simulate_schedule(graph, schedule, feeds)
    to_time_major = {"x": (1, 0, 2), "h0": (1, 0, 2), "c0": (1, 0, 2)}
    want = ort_outputs(time_major, {k: v.transpose(to_time_major[k]) if k in to_time_major else v
                                    for k, v in feeds.items()})
    to_batch_major = {"Y": (2, 0, 1, 3), "Y_h": (1, 0, 2), "Y_c": (1, 0, 2)}
    for name, ref in want.items():
        ref = ref.transpose(to_batch_major[name])
        assert got[name].shape == ref.shape
        assert np.max(np.abs(got[name] - ref)) <= 1e-4 * max(1.0, float(np.max(np.abs(ref)))), name
    assert_ptx(schedule)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_lstm_directions_with_initial_states_and_all_outputs(direction):
    check("LSTM", 5, 2, 6, 8, direction=direction, h0=True, c0=True)


def test_lstm_peepholes_clip_and_layout_1():
    check_layout1("LSTM", 4, 3, 5, 8, direction="bidirectional", peep=True, h0=True, c0=True, clip=0.7)


def test_lstm_sequence_lengths_and_input_forget():
    check("LSTM", 6, 3, 4, 8, direction="bidirectional", seq=[6, 3, 1], input_forget=1)


def test_lstm_activations_differ_per_direction():
    check("LSTM", 4, 2, 5, 8, direction="bidirectional", activations=["HardSigmoid", "Tanh", "Softsign",
                                                                       "Sigmoid", "Relu", "Tanh"],
          activation_alpha=[0.3], activation_beta=[0.4])


def test_lstm_only_y_h_and_runtime_weights_without_bias():
    check("LSTM", 5, 2, 6, 8, outputs=("Y_h",), bias=False, runtime_weights=True)


def test_lstm_hidden_past_the_register_budget_streams_r():
    """H=40: the thread keeps 32 of R's 40 columns in registers, the rest streams from memory."""
    check("LSTM", 3, 1, 4, 40, direction="reverse", h0=True)


@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_gru(direction, lbr):
    check("GRU", 5, 2, 6, 12, direction=direction, h0=True, linear_before_reset=lbr)


def test_gru_sequence_lengths_reverse_layout_1():
    check_layout1("GRU", 6, 3, 4, 8, direction="reverse", seq=[2, 6, 4], linear_before_reset=1)


def test_gru_clip_runtime_weights():
    check("GRU", 4, 2, 5, 8, direction="bidirectional", clip=0.5, runtime_weights=True)


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_rnn(direction):
    check("RNN", 6, 2, 5, 16, direction=direction, h0=True, seq=[6, 4])


def test_rnn_relu_only_y():
    check("RNN", 5, 3, 4, 8, outputs=("Y",), activations=["Relu"])


@pytest.mark.slow   # ~11 s in the simulator; test_gru_zoo_model covers a zoo recurrence by default
def test_lstm_zoo_model():
    model = zoo.export(zoo.lstm_model(), {"x": (1, 32, 16)})
    x = _rng(1).standard_normal((1, 32, 16)).astype(np.float32)
    assert_gpu_matches_ort(model, {"x": x}, families=["LSTM", "LSTMProjection"])


def test_gru_zoo_model():
    model = zoo.export(zoo.gru_model(), {"x": (2, 12, 16)})
    x = _rng(2).standard_normal((2, 12, 16)).astype(np.float32)
    assert_gpu_matches_ort(model, {"x": x}, families=["GRU", "GRUProjection"])


def test_unsupported_activation_names_the_node():
    model, feeds = rnn_model("RNN", 3, 1, 4, 8, activations=["Gelu"])
    graph = gpu_graph(model, {k: list(v.shape) for k, v in feeds.items()})
    node = next(n for n in graph.nodes if n.op == "RNN")
    with pytest.raises(UnsupportedOpError, match=node.name):
        gpu_rnn.lower_rnn(node, graph)


def test_rnn_hidden_past_the_block_gives_threads_two_units():
    """H=260 > 256 threads: 160 threads, each owning units tid and tid + 160 (past H for the last 60)."""
    check("RNN", 2, 1, 3, 260, h0=True)


@pytest.mark.parametrize("fill, scale", [(1, 4), (3, 2)])
def test_projection_tiles(monkeypatch, fill, scale):
    """The projection's 64x64 and 32x32 tiles (chosen on big grids; forced here by the grid size
    that counts as full): partial tiles, two K chunks (I=20)."""
    monkeypatch.setattr(gpu_rnn, "_FILL_BLOCKS", fill)
    model, feeds = rnn_model("LSTM", 5, 2, 20, 16, direction="bidirectional")
    graph = gpu_graph(model, {k: list(v.shape) for k, v in feeds.items()})
    spec = gpu_rnn._Spec(next(n for n in graph.nodes if n.op == "LSTM"), graph, "LSTM")
    assert gpu_rnn._tile_scale(spec) == scale
    assert_gpu_matches_ort(model, feeds, families=["LSTM", "LSTMProjection"])
