"""cuvil/bench.py: the C timing program is built with $CC, and a compiler that cannot be run
is a CuvilError naming it (timing itself is measured by benchmarks/, never asserted)."""
import pytest

from cuvil import bench
from cuvil.errors import CuvilError


def test_the_timing_program_is_built_with_cc(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "BUILD", tmp_path)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(CuvilError, match="cannot compile the timing program with '.*no-such-cc'") as error:
        bench.harness()
    assert "set CC" in error.value.hint
    assert not list(tmp_path.glob("ctime-*"))  # nothing half-built left behind

    monkeypatch.setenv("CC", "gcc")
    exe = bench.harness()
    assert exe.parent == tmp_path and exe.stat().st_mode & 0o111
    assert bench.harness() == exe  # built once per compiler and source
