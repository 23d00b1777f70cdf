"""GPU kernels: Numba CUDA source per op family -> PTX -> ptxas machine code (see kernel.py)."""
