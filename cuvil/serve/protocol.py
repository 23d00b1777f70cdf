"""The KServe v2 (Open Inference Protocol) tensors: parse an infer request, write its response.

A request body is JSON, optionally followed by raw tensor bytes (the binary
data extension): the header `Inference-Header-Content-Length` then gives the
length of the JSON part, and each input that travels as bytes says how many in
`parameters.binary_data_size`, in the order of `inputs`. An output is returned
as bytes when it asks for `parameters.binary_data` or the request sets
`parameters.binary_data_output` (tritonclient's default when it names no
outputs).

Everything is checked against the model's signature before any array is made,
so a huge declared shape costs nothing, and each problem raises `RequestError`
naming the model and the input.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from ..errors import CuvilError

# numpy dtype name -> v2 datatype; the reverse for checks
DATATYPES = {"bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
             "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
             "float16": "FP16", "float32": "FP32", "float64": "FP64"}
# numpy kinds that JSON numbers of an input of this kind may come as
_JSON_KINDS = {"b": "b", "u": "u", "i": "iu", "f": "fiu"}


class RequestError(CuvilError):
    """A request the server refuses: `status` is the HTTP status, `headers` extra response headers."""

    def __init__(self, message, status=400, headers=None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def datatype(self) -> str:
        return DATATYPES[self.dtype.name]

    def as_dict(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Signature:
    """A model's inputs and outputs as the library declares them; equal signatures are interchangeable."""
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]

    @classmethod
    def of(cls, info: dict) -> "Signature":
        def tensors(specs):
            seen, result = set(), []
            for spec in specs:
                if spec["name"] in seen:  # an output listed twice: the runtime returns it once
                    continue
                seen.add(spec["name"])
                dtype = np.dtype(object if spec["dtype"] == "string" else spec["dtype"])
                if dtype.name not in DATATYPES:   # (a string tensor: dtype object)
                    raise CuvilError(f"tensor '{spec['name']}' has dtype {dtype}, which the v2 protocol "
                                     f"server does not carry (it carries {', '.join(DATATYPES)})")
                result.append(Tensor(spec["name"], dtype, tuple(spec["shape"])))
            return tuple(result)
        return cls(tensors(info["inputs"]), tensors(info["outputs"]))

    def describe(self) -> str:
        def side(tensors):
            return ", ".join(f"{t.name}:{t.datatype}{list(t.shape)}" for t in tensors)
        return f"inputs ({side(self.inputs)}) -> outputs ({side(self.outputs)})"


@dataclass
class InferRequest:
    id: str | None
    feeds: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]]  # (name, as binary) in the order to return them
    # request parameter `cuvil_timing: true`: the response's parameters carry the server's clock
    # (time.monotonic, CLOCK_MONOTONIC: one clock for every process of the machine) at each stage
    timing: bool = False


def _json_object(data: bytes, model: str) -> dict:
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(f"model '{model}': the request body is not valid JSON ({error})") from None
    except RecursionError:
        raise RequestError(f"model '{model}': the request body nests JSON too deeply") from None
    if not isinstance(body, dict):
        raise RequestError(f"model '{model}': the request body must be a JSON object")
    return body


def _parameters(item: dict, where: str) -> dict:
    params = item.get("parameters", {})
    if not isinstance(params, dict):
        raise RequestError(f"{where}: 'parameters' must be a JSON object")
    return params


def parse_infer_request(body: bytes, header_length: str | None, signature: Signature, model: str) -> InferRequest:
    if header_length is not None:
        try:
            json_size = int(header_length)
        except ValueError:
            json_size = -1
        if not 0 <= json_size <= len(body):
            raise RequestError(f"model '{model}': Inference-Header-Content-Length {header_length!r} is not "
                               f"a length within the body ({len(body)} bytes)")
    else:
        json_size = len(body)
    request = _json_object(body[:json_size], model)
    binary = memoryview(body)[json_size:]
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError(f"model '{model}': 'id' must be a string")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not all(isinstance(i, dict) for i in inputs):
        raise RequestError(f"model '{model}': 'inputs' must be a list of tensor objects")
    expected = {t.name: t for t in signature.inputs}
    feeds, offset = {}, 0
    for item in inputs:
        name = item.get("name")
        if name not in expected:
            raise RequestError(f"model '{model}': unknown input {name!r} (inputs: {', '.join(expected)})")
        if name in feeds:
            raise RequestError(f"model '{model}': input '{name}' is given twice")
        feeds[name], offset = _tensor(item, expected[name], binary, offset, model)
    missing = [n for n in expected if n not in feeds]
    if missing:
        raise RequestError(f"model '{model}': missing input(s) {', '.join(missing)}")
    if offset != len(binary):
        raise RequestError(f"model '{model}': {len(binary) - offset} bytes of binary data after the last "
                           f"input's binary_data_size")
    timing = _parameters(request, f"model '{model}'").get("cuvil_timing", False)
    if not isinstance(timing, bool):
        raise RequestError(f"model '{model}': parameter cuvil_timing must be true or false")
    return InferRequest(request_id, feeds, _requested_outputs(request, signature, model), timing)


