"""The CPU targets a variant can be built for.

LLVM is told the CPU and features explicitly (never "whatever this machine
is", except for `native`), and AVX-512 targets ask for 512-bit vectors: LLVM's
default on AVX-512 CPUs is to prefer 256-bit ones.

Cross targets (`aarch64-linux`, `aarch64-neon-fp16-dotprod`, `x86_64-windows`,
`wasm32`) are built on this x86-64 Linux machine for another one: their triple
picks LLVM's backend and object format for the kernels, and their C compiler
(CROSS_TOOLCHAINS: a Debian cross gcc, MinGW-w64, clang + wasm-ld) compiles the
driver and links the library. Their libraries cannot be loaded here; they run on
their machine, or under qemu-user / Wine / wasmtime (cuvil/cross.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cuvil.errors import CuvilError


# L1 data cache ways of Haswell, Skylake and AMD Zen 4 (Ice Lake and later Intel cores have 12): the
# named targets' value, and native's when the machine does not say.
DEFAULT_L1D_WAYS = 8


@dataclass(frozen=True)
class CpuTarget:
    name: str
    triple: str
    cpu: str
    features: str
    vector_bits: int  # preferred vector width handed to LLVM
    gcc_flags: tuple[str, ...]  # for the C driver
    l1d_ways: int = DEFAULT_L1D_WAYS  # associativity of the L1 data cache (kernels avoid reading more aliasing rows)

    @property
    def arch(self) -> str:
        """The ISA, from the triple: "x86_64" or "aarch64"."""
        return self.triple.split("-", 1)[0]

    @property
    def system(self) -> str:
        """The operating system, from the triple: "linux", "windows", or "wasm" (a WebAssembly module,
        run by an engine such as wasmtime or a browser)."""
        return "windows" if "-windows" in self.triple else "wasm" if self.arch == "wasm32" else "linux"

    def library_file(self, name: str) -> str:
        """The shared library's file name: lib<name>.so, <name>.dll on Windows, <name>.wasm for wasm32."""
        return {"windows": f"{name}.dll", "wasm": f"{name}.wasm"}.get(self.system, f"lib{name}.so")

    @property
    def is_cross(self) -> bool:
        """Whether the library is for another kind of machine than this x86-64 one (it cannot be
        loaded here: see CROSS_TOOLCHAINS for how it is compiled and run)."""
        return self.triple in CROSS_TOOLCHAINS

    def as_key(self) -> dict:
        return {"name": self.name, "triple": self.triple, "cpu": self.cpu, "features": self.features,
                "vector_bits": self.vector_bits, "gcc_flags": list(self.gcc_flags), "l1d_ways": self.l1d_ways}

    @classmethod
    def from_key(cls, key: dict) -> CpuTarget:
        return cls(**{**key, "gcc_flags": tuple(key["gcc_flags"])})


_TRIPLE = "x86_64-unknown-linux-gnu"
_AARCH64 = "aarch64-unknown-linux-gnu"
_WINDOWS = "x86_64-pc-windows-gnu"
# WebAssembly, 32-bit linear memory: the C library is wasi-libc's, linked in whole (the module
# imports nothing; see WASM_TOOLCHAIN).
WASM_TRIPLE = "wasm32-unknown-wasi"

