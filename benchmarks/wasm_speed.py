"""How fast a wasm32 module runs in wasmtime against the same model's native cuvil libraries (this
CPU's target, and `generic`: SSE2, 4-float vectors and no FMA, as SIMD128) and onnxruntime, one
thread each (docs/cross.md).

    python benchmarks/wasm_speed.py [--models tiny_cnn resnet18] [--runs 30]

Each engine runs in a process of its own, one after the other, on the same input: the median time
of `runs` session runs after 3 warm-up runs. wasmtime's is one `session_run` call into the module
(the input already in its memory); cuvil native's and onnxruntime's go through their Python API
(a few microseconds of overhead a call). On a shared machine compare the ratios of one run, not
the times of different runs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def models(names):
    from tests import zoo
    if "tiny_cnn" in names:
        yield "tiny_cnn", (ROOT / "examples/models/tiny_cnn.onnx").read_bytes(), {"input": [1, 3, 32, 32]}
    if "resnet18" in names:
        yield "resnet18", zoo.export(zoo.resnet((2, 2, 2, 2)), {"input": (1, 3, 224, 224)}).SerializeToString(), \
            {"input": [1, 3, 224, 224]}


def _feeds(shapes: dict):
    import numpy as np
    return {k: np.random.default_rng(0).standard_normal(v).astype(np.float32) for k, v in shapes.items()}


def worker(engine: str, path: str, shapes: dict, runs: int) -> float:
    """The median milliseconds of one run of `path` by `engine`."""
    import time

    import numpy as np
    feeds = _feeds(shapes)
    if engine == "wasmtime":
        from cuvil.cross import WasmModule
        module = WasmModule(path)
        info = module.described.info
        pointers = []
        for spec in info["inputs"]:
            pointer = module.malloc(feeds[spec["name"]].nbytes)
            module.memory.write(module.store, feeds[spec["name"]].tobytes(), pointer)
            pointers.append(pointer)
        for spec in info["outputs"]:
            pointers.append(module.malloc(4 * int(np.prod(spec["shape"]))))
        table = module.malloc(4 * len(pointers))
        module.memory.write(module.store, np.array(pointers, "<u4").tobytes(), table)
        session = module.call("session_create")
        run = lambda: module.call("session_run", session, table, table + 4 * len(info["inputs"]))
    elif engine == "cuvil":
        import cuvil
        model = cuvil.load(path)
        run = lambda: model.run(feeds)
    else:
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        run = lambda: session.run(None, feeds)
    times = []
    for i in range(runs + 3):
        start = time.perf_counter()
        run()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny_cnn", "resnet18"])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--worker", nargs=3, metavar=("ENGINE", "PATH", "SHAPES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        engine, path, shapes = args.worker
        print(worker(engine, path, json.loads(shapes), args.runs))
        return
    from cuvil.build import VariantSpec, build_variant
    from cuvil.cache import Cache, default_cache_dir
    cache = Cache(default_cache_dir())
    print("| model | wasm32 in wasmtime | cuvil native | cuvil generic | onnxruntime | wasm32 / native | "
          "wasm32 / generic | wasm32 / onnxruntime |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, source, shapes in models(args.models):
            onnx_path = Path(tmp) / f"{name}.onnx"
            onnx_path.write_bytes(source)
            paths = {"onnxruntime": onnx_path}
            for key, target in (("wasm32", "wasm32"), ("native", "native"), ("generic", "generic")):
                paths[key] = build_variant(VariantSpec(name, source, shapes, target=target),
                                           Path(tmp) / f"{name}-{target}", cache).library
            ms = {}
            for key, path in paths.items():
                engine = {"wasm32": "wasmtime", "native": "cuvil", "generic": "cuvil"}.get(key, key)
                out = subprocess.run([sys.executable, __file__, "--runs", str(args.runs), "--worker", engine, str(path),
                                      json.dumps(shapes)], capture_output=True, text=True, check=True)
                ms[key] = float(out.stdout.strip().splitlines()[-1])
            wasm = ms["wasm32"]
            print(f"| {name} | {wasm:.3f} ms | {ms['native']:.3f} ms | {ms['generic']:.3f} ms | {ms['onnxruntime']:.3f} ms"
                  f" | {wasm / ms['native']:.2f} | {wasm / ms['generic']:.2f} | {wasm / ms['onnxruntime']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
