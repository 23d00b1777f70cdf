"""cuvil.yaml -> BuildSpec.

`load_config(path)` reads a build file and returns a `BuildSpec` in which every
model has the `defaults:` section merged in (a model's own keys win over
`defaults:`, which win over the built-in defaults) and every path is absolute,
resolved against the folder of cuvil.yaml, so no later step depends on the
working directory.

Every mistake raises `ConfigError` carrying file, line and column of the
offending key or value: the YAML is composed into a node tree (which keeps
marks) before it is validated, and each pydantic error location is walked back
down that tree. Loading is safe-only: tags that would build Python objects are
refused, and so are duplicate keys, which PyYAML would otherwise silently
resolve to the last one.

The same models give the file's JSON Schema (`json_schema()`, `cuvil schema`,
docs/cuvil.schema.json) for editors: each key's description is the text of
cuvil.yaml.example's comment, and each value check has its schema beside it
(`WithJsonSchema`), so the schema rejects what the loader rejects (a test
checks a list of mistakes against both).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError, WithJsonSchema,
                      model_validator)

from .errors import ConfigError, CuvilError

# backends/targets.py resolves each (known_targets() there lists the same names; a test checks).
TARGETS = ("native", "generic", "x86_64-avx2", "x86_64-avx512", "x86_64-znver4", "x86_64-sapphirerapids",
           "aarch64-linux", "aarch64-neon-fp16-dotprod", "x86_64-windows", "wasm32", "cuda-sm80", "cuda-sm86", "cuda-sm89", "cuda-sm90", "cuda-a10", "cuda-a100", "cuda-l4", "cuda-h100",
           "cuda-h200")
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
PRIORITIES = ("critical", "high", "normal", "low")  # `serve: priority:`, most important first
DIFF_MODES = ("syntactic", "semantic")
EXECUTORS = ("local", "dask")  # `executor: kind:`: this machine, or a Dask cluster (cluster.py)
LINK_MODES = ("shared", "static", "both")  # `link:`: lib<name>.so, lib<name>.a, or both
SELECT_MODES = ("rules", "measure")  # `select:`: kernels by shape rules, or timed here (cuvil/select.py)
GROUP_SIZES = (32, 64, 128)  # `quantization: group_size:` (precision int4)
# TensorFlow: Keras files and frozen GraphDefs; a SavedModel is a folder (a source with no suffix).
SOURCE_SUFFIXES = (".onnx", ".pt", ".pth", ".keras", ".h5", ".hdf5", ".pb")
DEFAULT_SYMBOL_PREFIX = "cuvil_"

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXAMPLE_HINT = "see cuvil.yaml.example for every section and key"


# --- value checks: their messages are what the user reads, so they name what is known

def _one_of(known, what):
    def check(value):
        if value not in known:
            raise ValueError(f"unknown {what} {value!r} (known: {', '.join(known)})")
        return value
    return AfterValidator(check), WithJsonSchema({"type": "string", "enum": list(known)})


def _identifier(value):
    if not _IDENTIFIER.fullmatch(value):
        raise ValueError(f"{value!r} is not an identifier (letters, digits, _; not starting with a digit)")
    return value


def _dimension(value):
    # `type(...) is int` because bool is an int and YAML reads `yes` as True.
    if type(value) is not int or value <= 0:
        raise ValueError(f"shape dimensions must be positive integers, got {value!r}")
    return value


def _source_suffix(value):
    if Path(value).suffix and Path(value).suffix.lower() not in SOURCE_SUFFIXES:
        raise ValueError(f"model source {value!r} must end in one of {', '.join(SOURCE_SUFFIXES)}, "
                         f"or be a TensorFlow SavedModel folder")
    return value


def _pass_options(value):
    # The passes own their options (a pydantic model each); the check lists what exists.
    from passes import check_pass_options
    return check_pass_options(value)


def _pass_names(value):
    # Checked here, not only when the pass list is made, so the error names the line (as the schema does).
    if value:
        from passes import PASSES
        for name in value:
            if name not in PASSES:
                raise ValueError(f"unknown pass {name!r} (known passes: {', '.join(sorted(PASSES))})")
    return value


def _version(value):
    if value != 1:
        raise ValueError(f"unsupported version {value} (this cuvil reads version 1)")
    return value


Target = Annotated[str, *_one_of(TARGETS, "target")]
Precision = Annotated[str, *_one_of(PRECISIONS, "precision")]
Identifier = Annotated[str, AfterValidator(_identifier),
                       WithJsonSchema({"type": "string", "pattern": "^" + _IDENTIFIER.pattern + "$"})]
Dimension = Annotated[Any, AfterValidator(_dimension), WithJsonSchema({"type": "integer", "minimum": 1})]
# Paths are the one place a str must be converted, so they opt out of strict mode.
LaxPath = Annotated[Path, Strict(False), WithJsonSchema({"type": "string"})]
Source = Annotated[str, AfterValidator(_source_suffix), WithJsonSchema(
    {"type": "string", "pattern": r"(\.([oO][nN][nN][xX]|[pP][tT][hH]?|[kK][eE][rR][aA][sS]|[hH](5|[dD][fF]5)|[pP][bB])"
                                  r"|(^|/)[^./]+/?)$"})]
Version = Annotated[int, AfterValidator(_version), WithJsonSchema({"type": "integer", "const": 1})]


# --- the file as written

class _Strict(BaseModel):
    # strict: `threads: "4"` or `opt_level: 2.5` is a mistake to report, not to coerce.
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheConfig(_Strict):
    """The step cache: compiled kernels are stored by content hash, so an unchanged kernel is never
    compiled twice, across models and across builds."""

    dir: LaxPath = Field(Path(".cuvil-cache"), description="Local folder of the cache (relative to this file). "
                         "Safe to delete at any time.")
    url: str | None = Field(None, description="Optional fsspec URL of a cache shared between machines, "
                            "e.g. s3://bucket/cuvil.")
    read_only: bool = Field(False, description="true: read from the cache but never write to it "
                            "(e.g. on untrusted CI jobs).")


class ExecutorConfig(_Strict):
    """Where `cuvil build` runs the steps: on this machine, or as tasks of a Dask cluster whose workers share
    the step cache (`cuvil build --scheduler ADDRESS` does the same for one build)."""

    kind: Annotated[str, *_one_of(EXECUTORS, "executor kind")] = Field(
        "local", description="local: this machine (-j threads compile kernels); dask: a Dask distributed "
        "cluster (pip install 'cuvil[dask]'), each step one task.")
    address: str | None = Field(None, description="The Dask scheduler's address, e.g. tcp://10.0.0.5:8786 "
                                "(kind: dask). Its workers need the cache: `cache: url:` (e.g. s3://) or a "
                                "`cache: dir:` every worker mounts.")

    # The schema says what the check below says: kind dask needs an address.
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"kind": {"const": "dask"}}, "required": ["kind"]}, "then": {"required": ["address"]}})

    @model_validator(mode="after")
    def _dask_needs_an_address(self):
        if self.kind == "dask" and not self.address:
            raise ValueError("kind dask needs the scheduler's address: add `address: tcp://HOST:8786` "
                             "(or pass --scheduler to cuvil build)")
        return self


class WatchConfig(_Strict):
    """`cuvil watch` rebuilds when a file below these paths changes."""

    paths: list[LaxPath] = Field([], description="Folders or glob patterns to watch (relative to this file).")
    debounce_ms: int = Field(300, ge=0, description="Wait this long after the last change before rebuilding, "
                             "in milliseconds.")


class ServeConfig(_Strict):
    """How `cuvil serve` schedules one model's requests (cuvil/serve/scheduler.py)."""

    priority: Annotated[str, *_one_of(PRIORITIES, "priority")] = Field(
        "normal", description="Orders requests under overload: critical, high, normal, low.")
    deadline_ms: int = Field(1000, ge=1, description="When an answer is due: milliseconds after the request "
                             "arrives.")
    max_concurrency: int = Field(1, ge=1, description="How many sessions of the library run at once.")


