"""The registry's swap: a request running on the old library finishes there, every later one runs the new,
and the old library is closed and its copy removed once its last request is done."""
import threading
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

import cuvil
from cuvil.config import parse_config
from cuvil.serve.registry import Registry
from tests.helpers import make_model


def scale(factor):
    return make_model([helper.make_node("Mul", ["x", "s"], ["y"])], [("x", np.float32, [4])],
                      [("y", np.float32, [4])], {"s": np.full((4,), factor, np.float32)})


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    folder = tmp_path_factory.mktemp("registry")
    return [cuvil.compile(scale(f), name="m").save(folder / f"v{f:g}" / "libm.so") for f in (2.0, 3.0)]


class Held:
    """A session whose next run waits until released: a request caught in the middle of running."""

    def __init__(self, session):
        self.session, self.started, self.release = session, threading.Event(), threading.Event()

    def run(self, feeds):
        self.started.set()
        assert self.release.wait(60)
        return self.session.run(feeds)

    def close(self):
        self.session.close()


def test_in_flight_requests_finish_on_the_old_library_which_is_then_unloaded(tmp_path, libraries):
    (tmp_path / "m.onnx").write_bytes(scale(2.0).SerializeToString())
    config = parse_config("version: 1\nmodels:\n  - {name: m, source: m.onnx}\n", tmp_path / "cuvil.yaml").models[0]
    registry = Registry([config], tmp_path / "store")
    assert registry.install("m", libraries[0]).outcome == "loaded"
    old = registry.entries["m"].current
    held = Held(old._free[0])
    old._free[0] = old._all[0] = held
    x = np.arange(4, dtype=np.float32)
    result = {}
    running = threading.Thread(target=lambda: result.update(old=registry.run("m", {"x": x})))
    running.start()
    assert held.started.wait(60)

    installed = registry.install("m", libraries[1])
    assert installed.outcome == "swapped" and old.retired and old.library is not None  # still running there
    version, outputs, *_ = registry.run("m", {"x": x})
    assert version == installed.version.version
    np.testing.assert_array_equal(outputs["y"], 3 * x)

    held.release.set()
    running.join(60)
    version, outputs, *_ = result["old"]
    assert version == old.version
    np.testing.assert_array_equal(outputs["y"], 2 * x)
    assert old.library is None and not old.path.exists()  # closed and unloaded
    # a library's file is removed from the store once it is open; the mapping stays while it is loaded
    assert list((tmp_path / "store").iterdir()) == []
    maps = Path("/proc/self/maps").read_text()
    assert str(old.path.resolve()) not in maps and str(installed.version.path.resolve()) in maps
    registry.close()
    assert not (tmp_path / "store").exists()
