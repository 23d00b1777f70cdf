"""GPU kernel source -> PTX (Numba CUDA, NVVM) -> machine code (ptxas) -> one fatbin per kernel.

The fatbin holds the kernel's SASS for the target's architecture and its PTX, so that the
driver can JIT it on a newer GPU (cuModuleLoadData picks). Numba's mangled entry name is
replaced by the kernel's symbol, and nothing in the PTX depends on the process: the same
kernel gives the same bytes in every build (tests/test_cuda_ptx.py checks).

The PTX ISA is that of the NVVM the `cuda` extra pins (CUDA 13.0: ISA 9.0), which the
system's ptxas (CUDA 13.0) and a 580-series driver accept.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from backends.schedule import Kernel
from cuvil.errors import BuildError

from .kernel import kernel_function


def _signature(arg_types):
    import numba
    from numba import types
    return tuple(types.CPointer(numba.from_dtype(np.dtype(t))) for t in arg_types) + (types.int64,)


_MANGLED = re.compile(r"\b_ZN[0-9A-Za-z_$]+")
_SHARED = re.compile(r"\b_cudapy_smem_\d+\b")
_ENTRY = re.compile(r"^\.(?:visible|weak) \.entry (\S+)\(", re.M)


def kernel_ptx(kernel: Kernel, cc: tuple[int, int]) -> str:
    """The kernel's PTX for compute capability `cc`, its entry named `kernel.symbol`."""
    from numba import cuda
    fn = kernel_function(kernel.source, cuda)
    try:
        ptx, _ = cuda.compile_ptx(fn, _signature(kernel.arg_types), cc=tuple(cc), fastmath=True,
                                  lineinfo=False, opt=True)
    except Exception as error:  # a Numba typing or lowering error in generated source
        raise BuildError(f"compiling GPU kernel {kernel.symbol} ({kernel.family}) to PTX failed: "
                         f"{str(error).splitlines()[0]}", hint="this is a bug in cuvil's GPU kernel generator") from error
    entries = _ENTRY.findall(ptx)
    if len(entries) != 1:
        raise BuildError(f"GPU kernel {kernel.symbol}: expected one PTX entry, found {len(entries)}")
    ptx = ptx.replace(entries[0], kernel.symbol)
    # Numba's other mangled names (its environment global, device functions) carry a
    # per-process version counter ("B3v13"): named after the symbol, in order of appearance.
    names: dict[str, str] = {}
    def rename(match):
        return names.setdefault(match.group(0), f"{kernel.symbol}__g{len(names)}")
    ptx = _MANGLED.sub(rename, ptx)
    # So do its shared arrays ("_cudapy_smem_<n>", n counting every array the process compiled): a
    # compile worker serves many kernels, so without this the bytes depend on what it compiled before.
    arrays: dict[str, str] = {}
    def rename_shared(match):
        return arrays.setdefault(match.group(0), f"_cudapy_smem_{len(arrays)}")
    return _SHARED.sub(rename_shared, ptx)


def _tool(name: str) -> str:
    found = shutil.which(name) or (f"/usr/local/cuda/bin/{name}" if os.path.exists(f"/usr/local/cuda/bin/{name}") else None)
    if not found:
        raise BuildError(f"'{name}' not found: building for a CUDA target needs the CUDA toolkit's {name}",
                         hint="install the CUDA toolkit (13.0) and put its bin/ on PATH, or set CUDA_HOME")
    return found


def ptxas(ptx: str, arch: str) -> bytes:
    """PTX -> cubin for `arch` (sm_90...) with the system's ptxas."""
    with tempfile.TemporaryDirectory(prefix="cuvil-ptxas-") as tmp:
        src, out = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        result = subprocess.run([_tool("ptxas"), f"-arch={arch}", "-O3", str(src), "-o", str(out)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"ptxas rejected a GPU kernel for {arch}:\n{result.stderr.strip()[-2000:]}",
                             hint="this is a bug in cuvil's GPU kernel generator")
        return out.read_bytes()


def fatbin(ptx: str, cubin: bytes, arch: str) -> bytes:
    """A fatbin holding the cubin for `arch` and the PTX (JIT-compiled by newer GPUs)."""
    sm = arch.split("_")[1]
    with tempfile.TemporaryDirectory(prefix="cuvil-fatbin-") as tmp:
        tmp = Path(tmp)
        (tmp / "k.ptx").write_text(ptx)
        (tmp / "k.cubin").write_bytes(cubin)
        result = subprocess.run([_tool("fatbinary"), "-64", "--create=k.fatbin", f"--image3=kind=elf,sm={sm},file=k.cubin",
                                 f"--image3=kind=ptx,sm={sm},file=k.ptx"], capture_output=True, text=True, cwd=tmp)
        if result.returncode != 0:
            raise BuildError(f"fatbinary failed for {arch}:\n{result.stderr.strip()[-2000:]}")
        return (tmp / "k.fatbin").read_bytes()


def build_kernel_fatbin(kernel: Kernel, target) -> bytes:
    """A GPU kernel as the fatbin the library embeds (the CUDA counterpart of an object file)."""
    ptx = kernel_ptx(kernel, target.cc)
    return fatbin(ptx, ptxas(ptx, target.arch), target.arch)


@lru_cache(maxsize=None)
def tool_versions() -> dict:
    """What a kernel's fatbin depends on besides its source: Numba CUDA, the NVVM it runs, ptxas
    and fatbinary (each tool's version line). In every GPU kernel step's key."""
    from importlib import metadata
    out = {}
    for dist in ("numba-cuda", "nvidia-nvvm"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    for tool in ("ptxas", "fatbinary"):
        try:
            text = subprocess.run([_tool(tool), "--version"], capture_output=True, text=True).stdout
            out[tool] = text.strip().splitlines()[-1] if text.strip() else None
        except (BuildError, OSError):
            out[tool] = None
    return out


FATBIN_MAGIC = 0xBA55ED50
_IMAGE_KINDS = {1: "ptx", 2: "elf"}


def fatbin_images(blob: bytes, offset: int = 0) -> list[tuple[str, int]]:
    """The images of the fatbin at `offset` in `blob`, as (kind, sm): ("elf", 90) is sm_90 machine
    code, ("ptx", 90) PTX for compute_90. (The layout: a 16-byte header - magic, version, header
    size, payload size - then per image a header whose first fields are kind, version, header
    size and payload size, and whose 29th byte starts the architecture.)"""
    import struct
    magic, _, header, size = struct.unpack_from("<IHHQ", blob, offset)
    if magic != FATBIN_MAGIC:
        raise ValueError("not a fatbin")
    images, at = [], offset + header
    while at < offset + header + size:
        kind, _, image_header, padded = struct.unpack_from("<HHIQ", blob, at)
        (sm,) = struct.unpack_from("<I", blob, at + 28)
        images.append((_IMAGE_KINDS.get(kind, str(kind)), sm))
        at += image_header + padded
    return images
