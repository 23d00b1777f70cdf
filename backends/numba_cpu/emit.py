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

from backends.schedule import Kernel
from backends.targets import CpuTarget, init_llvm

from .ukernel import specs_in, ukernel_ir
from .nbits import kinds as nbits_kinds, nbits_ir
from .nbits_vnni import kinds as vnni_kinds, vnni_ir
from .ukernel_int8 import int8_ir, kinds as int8_kinds
from .dwlanes import dwlanes_ir
from .ukernel_lowp import kinds as lowp_kinds, ukernel_lowp_ir

# the reduced-precision micro-kernels and conversions (ukernel_lowp.py, lowp.py) and the
# packed-weight products (nbits.py, nbits_vnni.py)
LOWP_KINDS = {**lowp_kinds(), **nbits_kinds(), **vnni_kinds()}
NBITS_KINDS = nbits_kinds()
VNNI_KINDS = vnni_kinds()
INT8_KINDS = int8_kinds()   # the int8 VNNI micro-kernel (ukernel_int8.py)
SPEC_KINDS = {**LOWP_KINDS, **INT8_KINDS}

def _numba_types(arg_types):
    import numba
    from numba import types
    return [types.CPointer(numba.from_dtype(__import__("numpy").dtype(t))) for t in arg_types]


# libm calls Numba cannot vectorise -> the vectorisable versions of vmath.py (float32
# polynomials; for float64 they are these same libm functions). Applied to every kernel's
# source, so generators that write `math.exp(x)` get vector code too.
_VMATH_CALLS = {"math.exp(": "vexp(", "math.tanh(": "vtanh(", "math.erf(": "verf("}


def vectorisable_source(source: str) -> str:
    for old, new in _VMATH_CALLS.items():
        source = source.replace(old, new)
    return source


def in_place_versions(source: str, arg_types) -> str:
    """Wrap an elementwise kernel so that it also has a version for running in place.

    The memory planner lets an elementwise kernel write over an input it reads last
    (output pointer == input pointer). LLVM vectorises `y[i] = f(x[i])` only behind a
    run-time check that x and y do not overlap, which fails when they are equal, and
    the scalar loop runs. So the body is inlined twice (or once per input of the
    output's type): with the input's pointer replaced by the output's when they are
    equal (one pointer: nothing to check), and as written otherwise. A kernel reading one
    tensor as two inputs (`Mul(x, x)`, a power spectrum's re * re) that runs in place has
    every input equal to the output: replacing only one of them left the other's overlap
    check failing, and the loop scalar (a log-mel front end's two squares: 30 us each for
    127K floats at batch 8); that case comes first, with all of them replaced."""
    n = len(arg_types)
    out = n - 1
    same = [i for i in range(out) if arg_types[i] == arg_types[out]]
    if not same or "def kernel(" not in source:
        return source
    params = [f"p{i}" for i in range(n)]
    lines = [source.replace("def kernel(", "def _kernel_body(", 1), "",
             "_kernel_body = _numba_njit(inline='always', fastmath=True, error_model='numpy')(_kernel_body)",
             f"def kernel({', '.join(params)}, begin, end):"]
    if len(same) > 1:
        args = [f"p{out}" if k in same else p for k, p in enumerate(params)]
        lines += [f"    if {' and '.join(f'same_buffer(p{i}, p{out})' for i in same)}:",
                  f"        _kernel_body({', '.join(args)}, begin, end)", "        return"]
    for i in same:
        args = [f"p{out}" if k == i else p for k, p in enumerate(params)]
        lines += [f"    if same_buffer(p{i}, p{out}):", f"        _kernel_body({', '.join(args)}, begin, end)",
                  "        return"]
    lines.append(f"    _kernel_body({', '.join(params)}, begin, end)")
    return "\n".join(lines) + "\n"