TARGETS = {
    "generic": CpuTarget("generic", _TRIPLE, "x86-64", "", 128, ("-march=x86-64",)),
    "x86_64-avx2": CpuTarget("x86_64-avx2", _TRIPLE, "haswell", "", 256, ("-march=haswell",)),
    "x86_64-avx512": CpuTarget("x86_64-avx512", _TRIPLE, "skylake-avx512", "", 512, ("-march=skylake-avx512",)),
    # The two CPUs of the reduced-precision paths: AMD Zen 4 (AVX512-BF16; no AMX, no AVX512-FP16) and
    # Intel Sapphire Rapids (AVX512-BF16, AVX512-FP16, AMX), for building on one for the other.
    "x86_64-znver4": CpuTarget("x86_64-znver4", _TRIPLE, "znver4", "", 512, ("-march=znver4",)),
    "x86_64-sapphirerapids": CpuTarget("x86_64-sapphirerapids", _TRIPLE, "sapphirerapids", "", 512,
                                       ("-march=sapphirerapids",)),
    # 64-bit Arm Linux: any ARMv8-A core (Advanced SIMD is part of it), 128-bit vectors. The variant is
    # for ARMv8.2-A cores with half-precision arithmetic and the dot-product instructions (Cortex-A78
    # of the Jetson Orin, Neoverse N1/V1 of Graviton 2/3): its library checks both (HWCAP) before
    # it makes a session.
    "aarch64-linux": CpuTarget("aarch64-linux", _AARCH64, "generic", "+neon,+fp-armv8", 128, ("-march=armv8-a",)),
    "aarch64-neon-fp16-dotprod": CpuTarget("aarch64-neon-fp16-dotprod", _AARCH64, "generic",
                                           "+v8.2a,+neon,+fp-armv8,+fullfp16,+dotprod", 128,
                                           ("-march=armv8.2-a+fp16+dotprod",)),
    # 64-bit Windows: a DLL for any x86-64 CPU (the `generic` target's code), built with MinGW-w64.
    "x86_64-windows": CpuTarget("x86_64-windows", _WINDOWS, "x86-64", "", 128, ("-march=x86-64",)),
    # WebAssembly with SIMD128 (4-float vectors; every current browser engine and wasmtime has it),
    # 32-bit pointers, one thread. LLVM's "generic" wasm CPU also enables bulk-memory (memcpy and
    # memset as instructions), sign-ext, mutable globals, non-trapping float-to-int and multivalue.
    "wasm32": CpuTarget("wasm32", WASM_TRIPLE, "generic", "+simd128", 128, ("-msimd128",)),
}


@dataclass(frozen=True)
class CrossToolchain:
    """How a cross target's C side is built and its programs run on this x86-64 Linux machine."""
    cc: str                  # the C compiler (gcc driver) for the triple; CC_<triple> in the environment overrides it
    package: str             # the Debian package that installs it
    sysroot: str             # the target's C library, as the Debian cross packages install it
    emulators: tuple[str, ...]   # the programs that can run the target's programs here (the first found)
    emulator_package: str

    def find_emulator(self) -> str | None:
        import shutil
        return next((found for name in self.emulators if (found := shutil.which(name))), None)

    def run_prefix(self, cpu: str | None = None) -> list[str]:
        """The command prefix that runs one of the target's programs here: qemu-user with the
        target's libc (`cpu`: the CPU it emulates; default its "max", with every feature), or Wine."""
        emulator = self.find_emulator()
        if emulator is None:
            raise CuvilError(f"{self.emulators[0]} is not installed", hint=f"apt-get install {self.emulator_package}")
        if "qemu" in Path(emulator).name:
            return [emulator, *(["-cpu", cpu] if cpu else []), "-L", self.sysroot]
        return [emulator]


CROSS_TOOLCHAINS = {
    _AARCH64: CrossToolchain("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu", "/usr/aarch64-linux-gnu",
                             ("qemu-aarch64",), "qemu-user"),
    # Debian's wine64 package installs its loader outside PATH; the `wine` package adds `wine`.
    _WINDOWS: CrossToolchain("x86_64-w64-mingw32-gcc", "gcc-mingw-w64-x86-64", "/usr/x86_64-w64-mingw32",
                             ("wine", "wine64", "/usr/lib/wine/wine64"), "wine64"),
    # wasm32: clang compiles the driver, wasm-ld (Debian's lld) links it with the kernels and
    # wasi-libc's libc.a and libm.a (memcpy, malloc, expf...) into a module that imports nothing.
    # No emulator: wasmtime's Python API runs the module (cuvil/cross.py run_wasm).
    WASM_TRIPLE: CrossToolchain("clang", "clang lld wasi-libc libclang-rt-14-dev-wasm32", "/usr/lib/wasm32-wasi",
                                (), "wasmtime (pip install wasmtime)"),
}

