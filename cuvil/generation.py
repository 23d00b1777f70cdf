"""What a generation library (a decoder with a static KV cache) is made of: the roles of the
model's inputs and outputs, and the static shapes of each compiled entry.

A decoder as onnxruntime-genai's model builder writes it takes `input_ids [batch, S]`,
`attention_mask [batch, total]` and one `past_key_values.N.key / .value [batch, kv_heads, past,
head]` pair per layer, and returns `logits [batch, S, vocab]` and `present.N.key / .value`. Cuvil
compiles it once per entry, every shape static (the agreed form, which the GroupQueryAttention
lowering implements):

    entry        input_ids   attention_mask   past / present (the same buffer)   logits
    prefill S    [1, S]      [1, C]           [1, kv_heads, C, head]             [1, S, vocab]
    decode       [1, 1]      [1, C]           [1, kv_heads, C, head]             [1, 1, vocab]

with C = max_context. The mask holds ones for the first past + S positions: GroupQueryAttention
reads past = sum(mask) - S from it, writes the S new rows of K and V at past .. past + S - 1 and
attends causally, in place when past and present are one buffer, as the library binds them. The
names come from genai_config.json beside the model when there is one, else the builder's defaults.

A torch export of a transformers decoder (torch.onnx.export, dynamo or TorchScript, of a wrapper
taking input_ids, attention_mask, position_ids and past_key_values.N.key / .value, returning logits
and present.N.key / .value) grows its cache by Concat(past, new) and attends with MatMul / Softmax
(kv_form "concat"). Each entry is imported with past [1, kv_heads, C - S, head] (so present and the
mask have C rows) and passes/write_kv_in_place.py turns the Concat into an in-place write at row
sum(mask) - S of a [1, kv_heads, C, head] cache, masked causally by real position: the same
buffers, the same C ABI. position_ids is required then (the static shapes cannot give positions).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CuvilError

DEFAULT_NAMES = {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                 "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value",
                 "logits": "logits", "present_key_names": "present.%d.key",
                 "present_value_names": "present.%d.value"}
SETTINGS = ("max_context", "prefill_buckets", "tokenizer", "pad_token")


@dataclass(frozen=True)
class Layout:
    """The roles of a decoder's tensors and the entries a generation library compiles."""
    input_ids: str
    attention_mask: str
    position_ids: str | None
    logits: str
    pairs: tuple[tuple[str, str], ...]        # (past input, present output), layer by layer
    max_context: int
    buckets: tuple[int, ...]                  # prompt lengths of the prefill entries, ascending
    pad_token: int
    eos_tokens: tuple[int, ...]
    shapes: dict                              # name -> shape with "S", "C", "P" (C - S) for the entry's dims
    kv_form: str = "static"                   # "static": the graph writes its C-row cache itself (GroupQuery-
                                              # Attention...); "concat": torch's Concat growth
    keys: tuple[str, ...] = ()                # the present outputs holding keys (kv_form "concat")

    @property
    def last_row(self) -> str:
        """The input naming the logits row a prefill entry computes (last_row_logits)."""
        return LAST_ROW

    @property
    def entries(self) -> tuple[int, ...]:
        """The tokens each entry takes, ascending; the decode entry (1) first."""
        return tuple(sorted({1, *self.buckets}))

    def input_shapes(self, tokens: int) -> dict[str, list[int]]:
        """The static input shapes of the entry that takes `tokens` tokens."""
        sizes = {"S": tokens, "C": self.max_context, "P": self.max_context - tokens}
        return {name: [sizes.get(d, d) for d in shape] for name, shape in sorted(self.shapes.items())}

    def as_key(self) -> dict:
        form = {"kv_form": self.kv_form, "keys": list(self.keys)} if self.kv_form != "static" else {}
        return {**form, "input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "position_ids": self.position_ids, "logits": self.logits, "pairs": [list(p) for p in self.pairs],
                "max_context": self.max_context, "buckets": list(self.buckets), "pad_token": self.pad_token,
                "eos_tokens": list(self.eos_tokens), "shapes": {k: list(v) for k, v in sorted(self.shapes.items())}}


