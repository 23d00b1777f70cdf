"""Per-convolution throughput of a zoo model: every distinct Conv of the model
(after cuvil's passes) as a one-node model, built by cuvil and timed from C,
as GFLOP/s and as a fraction of the measured single-core FMA peak (counting a
direct convolution's FLOPs, also for the convs Winograd takes); onnxruntime
on the same one-node model alongside (its own process).

    python benchmarks/convs.py [--model resnet50] [--threads 1] [--runs 20]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from onnx import helper  # noqa: E402

import cuvil  # noqa: E402
from cuvil import bench as ctime  # noqa: E402
from benchmarks import peak  # noqa: E402
from benchmarks.bench import MODELS, ort_time  # noqa: E402
from tests import zoo  # noqa: E402
from tests.helpers import make_model  # noqa: E402


def conv_layers(name):
    from cuvil.frontends.onnx import import_onnx
    from passes import resolve_passes, run_passes
    module, shapes = MODELS[name]()
    graph, _ = import_onnx(zoo.export(module, shapes), shapes)
    # Every conv on its own: a DepthwiseBlock's convs are timed apart too.
    graph = run_passes(graph, [p for p in resolve_passes(2, disable=["fuse_depthwise_block"]) if p != "plan_memory"])
    layers = {}
    for node in graph.nodes:
        if node.op not in ("Conv", "FusedConv"):
            continue
        x, w = graph.values[node.inputs[0]], graph.values[node.inputs[1]]
        y = graph.values[node.outputs[0]]
        attrs = {k: node.attrs[k] for k in ("strides", "pads", "group", "dilations", "kernel_shape") if k in node.attrs}
        key = json.dumps([list(x.shape), list(w.shape), attrs], sort_keys=True)
        entry = layers.setdefault(key, {"x": tuple(x.shape), "w": tuple(w.shape), "y": tuple(y.shape), "attrs": attrs,
                                        "count": 0})
        entry["count"] += 1
    return list(layers.values())


def layer_model(layer):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(layer["w"]) * 0.1).astype(np.float32)
    b = (rng.standard_normal(layer["w"][0]) * 0.1).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], **layer["attrs"])
    return make_model([node], [("x", np.float32, layer["x"])], [("y", np.float32, layer["y"])], {"w": w, "b": b})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--no-ort", action="store_true")
    args = parser.parse_args(argv)
    p = peak.measure()["gflops"] * args.threads
    print(f"# {args.model}: convolutions, threads={args.threads}, peak {p:.1f} GFLOP/s")
    print(f"{'x':>18} {'w':>18} {'s':>2} {'n':>3} {'cuvil ms':>9} {'GFLOP/s':>8} {'%peak':>6} {'ort ms':>8} {'ratio':>6}")
    total_flops = total_time = total_ort = 0.0
    for layer in conv_layers(args.model):
        model = layer_model(layer)
        compiled = cuvil.compile(model, threads=args.threads)
        t = statistics.median(ctime.time_library(compiled.artifacts.library, runs=args.runs, warmup=3,
                                                 info=compiled.info))
        flops = 2 * np.prod(layer["y"]) * np.prod(layer["w"][1:])
        o = float("nan") if args.no_ort else ort_time(model, args.threads, args.runs)
        total_flops += flops * layer["count"]
        total_time += t * layer["count"]
        total_ort += o * layer["count"]
        s = (layer["attrs"].get("strides") or [1])[0]
        print(f"{str(layer['x']):>18} {str(layer['w']):>18} {s:>2} {layer['count']:>3} {t * 1e3:>9.3f} "
              f"{flops / t / 1e9:>8.1f} {100 * flops / t / 1e9 / p:>5.0f}% {o * 1e3:>8.3f} {t / o:>6.2f}", flush=True)
    print("# GFLOP/s and %peak count a direct convolution's FLOPs: the 3x3 stride-1 convs Winograd takes do"
          " 2.25-4x fewer, so they can exceed 100 %")
    print(f"# total: cuvil {total_time * 1e3:.2f} ms, {total_flops / total_time / 1e9:.1f} GFLOP/s "
          f"({100 * total_flops / total_time / 1e9 / p:.0f}% of peak); onnxruntime {total_ort * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
