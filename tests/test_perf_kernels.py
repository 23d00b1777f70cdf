"""Correctness of the performance code paths against onnxruntime: the LLVM-IR
micro-kernel GEMM (packed constant weights, activations read in place, edge
tiles, batches), convolution as an implicit GEMM over phase images (strides,
dilations, asymmetric pads, groups), the vectorised exp/tanh/erf/sigmoid,
in-place elementwise kernels, and identical results for any thread count.
No timing here (benchmarks/ does that)."""
import numpy as np
import pytest
from onnx import helper

import cuvil
from backends.numba_cpu.ukernel import (DwLanesSpec, DwRowSpec, GatherSpec, SyncSpec, TBlockSpec, TSpec, UKSpec, specs_in,
                                         ukernel_ir)
from tests.helpers import assert_matches_ort, make_model, rand


def matmul_model(a_shape, b_shape, const_b=True, seed=0):
    inputs = [("a", np.float32, a_shape)]
    inits = {}
    if const_b:
        inits["b"] = rand(*b_shape, seed=seed + 1)
    else:
        inputs.append(("b", np.float32, b_shape))
    model = make_model([helper.make_node("MatMul", ["a", "b"], ["y"])], inputs, [("y", np.float32, None)], inits)
    feeds = {"a": rand(*a_shape, seed=seed + 2)}
    if not const_b:
        feeds["b"] = rand(*b_shape, seed=seed + 3)
    return model, feeds


@pytest.mark.parametrize("a_shape,b_shape,const_b", [
    ((64, 96), (96, 128), True),        # whole tiles
    ((13, 70), (70, 67), True),         # edge rows (13 % 6) and columns (67 % 64)
    ((1, 300), (300, 200), True),       # one row (GEMV), several k passes
    ((7, 600), (600, 40), True),        # K split in passes, N below one tile
    ((2, 9, 32), (32, 80), True),       # batch folded into rows
    ((3, 10, 24), (3, 24, 33), False),  # batched, B read in place with masked loads
    ((20, 48), (48, 130), False),
    ((605, 300), (300, 70), True),      # rows in several L2 blocks, edge rows, two passes over k
])
def test_microkernel_matmul(a_shape, b_shape, const_b):
    model, feeds = matmul_model(a_shape, b_shape, const_b)
    assert_matches_ort(model, feeds, tol=1e-5)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_microkernel_gemm_transposes(trans_a, trans_b):
    M, K, N = 11, 40, 70
    a = rand(*((K, M) if trans_a else (M, K)), seed=4)
    b = rand(*((N, K) if trans_b else (K, N)), seed=5)
    c = rand(N, seed=6)
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], transA=trans_a, transB=trans_b, alpha=0.7, beta=1.3)
    model = make_model([node], [("a", np.float32, a.shape)], [("y", np.float32, None)], {"b": b, "c": c})
    assert_matches_ort(model, {"a": a}, tol=1e-5)


def conv_model(x_shape, w_shape, seed=0, bias=True, **attrs):
    inits = {"w": rand(*w_shape, seed=seed + 1) * 0.2}
    if bias:
        inits["bias"] = rand(w_shape[0], seed=seed + 2)
    node = helper.make_node("Conv", ["x", "w"] + (["bias"] if bias else []), ["y"], **attrs)
    return make_model([node], [("x", np.float32, x_shape)], [("y", np.float32, None)], inits), \
        {"x": rand(*x_shape, seed=seed + 3)}


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 16, 14, 14), (24, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((1, 8, 13, 17), (12, 8, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2])),       # odd sizes, stride 2
    ((1, 3, 32, 30), (16, 3, 7, 7), dict(pads=[3, 3, 3, 3], strides=[2, 2])),       # ResNet stem shape
    ((1, 16, 12, 12), (32, 16, 1, 1), dict(strides=[2, 2])),                        # 1x1 downsample
    ((1, 8, 15, 15), (8, 8, 3, 3), dict(pads=[2, 2, 2, 2], dilations=[2, 2])),      # dilation
    ((1, 8, 10, 11), (10, 8, 3, 2), dict(pads=[0, 1, 2, 0])),                       # asymmetric pads, 3x2 kernel
    ((2, 16, 9, 9), (32, 4, 3, 3), dict(pads=[1, 1, 1, 1], group=4)),               # groups, batch 2
    ((1, 12, 20, 9), (7, 12, 5, 5), dict(pads=[2, 2, 2, 2], strides=[1, 2])),       # unequal strides
    ((1, 6, 16, 16), (9, 6, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    ((1, 600, 7, 7), (20, 600, 1, 1), dict()),                                       # 1x1 as GEMM, 3 passes over k
    ((1, 64, 5, 6), (32, 16, 1, 1), dict(group=4)),                                  # grouped 1x1
    ((1, 300, 6, 6), (14, 300, 3, 3), dict(pads=[1, 1, 1, 1])),                      # several passes, edge rows
    ((1, 3, 37, 35), (70, 3, 7, 7), dict(pads=[3, 3, 3, 3], strides=[2, 2])),       # stem: panel groups, edge panel
])
def test_conv_implicit_gemm(x_shape, w_shape, attrs):
    model, feeds = conv_model(x_shape, w_shape, **attrs)
    compiled, _ = assert_matches_ort(model, feeds, tol=1e-5)