# What a wasm32 link needs beside clang: the linker clang runs, wasi-libc, compiler-rt's builtins
# (a path pattern: the one of Debian's clang).
WASM_LINK_PARTS = (("wasm-ld", "lld"), ("/usr/lib/wasm32-wasi/libc.a", "wasi-libc"),
                   ("/usr/lib/llvm-*/lib/clang/*/lib/wasi/libclang_rt.builtins-wasm32.a", "libclang-rt-14-dev-wasm32"))


def cc_variable(triple: str) -> str:
    """The environment variable naming a triple's C compiler (the convention of Rust's cc crate):
    CC_aarch64_unknown_linux_gnu."""
    return "CC_" + triple.replace("-", "_").replace(".", "_")


def c_compiler(target) -> str:
    """The C compiler that compiles `target`'s driver and links its library: $CC (default gcc) for
    this machine's targets; for a cross target $CC_<triple>, else its cross gcc, which must be
    installed (a CuvilError naming the Debian package otherwise)."""
    import os
    import shutil
    toolchain = CROSS_TOOLCHAINS.get(getattr(target, "triple", None))
    if toolchain is None:
        return os.environ.get("CC", "gcc")
    cc = os.environ.get(cc_variable(target.triple), toolchain.cc)
    if shutil.which(cc) is None:
        raise CuvilError(f"target '{target.name}' needs the C cross compiler '{cc}', which is not installed",
                         hint=f"install it: apt-get install {toolchain.package} (or set "
                              f"{cc_variable(target.triple)} to another {target.arch} C compiler)")
    if target.triple == WASM_TRIPLE and (missing := wasm_link_problem()):
        raise CuvilError(f"target '{target.name}' needs {missing}", hint=f"install it: apt-get install {toolchain.package}")
    return cc


def wasm_link_problem() -> str | None:
    """What a wasm32 link lacks beside clang (the linker, the C library), naming its Debian package; or None."""
    import glob
    import shutil
    for part, package in WASM_LINK_PARTS:
        if not (glob.glob(part) if part.startswith("/") else shutil.which(part)):
            return f"{part} (Debian package {package}), which is not installed"
    return None


# A wasm32 module's memory: 4 GiB of 32-bit addresses, less its stack and the C library's data.
WASM32_MEMORY_BYTES = (4 << 30) - (16 << 20)


def data_layout(triple: str) -> str:
    """LLVM's data layout of a triple (the pointer width and alignments the kernels are laid out by)."""
    import llvmlite.binding as llvm
    init_llvm()
    return str(llvm.Target.from_triple(triple).create_target_machine().target_data)


def check_memory(target, weights_bytes: int, working_bytes: int) -> None:
    """A wasm32 module holds its weights and every session's working memory in 4 GiB of linear memory
    (memory64, 64-bit pointers, is not a target yet): a model that cannot fit one session is refused."""
    if getattr(target, "triple", None) != WASM_TRIPLE or weights_bytes + working_bytes <= WASM32_MEMORY_BYTES:
        return
    raise CuvilError(f"{weights_bytes / 2**20:.0f} MiB of weights and {working_bytes / 2**20:.0f} MiB of working "
                     f"memory do not fit in the 4 GiB memory of a wasm32 module",
                     hint="build a smaller model or smaller input shapes for wasm32, or int4/int8 weights on a "
                          "native target")


def check_link(target, link: str, sanitize: bool) -> None:
    """A wasm32 build makes the module (`link: shared`) without sanitizers (ASan and UBSan have no
    WebAssembly runtime here): anything else is refused before anything is compiled."""
    if getattr(target, "triple", None) != WASM_TRIPLE:
        return
    if link != "shared":
        raise CuvilError(f"link: {link} is not supported for the wasm32 target", hint="link: shared builds <name>.wasm")
    if sanitize:
        raise CuvilError("sanitize: true is not supported for the wasm32 target",
                         hint="check the driver with sanitize on a native target")