class IncrementalConfig(_Strict):
    """Hot updates in `cuvil serve`: rebuild a changed model and swap it into the running server."""

    enabled: bool = Field(False, description="Rebuild a changed model in a worker process and swap it into "
                          "the running server.")
    diff_mode: Annotated[str, *_one_of(DIFF_MODES, "diff_mode")] = Field(
        "semantic", description="semantic: only a change of the imported graph rebuilds (not of names or node "
        "order); syntactic: any change of the file's bytes does.")
    cache_ttl: int = Field(3600, ge=0, description="Seconds a remembered diff hash stays valid.")
    watch_paths: list[LaxPath] = Field([], description="Files, folders or globs to watch besides the models' "
                                       "sources (relative to this file).")


class AccuracyConfig(_Strict):
    """How a reduced-precision build measures itself against the float32 build of the same model
    (cuvil/accuracy.py): on `samples` inputs, random or read from an .npz file."""

    samples: int = Field(8, ge=1, le=1024, description="How many inputs the two builds are compared on.")
    inputs: str = Field("random", description='"random" (seeded: normal floats, integers 0 or 1), or an .npz '
                        "file with an array per input name whose first axis is the sample (relative to this file).")
    min_cosine: float | None = Field(None, ge=-1.0, le=1.0, description="Fail the build when an output's cosine "
                                     "similarity to float32 is below this (null: never).")