def check_settings(generate: dict, where: str = "generate") -> dict:
    """The generate settings ({max_context, prefill_buckets, tokenizer, pad_token}) checked, with
    defaults filled in; the API's `generate=` and cuvil.yaml's block (config.GenerateConfig) agree."""
    if not isinstance(generate, dict):
        raise CuvilError(f"{where}: expected a dict of {', '.join(SETTINGS)}, got {type(generate).__name__}")
    unknown = sorted(set(generate) - set(SETTINGS))
    if unknown:
        raise CuvilError(f"{where}: unknown key(s) {unknown}", hint=f"known: {', '.join(SETTINGS)}")
    context = generate.get("max_context", 512)
    if type(context) is not int or context < 2:
        raise CuvilError(f"{where}.max_context: expected an integer >= 2, got {context!r}")
    buckets = generate.get("prefill_buckets", [16, 64])
    if not isinstance(buckets, (list, tuple)) or any(type(b) is not int or b < 1 for b in buckets):
        raise CuvilError(f"{where}.prefill_buckets: expected a list of positive integers, got {buckets!r}")
    too_long = [b for b in buckets if b > context]
    if too_long:
        raise CuvilError(f"{where}.prefill_buckets: {too_long} longer than max_context {context}",
                         hint="a prefill entry writes its tokens into the cache: each bucket must be <= max_context")
    tokenizer = generate.get("tokenizer")
    if tokenizer is not None:
        path = Path(tokenizer)
        if not path.is_file():
            raise CuvilError(f"{where}.tokenizer: file not found: {path}",
                             hint="a tokenizer.json of the Hugging Face `tokenizers` package (the model "
                                  "builder writes one beside the model)")
        tokenizer = str(path)
    pad = generate.get("pad_token")
    if pad is not None and (type(pad) is not int or pad < 0):
        raise CuvilError(f"{where}.pad_token: expected a token id >= 0, got {pad!r}")
    return {"max_context": context, "prefill_buckets": sorted(set(buckets)), "tokenizer": tokenizer,
            "pad_token": pad}


def genai_config(source) -> dict:
    """genai_config.json beside a model file, or {}."""
    if not isinstance(source, (str, Path)):
        return {}
    path = Path(source).with_name("genai_config.json")
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CuvilError(f"{path}: cannot be read as JSON ({exc})") from None


