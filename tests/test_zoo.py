"""Architectures users bring, made here with seeded weights and exported from torch;
each compiles and matches onnxruntime (max abs error / max |reference| <= 1e-3)."""
import numpy as np
import pytest

from tests import zoo
from tests.helpers import assert_matches_ort

torch = pytest.importorskip("torch")

TOL = 1e-3


def _ids(seq, vocab=100, seed=2):
    return np.random.default_rng(seed).integers(0, vocab, (1, seq)).astype(np.int64)


def test_bert_style_encoder_with_padding_mask():
    seq = 16
    model = zoo.export(zoo.bert_encoder(seq=seq), {"ids": (1, seq), "mask": (1, seq)}, int_inputs=("ids",))
    mask = np.ones((1, seq), np.float32)
    mask[0, 11:] = 0
    assert_matches_ort(model, {"ids": _ids(seq), "mask": mask}, tol=TOL, jobs=2)


def test_gpt2_style_block_with_causal_mask():
    model = zoo.export(zoo.gpt2_block(), {"x": (1, 16, 64)})
    assert_matches_ort(model, {"x": zoo.sample_input((1, 16, 64))}, tol=TOL, jobs=2)


def test_lstm_sequence_model():
    model = zoo.export(zoo.lstm_model(), {"x": (1, 32, 16)})
    assert_matches_ort(model, {"x": zoo.sample_input((1, 32, 16))}, tol=TOL)


def test_gru_sequence_model():
    model = zoo.export(zoo.gru_model(), {"x": (2, 12, 16)})
    assert_matches_ort(model, {"x": zoo.sample_input((2, 12, 16))}, tol=TOL)


def test_yolo_style_detector():
    model = zoo.export(zoo.yolo_style(), {"input": (1, 3, 64, 64)})
    assert_matches_ort(model, {"input": zoo.sample_input((1, 3, 64, 64))}, tol=TOL, jobs=2)


def test_unet_style_with_conv_transpose():
    model = zoo.export(zoo.unet_style(), {"input": (1, 3, 32, 32)})
    assert_matches_ort(model, {"input": zoo.sample_input((1, 3, 32, 32))}, tol=TOL, jobs=2)


def test_mobilenet_v2_at_224():
    model = zoo.export(zoo.mobilenet_v2(), {"input": (1, 3, 224, 224)})
    assert_matches_ort(model, {"input": zoo.sample_input((1, 3, 224, 224))}, tol=TOL, jobs=2)


@pytest.mark.slow
def test_resnet50():
    model = zoo.export(zoo.resnet((3, 4, 6, 3), bottleneck=True), {"input": (1, 3, 224, 224)})
    assert_matches_ort(model, {"input": zoo.sample_input((1, 3, 224, 224))}, tol=TOL, jobs=2)
