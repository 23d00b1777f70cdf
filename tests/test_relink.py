"""The link's splice (backends/native/relink.py): after a full link, a build whose inputs differ only in
the weights' values (and so in the model description's source sha256) is made from the stored template,
and must be byte-identical to a full link of the same inputs through SCons; a change anywhere else in
the driver, or weights of another size, must take the full link."""
from __future__ import annotations

import json

import numpy as np
from onnx import helper

from backends.native import link as link_module
from backends.native import relink
from backends.native.link import link_files
from cuvil.build import VariantSpec, add_kernel_steps, plan_variant, tool_versions
from cuvil.cache import Cache
from cuvil.dag import StepGraph
from tests.helpers import make_model, run_ort

import cuvil


def _model(first_weight: float, hidden: int = 24):
    rng = np.random.default_rng(5)
    w1 = rng.standard_normal((16, hidden)).astype(np.float32)
    w1[0, 0] = first_weight
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    return make_model(nodes, [("x", np.float32, [2, 16])], [("y", np.float32, [2, 8])],
                      {"w1": w1, "w2": rng.standard_normal((hidden, 8)).astype(np.float32)})


def _link_inputs(model, cache):
    """What the link step of `model`'s build gets: the driver, the weights, the kernel objects."""
    dag = StepGraph(cache, tool_versions(), progress=None)
    link = plan_variant(dag, VariantSpec("m", model.SerializeToString(), symbol_prefix="m_"))
    bundle = dag.get(dag.step(link).deps[0])
    objects = dict(zip([k["symbol"] for k in json.loads(bundle["kernels.json"])],
                       dag.get_many(add_kernel_steps(dag, link, bundle))))
    return bundle["driver.c"].decode(), bundle["weights.bin"], objects


def _link(tmp_path, tag, inputs, cache, spliced: list):
    folder = tmp_path / tag
    folder.mkdir()
    calls = []
    original = relink.splice

    def counted(*args):
        result = original(*args)
        calls.append(result is not None)
        return result
    relink.splice = counted
    try:
        files = link_files(folder, "m_", *inputs, "libm.so", cache=cache)
    finally:
        relink.splice = original
    spliced.append(any(calls))
    return files["libm.so"]


def test_a_weight_change_is_spliced_byte_identical_to_a_full_link(tmp_path):
    steps = Cache(tmp_path / "steps")
    first, second = _link_inputs(_model(0.5), steps), _link_inputs(_model(-3.0), steps)
    assert first[0] != second[0] and first[1] != second[1]   # the description's sha256 and the weights moved
    assert first[2] == second[2]                              # the same kernels
    templates, spliced = Cache(tmp_path / "templates"), []
    _link(tmp_path, "first", first, templates, spliced)       # full link: stores the template
    compiled = []
    original = link_module.compile_driver
    link_module.compile_driver = lambda *args: compiled.append(args) or original(*args)
    try:
        library = _link(tmp_path, "second", second, templates, spliced)
    finally:
        link_module.compile_driver = original
    full = _link(tmp_path, "full", second, None, spliced)     # no cache: SCons
    assert spliced == [False, True, False]
    assert library == full
    # the description had the same length: the driver object came from the template, not the compiler
    assert compiled == []

    # and the spliced library runs: same answers as onnxruntime on the second weights
    path = tmp_path / "libm.so"
    path.write_bytes(library)
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    got = cuvil.load(path).run({"x": x})["y"]
    # float32 sums of 16 and 24 products, in another order: ~1e-6 relative; 1e-5 leaves margin
    np.testing.assert_allclose(got, run_ort(_model(-3.0), {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_another_shape_or_a_changed_driver_takes_the_full_link(tmp_path):
    steps, templates, spliced = Cache(tmp_path / "steps"), Cache(tmp_path / "templates"), []
    driver, weights, objects = _link_inputs(_model(0.5), steps)
    _link(tmp_path, "first", (driver, weights, objects), templates, spliced)
    # a changed line of the driver outside the model's description: the key moves, no template
    _link(tmp_path, "edited", (driver.replace("(void)W;", "(void)W; ", 1), weights, objects), templates, spliced)
    # weights of another size (another model): another key
    _link(tmp_path, "wider", _link_inputs(_model(0.5, hidden=32), steps), templates, spliced)
    assert spliced == [False, False, False]


def test_a_template_whose_driver_object_differs_elsewhere_is_refused(tmp_path):
    steps, spliced = Cache(tmp_path / "steps"), []
    driver, weights, objects = _link_inputs(_model(0.5), steps)
    library = _link(tmp_path, "first", (driver, weights, objects), None, spliced)
    driver_object = (tmp_path / "first" / "driver.os").read_bytes()
    template = relink.make_template(library, driver_object, weights, "m_")
    assert template is not None
    # the description's bytes read from the driver's text are the compiler's, and the object made
    # from the template for that text is the compiled one; a description of another length is not
    start, size = relink._info_range(relink.Elf(driver_object))
    assert relink.info_bytes(driver) == driver_object[start:start + size]
    assert relink.object_from_template(template, driver) == driver_object
    longer = driver.replace('model_info[] =\n    "', 'model_info[] =\n    "  ', 1)
    assert longer != driver and relink.object_from_template(template, longer) is None
    assert relink.splice(template, driver_object, weights) == library
    changed = bytearray(driver_object)
    changed[64] ^= 1  # a byte of the ELF header's neighbourhood, outside model_info
    assert relink.splice(template, bytes(changed), weights) is None
    assert relink.splice(template, driver_object, weights + b"\0") is None