def test_conv_implicit_gemm_is_used():
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    model, _ = conv_model((1, 16, 14, 14), (24, 16, 3, 3), pads=[1, 1, 1, 1])
    graph, _ = import_onnx(model)
    families = [c.kernel.family for c in lower(graph)]
    assert families == ["ConvPad", "Conv"]
    assert specs_in(lower(graph)[1].kernel.source)


@pytest.mark.parametrize("op", ["Exp", "Tanh", "Erf", "Sigmoid"])
def test_vectorised_math_matches_ort(op):
    x = np.concatenate([np.linspace(-12, 12, 4001), np.linspace(-0.01, 0.01, 101)]).astype(np.float32)
    if op == "Exp":
        x = np.linspace(-80, 80, 4001).astype(np.float32)
    model = make_model([helper.make_node(op, ["x"], ["y"])], [("x", np.float32, x.shape)], [("y", np.float32, None)])
    compiled = cuvil.compile(model)
    got = compiled.run({"x": x})["y"].astype(np.float64)
    from tests.helpers import run_ort
    want = run_ort(model, {"x": x})["y"].astype(np.float64)
    if op == "Exp":
        np.testing.assert_allclose(got, want, rtol=1e-6)
    else:
        np.testing.assert_allclose(got, want, atol=5e-7)


def test_softmax_and_gelu_chain_in_place():
    """Softmax (vexp) then an elementwise chain that the memory planner runs in place."""
    x = rand(4, 37, seed=9) * 5
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=-1),
             helper.make_node("Mul", ["s", "k"], ["m"]),
             helper.make_node("Erf", ["m"], ["e"]),
             helper.make_node("Tanh", ["e"], ["y"])]
    model = make_model(nodes, [("x", np.float32, x.shape)], [("y", np.float32, None)], {"k": np.float32(3.0)})
    assert_matches_ort(model, {"x": x}, tol=1e-5)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape", [(4, 128, 128), (3, 1), (2, 17), (2, 3, 40)])
def test_softmax_rows_match_ort(op, shape):
    """Rows of any length (one, shorter than a vector, a vector and a tail) with the row maximum
    anywhere, including first and last: the max reduction (vmax) then vexp."""
    x = rand(*shape, seed=len(shape) + shape[-1]) * 6
    x[..., 0] += 9.0                   # the maximum first in these rows...
    x.reshape(-1, shape[-1])[1::2, -1] += 20.0   # ...and last in every other row
    model = make_model([helper.make_node(op, ["x"], ["y"], axis=-1)], [("x", np.float32, x.shape)],
                       [("y", np.float32, None)])
    assert_matches_ort(model, {"x": x}, tol=1e-5)


@pytest.mark.parametrize("form, vector", [("m = vmax(m, p0[i])", True), ("v = p0[i]\n        m = v if v > m else m", False)])
def test_vmax_reduction_vectorises(tmp_path, form, vector):
    """A max over a row written with vmax (llvm.maxnum) vectorises on AVX-512; Numba's select form
    stays a scalar vmaxss chain (Softmax over 4 x 128 x 128 on Zen 4: 0.052 -> 0.022 ms)."""
    import subprocess

    from backends.numba_cpu.emit import emit_object, kernel_ir
    from backends.targets import resolve_target
    from backends.numba_cpu.kernel import Source, kernel_header
    src = Source().line(kernel_header(2)).indent()
    src.line("for r in range(begin, end):").indent()
    src.line("m = p0[r * 128]")
    src.line("for i in range(r * 128, r * 128 + 128):").indent()
    for line in form.split("\n"):
        src.line(line.strip())
    src.dedent().line("p1[r] = m")
    source = src.text()
    obj = emit_object(kernel_ir(source, ("float32", "float32")), "k", resolve_target("x86_64-avx512"), source)
    path = tmp_path / "k.o"
    path.write_bytes(obj)
    asm = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    assert ("vmaxps" in asm and "zmm" in asm) == vector, asm


def resnetish():
    """Conv stem, a residual block (3x3 convs, 1x1 downsample) and a Gemm head."""
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[3, 3, 3, 3], strides=[2, 2]),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["r0", "wd", "bd"], ["d"], strides=[2, 2]),
        helper.make_node("Add", ["c2", "d"], ["s"]),
        helper.make_node("Relu", ["s"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1),
    ]
    inits = {"w0": rand(16, 3, 7, 7, seed=1) * 0.1, "b0": rand(16, seed=2) * 0.1,
             "w1": rand(32, 16, 3, 3, seed=3) * 0.1, "b1": rand(32, seed=4) * 0.1,
             "w2": rand(32, 32, 3, 3, seed=5) * 0.1, "b2": rand(32, seed=6) * 0.1,
             "wd": rand(32, 16, 1, 1, seed=7) * 0.1, "bd": rand(32, seed=8) * 0.1,
             "wf": rand(10, 32, seed=9) * 0.1, "bf": rand(10, seed=10) * 0.1}
    model = make_model(nodes, [("x", np.float32, (1, 3, 40, 40))], [("y", np.float32, None)], inits)
    return model, {"x": rand(1, 3, 40, 40, seed=11)}


def test_results_identical_for_any_thread_count():
    model, feeds = resnetish()
    outs = {}
    for threads in (1, 2, 3):
        compiled, got = assert_matches_ort(model, feeds, tol=1e-5, threads=threads)
        outs[threads] = got["y"]
        # many runs of one session give the same bytes too (the pool hands out work dynamically)
        for _ in range(30):
            np.testing.assert_array_equal(compiled.run(feeds)["y"], got["y"])
    np.testing.assert_array_equal(outs[1], outs[2])
    np.testing.assert_array_equal(outs[1], outs[3])