def _group_size(value):
    if type(value) is not int or value not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {value!r}")
    return value


class QuantizationConfig(_Strict):
    """precision int4: weight-only, group-wise quantisation of the constant MatMul/Gemm weights
    (passes/quantize_weights.py); activations stay float32."""

    group_size: Annotated[int, AfterValidator(_group_size),
                          WithJsonSchema({"type": "integer", "enum": list(GROUP_SIZES)})] = Field(
        32, description="Consecutive weights along K that share a scale (and a zero point): 32, 64 or 128.")
    symmetric: bool = Field(True, description="true: a scale per group and the zero point 8; false: a zero "
                            "point per group too (the range of each group's own minimum and maximum).")


class CalibrationConfig(_Strict):
    """precision int8: how the float model is calibrated before it is written as QDQ (cuvil/calibrate.py):
    uint8 asymmetric activations, int8 symmetric weights, int32 biases."""

    inputs: str = Field("random", description='"random" (seeded normal floats, other than the accuracy '
                        "report's), or an .npz file with an array per input name whose first axis is the sample "
                        "(relative to this file).")
    samples: int = Field(8, ge=1, le=4096, description="How many inputs the float model runs on to find each "
                         "activation's range.")
    method: Literal["minmax", "percentile"] = Field("minmax", description="minmax: each activation's smallest "
                                                    "and largest value; percentile: clipped at `percentile`.")
    percentile: float = Field(99.99, gt=50.0, le=100.0, description="method percentile: the share (in %) of "
                              "values inside the range, at each end.")
    per_channel: bool = Field(True, description="One weight scale per output channel (true) or per tensor.")


class GenerateConfig(_Strict):
    """Build the model as a generation library (a decoder with a static KV cache; cuvil/generation.py):
    one library with a compiled prefill entry per bucket and a one-token decode entry, sharing the
    weights, and the C ABI session_prefill / session_decode / session_reset / sample. Tensor names
    come from genai_config.json beside the model (onnxruntime-genai's builder writes it)."""

    max_context: int = Field(512, ge=2, description="Tokens the KV cache of a session holds (prompt and "
                             "generated); more is an error (ERR_CONTEXT_FULL).")
    prefill_buckets: list[Annotated[int, Field(ge=1)]] = Field(
        [16, 64], description="Prompt lengths with a compiled prefill entry: a prompt goes to the smallest "
        "bucket that holds it (padded), a longer one in chunks of the largest; each at most max_context.")
    tokenizer: LaxPath | None = Field(None, description="A tokenizer.json (Hugging Face tokenizers) installed "
                                      "beside the library, for text in / out (lib.generate_text); relative to "
                                      "this file.")
    pad_token: int | None = Field(None, ge=0, description="Token id that pads a prompt to its bucket; null: "
                                  "genai_config.json's pad_token_id, else 0.")

    @model_validator(mode="after")
    def _buckets_fit(self):
        longer = [b for b in self.prefill_buckets if b > self.max_context]
        if longer:
            raise ValueError(f"prefill_buckets {longer} are longer than max_context {self.max_context}")
        return self


