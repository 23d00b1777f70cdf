"""Run generated IR on this machine, compiled for a named CPU: the tests and benchmarks of
micro-kernels call them through ctypes without building a library.

A module compiled for an older CPU than the host's (`x86-64`, `haswell` on an AVX-512 machine)
runs here too, which is how the generic and AVX2 paths are tested on one machine. The target
attributes go on every function (llvmlite's TargetMachine alone does not decide what the
instruction selector may use for intrinsics such as `llvm.x86.*`).
"""
from __future__ import annotations

import ctypes
import re

from backends.targets import init_llvm


def with_target_attributes(ir: str, cpu: str, features: str = "", vector_bits: int = 0) -> str:
    """`ir` with every function definition carrying target-cpu/-features (and prefer-vector-width)."""
    attrs = f'"target-cpu"="{cpu}"'
    if features:
        attrs += f' "target-features"="{features}"'
    if vector_bits:
        attrs += f' "prefer-vector-width"="{vector_bits}"'
    ir = re.sub(r"^(define [^\n]*?\))( #\d+)? \{$", r"\1 #77 {", ir, flags=re.M)
    return ir + f"\nattributes #77 = {{ nounwind {attrs} }}\n"


class HostJit:
    """One MCJIT engine holding modules compiled for `cpu` / `features`."""

    def __init__(self, cpu: str, features: str = "", vector_bits: int = 0, opt: int = 3):
        import llvmlite.binding as llvm
        init_llvm()
        self.cpu, self.features, self.vector_bits = cpu, features, vector_bits
        self.machine = llvm.Target.from_default_triple().create_target_machine(
            cpu=cpu, features=features, opt=opt, codemodel="jitdefault")
        self.engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), self.machine)
        self.modules = []

    def add(self, ir: str) -> None:
        import llvmlite.binding as llvm
        module = llvm.parse_assembly(with_target_attributes(ir, self.cpu, self.features, self.vector_bits))
        module.verify()
        optimise(module, self.machine)
        self.engine.add_module(module)
        self.engine.finalize_object()
        self.modules.append(module)

    def has(self, name: str) -> bool:
        return bool(self.engine.get_function_address(name))

    def function(self, name: str, restype, *argtypes):
        address = self.engine.get_function_address(name)
        assert address, f"no function {name} in the JIT"
        return ctypes.CFUNCTYPE(restype, *argtypes)(address)


def optimise(module, machine) -> None:
    """The O3 pipeline for `machine`, as emit.py runs it on kernel objects."""
    import llvmlite.binding as llvm
    module.data_layout = str(machine.target_data)
    tuning = llvm.create_pipeline_tuning_options(speed_level=3)
    builder = llvm.create_pass_builder(machine, tuning)
    builder.getModulePassManager().run(module, builder)
    module.verify()


def object_code(ir, cpu: str, features: str = "", vector_bits: int = 0) -> bytes:
    """An ELF object (PIC) of `ir` (one module's text, or a list of them, linked) for `cpu`: for
    objdump checks of code this machine cannot run, and for benchmark harnesses linked by gcc."""
    import llvmlite.binding as llvm
    init_llvm()
    texts = [ir] if isinstance(ir, str) else list(ir)
    module = llvm.parse_assembly(with_target_attributes(texts[0], cpu, features, vector_bits))
    for text in texts[1:]:
        module.link_in(llvm.parse_assembly(with_target_attributes(text, cpu, features, vector_bits)))
    module.verify()
    machine = llvm.Target.from_triple("x86_64-unknown-linux-gnu").create_target_machine(
        cpu=cpu, features=features, opt=3, reloc="pic")
    optimise(module, machine)
    return machine.emit_object(module)
