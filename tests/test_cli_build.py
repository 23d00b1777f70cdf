"""`cuvil build --report`, `graph`, `verify` and `clean` on a temporary copy of the example project."""
import json
import shutil

from cuvil.cli import main
from tests.test_cli import TEST_CACHE, write_example_project


def test_report_graph_verify_clean(tmp_path, capsys, monkeypatch):
    config = write_example_project(tmp_path)
    cache = tmp_path / "own-cache"  # a cache of its own, so the first build really runs its steps
    config.write_text(config.read_text().replace(f"dir: {TEST_CACHE}", f"dir: {cache}"))
    monkeypatch.chdir(tmp_path)

    assert main(["build", "--report", "first.json"]) == 0
    first = json.loads((tmp_path / "first.json").read_text())["steps"]
    kinds = {s["kind"] for s in first}
    assert {"import", "pass", "codegen", "kernel", "link"} <= kinds
    assert all(s["status"] == "ran" and len(s["key"]) == 64 and s["seconds"] >= 0 for s in first)

    assert main(["build", "--report", "second.json"]) == 0
    second = json.loads((tmp_path / "second.json").read_text())["steps"]
    assert second and all(s["status"] == "cached" for s in second)
    assert "ran 0, cached" in capsys.readouterr().out

    assert main(["graph"]) == 0
    text = capsys.readouterr().out
    assert "tiny_cnn/native/import" in text and "tiny_cnn/native/link" in text
    assert main(["graph", "--format", "dot", "--expand"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph") and "kernel:" in dot

    library = tmp_path / "build" / "cuvil" / "tiny_cnn" / "native" / "libtiny_cnn.so"
    assert main(["verify", str(library)]) == 0
    assert "byte-identical" in capsys.readouterr().out
    data = bytearray(library.read_bytes())
    data[-1] ^= 1
    # Replace the file rather than rewrite it: this process has the library mapped.
    (tmp_path / "tampered.so").write_bytes(bytes(data))
    (tmp_path / "tampered.so").replace(library)
    assert main(["verify", str(library)]) == 1
    assert "DIFFERENT libtiny_cnn.so" in capsys.readouterr().out

    assert main(["cache", "stats"]) == 0
    stats = capsys.readouterr().out
    assert "entries" in stats
    assert main(["cache", "prune", "--max-size", "1K"]) == 0
    assert "removed" in capsys.readouterr().out
    assert main(["cache", "prune", "--max-size", "lots"]) == 2

    assert main(["clean", "--cache"]) == 0
    assert not (tmp_path / "build" / "cuvil").exists() and not cache.exists()
    shutil.rmtree(tmp_path / "examples")