def layout(model, settings: dict, config: dict, name: str) -> Layout:
    """The layout of an onnx.ModelProto (loaded without its external data) built as a generation
    library with `settings` (check_settings'), names from genai_config.json's `config`."""
    decoder = config.get("model", {}).get("decoder", {})
    names = {**DEFAULT_NAMES, **decoder.get("inputs", {}), **decoder.get("outputs", {})}
    inputs = {i.name: i for i in model.graph.input}
    outputs = {o.name: o for o in model.graph.output}
    init = {t.name for t in model.graph.initializer}
    inputs = {k: v for k, v in inputs.items() if k not in init}
    where = f"model '{name}'"

    def need(table, key, kind):
        if names[key] not in table:
            raise CuvilError(f"{where}: no {kind} named {names[key]!r} ({key}) for generation "
                             f"(the model's {kind}s: {sorted(table)})",
                             hint="a generation library compiles decoders with onnxruntime-genai's inputs and outputs; "
                                  "genai_config.json beside the model names them")
        return names[key]

    ids, mask, logits = need(inputs, "input_ids", "input"), need(inputs, "attention_mask", "input"), \
        need(outputs, "logits", "output")
    pairs, keys = [], []
    for layer in range(len(inputs)):
        for past_key, present_key in (("past_key_names", "present_key_names"),
                                      ("past_value_names", "present_value_names")):
            past, present = names[past_key] % layer, names[present_key] % layer
            if past in inputs:
                if present not in outputs:
                    raise CuvilError(f"{where}: the cache input {past!r} has no output {present!r}",
                                     hint="each past_key_values input needs its present output (genai_config.json "
                                          "names them)")
                pairs.append((past, present))
                if past_key == "past_key_names":
                    keys.append(present)
    if not pairs:
        raise CuvilError(f"{where}: no KV cache inputs named like {names['past_key_names']!r}",
                         hint="a generation library needs a decoder with past/present key-value tensors")
    position_ids = names["position_ids"] if names["position_ids"] in inputs else None
    known = {ids, mask, position_ids} | {p for p, _ in pairs}
    extra = sorted(set(inputs) - known)
    extra_out = sorted(set(outputs) - {logits} - {q for _, q in pairs})
    if extra or extra_out:
        raise CuvilError(f"{where}: inputs {extra} / outputs {extra_out} have no role in generation",
                         hint="Cuvil generates with input_ids, attention_mask, position_ids, the KV cache and logits only")
    form = kv_form(model, pairs, where)
    if form == "concat":
        if position_ids is None:
            raise CuvilError(f"{where}: a decoder whose cache grows by Concat (a torch export) needs a "
                             f"{names['position_ids']!r} input", hint="export the model with position_ids as an input "
                                                                      "(docs/generation.md): its static shapes cannot give positions")
        full = [b for b in settings["prefill_buckets"] if b >= settings["max_context"]]
        if full:
            raise CuvilError(f"{where}: prefill_buckets {full} leave no past rows in a context of "
                             f"{settings['max_context']} (a torch export's entries are imported with past = "
                             f"max_context - bucket rows)", hint="use buckets smaller than max_context")
    heads, head_size = decoder.get("num_key_value_heads"), decoder.get("head_size")
    shapes = {ids: [1, "S"], mask: [1, "C"]}
    if position_ids:
        shapes[position_ids] = [1, "S"]
    for past, _ in pairs:
        dims = [d.dim_value if d.HasField("dim_value") else None for d in inputs[past].type.tensor_type.shape.dim]
        if len(dims) != 4:
            raise CuvilError(f"{where}: the cache input {past!r} has rank {len(dims)}, not 4 "
                             f"[batch, kv_heads, sequence, head_size]")
        kv = dims[1] or heads
        hs = dims[3] or head_size
        if not kv or not hs:
            raise CuvilError(f"{where}: the cache input {past!r} does not fix its kv_heads / head_size dims",
                             hint="put genai_config.json (num_key_value_heads, head_size) beside the model")
        shapes[past] = [1, kv, "P" if form == "concat" else "C", hs]
    elem = {ids: 7, mask: (6, 7)}
    for value, types in elem.items():
        found = inputs[value].type.tensor_type.elem_type
        if found not in (types if isinstance(types, tuple) else (types,)):
            raise CuvilError(f"{where}: input {value!r} has ONNX element type {found}; generation takes int64 token ids "
                             f"and an int32 or int64 attention mask")
    if outputs[logits].type.tensor_type.elem_type != 1:
        raise CuvilError(f"{where}: the logits output {logits!r} is not float32",
                         hint="build the model in fp32 or int4 (onnxruntime-genai's builder: -p fp32 | int4)")
    eos = config.get("model", {}).get("eos_token_id", [])
    eos = tuple(eos if isinstance(eos, list) else [eos])
    pad = settings.get("pad_token")
    if pad is None:
        pad = config.get("model", {}).get("pad_token_id", 0)
    return Layout(ids, mask, position_ids, logits, tuple(pairs), settings["max_context"],
                  tuple(settings["prefill_buckets"]), int(pad), tuple(int(e) for e in eos), shapes, form,
                  tuple(keys) if form == "concat" else ())


SUPPORTED_FORMS = ("a cache of max_context rows the graph updates itself, present the same shape as past "
                   "(onnxruntime-genai's GroupQueryAttention), or a torch export's present = Concat(past, new) on "
                   "the sequence axis (torch.onnx.export, dynamo or TorchScript: docs/generation.md)")


def kv_form(model, pairs, where: str) -> str:
    """How an ONNX decoder updates its cache: "concat" (present = Concat(past, new), through the
    Identity or one-input Concat copies the TorchScript exporter writes) or "static" (anything
    else: the graph takes and returns the whole cache, as GroupQueryAttention does; prepare_entry
    checks that present's shape is past's). A decoder mixing the two is refused."""
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    forms = {}
    for past, present in pairs:
        name, forms[past] = past, "static"
        for _ in range(len(model.graph.node) + 1):
            users = readers.get(name, [])
            if any(n.op_type == "GroupQueryAttention" for n in users):
                break
            grow = [n for n in users if n.op_type == "Concat" and len(n.input) == 2 and n.input[0] == name]
            if grow:
                if grow[0].output[0] != present:
                    raise CuvilError(f"{where}: the cache input {past!r} grows in Concat node '{grow[0].name}', whose "
                                     f"output {grow[0].output[0]!r} is not the output {present!r}",
                                     hint=f"supported: {SUPPORTED_FORMS}")
                forms[past] = "concat"
                break
            copies = [n for n in users if n.op_type == "Identity" or (n.op_type == "Concat" and len(n.input) == 1)]
            if not copies:
                break
            name = copies[0].output[0]
    if len(set(forms.values())) > 1:
        raise CuvilError(f"{where}: some cache inputs grow by Concat and some do not "
                         f"({sorted(forms.items())[:4]}...)", hint=f"supported: {SUPPORTED_FORMS}")
    return next(iter(forms.values()))


