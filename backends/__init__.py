"""Code generation: numba_cpu (kernel sources per op family), native (objects, driver, link)."""
