"""CIR <-> bytes, for the step cache. JSON for the structure, one binary blob
for constant data; no pickle, so a cache entry can never run code."""
from __future__ import annotations

import hashlib
import json
import struct

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


def dumps(graph: Graph, store=None) -> bytes:
    """Serialise a graph. With a `store` (a Cache), constant arrays go into it as
    content-addressed entries of their own, so the graphs that successive passes
    produce share their weights instead of copying them."""
    arrays: list[np.ndarray] = []
    values = []
    for v in graph.values.values():
        entry = {"name": v.name, "dtype": np.dtype(v.dtype).str, "shape": list(v.shape)}
        if v.is_const:
            arrays.append(np.asarray(v.data))
            entry["data"] = len(arrays) - 1
        values.append(entry)
    nodes = [{"op": n.op, "name": n.name, "inputs": n.inputs, "outputs": n.outputs, "domain": n.domain,
              "attrs": {k: _encode_attr(a, arrays) for k, a in sorted(n.attrs.items())}} for n in graph.nodes]
    blobs, index, offset = [], [], 0
    for arr in arrays:
        arr = np.ascontiguousarray(arr)
        raw = arr.tobytes()
        entry = {"dtype": arr.dtype.str, "shape": list(arr.shape), "size": len(raw)}
        if store is not None and len(raw) > 1024:
            entry["blob"] = "blob-" + hashlib.sha256(raw).hexdigest()
            if not store.contains(entry["blob"]):
                store.put(entry["blob"], raw)
        else:
            entry["offset"] = offset
            blobs.append(raw)
            offset += len(raw)
        index.append(entry)
    header = json.dumps({"name": graph.name, "opset": graph.opset, "inputs": graph.inputs, "outputs": graph.outputs,
                         "values": values, "nodes": nodes, "arrays": index}, sort_keys=True).encode()
    return _MAGIC + struct.pack("<Q", len(header)) + header + b"".join(blobs)


def loads(data: bytes, store=None) -> Graph:
    if data[:8] != _MAGIC:
        raise ValueError("not a serialised CIR graph")
    (size,) = struct.unpack("<Q", data[8:16])
    header = json.loads(data[16:16 + size])
    base = 16 + size
    arrays = []
    for entry in header["arrays"]:
        if "blob" in entry:
            raw = store.get(entry["blob"]) if store is not None else None
            if raw is None or len(raw) != entry["size"]:
                raise ValueError(f"constant data {entry['blob']} is missing from the cache")
        else:
            raw = data[base + entry["offset"]: base + entry["offset"] + entry["size"]]
        arrays.append(np.frombuffer(raw, dtype=np.dtype(entry["dtype"])).reshape(entry["shape"]).copy())
    values = {}
    for v in header["values"]:
        values[v["name"]] = Value(v["name"], np.dtype(v["dtype"]), tuple(v["shape"]),
                                  arrays[v["data"]] if "data" in v else None)
    nodes = [Node(n["op"], n["name"], n["inputs"], n["outputs"],
                  {k: _decode_attr(a, arrays) for k, a in n["attrs"].items()}, n["domain"]) for n in header["nodes"]]
    return Graph(header["name"], values, nodes, header["inputs"], header["outputs"], header["opset"])