def test_gemm_threads_identical():
    model, feeds = matmul_model((37, 200), (200, 300))
    one = cuvil.compile(model, threads=1).run(feeds)["y"]
    two = cuvil.compile(model, threads=2).run(feeds)["y"]
    np.testing.assert_array_equal(one, two)


def test_work_items_follow_the_build_threads():
    """The lowering knows the build's thread count: a large GEMM gets at least four items per
    thread on 4 threads, and the same bytes as on one."""
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    model, feeds = matmul_model((256, 256), (256, 512))
    graph, _ = import_onnx(model)
    work = {t: [c.work for c in lower(graph, threads=t) if hasattr(c, "work")] for t in (1, 4)}
    assert max(work[4]) >= 16 > max(work[1])
    _, four = assert_matches_ort(model, feeds, tol=1e-5, threads=4)
    one = cuvil.compile(model, threads=1).run(feeds)["y"]
    np.testing.assert_array_equal(four["y"], one)


def test_more_threads_than_items_identical():
    """Each thread owns a contiguous share of a step's items and then takes what is left of the
    others': with more threads than items (shares of none), every item still runs once."""
    model, feeds = matmul_model((30, 64), (64, 100))
    one = cuvil.compile(model, threads=1).run(feeds)["y"]
    compiled = cuvil.compile(model, threads=5)
    for _ in range(20):
        np.testing.assert_array_equal(compiled.run(feeds)["y"], one)


@pytest.mark.parametrize("target", ["x86_64-avx512", "x86_64-avx2", "generic"])
@pytest.mark.parametrize("width", [7, 33, 47])
def test_strided_conv_phase_images_by_wide_loads(target, width):
    """A stride-2 conv's phase images are copied by GatherSpec (wide loads and a shuffle; the last
    group of each row masked), for every vector width and row widths around the group size."""
    from backends.numba_cpu.ukernel import GatherSpec
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    model, feeds = conv_model((1, 4, 9, width), (8, 4, 3, 3), pads=[1, 1, 1, 1], strides=[2, 2])
    graph, _ = import_onnx(model)
    pad = lower(graph)[0]
    assert pad.kernel.family == "ConvPad"
    assert [type(s) for s in specs_in(pad.kernel.source).values()] == [GatherSpec]
    assert_matches_ort(model, feeds, tol=1e-5, target=target)


@pytest.mark.parametrize("bits", [512, 256, 128])
def test_microkernel_ir_for_every_vector_width(bits):
    """The micro-kernel IR is valid for AVX-512, AVX2 and SSE widths (the tile is split in
    column chunks so its accumulators fit the register file)."""
    import llvmlite.binding as llvm

    from backends.targets import init_llvm
    init_llvm()
    for spec in (UKSpec(mr=6, nr=64, a_packed=0), UKSpec(mr=4, nr=64, a_packed=1, a_panel=6, taps=(0, 1, 9), store="x"),
                 UKSpec(mr=1, nr=32, a_packed=0, b_masked=1),
                 UKSpec(mr=6, nr=64, a_packed=1, a_panel=6, bias=1, act="Relu", prefetch_c=1),
                 UKSpec(mr=8, nr=48, a_packed=1, a_panel=8, taps=(0, 1), store="x", bias=1, act="Clip",
                        act_lo=float("-inf"), act_hi=6.0), GatherSpec(2), GatherSpec(3),
                 TSpec(mr=7, nr=48, taps=(0, 1, 2, 9, 10, 11), a_ks=81, c_cs=49, pf_lines=2, bias=1, act="Relu"),
                 TSpec(mr=4, nr=64, taps=(0,), a_ks=49, c_cs=49),
                 DwRowSpec(H=28, W=27, OW=14, KH=3, KW=3, p_l=1, act="Clip", act_lo=0.0, act_hi=6.0),
                 DwRowSpec(H=20, W=21, OW=19, KH=5, KW=5, p_l=1, stride=1, rows=2, act="Relu"),
                 TBlockSpec(), *(SyncSpec(op) for op in ("claim", "adopt", "add", "wait"))):
        llvm.parse_assembly(ukernel_ir(spec, bits)).verify()
    from backends.numba_cpu.dwlanes import dwlanes_ir
    for spec in (DwLanesSpec(W=7, OW=7, KH=7, KW=7, p_l=3), DwLanesSpec(W=56, OW=14, KH=7, KW=7, p_l=3, ow0=42)):
        llvm.parse_assembly(dwlanes_ir(spec, bits)).verify()


def test_compressed_stores_compress_in_registers():
    """A conv tile's valid lanes are compressed in a register and stored with a masked store:
    the memory form of vcompressps is microcoded on AMD Zen 4 (~80 cycles a store)."""
    import llvmlite.binding as llvm

    from backends.targets import init_llvm
    init_llvm()
    spec = UKSpec(mr=6, nr=64, a_packed=1, a_panel=6, taps=(0, 1, 2), store="x")
    module = llvm.parse_assembly(ukernel_ir(spec, 512))
    machine = llvm.Target.from_default_triple().create_target_machine(cpu="skylake-avx512", opt=3)
    asm = [line for line in machine.emit_assembly(module).splitlines() if "vcompressps" in line]
    assert asm, "no compress instruction"
    assert not [line for line in asm if "(%" in line], asm


