"""cuvil/bench.py: the C timing program is built with $CC, and a compiler that cannot be run
is a CuvilError naming it (timing itself is measured by benchmarks/, never asserted)."""
import pytest

from cuvil import bench, ctime
from cuvil.errors import CuvilError


def test_the_timing_program_is_built_with_cc(tmp_path, monkeypatch):
    monkeypatch.setattr(ctime, "BUILD", tmp_path)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(CuvilError, match="cannot compile the timing program with '.*no-such-cc'") as error:
        bench.harness()
    assert "set CC" in error.value.hint
    assert not list(tmp_path.glob("ctime-*"))  # nothing half-built left behind

    monkeypatch.setenv("CC", "gcc")
    exe = bench.harness()
    assert exe.parent == tmp_path and exe.stat().st_mode & 0o111
    assert bench.harness() == exe  # built once per compiler and source


def test_the_cpus_round_trip_needs_two_of_them(tmp_path, monkeypatch):
    """core_round_trip_ns (the benchmarks' c2c column) bounces a cache line between the first two
    CPUs this process may use: a time in ns with two, None with one (no second CPU to ask)."""
    import os
    import subprocess
    import sys
    monkeypatch.setattr(ctime, "BUILD", tmp_path)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        ns = ctime.core_round_trip_ns(rounds=2000)
        assert ns is not None and 0 < ns < 1e6
    one = subprocess.run([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpus[0]}}}); "
                          "from cuvil import ctime; print(ctime.core_round_trip_ns(rounds=10))"],
                         capture_output=True, text=True, check=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert one.stdout.strip() == "None"


def test_bench_int8_quantises_with_onnxruntimes_tools_and_cuvil_folds_the_file(tmp_path):
    """`bench.py --precision int8`: the file every engine runs is onnxruntime's quantize_dynamic
    output for a non-convolutional model, and cuvil builds its products on int8 kernels."""
    import onnx
    import pytest
    pytest.importorskip("onnxruntime.quantization")
    from benchmarks import bench
    from cuvil.explain import explain_model
    module, shapes = bench.MODELS["mlp"]()
    path = tmp_path / "mlp.onnx"
    path.write_bytes(bench._zoo().export(module, shapes).SerializeToString())
    quantised = onnx.load(bench.quantise("mlp", path, shapes))
    assert any(n.op_type == "MatMulInteger" for n in quantised.graph.node)
    from backends.targets import has_feature, resolve_target
    labels = [k.precision for k in explain_model(quantised, input_shapes=shapes).kernels]
    # the VNNI kernels where the host has AVX512-VNNI; elsewhere the same nodes, exact scalar loops
    assert any(label.startswith("int8") for label in labels) == has_feature(resolve_target("native"), "avx512vnni")
