"""The weights blob: every constant a kernel reads, in one read-only block of the library."""
from __future__ import annotations

import hashlib

import numpy as np

from backends.schedule import KernelCall

ALIGN = 64


def pack_weights(graph, schedule) -> tuple[bytes, dict[str, int]]:
    """Every constant a kernel reads (and every build-time packed array) in one blob, each
    64-byte aligned, identical arrays once; the packed arrays in the schedule's calls are
    replaced by the names they get here (`__packed_<n>`). Returns the blob and each name's offset."""
    blob = bytearray()
    offsets: dict[str, int] = {}
    by_digest: dict[str, str] = {}

    def place(name, arr):
        arr = np.ascontiguousarray(arr)
        digest = hashlib.sha256(arr.dtype.str.encode() + arr.tobytes()).hexdigest()
        if digest in by_digest:
            offsets[name] = offsets[by_digest[digest]]
            return
        by_digest[digest] = name
        blob.extend(b"\0" * (-len(blob) % ALIGN))
        offsets[name] = len(blob)
        blob.extend(arr.tobytes())

    packed = 0
    for call in schedule:
        if not isinstance(call, KernelCall):
            continue
        for args in [call.args] + ([call.in_place.args] if call.in_place else []):
            for i, arg in enumerate(args):
                if isinstance(arg, np.ndarray):
                    name = f"__packed_{packed}"
                    packed += 1
                    place(name, arg)
                    args[i] = name
                elif arg not in offsets and graph.values[arg].is_const:
                    place(arg, graph.values[arg].data)
    for name in graph.outputs:
        if name not in offsets and graph.values[name].is_const:
            place(name, graph.values[name].data)
    return bytes(blob), offsets