class _Settings(_Strict):
    """What `defaults:` may set for every model; the field defaults are the built-in ones."""

    model_config = ConfigDict(title="defaults")

    targets: list[Target] = Field(
        default_factory=lambda: ["native"], min_length=1,
        description="What to build for; one library per target: native (this machine's CPU), generic (any "
        "x86-64), x86_64-avx2, x86_64-avx512, x86_64-znver4 (AMD Zen 4), x86_64-sapphirerapids (Intel), a "
        "CUDA GPU (cuda-sm80, cuda-sm90, cuda-h100...), or, cross-compiled, aarch64-linux (any 64-bit Arm "
        "Linux), aarch64-neon-fp16-dotprod (ARMv8.2 cores with fp16 and dot product: Jetson Orin, Graviton), "
        "x86_64-windows (a DLL for 64-bit Windows) and wasm32 (a WebAssembly module with SIMD128, one thread). "
        "A library run on a CPU without its target's instructions refuses to make a session, with an error "
        "naming them.")
    precision: Precision = Field(
        "fp32", description="Arithmetic precision: fp32, or bf16 / fp16: the weight products (Gemm, MatMul "
        "with constant weights) compute on 16-bit operands with float32 sums; int4: those weights are "
        "quantised to 4 bits by group (see quantization:), activations stay float32; int8: the model is "
        "calibrated (see calibration:) and Conv/MatMul/Gemm run on uint8 activations and int8 weights.")
    opt_level: int = Field(2, ge=0, le=3, description="0: no passes; 1-3: the default pass lists, from safest "
                           "to most aggressive.")
    passes: Annotated[list[str] | None, AfterValidator(_pass_names)] = Field(None, description="An explicit ordered pass list replaces the opt level's "
                                     "list; null keeps it.")
    disable_passes: Annotated[list[str], AfterValidator(_pass_names)] = Field([], description="Passes to leave out of the list (e.g. to bisect a numeric "
                                      "difference; `winograd` keeps 3x3 convs on the direct kernels).")
    # json_schema() lists the passes and their options (importing them here would slow every command).
    pass_options: Annotated[dict[str, dict[str, Any]], AfterValidator(_pass_options),
                            WithJsonSchema({"type": "object"})] = Field(
        {}, description="Options of single passes, e.g. {fuse_elementwise: {max_ops: 16}}; a model's own merge "
        "over `defaults:`, pass by pass. `cuvil explain MODEL` shows what each pass did.")
    threads: int = Field(1, ge=1, description="Threads each session of the library runs on (1: no thread pool "
                         "at all).")
    symbol_prefix: Identifier | None = Field(
        None, description="Prefix of the exported C symbols (<prefix>session_run, ...): give each model its own "
        "prefix to load several models into one process. null: cuvil_")
    max_arena_mb: int = Field(4096, ge=1, description="Largest working memory a session may need, in MiB; a "
                              "model whose plan is larger is refused.")
    sanitize: bool = Field(False, description="Compile the driver with AddressSanitizer and "
                           "UndefinedBehaviorSanitizer (for testing).")
    accuracy: AccuracyConfig = Field(AccuracyConfig(), description="bf16 / fp16 / int4 builds: how they measure "
                                     "themselves against the float32 build.")
    quantization: QuantizationConfig = Field(QuantizationConfig(), description="int4 builds: the group size and "
                                             "form of the weights' quantisation.")
    calibration: CalibrationConfig = Field(CalibrationConfig(), description="int8 builds: the inputs and method "
                                           "that choose the activations' scales.")
    link: Annotated[str, *_one_of(LINK_MODES, "link")] = Field(
        "shared", description="What the link makes: shared (lib<name>.so), static (lib<name>.a, the same "
        "exported symbols), or both; <name>.pc and <name>Config.cmake point at what was made.")
    select: Annotated[str, *_one_of(SELECT_MODES, "select")] = Field(
        "rules", description="How a node with several applicable kernels gets one: rules (shape rules: the same "
        "library on every machine) or measure (each candidate built as a one-node library and timed on this "
        "machine, the fastest taken unless the rules' kernel is within 5 %; cached per node shape, target, "
        "threads and CPU model; `cuvil explain` shows the times). Today it chooses among Winograd F(4x4), "
        "F(2x2) and direct for float32 3x3 stride-1 convs.")
    select_candidates: list[str] | None = Field(
        None, description="With select: measure, the kernels to time (at least two of winograd_f4, "
        "winograd_f2, direct); null: every one that applies.")