def test_sync_counters():
    """The counters of cooperating work items (SyncSpec), JIT-compiled and called on a buffer:
    claim is a compare-and-swap from arg, adopt claims a flag still 0 after its wait, add adds,
    wait returns once the counter reaches arg."""
    import ctypes

    import llvmlite.binding as llvm

    from backends.targets import init_llvm
    init_llvm()
    machine = llvm.Target.from_default_triple().create_target_machine()
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), machine)
    fns = {}
    for op in ("claim", "adopt", "add", "wait"):
        spec = SyncSpec(op)
        engine.add_module(llvm.parse_assembly(ukernel_ir(spec, 512)))
        engine.finalize_object()
        fns[op] = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(
            engine.get_function_address(spec.name))
    words = np.zeros(4, np.int32)
    p = words.ctypes.data
    assert fns["claim"](p, 1, 0) == 1 and words[1] == 1
    assert fns["claim"](p, 1, 0) == 0 and words[1] == 1     # taken
    assert fns["claim"](p, 1, 1) == 1 and words[1] == 2     # the next step's claim
    assert fns["adopt"](p, 2, 1000) == 1 and words[2] == 1  # still 0 after the wait: claimed
    assert fns["adopt"](p, 2, 1000) == 0 and words[2] == 1  # already set
    fns["add"](p, 3, 5)
    fns["add"](p, 3, 2)
    assert words[3] == 7
    assert fns["wait"](p, 3, 7) == 0                         # reached: returns at once
    assert list(words) == [0, 2, 1, 7]


@pytest.mark.parametrize("rows,cols", [(7, 48), (7, 18), (5, 48)])
def test_transposed_tile_of_a_whole_plane(rows, cols):
    """A TSpec tile holding a whole output plane (c_cs = mr: the STFT's 7 frames) stores its
    columns as contiguous vectors shuffled in registers, not as scatters: the outputs of the
    `cols` columns only (an edge panel leaves the next channels' floats alone), bias and Relu
    applied; a tile of fewer rows than mr takes the scatters. JIT-compiled for this machine's CPU
    and called on buffers; the reference is float64, and each output of kc = 40 float32 products
    summed with FMAs is within 40 x 2^-24 of the sum of their magnitudes."""
    import ctypes

    import llvmlite.binding as llvm

    from backends.numba_cpu.ukernel import LOADC_EPILOGUE, TSTORE_OUTPUT
    from backends.targets import init_llvm
    init_llvm()
    mr, nr, kc = 7, 48, 40
    spec = TSpec(mr=mr, nr=nr, taps=(0,), a_ks=mr, c_cs=mr, bias=1, act="Relu")
    machine = llvm.Target.from_default_triple().create_target_machine(cpu=llvm.get_host_cpu_name(),
                                                                       features=llvm.get_host_cpu_features().flatten())
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(ukernel_ir(spec, 512)), machine)
    engine.finalize_object()
    p, i = ctypes.c_void_p, ctypes.c_int64
    fn = ctypes.CFUNCTYPE(ctypes.c_int32, p, i, p, i, p, i, p, i, i, i, i, i, p, i, i)(
        engine.get_function_address(spec.name))
    a, b, bias = rand(kc * mr, seed=1), rand(kc * nr, seed=2), rand(nr, seed=3)
    slot = np.zeros(mr * nr, np.float32)
    c = np.full(nr * mr + 16, 7.0, np.float32)          # 7.0: not written
    fn(a.ctypes.data, 0, b.ctypes.data, 0, slot.ctypes.data, 0, c.ctypes.data, 0, kc, rows, cols,
       TSTORE_OUTPUT + LOADC_EPILOGUE, bias.ctypes.data, 0, 0)
    A, B = a.reshape(kc, mr).astype(np.float64), b.reshape(kc, nr).astype(np.float64)
    want = np.maximum(A.T @ B + bias, 0.0)              # (position i, channel j) -> c[i + j * mr]
    bound = kc * 2.0 ** -24 * (np.abs(A).T @ np.abs(B) + np.abs(bias))
    got = c[:nr * mr].reshape(nr, mr).T
    assert np.all(np.abs(got[:rows, :cols] - want[:rows, :cols]) <= bound[:rows, :cols])
    assert np.all(got[rows:, :] == 7.0) and np.all(got[:, cols:] == 7.0) and np.all(c[nr * mr:] == 7.0)


@pytest.mark.parametrize("target", ["x86_64-avx2", "generic"])
def test_other_targets_compute_the_same(target):
    """Narrower targets run the same micro-kernels with 8- or 4-wide vectors."""
    model, feeds = resnetish()
    assert_matches_ort(model, feeds, tol=1e-5, target=target)


