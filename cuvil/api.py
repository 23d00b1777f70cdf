"""The Python API: `compile` a model into a loaded library in one call."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .cache import Cache, default_cache_dir
from .errors import CuvilError
from .runtime import Library


class CompiledModel(Library):
    """A library cuvil just built, loaded; `.save()` keeps it."""

    def __init__(self, artifacts, workdir):
        super().__init__(artifacts.library)
        self.artifacts = artifacts
        self._workdir = workdir  # TemporaryDirectory: removed with this object
        # bf16 / fp16 builds: the report against the float32 build (accuracy.py; in manifest.json,
        # not in the library, which it measures)
        self.accuracy = artifacts.info.get("accuracy")

    def save(self, path) -> Path:
        """Copy the library to `path`: a folder (every file of the build goes in it: library, header,
        pkg-config file, CMake package, manifest) or a file name."""
        path = Path(path)
        if path.is_dir() or str(path).endswith(os.sep) or not path.suffix:
            path.mkdir(parents=True, exist_ok=True)
            for src in self.artifacts.files:
                shutil.copyfile(src, path / src.name)
            return path / self.artifacts.library.name
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.artifacts.library, path)
        return path


def _model_name(model) -> str:
    if isinstance(model, (str, os.PathLike)):
        stem = Path(model).stem
        name = "".join(c if c.isalnum() or c == "_" else "_" for c in stem)
        return name if name and not name[0].isdigit() else f"m_{name}"
    return "model"


def _accuracy_options(accuracy) -> dict:
    """`accuracy=` checked like cuvil.yaml's accuracy: block (config.AccuracyConfig)."""
    import pydantic
    from .config import AccuracyConfig
    try:
        return AccuracyConfig.model_validate(accuracy).model_dump()
    except pydantic.ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'accuracy'}: {e['msg']}" for e in error.errors())
        raise CuvilError(f"accuracy={accuracy!r}: {problems}",
                         hint="accuracy takes {samples: 1-1024, inputs: 'random' or an .npz path, "
                              "min_cosine: -1..1 or None}") from None


def _calibration_options(calibration) -> dict:
    """`calibration=` checked like cuvil.yaml's calibration: block (config.CalibrationConfig)."""
    import pydantic
    from .config import CalibrationConfig
    try:
        return CalibrationConfig.model_validate(calibration).model_dump()
    except pydantic.ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'calibration'}: {e['msg']}" for e in error.errors())
        raise CuvilError(f"calibration={calibration!r}: {problems}",
                         hint="calibration takes {inputs: 'random' or an .npz path, samples: 1-4096, "
                              "method: 'minmax' or 'percentile', percentile: 50-100, per_channel: bool}") from None


def _generate_options(generate) -> dict:
    """`generate=` checked like cuvil.yaml's generate: block (config.GenerateConfig); the tokenizer
    path relative to the current folder."""
    import pydantic
    from .config import GenerateConfig
    try:
        options = GenerateConfig.model_validate(generate).model_dump()
    except pydantic.ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'generate'}: {e['msg']}" for e in error.errors())
        raise CuvilError(f"generate={generate!r}: {problems}",
                         hint="generate takes {max_context: >= 2, prefill_buckets: [positive ints <= max_context], "
                              "tokenizer: a tokenizer.json path or None, pad_token: a token id or None}") from None
    if options["tokenizer"] is not None:
        options["tokenizer"] = str(Path(options["tokenizer"]).resolve())
    return options


def compile(model, *, input_shapes=None, target="native", precision="fp32", threads=None, enable_fp16=False,
            opt_level=2, passes=None, disable_passes=(), pass_options=None, symbol_prefix="cuvil_", name=None,
            cache_dir=None, jobs=1, progress=None, max_arena_mb=4096, sanitize=False,
            accuracy=None, calibration=None, signature=None, generate=None, batch=None, select="rules",
            select_candidates=None) -> CompiledModel:
    """Build `model` and load it. generate={max_context, prefill_buckets, tokenizer, pad_token}
    builds an ONNX decoder as a generation library (lib.generate(...), README "LLM generation").
    batch=[1, 8, 32] (or input_shapes listing one shape per bucket) builds one entry per batch size
    sharing the weights; .run then takes any batch from 1 to the largest (cuvil/batching.py).
    select="measure" times the candidate kernels of each node that has several (today the float32 3x3
    convs' Winograd F(4x4) / F(2x2) / direct) on this machine and takes the fastest (cuvil/select.py);
    select_candidates=["winograd_f2", "direct"] limits what it times."""
    from backends.targets import TARGETS

    from .build import VariantSpec, build_variant
    if target in TARGETS and TARGETS[target].is_cross:
        raise CuvilError(f"target '{target}': cuvil.compile loads the library it builds into this process, and a "
                         f"library for {TARGETS[target].arch} cannot be loaded on this machine",
                         hint="build cross targets with `cuvil build` (targets: in cuvil.yaml) or cuvil.build."
                              "build_variant; the README's \"Cross targets\" shows how to run them")
    if enable_fp16:
        if precision not in ("fp32", "fp16"):
            raise CuvilError(f"enable_fp16=True asks for fp16, but precision={precision!r} was given too",
                             hint="give one of them: enable_fp16=True is precision='fp16'")
        precision = "fp16"
    threads = 1 if threads is None else int(threads)
    if threads < 1:
        raise CuvilError(f"threads must be >= 1, got {threads}")
    if accuracy is not None:
        accuracy = _accuracy_options(accuracy)
    calibration = _calibration_options(calibration or {})
    from .batching import split_input_shapes
    input_shapes, batches = split_input_shapes(input_shapes, batch, "compile")
    source = model
    if not isinstance(model, (str, os.PathLike, bytes)):
        import onnx
        from .frontends import tensorflow
        if tensorflow.is_tensorflow_source(model):  # a keras.Model, tf.function or ConcreteFunction
            source = tensorflow.to_onnx_proto(model, input_shapes)
        elif not isinstance(model, onnx.ModelProto):
            from .frontends.torch import to_onnx_proto
            source = to_onnx_proto(model, input_shapes)
    spec = VariantSpec(name=name or _model_name(model), source=source, input_shapes=dict(input_shapes or {}),
                       target=target, precision=precision, opt_level=opt_level, passes=passes,
                       disable_passes=list(disable_passes), pass_options=dict(pass_options or {}),
                       threads=threads, symbol_prefix=symbol_prefix,
                       max_arena_mb=max_arena_mb, sanitize=sanitize, accuracy=accuracy,
                       calibration=calibration, signature=signature,
                       generate=_generate_options(generate) if generate is not None else None,
                       batch=batches, select=select,
                       select_candidates=None if select_candidates is None else list(select_candidates))
    cache = Cache(Path(cache_dir) if cache_dir else default_cache_dir())
    workdir = tempfile.TemporaryDirectory(prefix="cuvil-")
    artifacts = build_variant(spec, Path(workdir.name), cache, jobs=jobs, progress=progress)
    return CompiledModel(artifacts, workdir)