class _Model(_Settings):
    """One model to build; it may override any key of `defaults:`."""

    model_config = ConfigDict(title="model")

    name: Identifier = Field(description="Name of the library (lib<name>.so) and of its folder: an identifier.")
    source: Source = Field(description="The model: .onnx, TorchScript .pt/.pth, or TensorFlow (a SavedModel "
                           "folder, Keras .keras/.h5, frozen GraphDef .pb); TorchScript and TensorFlow are "
                           "converted to ONNX first. Relative to this file.")
    signature: str | None = Field(None, description="TensorFlow SavedModel: the signature to build (default "
                                  "serving_default, or the only one).")
    inputs: dict[str, list[Dimension] | list[list[Dimension]]] | None = Field(
        None, description="Static shape of every input whose shape in the model is not fully fixed; libraries "
        "are specialised to these shapes. A list of shapes per input (differing in dim 0 only) builds batch "
        "buckets, as `batch:` does.")
    batch: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="Batch buckets: one compiled entry per batch size (dim 0 of every input and output), "
        "one weights blob; a run of n rows takes the smallest bucket >= n, zero-padded (session_run_batch). "
        "Needs `inputs:`; each input's dim 0 is replaced by each size.")
    serve: ServeConfig | None = Field(None, description="How `cuvil serve` schedules this model's requests.")
    generate: GenerateConfig | None = Field(None, description="Build a decoder as a generation library: a static "
                                            "KV cache, prefill and decode entries, next-token sampling in C.")


class _File(_Strict):
    """cuvil.yaml: what `cuvil build` compiles, and how. Relative paths are resolved against the folder
    of this file; unknown keys are errors and values are not coerced."""

    model_config = ConfigDict(title="cuvil.yaml")
    version: Version = Field(description="Format version of this file. Required; this cuvil reads version 1.")
    output_dir: LaxPath = Field(Path("build/cuvil"), description="Where built libraries go: "
                                "<output_dir>/<model>/<target>/ holds lib<model>.so, <model>.h and manifest.json.")
    # `None` lets a section stand empty (`cache:` with every line commented out).
    cache: CacheConfig | None = Field(None, description="The step cache: compiled kernels are stored by content "
                                      "hash, so an unchanged kernel is never compiled twice.")
    defaults: _Settings | None = Field(None, description="Settings every model gets unless the model sets the "
                                       "key itself.")
    models: list[_Model] = Field(min_length=1, description="The models to build.")
    watch: WatchConfig | None = Field(None, description="`cuvil watch` rebuilds when a file below these paths "
                                      "changes.")
    executor: ExecutorConfig | None = Field(None, description="Where `cuvil build` runs the steps: this machine "
                                            "(local) or a Dask cluster (dask).")
    incremental: IncrementalConfig | None = Field(None, description="`cuvil serve` hot updates: rebuild a changed "
                                                  "model in a worker process and swap it into the running server.")


