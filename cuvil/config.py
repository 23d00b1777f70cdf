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
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError

from .errors import ConfigError

TARGETS = ("native", "generic", "x86_64-avx2", "x86_64-avx512", "x86_64-znver4", "x86_64-sapphirerapids",
           "cuda-sm80", "cuda-sm90")
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
PRIORITIES = ("critical", "high", "normal", "low")  # `serve: priority:`, most important first
DIFF_MODES = ("syntactic", "semantic")
SOURCE_SUFFIXES = (".onnx", ".pt", ".pth")
DEFAULT_SYMBOL_PREFIX = "cuvil_"

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXAMPLE_HINT = "see cuvil.yaml.example for every section and key"


# --- value checks: their messages are what the user reads, so they name what is known

def _one_of(known, what):
    def check(value):
        if value not in known:
            raise ValueError(f"unknown {what} {value!r} (known: {', '.join(known)})")
        return value
    return AfterValidator(check)


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
    if Path(value).suffix.lower() not in SOURCE_SUFFIXES:
        raise ValueError(f"model source {value!r} must end in one of {', '.join(SOURCE_SUFFIXES)}")
    return value


def _pass_options(value):
    # The passes own their options (a pydantic model each); the check lists what exists.
    from passes import check_pass_options
    return check_pass_options(value)


def _version(value):
    if value != 1:
        raise ValueError(f"unsupported version {value} (this cuvil reads version 1)")
    return value


Target = Annotated[str, _one_of(TARGETS, "target")]
Precision = Annotated[str, _one_of(PRECISIONS, "precision")]
Identifier = Annotated[str, AfterValidator(_identifier)]
Dimension = Annotated[Any, AfterValidator(_dimension)]
# Paths are the one place a str must be converted, so they opt out of strict mode.
LaxPath = Annotated[Path, Strict(False)]


# --- the file as written

class _Strict(BaseModel):
    # strict: `threads: "4"` or `opt_level: 2.5` is a mistake to report, not to coerce.
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheConfig(_Strict):
    dir: LaxPath = Path(".cuvil-cache")
    url: str | None = None  # an fsspec URL (s3://bucket/prefix) shared between machines
    read_only: bool = False


class WatchConfig(_Strict):
    paths: list[LaxPath] = []  # folders or globs
    debounce_ms: int = Field(300, ge=0)


class ServeConfig(_Strict):
    """How `cuvil serve` schedules one model's requests (cuvil/serve/scheduler.py)."""

    priority: Annotated[str, _one_of(PRIORITIES, "priority")] = "normal"
    deadline_ms: int = Field(1000, ge=1)  # a request should be answered this long after it arrives
    max_concurrency: int = Field(1, ge=1)  # sessions of the library that run at once


class IncrementalConfig(_Strict):
    """Hot updates in `cuvil serve`: rebuild a changed model and swap it into the running server."""

    enabled: bool = False
    # syntactic: any change of the file's bytes rebuilds; semantic: only a change of the
    # imported graph (not of names or node order) does.
    diff_mode: Annotated[str, _one_of(DIFF_MODES, "diff_mode")] = "semantic"
    cache_ttl: int = Field(3600, ge=0)  # seconds a remembered diff hash stays valid
    watch_paths: list[LaxPath] = []  # files, folders or globs besides the models' sources


class AccuracyConfig(_Strict):
    """How a reduced-precision build measures itself against the float32 build of the same model
    (cuvil/accuracy.py): on `samples` inputs, random or read from an .npz file."""

    samples: int = Field(8, ge=1, le=1024)
    # "random" (seeded: normal floats, integers 0 or 1), or an .npz file with an array per input
    # name whose first axis is the sample (relative to this file)
    inputs: str = "random"
    # Fail the build when an output's cosine similarity to float32 is below this.
    min_cosine: float | None = Field(None, ge=-1.0, le=1.0)


class _Settings(_Strict):
    """What `defaults:` may set for every model; the field defaults are the built-in ones."""

    targets: list[Target] = Field(default_factory=lambda: ["native"], min_length=1)
    precision: Precision = "fp32"
    opt_level: int = Field(2, ge=0, le=3)
    passes: list[str] | None = None  # None: the opt level's default list
    disable_passes: list[str] = []
    # Options of individual passes, e.g. {fuse_elementwise: {max_ops: 8}}; a model's merge
    # over `defaults:` pass by pass.
    pass_options: Annotated[dict[str, dict[str, Any]], AfterValidator(_pass_options)] = {}
    threads: int = Field(1, ge=1)
    symbol_prefix: Identifier | None = None  # None: DEFAULT_SYMBOL_PREFIX
    # Largest working memory a session may need; a model whose plan is larger is refused.
    max_arena_mb: int = Field(4096, ge=1)
    # Compile the driver with AddressSanitizer and UndefinedBehaviorSanitizer (for testing).
    sanitize: bool = False
    # bf16 / fp16 builds: how they measure themselves against the float32 build.
    accuracy: AccuracyConfig = AccuracyConfig()


class _Model(_Settings):
    name: Identifier
    source: Annotated[str, AfterValidator(_source_suffix)]
    inputs: dict[str, list[Dimension]] | None = None
    serve: ServeConfig | None = None


class _File(_Strict):
    version: Annotated[int, AfterValidator(_version)]
    output_dir: LaxPath = Path("build/cuvil")
    # `None` lets a section stand empty (`cache:` with every line commented out).
    cache: CacheConfig | None = None
    defaults: _Settings | None = None
    models: list[_Model] = Field(min_length=1)
    watch: WatchConfig | None = None
    incremental: IncrementalConfig | None = None


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
    serve: ServeConfig = ServeConfig()
    line: int | None = None


class BuildSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int
    output_dir: Path
    cache: CacheConfig
    models: list[ModelConfig]
    watch: WatchConfig
    incremental: IncrementalConfig = IncrementalConfig()
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
        if not source.is_file():
            raise ConfigError(f"models[{index}].source: model file not found: {source}", file=path,
                              hint=f"paths are relative to the folder of {path.name} ({root})",
                              **_position_of(root_node, (*where, "source")))
        values = {**defaults, **entry.model_dump(exclude_unset=True)}
        values["pass_options"] = {name: {**defaults["pass_options"].get(name, {}), **own}
                                  for name, own in {**defaults["pass_options"], **values["pass_options"]}.items()}
        values.update(source=source, line=line,
                      inputs={name: tuple(shape) for name, shape in (entry.inputs or {}).items()},
                      symbol_prefix=values["symbol_prefix"] or DEFAULT_SYMBOL_PREFIX,
                      serve=entry.serve or ServeConfig())
        values["accuracy"] = {**defaults["accuracy"], **values["accuracy"]}   # a model's keys over defaults'
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
    return BuildSpec(
        version=raw.version,
        output_dir=absolute(raw.output_dir),
        cache=cache.model_copy(update={"dir": absolute(cache.dir)}),
        models=models,
        watch=watch.model_copy(update={"paths": [absolute(p) for p in watch.paths]}),
        incremental=incremental.model_copy(update={"watch_paths": [absolute(p) for p in incremental.watch_paths]}),
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
