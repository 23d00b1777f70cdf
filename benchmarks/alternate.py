"""Old against new on a loaded machine, by thread CPU time: two libraries of one model in one process,
runs alternating, each run's `time.thread_time` (the time its thread ran: a preempted run does not
count its wait), so both see the same load and the same caches. Prints each library's percentiles and
new / old at the minimum, 10th and 25th percentile and the median, and checks the outputs are equal
(max |difference|). The ratio is one thread's: with a pool, the calling thread's share only;
`--clock process` takes the process's CPU time (every thread's, a pool's waits included: the
library's threads count, preemption still does not), `--clock wall` the elapsed time.

    python benchmarks/alternate.py compare OLD.so NEW.so [--runs 200] [--clock thread|process|wall]
    # a chain of L distinct MatMul + bias [1, T, 768] @ [768, 768] (2.36 MB of weights each)
    python benchmarks/alternate.py chain 16 --tokens 128 --threads 1 --out /tmp/chain16

Two copies of one library (the same path twice) are two instances: their A/A ratio is the noise.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.append(str(ROOT))


def chain(args) -> None:
    """Build the chain of `args.layers` distinct 768 x 768 products and print its library's path."""
    import cuvil
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(args.layers):
        inits += [numpy_helper.from_array((rng.standard_normal((768, 768)) / 28).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(768).astype(np.float32) * 0.1, f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"])]
        x = f"y{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, args.tokens, 768])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    print(cuvil.compile(model, threads=args.threads, jobs=2).save(args.out))


CLOCKS = {"thread": time.thread_time, "process": time.process_time, "wall": time.perf_counter}


def compare(args) -> None:
    from cuvil.runtime import Library
    folder = Path(tempfile.mkdtemp(prefix="cuvil-alternate-"))
    sessions = []
    for tag, path in (("old", args.old), ("new", args.new)):
        copy = folder / f"{tag}.so"   # two files: the same library twice is then two instances
        shutil.copy(path, copy)
        library = Library(copy)
        sessions.append((tag, library, library.session()))
    feeds = {v["name"]: np.random.default_rng(1).standard_normal(v["shape"]).astype(v["dtype"])
             for v in sessions[0][1].info["inputs"]}
    outs = [list(s.run(feeds).values()) for _, _, s in sessions]
    diff = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(*outs))
    times = {tag: [] for tag, _, _ in sessions}
    clock = CLOCKS[args.clock]
    for i in range(args.runs):
        for tag, _, session in (sessions if i % 2 else sessions[::-1]):
            start = clock()
            session.run(feeds)
            times[tag].append(clock() - start)
    q = {tag: np.percentile(np.array(t) * 1e3, [0, 10, 25, 50]) for tag, t in times.items()}
    for tag in times:
        print(f"{tag}: min {q[tag][0]:.3f}  p10 {q[tag][1]:.3f}  p25 {q[tag][2]:.3f}  median {q[tag][3]:.3f} ms")
    ratio = q["new"] / q["old"]
    print(f"new / old: min {ratio[0]:.3f}  p10 {ratio[1]:.3f}  p25 {ratio[2]:.3f}  median {ratio[3]:.3f}; "
          f"outputs max |difference| {diff:.3g}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--runs", type=int, default=200)
    c.add_argument("--clock", choices=sorted(CLOCKS), default="thread")
    b = sub.add_parser("chain")
    b.add_argument("layers", type=int)
    b.add_argument("--tokens", type=int, default=128)
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    compare(args) if args.command == "compare" else chain(args)


if __name__ == "__main__":
    main()