def check_threads(target, threads: int) -> None:
    """wasm32 libraries run one thread: the module has no thread pool (WebAssembly threads need a
    shared memory and a host that starts the workers). More is refused, not clamped, so that a
    cuvil.yaml never says one thing and builds another."""
    if getattr(target, "triple", None) == WASM_TRIPLE and threads > 1:
        raise CuvilError(f"threads: {threads} for target '{target.name}': a WebAssembly module runs one "
                         f"thread (it has no thread pool)",
                         hint="set threads: 1 for this model, or build wasm32 in a model entry of its own")


def cross_toolchain(target) -> CrossToolchain | None:
    return CROSS_TOOLCHAINS.get(getattr(target, "triple", None))


# The instruction-set features (LLVM's names) whose absence a library checks before it makes a
# session (backends/native/driver.py): code for a target may use every one its CPU implies or its
# explicit `+feature`s name, and a CPU without one would die of SIGILL in the first kernel.
CHECKED_FEATURES = ("fma", "f16c", "avx2", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512vnni",
                    "avx512bf16", "avx512fp16", "amx-tile", "amx-bf16", "amx-int8")
_V3 = ("fma", "f16c", "avx2")
_AVX512 = _V3 + ("avx512f", "avx512dq", "avx512bw", "avx512vl")
_SPR = _AVX512 + ("avx512vnni", "avx512bf16", "avx512fp16", "amx-tile", "amx-bf16", "amx-int8")
# What a CPU name implies, of CHECKED_FEATURES (named targets and the reduced-precision ones).
CPU_FEATURES = {
    "x86-64": (),
    **{cpu: _V3 for cpu in ("haswell", "broadwell", "skylake", "x86-64-v3", "znver1", "znver2", "znver3",
                            "alderlake")},
    "skylake-avx512": _AVX512, "x86-64-v4": _AVX512,
    **{cpu: _AVX512 + ("avx512vnni",) for cpu in ("cascadelake", "icelake-server", "icelake-client", "tigerlake",
                                                   "rocketlake")},
    **{cpu: _AVX512 + ("avx512vnni", "avx512bf16") for cpu in ("cooperlake", "znver4", "znver5")},
    **{cpu: _SPR for cpu in ("sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d")},
}


def has_feature(target: CpuTarget, feature: str) -> bool:
    """Whether code for `target` may use `feature` (LLVM's name: "avx512bf16", "f16c", "amx-bf16"...):
    its explicit `+feature` / `-feature` (`native` lists the host's) first, else what its CPU implies."""
    explicit = {f[1:]: f[0] == "+" for f in target.features.split(",") if f[:1] in "+-" and f[1:]}
    if feature in explicit:
        return explicit[feature]
    if target.arch == "aarch64":
        return feature in AARCH64_EQUIVALENTS
    return feature in CPU_FEATURES.get(target.cpu, ())


# x86 features whose instructions every AArch64 core has under another name: F16C's vector
# half <-> single conversion (vcvtph2ps / vcvtps2ph, round to nearest even) is Advanced SIMD's
# FCVTL / FCVTN, part of ARMv8-A. The kernels ask for "f16c" and emit portable `fpext`/`fptrunc`
# on half vectors, which LLVM lowers to either.
AARCH64_EQUIVALENTS = ("f16c",)


def missing_feature_reason(target, precision: str) -> str:
    """Why products marked `precision` ("fp16") compute in float32 on `target` (cuvil explain)."""
    name = getattr(target, "name", "?")
    if precision == "fp16":
        if getattr(target, "arch", "") == "wasm32":
            return (f"the target {name} has no half-precision conversion (WebAssembly SIMD128 has none: each "
                    f"lane would be a software call)")
        return f"the target {name} (cpu {getattr(target, 'cpu', '?')}) has no F16C half-precision conversion"
    return f"the target {name} has no kernel for it"


# AArch64: what a library checks in the kernel's HWCAP bits (getauxval(AT_HWCAP), driver.py
# HWCAP_BITS). Advanced SIMD ("neon") is in every ARMv8-A Linux machine but checked all the same.
CHECKED_FEATURES_AARCH64 = ("neon", "fullfp16", "dotprod")


