"""The weights blob: every constant a kernel reads, in one read-only block of the library."""
from __future__ import annotations

import hashlib

import numpy as np

from backends.schedule import KernelCall, LoopMark

ALIGN = 64


class Blob:
    """The bytes of a weights blob being packed: identical arrays are stored once, so the several
    graphs of a generation library (prefill buckets, decode) share the weights they all read."""

    def __init__(self):
        self.data = bytearray()
        self._by_digest: dict[str, int] = {}

    def place(self, arr) -> int:
        """The offset of `arr`'s bytes in the blob (64-byte aligned), adding them if new."""
        arr = np.ascontiguousarray(arr)
        raw = arr.reshape(-1).view(np.uint8)  # the bytes, not copied (tobytes copies: 45 MB for ResNet-18)
        digest = hashlib.sha256(arr.dtype.str.encode())
        digest.update(raw)
        digest = digest.hexdigest()
        if digest not in self._by_digest:
            self.data.extend(b"\0" * (-len(self.data) % ALIGN))
            self._by_digest[digest] = len(self.data)
            self.data.extend(raw)
        return self._by_digest[digest]


def pack_weights(graph, schedule, blob: Blob | None = None) -> tuple[bytes, dict[str, int]]:
    """Every constant a kernel reads (and every build-time packed array) in one blob, each
    64-byte aligned, identical arrays once; the packed arrays in the schedule's calls are
    replaced by the names they get here (`__packed_<n>`). Returns the blob and each name's offset.
    With `blob`, the arrays go into that shared blob (offsets are then this graph's own) and what
    is returned is the blob's bytearray itself, not a copy: the caller takes the bytes once every
    graph is in (a copy per entry held three copies of a 1.1B model's 0.9 GB of weights at once)."""
    shared = blob is not None
    blob = blob if shared else Blob()
    offsets: dict[str, int] = {}
    packed = 0
    for call in schedule:
        if not isinstance(call, (KernelCall, LoopMark)):
            continue
        for args in [call.args] + ([call.in_place.args] if call.in_place else []):
            for i, arg in enumerate(args):
                if isinstance(arg, np.ndarray):
                    name = f"__packed_{packed}"
                    packed += 1
                    offsets[name] = blob.place(arg)
                    args[i] = name
                elif arg not in offsets and graph.values[arg].is_const and graph.values[arg].data.dtype != object:
                    offsets[arg] = blob.place(graph.values[arg].data)
    for name in graph.outputs:
        # (a string constant output is written by a kernel of its own: numba_cpu/strings.py)
        if name not in offsets and graph.values[name].is_const and graph.values[name].data.dtype != object:
            offsets[name] = blob.place(graph.values[name].data)
    return (blob.data if shared else bytes(blob.data)), offsets