def json_schema() -> dict:
    """The JSON Schema of cuvil.yaml (`cuvil schema`), from the models above; the pass names and
    each pass's options come from the pass registry."""
    from passes import PASS_OPTIONS, PASSES

    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **_File.model_json_schema()}
    names = sorted(PASSES)
    options = {"type": "object", "additionalProperties": False, "properties": {
        name: ({k: v for k, v in PASS_OPTIONS[name].model_json_schema().items() if k != "title"}
               if name in PASS_OPTIONS else {"type": "object", "maxProperties": 0}) for name in names}}
    for section in (_Settings, _Model):
        fields = schema["$defs"][section.__name__]["properties"]
        fields["pass_options"].update(options)
        fields["disable_passes"]["items"] = {"type": "string", "enum": names}
        fields["passes"]["anyOf"][0]["items"] = {"type": "string", "enum": names}
    return schema


# --- the resolved spec the rest of cuvil reads

class ModelConfig(BaseModel):
    """One model with defaults merged in; `line` is where its entry starts in cuvil.yaml."""

    model_config = ConfigDict(extra="forbid")
    name: str
    source: Path
    inputs: dict[str, tuple[int, ...]] = {}
    targets: list[str]
    precision: str
    opt_level: int
    passes: list[str] | None
    disable_passes: list[str]
    pass_options: dict[str, dict] = {}
    threads: int
    symbol_prefix: str
    max_arena_mb: int = 4096
    sanitize: bool = False
    accuracy: AccuracyConfig = AccuracyConfig()
    quantization: QuantizationConfig = QuantizationConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    serve: ServeConfig = ServeConfig()
    link: str = "shared"
    select: str = "rules"
    select_candidates: list[str] | None = None
    signature: str | None = None
    generate: dict | None = None    # GenerateConfig's keys, the tokenizer path absolute
    batch: list[int] | None = None  # batch buckets, sorted (inputs: the largest bucket's shapes)
    line: int | None = None


class BuildSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int
    output_dir: Path
    cache: CacheConfig
    models: list[ModelConfig]
    watch: WatchConfig
    incremental: IncrementalConfig = IncrementalConfig()
    executor: ExecutorConfig = ExecutorConfig()
    path: Path
    root: Path

    def model(self, name: str) -> ModelConfig:
        for model in self.models:
            if model.name == name:
                return model
        known = ", ".join(m.name for m in self.models)
        raise ConfigError(f"no model named {name!r} (known: {known})", file=self.path,
                          hint="model names are the `name:` keys under `models:`")


# --- loading

class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        first_seen = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            first = first_seen.setdefault(key_node.value, key_node)
            if first is not key_node:
                raise _DuplicateKey(None, None, f"duplicate key {key_node.value!r} "
                                    f"(first given on line {first.start_mark.line + 1})",
                                    key_node.start_mark)
        return super().construct_mapping(node, deep)


def load_config(path: str | Path = "cuvil.yaml") -> BuildSpec:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}",
                          hint="create one from cuvil.yaml.example (cp cuvil.yaml.example cuvil.yaml)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}", file=path) from None
    return parse_config(text, path)


def parse_config(text: str, path: str | Path = "cuvil.yaml") -> BuildSpec:
    """Parse a build file's text; `path` names it in messages and its folder is the base of relative paths."""
    path = Path(path)
    node, data = _parse_yaml(text, path)
    if data is None:
        raise ConfigError("the file is empty", file=path, hint="start from cuvil.yaml.example")
    try:
        raw = _File.model_validate(data)
    except ValidationError as error:
        raise _located_error(error, node, path) from None
    return _resolve(raw, node, path)


def _parse_yaml(text, path):
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        return node, (loader.construct_document(node) if node is not None else None)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        if isinstance(error, _DuplicateKey):
            hint = "remove one of them: YAML would silently keep only the last"
        elif "tag" in (error.problem or ""):
            hint = "cuvil.yaml is plain data: remove the !tag (no Python objects are built)"
        else:
            hint = "check indentation, quoting and the `key: value` spacing near this position"
        raise ConfigError(f"invalid YAML: {error.problem}", file=path, hint=hint,
                          **(_position(mark) if mark else {})) from None
    except yaml.YAMLError as error:  # reader errors (bad characters) carry no mark
        raise ConfigError(f"invalid YAML: {error}", file=path, hint="save the file as UTF-8 text") from None
    finally:
        loader.dispose()