def required_features(target: CpuTarget) -> list[str]:
    """The features code for `target` may use that a CPU running its library must have:
    CHECKED_FEATURES (CPUID) for x86-64, CHECKED_FEATURES_AARCH64 (HWCAP) for AArch64."""
    if is_cuda(target) or target.arch == "wasm32":   # a wasm engine checks SIMD128 when it compiles the module
        return []
    checked = CHECKED_FEATURES_AARCH64 if target.arch == "aarch64" else CHECKED_FEATURES
    return [f for f in checked if has_feature(target, f)]


def _native() -> CpuTarget:
    import llvmlite.binding as llvm
    init_llvm()
    cpu = llvm.get_host_cpu_name()
    features = llvm.get_host_cpu_features().flatten()
    bits = 512 if "+avx512f" in features.split(",") else 256 if "+avx2" in features.split(",") else 128
    return CpuTarget("native", _TRIPLE, cpu, features, bits, ("-march=native",), _host_l1d_ways())


def _host_l1d_ways(default: int = DEFAULT_L1D_WAYS) -> int:
    """The ways of this machine's L1 data cache (Linux sysfs), or `default` when it does not say."""
    from pathlib import Path
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "1" and (index / "type").read_text().strip() == "Data":
                ways = int((index / "ways_of_associativity").read_text())
                return ways if ways > 0 else default
        except (OSError, ValueError):
            continue
    return default


_llvm_ready = False


def init_llvm():
    global _llvm_ready
    if not _llvm_ready:
        import llvmlite.binding as llvm
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        # every backend this llvmlite has (AArch64 for the cross targets)
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        _llvm_ready = True


@dataclass(frozen=True)
class CudaTarget:
    """An NVIDIA GPU architecture: kernels are PTX for `cc` (backends/numba_cuda/), assembled by
    ptxas into machine code for that architecture, with the PTX kept beside it so that the
    driver can JIT it on a newer GPU. The host side (the C driver) is built for x86-64."""
    name: str
    cc: tuple[int, int]            # compute capability
    ptx_isa: str = "9.0"           # the PTX ISA of CUDA 13.0's NVVM, which a 580 driver loads
    gcc_flags: tuple[str, ...] = ("-march=x86-64",)
    kind: str = "cuda"

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    def as_key(self) -> dict:
        return {"kind": "cuda", "name": self.name, "cc": list(self.cc), "ptx_isa": self.ptx_isa,
                "gcc_flags": list(self.gcc_flags)}

    @classmethod
    def from_key(cls, key: dict) -> CudaTarget:
        return cls(key["name"], tuple(key["cc"]), key["ptx_isa"], tuple(key["gcc_flags"]))


CUDA_TARGETS = {
    "cuda-sm80": CudaTarget("cuda-sm80", (8, 0)),    # A100
    "cuda-sm86": CudaTarget("cuda-sm86", (8, 6)),    # A10, RTX 30xx
    "cuda-sm89": CudaTarget("cuda-sm89", (8, 9)),    # L4, L40, RTX 40xx
    "cuda-sm90": CudaTarget("cuda-sm90", (9, 0)),    # H100, H200
}
CUDA_ALIASES = {"cuda-a10": "cuda-sm86", "cuda-a100": "cuda-sm80", "cuda-l4": "cuda-sm89", "cuda-h100": "cuda-sm90",
                "cuda-h200": "cuda-sm90"}


def is_cuda(target) -> bool:
    return isinstance(target, CudaTarget)


def target_from_key(key: dict):
    """The target a step key describes (CPU or CUDA)."""
    return CudaTarget.from_key(key) if key.get("kind") == "cuda" else CpuTarget.from_key(key)


def known_targets() -> list[str]:
    return ["native", *TARGETS, *CUDA_TARGETS, *CUDA_ALIASES]


def resolve_target(name: str):
    """The CpuTarget or CudaTarget for a target name from cuvil.yaml or the API."""
    if name == "native":
        return _native()
    if name in TARGETS:
        return TARGETS[name]
    if name in CUDA_ALIASES:
        name = CUDA_ALIASES[name]
    if name in CUDA_TARGETS:
        return CUDA_TARGETS[name]
    raise CuvilError(f"unknown target '{name}'", hint=f"use one of: {', '.join(known_targets())}")