def kernel_ir(source: str, arg_types: tuple[str, ...], in_place: bool = False) -> str:
    """Compile kernel source with Numba as a cfunc over raw pointers; return its LLVM IR."""
    os.environ.setdefault("NUMBA_OPT", "0")
    source = vectorisable_source(source)
    if in_place:
        source = in_place_versions(source, arg_types)
    import math

    import numpy as np
    from numba import cfunc, types
    _declare_ukernels(source)
    from .vmath import NAMESPACE as vmath
    from numba import njit
    namespace = {"__name__": "cuvil_kernel", "math": math, "np": np, "_numba_njit": njit, **vmath}
    exec(compile(source, "<cuvil kernel>", "exec"), namespace)
    sig = types.void(*_numba_types(arg_types), types.int64, types.int64)
    compiled = cfunc(sig, nopython=True, fastmath=True, error_model="numpy", cache=False)(namespace["kernel"])
    ir = compiled.inspect_llvm()
    return noalias_pointers(ir) if NOALIAS_MARK in source else ir


# A kernel whose source has this line promises that its pointer arguments never overlap (no
# in-place form; distinct arena buffers or constants). Without it LLVM vectorises a loop only
# behind run-time overlap checks, one per pair of load and store streams, and gives up when
# there are many (Winograd's transforms: 36 of each).
NOALIAS_MARK = "# cuvil: pointers do not alias"


def noalias_pointers(ir: str) -> str:
    """Mark the kernel body's pointer parameters (Numba names them %arg.p<i>) noalias."""
    return re.sub(r"^define [^\n]*$",
                  lambda m: re.sub(r"\bptr %arg\.p(\d+)\b", r"ptr noalias %arg.p\1", m.group(0)), ir, flags=re.M)


_PLACEHOLDER = None


def _declare_ukernels(source: str) -> None:
    """Numba finalises every cfunc in its own JIT, which must resolve the micro-kernels the
    source calls: bind their names to a placeholder address (never called; the object
    file gets the real micro-kernels in `emit_object`)."""
    global _PLACEHOLDER
    import ctypes

    import llvmlite.binding as llvm
    names = specs_in(source, SPEC_KINDS)
    if not names:
        return
    if _PLACEHOLDER is None:
        _PLACEHOLDER = ctypes.CFUNCTYPE(ctypes.c_int32)(lambda: 0)
    address = ctypes.cast(_PLACEHOLDER, ctypes.c_void_p).value
    for name in names:
        llvm.add_symbol(name, address)


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


def void_wrapper(ir: str) -> str:
    """Numba's cfunc wrapper of a `void(...)` signature returns a null pointer; the driver declares
    the kernel void. x86-64 and AArch64 ignore the register it leaves, but a WebAssembly call must
    match the callee's type exactly (wasm-ld links a mismatch to a trap): the wrapper returns void."""
    def fix(match):
        return match.group(1) + "void" + match.group(2) + re.sub(r"^(\s*)ret ptr [^\n]*$", r"\1ret void",
                                                                  match.group(3), flags=re.M)
    return re.sub(r"^(define )ptr( @\"?cfunc\.[^\n]*\{\n)(.*?^\})", fix, ir, count=1, flags=re.M | re.S)


# WebAssembly's floating point differs from x86's and Arm's in two places that LLVM otherwise
# lowers, lane by lane, to calls of wasi-libc's software routines (the example's conv made 512
# fmaxf calls; its run took 6.5x longer with the fmaf calls):
# - no fused multiply-add: llvm.fmuladd lets it multiply and add (two roundings) instead;
# - f32.max / f32x4.max return NaN when an operand is NaN (IEEE 754-2019 maximum) where
#   llvm.maxnum returns the other operand: the kernels' max and min (ReLU, clamps, max pooling)
#   become llvm.maximum / llvm.minimum, which propagate a NaN instead of dropping it.
WASM_INTRINSICS = {"@llvm.fma.": "@llvm.fmuladd.", "@llvm.maxnum.": "@llvm.maximum.", "@llvm.minnum.": "@llvm.minimum."}


def wasm_intrinsics(ir: str) -> str:
    """The kernel IR with WASM_INTRINSICS' replacements."""
    for old, new in WASM_INTRINSICS.items():
        ir = ir.replace(old, new)
    return ir


# x86-64 CPUs LLVM knows without FMA3: the `generic` and `x86_64-windows` targets' baseline. There
# llvm.fma is a call of the C library's software fmaf per lane (the example's generic library made
# 5,248 of them; ResNet-18 ran 130x slower than native); llvm.fmuladd multiplies and adds instead
# (one more rounding per product, as the wasm32 target does).
_NO_FMA_X86_CPUS = ("x86-64", "x86-64-v2")


