"""SCons tool: build ONNX models into C-ABI libraries with cuvil, inside any SConstruct.

A monorepo loads it from the installed cuvil::

    import cuvil
    env = Environment(tools=["default", "cuvil"], toolpath=[cuvil.scons_toolpath()])

    # one model, settings as construction variables
    mlp = env.CuvilModel("build/libmlp.so", "models/mlp.onnx",
                         CUVIL_INPUTS={"x": [1, 64]}, CUVIL_PREFIX="mlp_", CUVIL_THREADS=2)
    # -> build/libmlp.so, build/mlp.h, build/mlp.pc, build/mlpConfig.cmake (+ Version), build/manifest.json

    # or every model x target of a cuvil.yaml
    libs = env.Cuvil("cuvil.yaml")   # <output_dir>/<model>/<target>/lib<model>.so (+ .h, manifest.json)

    env.Program("app", "app.c", CPPPATH=["build"], LIBS=["mlp"], LIBPATH=["build"],
                RPATH=[Dir("build").abspath])

`CuvilModel(target, source)`: `source` is one model file (.onnx; .pt/.pth
TorchScript also work); `target` is `lib<name>.so` (the `lib` and `.so` may be
left out, and without a target the name is the source's). An emitter adds
`<name>.h`, `<name>.pc`, the CMake package and `manifest.json` beside it, so
build one model per folder. The tool builds shared libraries (a cuvil.yaml's
`link:` is for `cuvil build`). The
action builds in-process through `cuvil.build.build_variant` into the
target's folder, with the step cache at `$CUVIL_CACHE_DIR` (default: cuvil's
default cache folder: `$CUVIL_CACHE_DIR` in the OS environment, else
`$XDG_CACHE_HOME/cuvil` or `~/.cache/cuvil`).

| variable | default | |
|---|---|---|
| `CUVIL_INPUTS` | `{}` | static shape of each input, `{"x": [1, 3, 224, 224]}` |
| `CUVIL_TARGET` | `native` | `native`, `generic`, `x86_64-avx2`, `x86_64-avx512` |
| `CUVIL_PRECISION` | `fp32` | |
| `CUVIL_THREADS` | `1` | worker threads per session |
| `CUVIL_PREFIX` | `cuvil_` | replaces `cuvil_` in the exported symbols (two models in one program need two) |
| `CUVIL_OPT_LEVEL` | `2` | 0..3: which passes run |
| `CUVIL_PASSES` | `None` | an explicit list of pass names instead of the opt level's |
| `CUVIL_DISABLE_PASSES` | `[]` | passes to leave out |
| `CUVIL_PASS_OPTIONS` | `{}` | options of passes, `{"fuse_activation": {...}}` (as `pass_options` in cuvil.yaml) |
| `CUVIL_MAX_ARENA_MB` | `4096` | refuse a model whose planned memory is larger |
| `CUVIL_SANITIZE` | `False` | link with AddressSanitizer/UBSan (debugging) |
| `CUVIL_CACHE_DIR` | cuvil's default | where compiled steps are kept (does not change the output) |
| `CUVIL_CACHE_READ_ONLY` | `False` | read the cache, never write it (a shared CI cache) |
| `CUVIL_JOBS` | SCons' `-j` | kernels compiled in parallel within one model |
| `CUVILCOMSTR` | | the line printed for each model (default: `$CUVILCOM`, a command-like line) |

Every variable that changes the output is in the action's varlist, and so
are the versions of cuvil, numba and llvmlite: changing one rebuilds the
library (compiled steps that did not change come from the cache).

`Cuvil(config)` reads the cuvil.yaml when the SConscript is read and declares
one `CuvilModel` per model x target, whose sources are the model file and the
yaml, with the yaml's settings and its `cache.dir`; it returns the library
nodes. A mistake in the yaml stops SCons while reading the SConscript; a
model that cannot be built fails its target; both print cuvil's message (file,
line, hint) and no Python traceback.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
import threading

import SCons.Action
import SCons.Builder
import SCons.Errors
import SCons.Script

DEFAULTS = {
    "CUVIL_INPUTS": {},
    "CUVIL_TARGET": "native",
    "CUVIL_PRECISION": "fp32",
    "CUVIL_THREADS": 1,
    "CUVIL_PREFIX": "cuvil_",
    "CUVIL_OPT_LEVEL": 2,
    "CUVIL_PASSES": None,
    "CUVIL_DISABLE_PASSES": [],
    "CUVIL_PASS_OPTIONS": {},
    "CUVIL_MAX_ARENA_MB": 4096,
    "CUVIL_SANITIZE": False,
}

# What reaches the bytes of the library; `_CUVIL_VERSIONS` stands for cuvil's own code.
OUTPUT_VARIABLES = [*DEFAULTS, "_CUVIL_VERSIONS"]

CUVILCOM = ("cuvil-compile $SOURCE -o ${TARGET.dir} --target $CUVIL_TARGET --precision $CUVIL_PRECISION "
            "--threads $CUVIL_THREADS --prefix $CUVIL_PREFIX --opt-level $CUVIL_OPT_LEVEL")

# the DLL: x86_64-windows; the module: wasm32
_LIBRARY_NAME = re.compile(r"lib([A-Za-z_][A-Za-z0-9_]*)\.so|([A-Za-z_][A-Za-z0-9_]*)\.dll|([A-Za-z_][A-Za-z0-9_]*)\.wasm")


def _model_name(match) -> str:
    return match.group(1) or match.group(2) or match.group(3)

# SCons runs function actions of a `-j` build in threads; cuvil's build spreads
# its own kernel compiles over CUVIL_JOBS threads, one model at a time.
_BUILD_LOCK = threading.Lock()


def _cuvil_package():
    """The cuvil package, or None when it is not installed.

    SCons registers a tool found in a toolpath in sys.modules under its bare
    name, "cuvil": over the package of the same name, which cuvil's own lazy
    imports (`from .frontends.onnx import ...`) need there. Put the package
    back, importing it without this file's folder on sys.path; if the
    SConstruct had imported it already, its submodules are reused.
    """
    registered = sys.modules.get("cuvil")
    if registered is not None and hasattr(registered, "__path__"):
        return registered
    if registered is not None and registered.__dict__ is globals():
        del sys.modules["cuvil"]
    here = os.path.dirname(os.path.abspath(__file__))
    saved_path = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        return importlib.import_module("cuvil")
    except ImportError:
        return None
    finally:
        sys.path[:] = saved_path


_cuvil_package()


# -- the action --------------------------------------------------------------------------

def _versions(target, source, env, for_signature):
    """cuvil's code fingerprint and tool versions: a new cuvil rebuilds every library."""
    import json

    from cuvil.build import tool_versions
    return json.dumps(tool_versions(), sort_keys=True)