def _tensor(item: dict, spec: Tensor, binary: memoryview, offset: int, model: str):
    where = f"model '{model}', input '{spec.name}'"
    if item.get("datatype") != spec.datatype:
        raise RequestError(f"{where}: datatype {item.get('datatype')!r}, the model takes {spec.datatype}")
    shape = item.get("shape")
    if (not isinstance(shape, list) or not all(type(d) is int for d in shape)
            or tuple(shape) != spec.shape):
        raise RequestError(f"{where}: shape {shape!r}, the model takes {list(spec.shape)}")
    count = math.prod(spec.shape)
    params = _parameters(item, where)
    if "binary_data_size" in params:
        size = params["binary_data_size"]
        nbytes = count * spec.dtype.itemsize
        if type(size) is not int or size != nbytes:
            raise RequestError(f"{where}: binary_data_size {size!r}, a {spec.datatype}{list(spec.shape)} "
                               f"tensor is {nbytes} bytes")
        if offset + size > len(binary):
            raise RequestError(f"{where}: the body holds {len(binary) - offset} bytes of binary data for it, "
                               f"binary_data_size says {size}")
        array = np.frombuffer(binary[offset:offset + size], dtype=spec.dtype).reshape(spec.shape)
        return array, offset + size
    if "data" not in item:
        raise RequestError(f"{where}: no 'data' and no binary_data_size parameter")
    data = item["data"]
    if not isinstance(data, list):
        raise RequestError(f"{where}: 'data' must be a list of numbers in row-major order")
    try:
        array = np.array(data)
    except (ValueError, TypeError):  # ragged nesting
        raise RequestError(f"{where}: 'data' is not a regular (row-major) list of numbers") from None
    if array.size and array.dtype.kind not in _JSON_KINDS[spec.dtype.kind]:
        raise RequestError(f"{where}: 'data' holds {array.dtype.kind!r}-kind values "
                           f"({'strings' if array.dtype.kind == 'U' else array.dtype}), not {spec.datatype} numbers")
    if array.size != count:
        raise RequestError(f"{where}: 'data' has {array.size} values, shape {list(spec.shape)} needs {count}")
    with np.errstate(over="ignore", invalid="ignore"):
        converted = array.astype(spec.dtype).reshape(spec.shape)
    if spec.dtype.kind in "iu" and not np.array_equal(converted, array.reshape(spec.shape)):
        raise RequestError(f"{where}: 'data' holds values outside the range of {spec.datatype}")
    return converted, offset


def _requested_outputs(request: dict, signature: Signature, model: str) -> list[tuple[str, bool]]:
    params = _parameters(request, f"model '{model}'")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise RequestError(f"model '{model}': parameter binary_data_output must be true or false")
    known = [t.name for t in signature.outputs]
    asked = request.get("outputs")
    if asked is None:
        return [(name, binary_default) for name in known]
    if not isinstance(asked, list) or not all(isinstance(o, dict) for o in asked):
        raise RequestError(f"model '{model}': 'outputs' must be a list of objects with a 'name'")
    result = []
    for item in asked:
        name = item.get("name")
        if name not in known:
            raise RequestError(f"model '{model}': unknown output {name!r} (outputs: {', '.join(known)})")
        params = _parameters(item, f"model '{model}', output '{name}'")
        if "classification" in params:
            raise RequestError(f"model '{model}', output '{name}': the classification extension is not supported")
        binary = params.get("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise RequestError(f"model '{model}', output '{name}': binary_data must be true or false")
        result.append((name, binary))
    return result


def encode_infer_response(model: str, version: str, request: InferRequest, results: dict,
                          timing: dict | None = None) -> tuple[bytes, dict]:
    """The response body and its headers: JSON alone, or JSON then each binary output's bytes.
    `timing` (the request asked for it): the response's parameters, `cuvil_<stage>` seconds."""
    outputs, blobs = [], []
    for name, binary in request.outputs:
        array = np.ascontiguousarray(results[name])
        entry = {"name": name, "datatype": DATATYPES[array.dtype.name], "shape": list(array.shape)}
        if binary:
            blob = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = array.ravel().tolist()
        outputs.append(entry)
    response = {"model_name": model, "model_version": version, "outputs": outputs}
    if request.id is not None:
        response["id"] = request.id
    if request.timing and timing:
        response["parameters"] = {f"cuvil_{stage}": seconds for stage, seconds in timing.items()}
    header = json.dumps(response).encode()
    if not blobs:
        return header, {"Content-Type": "application/json"}
    return b"".join([header, *blobs]), {"Content-Type": "application/octet-stream",
                                          "Inference-Header-Content-Length": str(len(header))}
