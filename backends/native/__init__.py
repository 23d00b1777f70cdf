"""The library around the kernels: the arena plan (memory), the weights blob, the generated C
driver and C ABI, and the SCons link. Reads the schedule; knows nothing of how kernels are written."""