def _resolve(raw, root_node, path):
    root = path.resolve().parent
    defaults = (raw.defaults or _Settings()).model_dump()
    models, first_line = [], {}
    for index, entry in enumerate(raw.models):
        where = ("models", index)
        if entry.name in first_line:
            raise ConfigError(f"models[{index}].name: duplicate model name {entry.name!r} "
                              f"(first on line {first_line[entry.name]})", file=path,
                              hint="model names must be unique", **_position_of(root_node, (*where, "name")))
        line = _position_of(root_node, where).get("line")
        first_line[entry.name] = line
        source = (root / Path(entry.source).expanduser()).resolve()
        if not (source.is_file() or (source.is_dir() and (source / "saved_model.pb").is_file())):
            what = "folder is not a TensorFlow SavedModel (no saved_model.pb)" if source.is_dir() else \
                "model file not found"
            raise ConfigError(f"models[{index}].source: {what}: {source}", file=path,
                              hint=f"paths are relative to the folder of {path.name} ({root})",
                              **_position_of(root_node, (*where, "source")))
        values = {**defaults, **entry.model_dump(exclude_unset=True)}
        values["pass_options"] = {name: {**defaults["pass_options"].get(name, {}), **own}
                                  for name, own in {**defaults["pass_options"], **values["pass_options"]}.items()}
        from .batching import split_input_shapes
        try:
            inputs, batches = split_input_shapes(entry.inputs or {}, entry.batch, f"models[{index}]")
        except CuvilError as error:
            raise ConfigError(error.message, file=path, hint=error.hint,
                              **_position_of(root_node, (*where, "batch" if entry.batch else "inputs"))) from None
        values.update(source=source, line=line, batch=batches,
                      inputs={name: tuple(shape) for name, shape in inputs.items()},
                      symbol_prefix=values["symbol_prefix"] or DEFAULT_SYMBOL_PREFIX,
                      serve=entry.serve or ServeConfig())
        values["accuracy"] = {**defaults["accuracy"], **values["accuracy"]}   # a model's keys over defaults'
        values["quantization"] = {**defaults["quantization"], **values["quantization"]}
        values["calibration"] = {**defaults["calibration"], **values["calibration"]}
        if values["calibration"]["inputs"] != "random":
            inputs = (root / Path(values["calibration"]["inputs"]).expanduser()).resolve()
            if not inputs.is_file():
                raise ConfigError(f"models[{index}].calibration.inputs: file not found: {inputs}", file=path,
                                  hint=f"'random', or an .npz file relative to the folder of {path.name} ({root})",
                                  **_position_of(root_node, where))
            values["calibration"] = {**values["calibration"], "inputs": str(inputs)}
        if values["precision"] == "int4":   # the pass that quantises takes them as its options
            values["pass_options"]["quantize_weights"] = {**values["quantization"],
                                                          **values["pass_options"].get("quantize_weights", {})}
        if entry.generate is not None:
            generate = entry.generate.model_dump()
            if generate["tokenizer"] is not None:
                tokenizer = (root / Path(generate["tokenizer"]).expanduser()).resolve()
                if not tokenizer.is_file():
                    raise ConfigError(f"models[{index}].generate.tokenizer: file not found: {tokenizer}", file=path,
                                      hint=f"paths are relative to the folder of {path.name} ({root})",
                                      **_position_of(root_node, (*where, "generate", "tokenizer")))
                generate["tokenizer"] = str(tokenizer)
            values["generate"] = generate
        if values["accuracy"]["inputs"] != "random":
            inputs = (root / Path(values["accuracy"]["inputs"]).expanduser()).resolve()
            if not inputs.is_file():
                raise ConfigError(f"models[{index}].accuracy.inputs: file not found: {inputs}", file=path,
                                  hint=f"'random', or an .npz file relative to the folder of {path.name} ({root})",
                                  **_position_of(root_node, where))
            values["accuracy"] = {**values["accuracy"], "inputs": str(inputs)}
        models.append(ModelConfig(**values))

    def absolute(value):
        return (root / Path(value).expanduser()).resolve()

    cache, watch = raw.cache or CacheConfig(), raw.watch or WatchConfig()
    incremental = raw.incremental or IncrementalConfig()
    executor = raw.executor or ExecutorConfig()
    return BuildSpec(
        version=raw.version,
        output_dir=absolute(raw.output_dir),
        cache=cache.model_copy(update={"dir": absolute(cache.dir)}),
        models=models,
        watch=watch.model_copy(update={"paths": [absolute(p) for p in watch.paths]}),
        incremental=incremental.model_copy(update={"watch_paths": [absolute(p) for p in incremental.watch_paths]}),
        executor=executor,
        path=path.resolve(),
        root=root,
    )