def _as_int(env, name):
    value = env.get(name, DEFAULTS.get(name))
    try:
        return int(value)
    except (TypeError, ValueError):
        raise _Error(f"{name} must be an integer, got {value!r}") from None


def _as_list(env, name):
    value = env.get(name, DEFAULTS.get(name))
    if value is None:
        return None
    return [value] if isinstance(value, str) else [str(v) for v in value]


class _Error(Exception):
    """A mistake in the construction variables: reported like a cuvil error."""


def _variant_spec(target, source, env):
    from cuvil.build import VariantSpec

    match = _LIBRARY_NAME.fullmatch(target[0].name)
    inputs = env.get("CUVIL_INPUTS") or {}
    if not isinstance(inputs, dict):
        raise _Error(f"CUVIL_INPUTS must be a dict of input name -> shape, got {inputs!r}")
    try:
        shapes = {str(name): [int(d) for d in shape] for name, shape in inputs.items()}
    except (TypeError, ValueError):
        raise _Error(f"CUVIL_INPUTS: every shape must be a list of integers, got {inputs!r}") from None
    return VariantSpec(
        name=_model_name(match), source=source[0].abspath, input_shapes=shapes,
        target=env.subst("$CUVIL_TARGET"), precision=env.subst("$CUVIL_PRECISION"),
        opt_level=_as_int(env, "CUVIL_OPT_LEVEL"), passes=_as_list(env, "CUVIL_PASSES"),
        disable_passes=_as_list(env, "CUVIL_DISABLE_PASSES") or [], threads=_as_int(env, "CUVIL_THREADS"),
        symbol_prefix=env.subst("$CUVIL_PREFIX"), pass_options=_pass_options(env),
        max_arena_mb=_as_int(env, "CUVIL_MAX_ARENA_MB"), sanitize=bool(env.get("CUVIL_SANITIZE", False)))


def _pass_options(env):
    from cuvil.errors import CuvilError
    from passes import check_pass_options

    options = env.get("CUVIL_PASS_OPTIONS") or {}
    if not isinstance(options, dict):
        raise _Error(f"CUVIL_PASS_OPTIONS must be a dict of pass name -> options, got {options!r}")
    try:
        return check_pass_options({str(k): dict(v) for k, v in options.items()})
    except (CuvilError, TypeError, ValueError) as error:
        raise _Error(f"CUVIL_PASS_OPTIONS: {error}") from None


def _jobs(env):
    jobs = env.get("CUVIL_JOBS")
    if jobs is None:
        jobs = SCons.Script.GetOption("num_jobs") or 1
    return max(1, int(jobs))


