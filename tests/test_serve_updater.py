"""The hot updater's bookkeeping, without a server: what it watches, and when it asks for keys again.

The builder is a stand-in that counts calls; no process, no HTTP.
"""
from types import SimpleNamespace

import numpy as np
from onnx import helper

from cuvil.config import load_config
from cuvil.serve.updater import Updater
from tests.helpers import make_model


class CountingBuilder:
    def __init__(self):
        self.calls = []

    def keys(self, names, diff_mode):
        self.calls.append((tuple(names), diff_mode))
        return {name: {"key": f"key-{len(self.calls)}"} for name in names}


def updater(tmp_path, incremental):
    (tmp_path / "models").mkdir()
    (tmp_path / "extra").mkdir()
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", np.float32, [2])], [("y", np.float32, [2])])
    (tmp_path / "models" / "m.onnx").write_bytes(model.SerializeToString())
    (tmp_path / "cuvil.yaml").write_text(f"version: 1\nmodels:\n  - {{name: m, source: models/m.onnx}}\n"
                                         f"incremental: {incremental}\n")
    spec = load_config(tmp_path / "cuvil.yaml")
    server = SimpleNamespace(spec=spec, builder=CountingBuilder(), say=lambda message: None,
                             registry=SimpleNamespace(entries={"m": SimpleNamespace(config=spec.models[0])}))
    return Updater(server), server.builder


def test_watches_the_config_the_models_and_the_folders_of_watch_paths(tmp_path):
    up, _ = updater(tmp_path, "{enabled: true, watch_paths: [extra/*.onnx]}")
    assert up.paths() == sorted({tmp_path, tmp_path / "models", tmp_path / "extra"})


def test_a_key_is_remembered_while_the_file_is_untouched_and_fresh(tmp_path):
    up, builder = updater(tmp_path, "{enabled: true, diff_mode: syntactic, cache_ttl: 3600}")
    first = up.keys(["m"])
    assert up.keys(["m"]) == first and builder.calls == [(("m",), "syntactic")]
    source = tmp_path / "models" / "m.onnx"
    edited = source.with_suffix(".partial")
    edited.write_bytes(source.read_bytes() + b"\n")  # saved as editors do: another file renamed over it
    edited.replace(source)
    assert up.keys(["m"]) != first and len(builder.calls) == 2
    assert up._touched == {"m"}


def test_cache_ttl_zero_asks_every_time(tmp_path):
    up, builder = updater(tmp_path, "{enabled: true, cache_ttl: 0}")
    up.keys(["m"])
    up.keys(["m"])
    assert builder.calls == [(("m",), "semantic")] * 2