def prepare_entry(graph, layout: Layout, where: str):
    """An entry's imported graph in the agreed static form: a torch export's Concat-grown cache
    written in place (passes/write_kv_in_place.py); another decoder as it is, once each present
    is checked to have its past's shape (the cache the library binds to both)."""
    if layout.kv_form != "concat":
        for past, present in layout.pairs:
            have, want = graph.values[present].shape, graph.values[past].shape
            if tuple(have) != tuple(want):
                node = graph.producers().get(present)
                by = f" (written by {node.op} node '{node.name}')" if node is not None else ""
                raise CuvilError(f"{where}: the cache output {present!r}{by} has shape {list(have)} for the cache "
                                 f"input {past!r} of shape {list(want)}: not a KV cache form Cuvil generates with",
                                 hint=f"supported: {SUPPORTED_FORMS}")
        return graph
    from passes.write_kv_in_place import write_kv_in_place
    return write_kv_in_place(graph, layout.pairs, layout.keys, layout.attention_mask, where)


def decode_shapes(source, generate: dict, name: str) -> dict[str, list[int]]:
    """The static input shapes of a model file's decode entry (`cuvil check` imports it so)."""
    import onnx
    settings = check_settings(generate, f"model '{name}': generate")
    try:
        model = onnx.load(str(source), load_external_data=False)
    except Exception as exc:
        raise CuvilError(f"{source}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    return layout(model, settings, genai_config(source), name).input_shapes(1)


def external_data_sha256(model, source) -> dict[str, str]:
    """sha256 of each external data file a model file's tensors name (model.onnx.data): the
    import reads them, so the key of every step after it must change with them."""
    if not isinstance(source, (str, Path)):
        return {}
    files = sorted({e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"})
    digests = {}
    for file in files:
        path = Path(source).parent / file
        if not path.is_file():
            raise CuvilError(f"{source}: its external data file {file!r} is missing", hint=f"expected at {path}")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        digests[file] = digest.hexdigest()
    return digests


LAST_ROW = "cuvil_last_row"


def last_row_logits(graph, layout):
    """A prefill entry's graph computing the logits of one row, the one the input `cuvil_last_row`
    [1] (int64) names at run time (the prompt's last real token; the rows after it are padding),
    instead of every row: the product with the vocabulary matrix (the largest of a small model:
    40 % of a 128-token prefill of hidden 512 and vocab 32000) reads one row. A Gather of that row
    goes before the product; the graph is returned unchanged when the logits are not a MatMul /
    MatMulNBits of a [1, S, hidden] input."""
    from .ir import Node, Value
    producer = graph.producers().get(layout.logits)
    if producer is None or producer.op not in ("MatMul", "MatMulNBits", "FusedMatMul"):
        return graph
    hidden = graph.values[producer.inputs[0]]
    logits = graph.values[layout.logits]
    if len(hidden.shape) != 3 or hidden.shape[0] != 1 or len(logits.shape) != 3 or logits.shape[1] == 1:
        return graph
    g = graph.copy()
    g.values[LAST_ROW] = Value(LAST_ROW, np.dtype(np.int64), (1,))
    g.inputs.append(LAST_ROW)
    row = g.unique_name(f"{producer.inputs[0]}/last_row")
    g.values[row] = Value(row, hidden.dtype, (1, 1, hidden.shape[2]))
    names = {n.name for n in g.nodes}
    gather = Node("Gather", next(f"{producer.name}/last_row{i or ''}" for i in range(len(names) + 1)
                                 if f"{producer.name}/last_row{i or ''}" not in names),
                  [producer.inputs[0], LAST_ROW], [row], {"axis": 1})
    index = next(i for i, n in enumerate(g.nodes) if n.name == producer.name)
    g.nodes[index].inputs[0] = row
    g.nodes.insert(index, gather)
    g.values[layout.logits].shape = (1, 1, logits.shape[2])
    return g
