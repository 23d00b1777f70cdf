"""Run a GPU schedule in Numba's CUDA simulator, over numpy arrays: the numerics of every GPU
kernel are checked this way without a GPU (tests/test_cuda_sim.py), on small shapes.

The simulator must be switched on before Numba CUDA is imported (NUMBA_ENABLE_CUDASIM=1), so a
process that also compiles PTX (which needs the real target) runs this in a subprocess:
`python -m backends.numba_cuda.simulate` reads a pickled (graph, schedule, feeds) on stdin and
writes the outputs pickled on stdout.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np

from backends.schedule import KernelCall, View

from .kernel import blocks, kernel_function


def _cuda():
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        raise RuntimeError("the CUDA simulator needs NUMBA_ENABLE_CUDASIM=1 before numba.cuda is imported "
                           "(use simulate_schedule, which runs a subprocess)")
    from numba import cuda
    return cuda


def launch(kernel, arrays: list, work: int) -> None:
    """One kernel over flat numpy arrays (outputs written in place), in the simulator."""
    cuda = _cuda()
    fn = cuda.jit(kernel_function(kernel.source, cuda))
    fn[blocks(work, kernel.block), kernel.block](*arrays, np.int64(work))


def run_schedule(graph, schedule, feeds: dict) -> dict:
    """Execute a lowered schedule: every value a flat array of its own (no arena), constants
    from the graph and the calls' packed arguments."""
    values: dict[str, np.ndarray] = {}
    for name, value in graph.values.items():
        if value.is_const:
            values[name] = np.ascontiguousarray(value.data).reshape(-1).copy()
    for name in graph.inputs:
        values[name] = np.ascontiguousarray(feeds[name], dtype=graph.values[name].dtype).reshape(-1).copy()

    def buffer(name):
        if name not in values:
            v = graph.values[name]
            values[name] = np.zeros(int(np.prod(v.shape, dtype=np.int64)), dtype=v.dtype)
        return values[name]

    for step in schedule:
        if isinstance(step, View):
            values[step.dst] = buffer(step.src)
            continue
        assert isinstance(step, KernelCall)
        arrays = [np.ascontiguousarray(a).reshape(-1) if isinstance(a, np.ndarray) else buffer(a) for a in step.args]
        if step.kernel.block <= 0:
            raise ValueError(f"call for '{step.node}' is not a GPU kernel")
        launch(step.kernel, arrays, step.work)
    return {name: buffer(name).reshape(graph.values[name].shape).copy() for name in graph.outputs}


def simulate_schedule(graph, schedule, feeds: dict, timeout: float = 600) -> dict:
    """run_schedule in a subprocess with the simulator switched on."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-m", "backends.numba_cuda.simulate"], input=pickle.dumps(
        (graph, schedule, feeds)), capture_output=True, env=env, timeout=timeout, cwd=root)
    if result.returncode != 0:
        raise RuntimeError("the CUDA simulator failed:\n" + result.stderr.decode(errors="replace")[-4000:])
    return pickle.loads(result.stdout)


if __name__ == "__main__":
    graph, schedule, feeds = pickle.loads(sys.stdin.buffer.read())
    outputs = run_schedule(graph, schedule, feeds)
    sys.stdout.buffer.write(pickle.dumps(outputs))
