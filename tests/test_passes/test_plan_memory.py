"""plan_memory: a schedule with a lower peak, and the arena planner's options
(in-place reuse, greedy_by_size / best_fit / none): backends/native/memory.py plan_arena."""
import numpy as np
import pytest

import cuvil
from backends.native.memory import plan_arena as place_buffers
from backends.numba_cpu.registry import lower
from cuvil.frontends.onnx import import_onnx
from passes.plan_memory import Options, peak_bytes, plan_memory
from tests.helpers import rand, run_ort
from tests.test_passes.common import model_from_text, run_pass, run_pass_compiled, show

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def _two_branches():
    # Written breadth-first: both 64 KiB tensors are alive at once. Depth-first, one at a time.
    return model_from_text(HEAD + """
        g (float[128, 128] x, float[128, 128] y) => (float[1, 1] z) {
            a = Relu(x)
            b = Sigmoid(y)
            p = ReduceSum(a)
            q = ReduceSum(b)
            z = Add(p, q)
        }""")


FEEDS = {"x": rand(128, 128), "y": rand(128, 128, seed=1)}


def test_reorders_for_a_lower_peak():
    before, after = run_pass(plan_memory, _two_branches(), FEEDS)
    assert show(after) == ["Relu(x) -> a", "ReduceSum(a) -> p", "Sigmoid(y) -> b", "ReduceSum(b) -> q",
                           "Add(p, q) -> z"]
    assert peak_bytes(before, before.nodes) == 2 * 128 * 128 * 4 + 4
    assert peak_bytes(after, after.nodes) == 128 * 128 * 4 + 2 * 4


def test_must_not_fire_on_a_chain_or_when_reorder_is_off():
    model = model_from_text(HEAD + """
        g (float[8] x) => (float[8] y) {
            a = Relu(x)
            b = Exp(a)
            y = Neg(b)
        }""")
    before, after = run_pass(plan_memory, model, {"x": rand(8)})
    assert after is before
    graph, _ = import_onnx(_two_branches())
    assert plan_memory(graph, Options(reorder=False)) is graph


def _chain():
    return model_from_text(HEAD + """
        g (float[64, 64] x) => (float[64, 64] y) {
            a = Relu(x)
            b = Exp(a)
            c = Neg(b)
            d = Sigmoid(c)
            y = Abs(d)
        }""")


def _plan(model, **options):
    graph, _ = import_onnx(model)
    schedule = lower(graph)
    external = set(graph.inputs) | set(graph.outputs) | {v.name for v in graph.constants()}
    return place_buffers(graph, schedule, external, **options)


def test_in_place_chain_runs_in_one_buffer():
    size = 64 * 64 * 4
    plan = _plan(_chain())
    assert plan.naive_bytes == 4 * size
    assert plan.arena_bytes == size and plan.in_place == {"b": "a", "c": "b", "d": "c"}
    # Without in-place reuse two buffers alternate; with no planning every tensor has its own.
    assert _plan(_chain(), in_place=False).arena_bytes == 2 * size
    assert _plan(_chain(), strategy="none", in_place=False).arena_bytes == 4 * size


def test_in_place_is_not_used_while_the_input_is_still_read():
    model = model_from_text(HEAD + """
        g (float[64, 64] x) => (float[64, 64] y) {
            a = Relu(x)
            b = Exp(a)
            y = Add(a, b)
        }""")
    plan = _plan(model)
    assert plan.in_place == {} and plan.arena_bytes == 2 * 64 * 64 * 4


def test_best_fit_takes_the_tightest_gap():
    from backends.native.memory import _place
    # (bytes, name) largest first, and lifetimes in steps. When S is placed, Q and R are alive
    # at [4096, 8192) and [10240, 12288): the gaps are 4 KiB at 0 and 2 KiB at 8192.
    buffers = [(4096, "P1"), (4096, "Q"), (2048, "P2"), (2048, "R"), (2048, "S")]
    first = {"P1": 0, "Q": 0, "P2": 0, "R": 0, "S": 5}
    last = {"P1": 1, "Q": 9, "P2": 1, "R": 9, "S": 9}
    greedy, best = _place(buffers, first, last, "greedy_by_size"), _place(buffers, first, last, "best_fit")
    assert (greedy["Q"], greedy["P2"], greedy["R"]) == (4096, 8192, 10240)
    assert greedy["S"] == 0 and best["S"] == 8192
    assert _place(buffers, first, last, "none")["S"] == 4096 + 4096 + 2048 + 2048


def test_compiled_with_in_place_reuse_matches_onnxruntime():
    before, after = run_pass_compiled("plan_memory", _chain(), {"x": rand(64, 64)}, tol=1e-6)
    compiled = cuvil.compile(_chain(), passes=["plan_memory"])
    assert compiled.info["memory"]["arena_bytes"] == 64 * 64 * 4
    unplanned = cuvil.compile(_chain(), passes=[]).info["memory"]
    assert unplanned["arena_bytes"] == unplanned["naive_bytes"] == 4 * 64 * 64 * 4


@pytest.mark.parametrize("strategy", ["greedy_by_size", "best_fit", "none"])
def test_every_strategy_computes_the_same(strategy):
    model = _two_branches()
    compiled = cuvil.compile(model, passes=["plan_memory"], pass_options={"plan_memory": {"strategy": strategy}})
    got, want = compiled.run(FEEDS), run_ort(model, FEEDS)
    np.testing.assert_allclose(got["z"], want["z"], rtol=1e-5)
