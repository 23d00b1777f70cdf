"""CIR <-> bytes, for the step cache. JSON for the structure, one binary blob
for constant data; no pickle, so a cache entry can never run code."""
from __future__ import annotations

import hashlib
import json
import struct
import weakref

import ml_dtypes
import numpy as np

from .ir import Graph, Node, Value

_MAGIC = b"CUVILIR1"


def _encode_attr(value, arrays):
    if isinstance(value, np.ndarray):
        arrays.append(value)
        return {"__ndarray__": len(arrays) - 1}
    if isinstance(value, (list, tuple)):
        return [_encode_attr(v, arrays) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    return value


def _decode_attr(value, arrays):
    if isinstance(value, dict) and "__ndarray__" in value:
        return arrays[value["__ndarray__"]]
    if isinstance(value, list):
        return [_decode_attr(v, arrays) for v in value]
    return value


# sha256 of constant arrays whose bytes can never change: read-only views of an immutable `bytes`
# object (what the ONNX import makes of every initializer). The graphs that successive passes return
# share these arrays, so each is hashed once, not once per pass (a ResNet-18's 45 MB, 16 times).
# Keyed by id(), each entry dropped when its array is collected, so an id is never reused stale.
_FROZEN_DIGESTS: dict[int, tuple[weakref.ref, str]] = {}


def _frozen(arr: np.ndarray) -> bool:
    base = arr
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    return isinstance(base, bytes)


def _digest(arr: np.ndarray) -> str:
    """sha256 of a C-contiguous array's bytes (remembered for arrays that cannot change)."""
    known = _FROZEN_DIGESTS.get(id(arr))
    if known is not None and known[0]() is arr:
        return known[1]
    digest = hashlib.sha256(memoryview(arr).cast("B")).hexdigest()
    if _frozen(arr):
        key = id(arr)
        _FROZEN_DIGESTS[key] = (weakref.ref(arr, lambda _, key=key: _FROZEN_DIGESTS.pop(key, None)), digest)
    return digest


def _dtype_text(dtype) -> str:
    """numpy's type string, or the name of an ml_dtypes type (bfloat16, float8...), whose
    type string ("<V2") would come back as raw bytes, not that type."""
    dtype = np.dtype(dtype)
    return dtype.name if dtype.kind == "V" and hasattr(ml_dtypes, dtype.name) else dtype.str


def _dtype_from(text: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, text)) if hasattr(ml_dtypes, text) and not text[:1] in "<>|=" \
        else np.dtype(text)


def _text(x) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


def dumps(graph: Graph, store=None) -> bytes:
    """Serialise a graph. With a `store` (a Cache), constant arrays go into it as
    content-addressed entries of their own, so the graphs that successive passes
    produce share their weights instead of copying them."""
    arrays: list[np.ndarray] = []
    values = []
    for v in graph.values.values():
        entry = {"name": v.name, "dtype": _dtype_text(v.dtype), "shape": list(v.shape)}
        if v.shape_from is not None:
            entry["shape_from"] = v.shape_from
        if v.is_const:
            arrays.append(np.asarray(v.data))
            entry["data"] = len(arrays) - 1
        values.append(entry)
    nodes = [{"op": n.op, "name": n.name, "inputs": n.inputs, "outputs": n.outputs, "domain": n.domain,
              "attrs": {k: _encode_attr(a, arrays) for k, a in sorted(n.attrs.items())}} for n in graph.nodes]
    blobs, index, offset = [], [], 0
    for arr in arrays:
        arr = np.ascontiguousarray(arr).reshape(np.shape(arr))   # (ascontiguousarray makes a 0-d array 1-d)
        entry = {"dtype": _dtype_text(arr.dtype), "shape": list(arr.shape), "size": arr.nbytes}
        if arr.dtype == object:   # a string tensor: its elements as JSON text (bytes would be pointers)
            entry["strings"] = [_text(x) for x in arr.reshape(-1)]
        elif store is not None and arr.nbytes > 1024:
            entry["blob"] = "blob-" + _digest(arr)
            if not store.contains(entry["blob"]):
                store.put(entry["blob"], arr.tobytes())
        else:
            raw = arr.tobytes()
            entry["offset"] = offset
            blobs.append(raw)
            offset += len(raw)
        index.append(entry)
    header = json.dumps({"name": graph.name, "opset": graph.opset, "inputs": graph.inputs, "outputs": graph.outputs,
                         "values": values, "nodes": nodes, "arrays": index,
                         **({"structure": graph.structure} if graph.structure else {})}, sort_keys=True).encode()
    return _MAGIC + struct.pack("<Q", len(header)) + header + b"".join(blobs)


def loads(data: bytes, store=None) -> Graph:
    if data[:8] != _MAGIC:
        raise ValueError("not a serialised CIR graph")
    (size,) = struct.unpack("<Q", data[8:16])
    header = json.loads(data[16:16 + size])
    base = 16 + size
    arrays = []
    for entry in header["arrays"]:
        if "strings" in entry:
            arrays.append(np.array(entry["strings"] + [None], dtype=object)[:-1].reshape(entry["shape"]))
            continue
        if "blob" in entry:
            raw = store.get(entry["blob"]) if store is not None else None
            if raw is None or len(raw) != entry["size"]:
                raise ValueError(f"constant data {entry['blob']} is missing from the cache")
        else:
            raw = data[base + entry["offset"]: base + entry["offset"] + entry["size"]]
        arrays.append(np.frombuffer(raw, dtype=_dtype_from(entry["dtype"])).reshape(entry["shape"]).copy())
    values = {}
    for v in header["values"]:
        values[v["name"]] = Value(v["name"], _dtype_from(v["dtype"]), tuple(v["shape"]),
                                  arrays[v["data"]] if "data" in v else None, v.get("shape_from"))
    nodes = [Node(n["op"], n["name"], n["inputs"], n["outputs"],
                  {k: _decode_attr(a, arrays) for k, a in n["attrs"].items()}, n["domain"]) for n in header["nodes"]]
    return Graph(header["name"], values, nodes, header["inputs"], header["outputs"], header["opset"],
                 header.get("structure", {}))
