"""Figures of the passes on every zoo model (not a test: `python -m tests.test_passes.figures`).

For each model at batch 1: nodes and kernel calls with no pass and after opt levels 2 and 3,
arena against the naive sum of intermediates, weights, and the nodes onnxruntime runs after
its own optimisations (ORT_ENABLE_ALL). Nothing is compiled; --json writes the table.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

from cuvil.explain import explain_model
from tests import zoo
from tests.test_passes.common import export_keeping_batchnorm

IMAGE = {"input": (1, 3, 224, 224)}
MODELS = {
    "mlp": (zoo.mlp, {"x": (1, 256)}),
    "resnet18": (lambda: zoo.resnet((2, 2, 2, 2)), IMAGE),
    "resnet50": (lambda: zoo.resnet((3, 4, 6, 3), bottleneck=True), IMAGE),
    "mobilenet_v2": (zoo.mobilenet_v2, IMAGE),
}


def ort_nodes(model: onnx.ModelProto) -> int:
    """Nodes in onnxruntime's optimised graph (its fused ops count once)."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return len(onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node)


def figures(name: str, model: onnx.ModelProto) -> dict:
    row = {"model": name}
    for level in (0, 2, 3):
        report = explain_model(model, opt_level=level, name=name)
        row[f"nodes_opt{level}"] = sum(report.op_counts_after.values())
        row[f"kernels_opt{level}"] = len(report.kernels)
        if level:
            row[f"arena_opt{level}"] = report.memory["arena_bytes"]
            row[f"naive_opt{level}"] = report.memory["naive_bytes"]
        row["weights"] = report.memory["weights_bytes"]
        row["batchnorm_left"] = report.op_counts_after.get("BatchNormalization", 0)
    row["ort_nodes"] = ort_nodes(model)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for name, (make, shapes) in MODELS.items():
        rows.append(figures(name, zoo.export(make(), shapes)))
        if name != "mlp":
            rows.append(figures(f"{name}+bn", export_keeping_batchnorm(make(), shapes)))
    mib = lambda b: f"{b / 2**20:7.2f}"
    print(f"{'model':<16} {'nodes 0/2/3':>14} {'kernels 0/2/3':>14} {'ort':>5} {'arena MiB':>10} {'naive MiB':>10}"
          f" {'ratio':>6} {'weights MiB':>11}")
    for r in rows:
        print(f"{r['model']:<16} {r['nodes_opt0']:>4}/{r['nodes_opt2']:>4}/{r['nodes_opt3']:>4} "
              f"{r['kernels_opt0']:>4}/{r['kernels_opt2']:>4}/{r['kernels_opt3']:>4} {r['ort_nodes']:>5} "
              f"{mib(r['arena_opt2']):>10} {mib(r['naive_opt2']):>10} {r['arena_opt2'] / r['naive_opt2']:6.1%} "
              f"{mib(r['weights']):>11}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
