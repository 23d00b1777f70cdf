"""Code generation after the passes: `schedule` and `targets` (shared), `numba_cpu` (kernels
and their objects), `native` (arena, weights, C driver, link). The two backends never import each other."""
