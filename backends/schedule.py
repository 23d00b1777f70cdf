"""The schedule: what a kernel generator hands the driver, the memory planner and the link.

Both backends read these types and neither owns them: `numba_cpu` makes
Kernels and KernelCalls (one generator per op family), `native` plans the
arena over them and writes the C driver that calls them.

A Kernel is Python source specialised to static shapes that defines
`kernel(p0, p1, ..., begin, end)`: raw pointers (inputs first, then outputs)
and the work range `[begin, end)` of its outer loop, so the driver can split
it across threads. Its identity is what its compiled object depends on (its
source, pointer types and whether it has an in-place form): two nodes with
the same op, shapes and attributes produce the same Kernel and share one
compiled object.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class Kernel:
    family: str                 # short op-family name, used in the symbol
    source: str                 # defines `def kernel(p0, ..., begin, end):`
    arg_types: tuple[str, ...]  # numpy dtype name of each pointer argument
    # Reads input element i only in the iteration that writes output element i, so its output
    # may take over an input's buffer (the memory planner decides; the object then carries a
    # version for equal pointers: numba_cpu/emit.py `in_place_versions`).
    in_place: bool = False
    # Sizes its own work items by its arithmetic (a GEMM's or conv's few balanced items): the
    # driver always hands it to the pool, however few bytes it touches, one item at a time.
    self_sized: bool = False
    # A GPU kernel (backends/numba_cuda/): the threads of one block it is launched with; 0 for a
    # CPU kernel. Its source then defines `kernel(p0, ..., n)` over n = the call's work threads.
    block: int = 0
    # "c": `source` is the body of a C function `void kernel(void* p0, ..., int64_t begin, int64_t
    # end)` that the driver defines itself (string kernels: numba_cpu/strings.py), not Numba source
    # compiled to an object. Only a C kernel carries the field, so other kernels' keys are unchanged.
    language: str = "numba"

    @cached_property
    def key(self) -> str:
        parts = [self.family, self.source, list(self.arg_types), self.in_place] + ([self.block] if self.block else [])
        if self.language != "numba":
            parts.append(self.language)
        blob = json.dumps(parts, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def symbol(self) -> str:
        family = re.sub(r"[^A-Za-z0-9]", "_", self.family).lower()
        return f"cuvilk_{family}_{self.key[:16]}"

    def as_spec(self) -> dict:
        """What compiling the kernel needs, as JSON (the codegen step's kernels.json)."""
        spec = {"symbol": self.symbol, "family": self.family, "source": self.source,
                "arg_types": list(self.arg_types), "in_place": self.in_place}
        if self.language != "numba":
            spec["language"] = self.language
        return {**spec, "block": self.block} if self.block else spec

    @classmethod
    def from_spec(cls, spec: dict) -> Kernel:
        return cls(spec["family"], spec["source"], tuple(spec["arg_types"]), in_place=spec["in_place"],
                   block=spec.get("block", 0), language=spec.get("language", "numba"))


@dataclass
class InPlace:
    """The form a call takes when its output takes over the buffer of input `value` (the memory
    planner decides, when `value` has no later reader): `kernel` then finds that input's values
    in its output (a GEMM or conv accumulates onto its residual instead of reading it apart)."""
    value: str
    kernel: Kernel
    args: list
    work: int


@dataclass
class Strided:
    """The form a call takes when its output is written in place into a Concat at batch > 1: the
    same arguments, but `kernel` writes the output's batch blocks (dimension 0) `row_bytes` apart,
    the distance between batch blocks of the Concat's output, instead of one after the other. A
    generator gives its call this form only where the output's one reader is such a Concat
    (numba_cpu/concat.py strided_inputs); the memory planner decides whether to take it."""
    kernel: Kernel
    work: int
    row_bytes: int


@dataclass
class ConcatPart:
    """One input of a Concat as `rows` runs of its output (the Concat's outer extent: 1 for a
    channel Concat at batch 1, or any axis with nothing but 1s before it; else each run lies one
    output row further), the first starting `offset` bytes in. The memory planner may let the
    input's producer write there directly (backends/native/memory.py: at rows > 1 only a producer
    whose call has a Strided form); `copy` is the call that copies this input alone into its runs,
    which the planner keeps for the inputs it could not place."""
    value: str
    offset: int
    copy: KernelCall
    rows: int = 1


@dataclass
class KernelCall:
    """One call of a kernel in the schedule: which values (or build-time packed
    constants) its pointers bind to, and the size of its work range."""
    kernel: Kernel
    args: list  # value names (str) or np.ndarray constants packed at build time
    work: int
    node: str = ""  # the CIR node(s) it implements, for messages and `explain`
    n_outputs: int = 1  # the trailing n_outputs args are written, the rest only read
    in_place: InPlace | None = None  # see InPlace
    # Runs once, when the first session of the loaded library is created, not on every run: its
    # inputs are constants and its outputs persist, shared by every session, for the other calls
    # to read (weights transformed for a kernel, which the library then need not store
    # transformed: see numba_cpu/winograd.py).
    once: bool = False
    # The reduced precision the call computes in and how ("bf16 (dpbf16)": see numba_cpu/gemm.py
    # lowp_product); "" for float32.
    precision: str = ""
    # A Concat the memory planner may write in place (its inputs' runs of the output: see
    # ConcatPart); None for every other call.
    parts: list[ConcatPart] | None = None
    strided: Strided | None = None  # see Strided


@dataclass
class View:
    """The output is the input's bytes under another shape (Reshape, Flatten...)."""
    src: str
    dst: str
    node: str = ""


@dataclass
class LoopMark:
    """The start or the end of a loop compiled as a C loop (numba_cpu/control.py): the calls between
    a "begin" and its "end" mark are the body, run while the trip count and condition allow. Like a
    kernel call, `args` lists the values it reads, then the `n_outputs` it writes:
      begin: [trip?, cond?, init...] -> [iteration, cond_in, state...]
      end:   [cond_out?, body_out..., iteration, cond_in, state...] -> [final...]
    (reading the loop's state at its end keeps it alive, in the memory plan, the whole loop long)."""
    kind: str                   # "begin" | "end"
    loop: int                   # which loop (the C names of its variables)
    args: list
    n_outputs: int
    n_carried: int
    has_trip: bool = False      # begin: a trip count is read
    has_cond: bool = False      # a condition is read (begin: the initial one; end: the body's)
    node: str = ""
    in_place: None = None       # (read like a KernelCall's by the weight packer)


@dataclass
class Lowered:
    """What a generator returns for one node."""
    calls: list = field(default_factory=list)  # KernelCall | View


def kernel_calls(schedule) -> list[KernelCall]:
    return [c for c in schedule if isinstance(c, KernelCall)]
