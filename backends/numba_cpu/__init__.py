"""CPU kernels: one generator per op family (registry.py lowers a graph to the schedule), the
LLVM micro-kernels (ukernel.py), and kernel source -> object file (emit.py, objects.py, worker.py)."""
