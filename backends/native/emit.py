"""Numba kernel source -> LLVM IR -> object file for a target.

Runs in worker processes (see `compile_kernels`): Numba is imported there with
NUMBA_OPT=0 so that the IR it gives is target independent, and the full O3
pipeline runs here with the variant's TargetMachine, which is what decides
vector widths. Every symbol is renamed to a name derived from the kernel's
content hash: Numba's names carry per-process counters, ours must not.
"""
from __future__ import annotations

import os
import re

from .targets import CpuTarget, _init_llvm

def _numba_types(arg_types):
    import numba
    from numba import types
    return [types.CPointer(numba.from_dtype(__import__("numpy").dtype(t))) for t in arg_types]


def kernel_ir(source: str, arg_types: tuple[str, ...]) -> str:
    """Compile kernel source with Numba as a cfunc over raw pointers; return its LLVM IR."""
    os.environ.setdefault("NUMBA_OPT", "0")
    import math

    import numpy as np
    from numba import cfunc, types
    namespace = {"__name__": "cuvil_kernel", "math": math, "np": np}
    exec(compile(source, "<cuvil kernel>", "exec"), namespace)
    sig = types.void(*_numba_types(arg_types), types.int64, types.int64)
    compiled = cfunc(sig, nopython=True, fastmath=True, error_model="numpy", cache=False)(namespace["kernel"])
    return compiled.inspect_llvm()


def _add_function_attributes(ir: str, attrs: str) -> str:
    """Append string attributes to every attribute group used by a definition."""
    groups = set()
    def tag(match):
        line = match.group(0)
        found = re.findall(r"#(\d+)", line)
        if found:
            groups.update(found)
            return line
        groups.add("9999")
        return line[:-1].rstrip() + " #9999 {"
    ir = re.sub(r"^define [^\n]*\{$", tag, ir, flags=re.M)
    def extend(match):
        if match.group(1) in groups:
            body = re.sub(r'"(target-cpu|target-features|prefer-vector-width)"="[^"]*"', "", match.group(2))
            return f"attributes #{match.group(1)} = {{ {body.strip()} {attrs} }}"
        return match.group(0)
    ir = re.sub(r"^attributes #(\d+) = \{(.*)\}$", extend, ir, flags=re.M)
    if "9999" in groups:
        ir += f"\nattributes #9999 = {{ {attrs} }}\n"
    return ir


def emit_object(ir: str, symbol: str, target: CpuTarget) -> bytes:
    """Optimise kernel IR for `target` and emit an ELF object exporting only `symbol` (hidden)."""
    import llvmlite.binding as llvm
    _init_llvm()
    module = llvm.parse_assembly(ir)
    helpers = 0
    for fn in module.functions:
        if fn.is_declaration:
            continue
        if fn.name.startswith("cfunc."):
            fn.name = symbol
            fn.visibility = "hidden"
        else:
            fn.name = f"{symbol}__impl{helpers}"
            fn.linkage = "internal"
            helpers += 1
    for i, gv in enumerate(module.global_variables):
        if not gv.is_declaration:
            gv.name = f"{symbol}__g{i}"
            gv.linkage = "internal"
    attrs = f'"target-cpu"="{target.cpu}" "prefer-vector-width"="{target.vector_bits}"'
    if target.features:
        attrs += f' "target-features"="{target.features}"'
    module = llvm.parse_assembly(_add_function_attributes(str(module), attrs))
    module.triple = target.triple
    machine = llvm.Target.from_triple(target.triple).create_target_machine(
        cpu=target.cpu, features=target.features, opt=3, reloc="pic", codemodel="default")
    module.data_layout = str(machine.target_data)
    tuning = llvm.create_pipeline_tuning_options(speed_level=3)
    tuning.loop_vectorization = True
    tuning.slp_vectorization = True
    builder = llvm.create_pass_builder(machine, tuning)
    builder.getModulePassManager().run(module, builder)
    module.verify()
    return machine.emit_object(module)


def build_kernel_object(job: tuple) -> bytes:
    """Worker entry point: (source, arg_types, symbol, target) -> object bytes."""
    source, arg_types, symbol, target = job
    return emit_object(kernel_ir(source, arg_types), symbol, target)