def _build_model(target, source, env):
    """Build source[0] into target[0]'s folder; a cuvil error fails the target with cuvil's message."""
    from cuvil.build import build_variant
    from cuvil.cache import Cache, default_cache_dir
    from cuvil.errors import CuvilError

    try:
        spec = _variant_spec(target, source, env)
        cache_dir = env.subst("$CUVIL_CACHE_DIR") or default_cache_dir()
        cache = Cache(cache_dir, read_only=bool(env.get("CUVIL_CACHE_READ_ONLY", False)))
        with _BUILD_LOCK:
            build_variant(spec, target[0].dir.abspath, cache, jobs=_jobs(env))
    except (CuvilError, _Error) as error:
        raise SCons.Errors.BuildError(node=target[0], errstr=f"cuvil: error: {error}", status=2, exitstatus=2)
    return 0


def _command_line(target, source, env, executor=None):
    kw = {"executor": executor} if executor is not None else {"target": target, "source": source}
    return env.subst("$CUVILCOMSTR", **kw) or env.subst("$CUVILCOM", **kw)


def _emit(target, source, env):
    """lib<name>.so -> also <name>.h, <name>.pc, the CMake package and manifest.json in the same folder."""
    if len(source) < 1:
        raise SCons.Errors.UserError("CuvilModel: give one model file as the source")
    library = target[0]
    match = _LIBRARY_NAME.fullmatch(library.name)
    if not match:
        raise SCons.Errors.UserError(
            f"CuvilModel: the target must be named lib<name>.so with <name> a C identifier, got {library.name!r}")
    folder = library.dir
    name = _model_name(match)
    files = [f"{name}.h", f"{name}.pc", f"{name}Config.cmake", f"{name}ConfigVersion.cmake", "manifest.json"]
    if library.name.endswith(".dll"):
        files.append(f"lib{name}.dll.a")   # the DLL's import library
    if library.name.endswith(".wasm"):     # a module: no pkg-config file or CMake package
        files = [f"{name}.h", "manifest.json"]
    return [library] + [folder.File(file) for file in files], source


# -- cuvil.yaml ---------------------------------------------------------------------------

def _cuvil_project(env, config="cuvil.yaml"):
    """Declare one CuvilModel per model x target of a cuvil.yaml; returns the library nodes."""
    from cuvil.config import load_config
    from cuvil.errors import CuvilError

    config_node = env.File(config)
    try:
        spec = load_config(config_node.srcnode().abspath)
    except CuvilError as error:
        raise SCons.Errors.UserError(f"cuvil: error: {error}") from None
    from backends.targets import TARGETS

    libraries = []
    for model in spec.models:
        for target in model.targets:
            folder = spec.output_dir / model.name / target
            library = TARGETS[target].library_file(model.name) if target in TARGETS else f"lib{model.name}.so"
            nodes = env.CuvilModel(
                # a node, not a string: the builder's lib prefix is not added to <name>.dll
                env.File(str(folder / library)), [env.File(str(model.source)), config_node],
                CUVIL_INPUTS={name: list(shape) for name, shape in model.inputs.items()},
                CUVIL_TARGET=target, CUVIL_PRECISION=model.precision, CUVIL_THREADS=model.threads,
                CUVIL_PREFIX=model.symbol_prefix, CUVIL_OPT_LEVEL=model.opt_level, CUVIL_PASSES=model.passes,
                CUVIL_DISABLE_PASSES=list(model.disable_passes), CUVIL_CACHE_DIR=str(spec.cache.dir),
                CUVIL_CACHE_READ_ONLY=spec.cache.read_only, CUVIL_PASS_OPTIONS=dict(model.pass_options),
                CUVIL_MAX_ARENA_MB=model.max_arena_mb, CUVIL_SANITIZE=model.sanitize)
            libraries.append(nodes[0])
    return libraries


# -- the tool -----------------------------------------------------------------------------

def generate(env):
    if _cuvil_package() is None:
        raise SCons.Errors.UserError("the cuvil tool needs the cuvil package: pip install cuvil")
    for name, value in DEFAULTS.items():
        env.SetDefault(**{name: value})
    env.SetDefault(CUVILCOM=CUVILCOM, CUVILCOMSTR="", _CUVIL_VERSIONS=_versions)
    action = SCons.Action.Action(_build_model, strfunction=_command_line, varlist=OUTPUT_VARIABLES)
    env["BUILDERS"]["CuvilModel"] = SCons.Builder.Builder(
        action=action, emitter=_emit, prefix="lib", suffix=".so", src_suffix=".onnx")
    env.AddMethod(_cuvil_project, "Cuvil")


def exists(env):
    return _cuvil_package() is not None