# --- pydantic errors -> file:line:column

def _position(mark):
    return {"line": mark.line + 1, "column": mark.column + 1}  # marks count from 0


def _position_of(root_node, loc, key=False):
    """Position of the node at `loc`, or of the deepest node that exists (a missing key's mapping)."""
    node, key_node = root_node, None
    for part in loc:
        if part == "[key]":  # pydantic's marker for an invalid mapping key
            node = key_node or node
            break
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if getattr(k, "value", None) == str(part)), None)
            if pair is None:
                break
            key_node, node = pair
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            key_node, node = None, node.value[part]
        else:
            break
    if key and key_node is not None:
        node = key_node
    return _position(node.start_mark) if node is not None else {}


def _dotted(loc):
    text = ""
    for part in loc:
        if part != "[key]":
            text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _fields_at(loc):
    """The keys allowed in the section at `loc`, read from the pydantic models."""
    cls = _File
    for part in loc:
        if isinstance(part, str):
            annotation = cls.model_fields[part].annotation
            cls = next(a for a in (*get_args(annotation), annotation)
                       if isinstance(a, type) and get_origin(a) is None and issubclass(a, BaseModel))
    return list(cls.model_fields)


def _describe(error):
    """(message, hint) for one pydantic error, in the words of cuvil.yaml."""
    kind, loc, value = error["type"], error["loc"], error.get("input")
    owner = _dotted(loc[:-1]) or "the top level"
    if kind == "extra_forbidden":
        allowed = ", ".join(sorted(_fields_at(loc[:-1])))
        return f"unknown key {loc[-1]!r} in {owner} (allowed: {allowed})", f"check the spelling; {_EXAMPLE_HINT}"
    if kind == "missing":
        return f"missing required key {loc[-1]!r} in {owner}", _EXAMPLE_HINT
    if loc == ("models",) and (kind == "too_short" or value is None):
        return "models: list at least one model", "add an entry with `name:` and `source:` under `models:`"
    if kind == "value_error":
        message = str(error["ctx"]["error"])
    else:
        expected = {"model_type": "expected a mapping", "dict_type": "expected a mapping",
                    "path_type": "expected a path string"}.get(kind, error["msg"])
        message = f"{expected}, got {type(value).__name__} {value!r}"
    return f"{_dotted(loc) or 'the file'}: {message}", _EXAMPLE_HINT


def _located_error(error, root_node, path):
    """One ConfigError listing every problem, one per line; the first in the file sets line, column, hint."""
    located = []
    for item in error.errors():
        message, hint = _describe(item)
        located.append((message, hint, _position_of(root_node, item["loc"], key=item["type"] == "extra_forbidden")))
    # pydantic orders errors by field declaration; users read the file top to bottom.
    located.sort(key=lambda item: (item[2].get("line", 0), item[2].get("column", 0)))
    (message, hint, position), rest = located[0], located[1:]
    for other, _, where in rest:
        message += f"\n{path}:{where.get('line', '?')}:{where.get('column', '?')}: {other}"
    return ConfigError(message, file=path, hint=hint, **position)