def lacks_fma(target: CpuTarget) -> bool:
    """Whether `target`'s code has no fused multiply-add instruction to lower llvm.fma to."""
    if target.arch == "wasm32":
        return True
    return (target.arch == "x86_64" and target.cpu in _NO_FMA_X86_CPUS
            and "+fma" not in target.features.split(","))


def emit_object(ir: str, symbol: str, target: CpuTarget, source: str = "") -> bytes:
    """Optimise kernel IR for `target` and emit an object file (ELF; COFF for Windows) exporting only
    `symbol` (hidden).

    The micro-kernels `source` declares (see ukernel.py) are generated for the
    target's vector width and linked into the module first."""
    import llvmlite.binding as llvm
    init_llvm()
    # Numba's cfunc wrapper calls the kernel body through a noinline call site; the body is
    # inlined instead (see alwaysinline below).
    ir = re.sub(r"^(attributes #\d+ = \{.*?)\bnoinline\b", r"\1 nounwind", ir, flags=re.M)
    if target.arch == "wasm32":
        ir = void_wrapper(ir)
    module = llvm.parse_assembly(ir)
    specs = specs_in(source, SPEC_KINDS)
    called = {name for name, spec in specs.items() if not getattr(spec, "inline", True)}   # e.g. LowpCalledSpec
    for name, spec in sorted(specs.items()):
        kind = getattr(spec, "kind", "")
        if kind == "dwlanes":   # its IR generator lives beside its kernel (dwlanes.py)
            text = dwlanes_ir(spec, target.vector_bits)
        elif kind in INT8_KINDS or kind in NBITS_KINDS or kind in LOWP_KINDS:
            generate = (int8_ir if kind in INT8_KINDS else nbits_ir if kind in NBITS_KINDS
                        else vnni_ir if kind in VNNI_KINDS else ukernel_lowp_ir)
            text = generate(spec, target.vector_bits)
        else:   # the fp32 micro-kernels: only their synchronisation kernels depend on the ISA
            text = ukernel_ir(spec, target.vector_bits, target.arch)
        module.link_in(llvm.parse_assembly(text))
    helpers = 0
    for fn in module.functions:
        if fn.is_declaration:
            continue
        if fn.name.startswith("cfunc."):
            fn.name = symbol
            fn.visibility = "hidden"
        else:
            inline = fn.name not in called
            fn.name = f"{symbol}__impl{helpers}"
            fn.linkage = "internal"
            if not inline:
                fn.add_function_attribute("noinline")
                helpers += 1
                continue
            # Inlined into the cfunc wrapper, whose error path (it reports an exception status
            # through the Python C API) then folds away. Left to IPSCCP, a large body (a
            # Winograd output transform) kept that path, and with it references to
            # numba_gil_ensure and Py* functions that made the library fail to load.
            fn.add_function_attribute("alwaysinline")
            helpers += 1
    for i, gv in enumerate(module.global_variables):
        if not gv.is_declaration:
            gv.name = f"{symbol}__g{i}"
            gv.linkage = "internal"
    attrs = f'"target-cpu"="{target.cpu}" "prefer-vector-width"="{target.vector_bits}"'
    if target.features:
        attrs += f' "target-features"="{target.features}"'
    text = str(module)
    if target.arch == "wasm32":
        text = wasm_intrinsics(text)
    elif lacks_fma(target):
        text = text.replace("@llvm.fma.", "@llvm.fmuladd.")
    if target.arch != "x86_64" and "@llvm.x86." in text:
        # LLVM would abort the worker process on them; say which kernel instead
        raise ValueError(f"kernel {symbol}: x86 intrinsics in code for the {target.arch} target {target.name}")
    module = llvm.parse_assembly(_add_function_attributes(text, attrs))
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


def build_kernel_object(kernel: Kernel, target: CpuTarget) -> bytes:
    """Worker entry point: a kernel's object file for the target."""
    ir = kernel_ir(kernel.source, kernel.arg_types, in_place=kernel.in_place)
    return emit_object(ir, kernel.symbol, target, kernel.source)