@pytest.mark.parametrize("x_shape,attrs", [
    ((1, 8, 14, 14), dict(pads=[1, 1, 1, 1])),
    ((1, 8, 15, 13), dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    ((2, 6, 9, 11), dict(pads=[2, 2, 2, 2], dilations=[2, 2])),
    ((1, 4, 10, 10), dict(pads=[0, 1, 2, 0], kernel_shape=[5, 3])),
    ((1, 24, 28, 28), dict(pads=[1, 1, 1, 1], strides=[2, 2])),    # strided: DwRowSpec rows
    ((2, 5, 13, 15), dict(pads=[1, 0, 1, 2], strides=[2, 1])),
])
def test_depthwise_conv(x_shape, attrs):
    C = x_shape[1]
    k = attrs.get("kernel_shape", [3, 3])
    model, feeds = conv_model(x_shape, (C, 1, *k), group=C, **attrs)
    assert_matches_ort(model, feeds, tol=1e-5)


def test_depthwise_reads_rows_in_place():
    """Depthwise convs with stride 2 are one DwRowSpec call per output row (no phase images), with
    stride 1 one call per pair of rows when the rows are wide enough; stride (2, 1) still takes
    the phase images on small planes, and 7-wide stride-1 rows the channels-in-lanes kernel (dwlanes.py)."""
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    for shape, strides, families, rows in (((1, 24, 28, 28), [2, 2], ["Conv"], {1}),
                                           ((1, 24, 112, 112), [2, 2], ["Conv"], {1}),
                                           ((1, 24, 14, 14), [1, 1], ["Conv"], {1, 2}),
                                           ((1, 24, 7, 7), [1, 1], ["Conv"], set()),
                                           ((1, 24, 20, 10), [2, 1], ["ConvPad", "Conv"], set())):
        model, _ = conv_model(shape, (24, 1, 3, 3), group=24, pads=[1, 1, 1, 1], strides=strides)
        graph, _ = import_onnx(model)
        calls = lower(graph)
        assert [c.kernel.family for c in calls] == families
        specs = specs_in(calls[-1].kernel.source).values()
        assert {s.rows for s in specs if isinstance(s, DwRowSpec)} == rows
        assert any(isinstance(s, DwLanesSpec) for s in specs) == (shape[3] == 7)
        assert all(s.stride == strides[0] for s in specs if isinstance(s, DwRowSpec))


# Stride 1 on AVX-512 only: the narrower targets run its IR in test_microkernel_ir_for_every_vector_width
# and in DepthwiseBlocks (test_depthwise_block.py).
@pytest.mark.parametrize("target,stride", [("x86_64-avx512", 2), ("x86_64-avx2", 2), ("generic", 2),
                                           ("x86_64-avx512", 1)])
@pytest.mark.parametrize("x_shape,k,pads,bias,act", [
    ((1, 8, 28, 28), 3, [1, 1, 1, 1], True, ("Clip", 0.0, 6.0)),     # MobileNetV2's 28 -> 14
    ((2, 5, 113, 111), 3, [1, 1, 1, 1], True, ("Relu",)),            # odd sizes, 56 outputs a row, batch 2
    ((1, 4, 17, 40), 5, [2, 2, 2, 2], False, None),                  # 5x5, no bias: 20 outputs a row
    ((1, 3, 9, 8), 3, [0, 0, 1, 1], True, ("Clip", -0.1, float("inf"))),  # TF-style pads, one bound
    ((1, 2, 6, 33), 3, [0, 1, 0, 1], True, None),                    # 17 outputs: one lane past a vector
])
def test_depthwise_rows_match_ort(target, stride, x_shape, k, pads, bias, act):
    """DwRowSpec rows, stride 2 (one row a call) and 1 (two rows a call: even and odd row counts,
    the last one alone), against onnxruntime."""
    C = x_shape[1]
    model, feeds = conv_model(x_shape, (C, 1, k, k), group=C, pads=pads, strides=[stride, stride], bias=bias)
    if act is not None:
        from onnx import numpy_helper
        y = model.graph.output[0].name
        extra = []
        if act[0] == "Clip":
            extra = ["lo", ""] if act[2] == float("inf") else ["lo", "hi"]
            model.graph.initializer.append(numpy_helper.from_array(np.array(act[1], np.float32), "lo"))
            if act[2] != float("inf"):
                model.graph.initializer.append(numpy_helper.from_array(np.array(act[2], np.float32), "hi"))
        model.graph.node.append(helper.make_node(act[0], [y] + extra, ["out"]))
        model.graph.output[0].name = "out"
    for threads in (1, 2):
        assert_matches_ort(model, feeds, tol=1e-5, threads=threads, target=target)


@pytest.mark.parametrize("a_shape,b_shape,const_b", [
    ((24, 40), (40, 196), True),    # 12 x 32 tiles: the last column panel (4 columns) by a 16-wide kernel
    ((24, 40), (40, 196), False),   # the same with B read in place (masked loads)
    ((12, 30), (30, 40), True),     # one full panel and a 16-wide edge panel
])
def test_microkernel_narrow_edge_panel(a_shape, b_shape, const_b):
    from backends.numba_cpu.gemm import choose_tile
    assert choose_tile(a_shape[0], b_shape[1]) == (12, 32)
    model, feeds = matmul_model(a_shape, b_shape, const_b)
    compiled, _ = assert_matches_ort(model, feeds, tol=1e-5)
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    graph, _ = import_onnx(model)
    widths = {spec.nr for spec in specs_in(lower(graph)[0].kernel.source).values()}
    assert widths == {32, 16}


def test_split_work_keeps_large_weights_streaming_once():
    """Few output columns and large weights: rows are split, so the weights are read once; small
    weights keep the column-first split."""
    from backends.numba_cpu.gemm import split_work
    # 1x1 conv 512 -> 2048 at 7 x 7 (12 x 32 tiles: 2 column panels, 171 row tiles)
    n_blocks, per_n, m_blocks, per_m = split_work(8, 2, 171, 4 * 2048 * 512, 4 * 512 * 49)
    assert (n_blocks, per_n) == (1, 2) and 8 <= m_blocks <= 32
    # 1x1 conv 64 -> 64 at 56 x 56: columns first, as before
    n_blocks, per_n, m_blocks, per_m = split_work(8, 49, 11, 4 * 64 * 64, 4 * 64 * 3136)
    assert n_blocks >= 7 and m_blocks <= 2


@pytest.mark.parametrize("n_cols,m_tiles,a_bytes,b_bytes", [
    (2, 171, 4 * 2048 * 512, 4 * 512 * 49),    # ResNet-50 stage 4, 1x1 512 -> 2048
    (2, 43, 4 * 512 * 256 * 9, 4 * 256 * 160),  # ResNet-18 stage 4, 3x3 512 -> 512 as an implicit GEMM
    (7, 22, 4 * 256 * 256 * 9, 4 * 256 * 255),  # ResNet-18 stage 3, 3x3 256 -> 256
    (67, 8, 4 * 64 * 64 * 9, 4 * 64 * 3364),    # ResNet-18 stage 1, 3x3 64 -> 64
])
def test_split_work_balances_two_threads(n_cols, m_tiles, a_bytes, b_bytes):
    """Blocks are whole tiles: 43 row tiles in 8 blocks of 6 leave two threads 24 and 19 tiles.
    The split keeps two threads taking items in turn within 5 % of a perfect share, and tiles are
    neither lost nor computed twice."""
    from backends.numba_cpu.gemm import _imbalance, split_work
    c = split_work(8, n_cols, m_tiles, a_bytes, b_bytes)
    n_blocks, per_n, m_blocks, per_m = c
    assert (n_blocks - 1) * per_n < n_cols <= n_blocks * per_n
    assert (m_blocks - 1) * per_m < m_tiles <= m_blocks * per_m
    assert 8 <= n_blocks * m_blocks <= 32
    assert _imbalance(c, n_cols, m_tiles, 2) <= 1.05


@pytest.mark.parametrize("x_shape,w_shape,attrs,small", [
    ((1, 128, 7, 7), (512, 128, 1, 1), dict(), True),                   # 1x1, channels in the lanes
    ((1, 64, 7, 7), (128, 64, 3, 3), dict(pads=[1, 1, 1, 1]), True),    # 3x3, channels in the lanes
    ((1, 64, 28, 28), (512, 64, 3, 3), dict(pads=[1, 1, 1, 1]), False),  # implicit GEMM, rows split
    ((1, 128, 14, 14), (512, 128, 1, 1), dict(), False),                # GEMM, rows split (weights >> activations)
])
def test_conv_split_identical_for_any_thread_count(x_shape, w_shape, attrs, small, direct_convs):
    """Splits never cut the sum over input channels: 1, 2 and 4 threads give the same bytes
    (direct convs: test_winograd.py has Winograd's)."""
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    model, feeds = conv_model(x_shape, w_shape, **attrs)
    graph, _ = import_onnx(model)
    assert ("cuvil_ukt_" in lower(graph)[-1].kernel.source) == small
    outs = {t: assert_matches_ort(model, feeds, tol=1e-5, threads=t, **direct_convs)[1]["y"] for t in (1, 2, 4)}
    np.testing.assert_array_equal(outs[1], outs[2])
    np.testing.assert_array_equal(outs[1], outs[4])


def _residual_conv_model(k, own_input=False, later_reader=False):
    """t = act(conv(x') + r) with r an intermediate (Relu of an input); own_input: the residual is
    the conv's own input; later_reader: r is read again after the conv."""
    C, H = 8, 10
    w = rand(C, C, k, k, seed=3) * 0.2
    b = rand(C, seed=4) * 0.1
    nodes = [helper.make_node("Relu", ["z"], ["r"]), helper.make_node("Neg", ["x"], ["xn"]),
             helper.make_node("Conv", ["r" if own_input else "xn", "w", "b"], ["c"], pads=[k // 2] * 4),
             helper.make_node("Add", ["c", "r"], ["s"]), helper.make_node("Relu", ["s"], ["t"])]
    last = helper.make_node("Add", ["t", "r"], ["y"]) if later_reader else \
        helper.make_node("Transpose", ["t"], ["y"], perm=[0, 1, 3, 2])
    model = make_model(nodes + [last], [("x", np.float32, (1, C, H, H)), ("z", np.float32, (1, C, H, H))],
                       [("y", np.float32, None)], {"w": w, "b": b})
    return model, {"x": rand(1, C, H, H, seed=5), "z": rand(1, C, H, H, seed=6)}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", ["in_place", "own_input", "later_reader"])
def test_conv_accumulates_onto_its_residual(k, case):
    """A residual with no later reader becomes the conv's output buffer, and the conv accumulates
    onto it (KernelCall.in_place); not when it is read later, nor when the conv reads it as its
    input (a 1x1 conv; a 3x3 conv reads the phase images ConvPad made of it, one step before)."""
    from backends.native.memory import plan_arena
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    from passes import resolve_passes, run_passes
    model, feeds = _residual_conv_model(k, own_input=case == "own_input", later_reader=case == "later_reader")
    for threads in (1, 2):
        assert_matches_ort(model, feeds, tol=1e-5, threads=threads)
    graph, _ = import_onnx(model)
    graph = run_passes(graph, [p for p in resolve_passes(2) if p != "plan_memory"])
    schedule = lower(graph)
    conv = next(c for c in schedule if c.kernel.family == "Conv")
    assert conv.in_place is not None
    plan = plan_arena(graph, schedule, set(graph.inputs) | set(graph.outputs))
    taken = [out for out, value in plan.in_place.items() if value == "r"]
    expected = case == "in_place" or (case == "own_input" and k == 3)
    assert (len(taken) == 1) == expected
    assert (conv.in_place is None) == expected   # the call became its in-place form


@pytest.mark.parametrize("x_shape,attrs", [
    ((1, 4, 20, 8), dict(pads=[1, 1, 1, 1])),                    # flat loop, 4 channels: rows split in items
    ((1, 6, 17, 19), dict(pads=[1, 1, 1, 1], strides=[2, 2])),   # row by row
    ((1, 4, 21, 16), dict(pads=[0, 2, 1, 0], strides=[2, 1])),   # asymmetric pads
    ((1, 3, 9, 9), dict(pads=[0, 0, 0, 0])),                     # every row interior
])
def test_depthwise_conv_single_pass_with_epilogue(x_shape, attrs):
    """Depthwise conv + Clip, with rows too narrow for DwRowSpec (stride 1) or stride (2, 1), so
    the direct kernel computes them. In the flat loop (stride 1) interior outputs are stored once as
    clip(bias + sum), the border is set to the bias, summed and clipped after (conv.py
    _single_pass); stride (2, 1) goes row by row in three passes (one pass measured slower there),
    stride 2 by DwRowSpec rows with the epilogue in registers."""
    C = x_shape[1]
    model, feeds = conv_model(x_shape, (C, 1, 3, 3), group=C, **attrs)
    y = model.graph.output[0].name
    model.graph.node.append(helper.make_node("Clip", [y, "lo", "hi"], ["clipped"]))
    from onnx import numpy_helper
    model.graph.initializer.extend([numpy_helper.from_array(np.array(-0.2, np.float32), "lo"),
                                    numpy_helper.from_array(np.array(0.3, np.float32), "hi")])
    model.graph.output[0].name = "clipped"
    for threads in (1, 2):
        assert_matches_ort(model, feeds, tol=1e-5, threads=threads)


@pytest.mark.parametrize("x_shape,w_shape,attrs,act", [
    ((1, 16, 12, 12), (40, 16, 1, 1), {}, "Relu"),                            # 1x1: the GEMM path
    ((1, 300, 9, 9), (14, 300, 3, 3), dict(pads=[1, 1, 1, 1]), "Clip"),       # 3x3, several passes over k
    ((1, 24, 10, 10), (30, 24, 3, 3), dict(strides=[2, 2]), ""),             # bias only
])
def test_conv_epilogue_in_microkernel_registers(x_shape, w_shape, attrs, act, direct_convs):
    """Bias and Relu/Clip run on the micro-kernel's accumulators on the last pass over k (no loop
    reads the tile back): the spec carries them, and results match onnxruntime."""
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    from passes import resolve_passes, run_passes
    model, feeds = conv_model(x_shape, w_shape, **attrs)
    y = model.graph.output[0].name
    if act:
        from onnx import numpy_helper
        extra = ["lo", "hi"] if act == "Clip" else []
        model.graph.node.append(helper.make_node(act, [y] + extra, ["z"]))
        if act == "Clip":
            model.graph.initializer.extend([numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
                                            numpy_helper.from_array(np.array(0.25, np.float32), "hi")])
        model.graph.output[0].name = "z"
    # tol is relative to the largest output: the Clip bound (0.25) is far below the sums it clips,
    # whose float32 rounding (same before the epilogue moved into registers) is ~1e-5.
    for threads in (1, 2):
        assert_matches_ort(model, feeds, tol=1e-4 if act == "Clip" else 1e-5, threads=threads, **direct_convs)
    graph, _ = import_onnx(model)
    names = resolve_passes(2, disable=direct_convs["disable_passes"])
    graph = run_passes(graph, [p for p in names if p != "plan_memory"])
    conv = [c for c in lower(graph) if c.kernel.family == "Conv"][-1]
    specs = list(specs_in(conv.kernel.source).values())
    assert specs and all(sp.bias == 1 and sp.act == act for sp in specs)
    assert "if last:" not in conv.kernel.source


@pytest.mark.parametrize("target", ["x86_64-avx512", "x86_64-avx2", "generic"])
@pytest.mark.parametrize("x_shape,w_shape,attrs,act,residual", [
    ((1, 64, 7, 7), (96, 64, 3, 3), dict(pads=[1, 1, 1, 1]), "Relu", False),             # 7x48 tiles, 2 panels
    ((1, 40, 7, 7), (96, 40, 1, 1), {}, None, True),                                     # 1x1 on X, residual
    ((2, 48, 14, 14), (80, 48, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2]), "Clip", False),  # stride 2, edge panel
    ((1, 300, 7, 7), (96, 300, 3, 3), dict(pads=[1, 1, 1, 1]), None, False),             # many passes
    ((1, 64, 7, 7), (96, 32, 3, 3), dict(pads=[1, 1, 1, 1], group=2), "Relu", True),    # groups, residual
    ((1, 16, 7, 7), (96, 16, 3, 3), dict(pads=[2, 2, 2, 2], dilations=[2, 2]), None, False),  # dilation
    ((1, 64, 14, 14), (96, 64, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2]), None, False),  # pads 0,0,1,1
    ((1, 32, 7, 9), (96, 32, 3, 3), dict(pads=[1, 1, 1, 1]), "Relu", False),          # 9 wide: an edge tile of 2
    ((3, 96, 7, 7), (128, 96, 1, 1), {}, "Relu", False),                                 # batch 3, 1x1
])
def test_small_plane_conv_channels_in_lanes(target, x_shape, w_shape, attrs, act, residual, direct_convs):
    """Convs on small planes put output channels in the vector lanes (convsmall.py, TSpec
    micro-kernels): bias and Relu/Clip in registers, a residual after the last pass, weights in
    several passes with the next pass prefetched, scatters into NCHW."""
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    from passes import resolve_passes, run_passes
    model, feeds = conv_model(x_shape, w_shape, **attrs)
    y = model.graph.output[0].name
    out = y
    if residual:
        from onnx import TensorProto
        model.graph.node.append(helper.make_node("Add", [out, "r"], ["sum"]))
        out = "sum"
        oh = (x_shape[2] + 2 * attrs.get("pads", [0])[0] - attrs.get("dilations", [1])[0] * (w_shape[2] - 1) - 1) \
            // attrs.get("strides", [1])[0] + 1
        r_shape = (x_shape[0], w_shape[0], oh, oh)
        model.graph.input.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, r_shape))
        feeds["r"] = rand(*r_shape, seed=9)
    if act:
        from onnx import numpy_helper
        extra = []
        if act == "Clip":
            model.graph.initializer.extend([numpy_helper.from_array(np.array(-0.5, np.float32), "lo"),
                                            numpy_helper.from_array(np.array(0.5, np.float32), "hi")])
            extra = ["lo", "hi"]
        model.graph.node.append(helper.make_node(act, [out] + extra, ["act"]))
        out = "act"
    model.graph.output[0].name = out
    graph, _ = import_onnx(model)
    names = resolve_passes(2, disable=direct_convs["disable_passes"])
    graph = run_passes(graph, [p for p in names if p != "plan_memory"])
    convs = [c for c in lower(graph) if c.kernel.family == "Conv"]
    assert len(convs) == 1 and "cuvil_ukt_" in convs[0].kernel.source
    # tol is relative to the largest output. Without FMA (the `generic` target: emit.lacks_fma)
    # every product is rounded before its add, twice the roundings of the fused path, and for Clip
    # the largest output is the bound 0.5 while the 432-term sums it clips are several times larger:
    # the Clip tolerance of test_conv_epilogue_in_microkernel_registers (1e-4) applies there.
    from backends.numba_cpu.emit import lacks_fma
    from backends.targets import TARGETS
    tol = 1e-4 if act == "Clip" and lacks_fma(TARGETS[target]) else 1e-5
    for threads in (1, 2):
        assert_matches_ort(model, feeds, tol=tol, threads=threads, target=target, **direct_convs)


def test_vectorised_log_matches_ort():
    """Log (vmath.vlog, Cephes' logf polynomial) over the whole float32 range, subnormals
    included, and its special values. Cephes documents a relative error under 1e-7 (about 1 ulp)
    for logf and onnxruntime's libm logf is within 1 ulp: rtol 4 * 2**-24 (two ulp of each, at
    the 2**-24 half-ulp unit roundoff), with a floor of one ulp of 1 near log = 0 (|log x| < 1e-3
    around x = 1, where the ulp of the result is far smaller than that of the inputs' spacing)."""
    x = np.concatenate([np.logspace(-45, 38.5, 6001), np.linspace(0.5, 2.0, 3001),
                        np.array([1.0, 2.0, 0.5, 1e-40, 1.17549435e-38, 3.4e38])]).astype(np.float32)
    model = make_model([helper.make_node("Log", ["x"], ["y"])], [("x", np.float32, x.shape)], [("y", np.float32, None)])
    compiled = cuvil.compile(model)
    from tests.helpers import run_ort
    got = compiled.run({"x": x})["y"].astype(np.float64)
    want = run_ort(model, {"x": x})["y"].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=4 * 2.0 ** -24, atol=2.0 ** -24)
    special = np.array([0.0, -0.0, -1.0, -1e-40, np.inf, -np.inf, np.nan], dtype=np.float32)
    model = make_model([helper.make_node("Log", ["x"], ["y"])], [("x", np.float32, special.shape)],
                       [("y", np.float32, None)])
    got = cuvil.compile(model).run({"x": special})["y"]
    np.testing.assert_array_equal(got, run_ort(model, {"x": special})["y"])   # -inf, -inf, nan x 3, inf, nan


def test_square_in_place_vectorises():
    """Mul(r, r) run in place (the output over r, its only reader): every input equals the output,
    so the kernel's in-place version replaces all of them (emit.in_place_versions), and the loop
    has no overlap check left to fail (else it ran scalar). Exact: the same products."""
    from backends.numba_cpu.emit import in_place_versions
    source = in_place_versions("def kernel(p0, p1, p2, begin, end):\n    pass\n", ("float32",) * 3)
    first = [line for line in source.splitlines() if "same_buffer" in line][0]
    assert "same_buffer(p0, p2) and same_buffer(p1, p2)" in first
    x = rand(4, 129, 124, seed=3)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "r"], ["m"]),
             helper.make_node("Add", ["m", "x"], ["y"])]
    model = make_model(nodes, [("x", np.float32, x.shape)], [("y", np.float32, None)])
    assert_matches_ort(model, {"x": x}, tol=0.0)
