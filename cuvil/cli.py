"""The `cuvil` command line: build, run, inspect, check.

Every command is a small function of its parsed arguments that returns an exit
code. A `CuvilError` (a user mistake or a bad input) is printed as one
`cuvil: error: ...` message with exit code 2 and no traceback; `--debug` adds
the traceback. `run` and `inspect` need only numpy: the compiler is imported by
`build` and `check` alone.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import traceback
from pathlib import Path

from . import __version__
from .errors import CuvilError

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def main(argv=None) -> int:
    return _main(_parser, argv, "cuvil")


def compile_main(argv=None) -> int:
    """The `cuvil-compile` console script: one model, settings as flags (see cmd_compile)."""
    return _main(_compile_parser, argv, "cuvil-compile")


def _main(make_parser, argv, prog: str) -> int:
    parser = make_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # --help, --version and usage errors: argparse has printed them
        return exit.code if isinstance(exit.code, int) else EXIT_ERROR
    args.debug = getattr(args, "debug", False)
    try:
        if hasattr(args, "validate"):  # checks argparse cannot make alone, reported as usage errors
            try:
                args.validate(parser, args)
            except SystemExit as exit:
                return exit.code if isinstance(exit.code, int) else EXIT_ERROR
        return args.command(args)
    except CuvilError as error:
        if args.debug:
            traceback.print_exc()
        print(f"{prog}: error: {error}", file=sys.stderr)
        if getattr(args, "json", False):  # a script reading --json output gets the error as JSON too
            print(json.dumps({"error": {"message": error.message, "hint": error.hint}}, indent=2))
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("cuvil: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # a bug in cuvil: say so briefly; --debug shows where
        if args.debug:
            traceback.print_exc()
        print(f"cuvil: internal error: {type(error).__name__}: {error}\n"
              f"  hint: this is a bug in cuvil; rerun with --debug for the traceback and report it",
              file=sys.stderr)
        return EXIT_INTERNAL


def _parser() -> argparse.ArgumentParser:
    from .bench import VS_ENGINES
    from .config import SELECT_MODES
    from .pipeline import PRECISIONS_SUPPORTED
    # --debug is accepted before or after the command; SUPPRESS keeps a command's
    # parser from resetting a --debug given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    parser = argparse.ArgumentParser(prog="cuvil", parents=[common],
                                     description="Compile ONNX models ahead of time into "
                                     "standalone shared libraries with a plain C ABI.")
    parser.add_argument("--version", action="version", version=f"cuvil {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    build = commands.add_parser("build", parents=[common], help="build the models of a cuvil.yaml",
                                description="Build every model (or the MODELs named) for each of its targets.")
    _config_option(build)
    build.add_argument("-j", "--jobs", type=_positive_int, default=1, metavar="N",
                       help="compile up to N kernels in parallel (default 1)")
    build.add_argument("--report", type=Path, metavar="FILE.json",
                       help="write every step's name, kind, key, status (ran/cached) and seconds as JSON")
    build.add_argument("--scheduler", metavar="ADDRESS",
                       help="run the steps on the Dask cluster of this scheduler (tcp://HOST:8786; overrides "
                            "`executor:`); its workers share the step cache (cache.url, e.g. s3://...)")
    build.add_argument("--explain", action="store_true",
                       help="after building, print what the passes did, the kernels and the arena plan")
    build.add_argument("--json", action="store_true",
                       help="print a JSON report (variants, files, figures, every step) instead of the summary; "
                            "progress goes to stderr")
    build.add_argument("--timeline", type=Path, metavar="FILE.html",
                       help="write the build's step timeline (when each step ran, where) as a self-contained "
                            "HTML page")
    build.add_argument("--select", choices=SELECT_MODES,
                       help="how nodes with several applicable kernels get one, for every model (overrides "
                            "`select:`): rules (shape rules) or measure (timed on this machine, cached)")
    build.add_argument("models", nargs="*", metavar="MODEL", help="build only these models (default: all)")
    build.set_defaults(command=cmd_build)

    explain = commands.add_parser("explain", parents=[common], help="show what the passes do to a model",
                                  description="For MODEL (a name in cuvil.yaml): each pass with the node counts "
                                              "before and after and what it rewrote, the kernels the model "
                                              "becomes with the ops each one fuses, and the arena plan. "
                                              "Compiles nothing; pass results come from the build cache.")
    _config_option(explain)
    explain.add_argument("model", metavar="MODEL", help="a model name of the config")
    explain.add_argument("--target", metavar="TARGET", help="which of the model's targets (default: its first)")
    explain.add_argument("--buffers", type=_positive_int, default=24, metavar="N",
                         help="show the N largest arena buffers (default 24)")
    explain.add_argument("--json", action="store_true", help="print the explanation as JSON")
    explain.set_defaults(command=cmd_explain)

    watch = commands.add_parser("watch", parents=[common], help="rebuild whenever a model or the config changes",
                                description="Build, then rebuild what changed each time cuvil.yaml, a model file "
                                            "or a path under watch.paths changes. Ctrl-C stops.")
    _config_option(watch)
    watch.add_argument("-j", "--jobs", type=_positive_int, default=1, metavar="N")
    watch.add_argument("--max-builds", type=_positive_int, default=None, help=argparse.SUPPRESS)
    watch.set_defaults(command=cmd_watch)

    serve = commands.add_parser("serve", parents=[common], help="serve the models over the KServe v2 protocol",
                                description="Build what is missing, load every model and serve the KServe v2 "
                                            "(Open Inference Protocol) HTTP API, scheduled by each model's "
                                            "`serve:` settings and hot-updated when `incremental:` is enabled. "
                                            "Ctrl-C stops. See docs/serving.md.")
    _config_option(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    serve.add_argument("--token-file", type=Path, metavar="FILE",
                       help="require `Authorization: Bearer <the file's text>` on every endpoint but /v2/health")
    serve.add_argument("--workers", type=_positive_int, metavar="N",
                       help="compute threads shared by all models (default: the usable CPU cores)")
    serve.add_argument("--reserve-critical", type=int, default=None, metavar="N",
                       help="compute threads only critical models may use (default: 1 when there are 2 or more "
                            "threads and both critical and other models, else 0)")
    serve.add_argument("--nice-lower", type=int, default=10, metavar="N",
                       help="run the non-critical models' requests on threads N nice levels lower than the rest "
                            "(default 10; 0: the same), when there are critical models")
    serve.add_argument("--max-body-mb", type=_positive_int, default=64, metavar="MB",
                       help="largest request body accepted (default 64)")
    serve.add_argument("--stop-after", type=float, default=None, help=argparse.SUPPRESS)
    serve.set_defaults(command=cmd_serve)

    graph = commands.add_parser("graph", parents=[common], help="print the build's step graph, or draw a model",
                                description="text, dot, mermaid, json: the steps of the build and their keys "
                                            "(kernel steps appear once the code generator has run or is cached). "
                                            "svg, html: MODEL's compiled graph (a box per kernel, the ops it "
                                            "fuses inside) and its memory plan's buffer lifetimes; svg needs "
                                            "Graphviz's dot, html is a self-contained page.")
    _config_option(graph)
    graph.add_argument("--format", choices=["text", "dot", "mermaid", "json", "svg", "html"], default="text")
    graph.add_argument("--expand", action="store_true",
                       help="run (or load from the cache) the code generator so kernel steps are shown")
    graph.add_argument("--target", metavar="TARGET", help="svg, html: which of the model's targets (default: its first)")
    graph.add_argument("-o", "--output", type=Path, metavar="FILE", help="write to FILE instead of stdout")
    graph.add_argument("models", nargs="*", metavar="MODEL")
    graph.set_defaults(command=cmd_graph)

    verify = commands.add_parser("verify", parents=[common], help="rebuild a library and compare the bytes",
                                 description="Rebuild LIB's model from the config in a temporary folder with a "
                                             "fresh cache and report whether the bytes match.")
    verify.add_argument("library", type=Path, metavar="LIB")
    _config_option(verify)
    verify.set_defaults(command=cmd_verify)

    clean = commands.add_parser("clean", parents=[common], help="remove the build outputs of a cuvil.yaml",
                                description="Remove <output_dir>; with --cache also the step cache.")
    _config_option(clean)
    clean.add_argument("--cache", action="store_true", help="also remove the local step cache")
    clean.set_defaults(command=cmd_clean)

    cache = commands.add_parser("cache", parents=[common], help="step cache statistics and pruning")
    _config_option(cache)
    cache_commands = cache.add_subparsers(metavar="ACTION", required=True)
    stats = cache_commands.add_parser("stats", parents=[common], help="entries and bytes in the local cache")
    stats.set_defaults(command=cmd_cache_stats)
    prune = cache_commands.add_parser("prune", parents=[common], help="remove least recently used entries")
    prune.add_argument("--max-size", required=True, metavar="SIZE", help="e.g. 500M, 2G")
    prune.set_defaults(command=cmd_cache_prune)

    run = commands.add_parser("run", parents=[common], help="run a built library on .npy inputs",
                              description="Run a library built by cuvil on inputs read from .npy files "
                                          "and save each output as <output-dir>/<name>.npy.")
    run.add_argument("library", type=Path, metavar="LIB", help="a lib<model>.so built by cuvil")
    run.add_argument("-i", "--input", action="append", default=[], metavar="NAME=FILE.npy", dest="inputs",
                     help="an input tensor (repeat for each input; NAME= may be left out for a one-input model)")
    run.add_argument("-o", "--output-dir", type=Path, default=Path("."), metavar="D",
                     help="folder for the output .npy files (default: the current folder)")
    run.set_defaults(command=cmd_run)

    inspect = commands.add_parser("inspect", parents=[common], help="describe a built library",
                                  description="Print what a library built by cuvil contains: its tensors, "
                                              "target, precision, memory and provenance.")
    inspect.add_argument("library", type=Path, metavar="LIB")
    inspect.add_argument("--json", action="store_true", help="print the library's model info as JSON")
    inspect.set_defaults(command=cmd_inspect)

    check = commands.add_parser("check", parents=[common], help="validate a cuvil.yaml and find unsupported ops",
                                description="Validate the config and import each model without building it. "
                                            "Exit 1 if some op cannot be compiled, 0 if all can.")
    _config_option(check)
    check.add_argument("models", nargs="*", metavar="MODEL", help="check only these models (default: all)")
    check.add_argument("--json", action="store_true", help="print the report as JSON (same exit codes)")
    check.set_defaults(command=cmd_check)

    schema = commands.add_parser("schema", parents=[common], help="print the JSON Schema of cuvil.yaml",
                                 description="Print the JSON Schema of cuvil.yaml (for editors: the YAML language "
                                             "server reads it from a `# yaml-language-server: $schema=FILE` line). "
                                             "docs/cuvil.schema.json holds the same text.")
    schema.set_defaults(command=cmd_schema)

    quantize = commands.add_parser("quantize", parents=[common], help="calibrate a float model and write it as "
                                   "int8 QDQ ONNX", description="Calibrate a float ONNX (or TorchScript) model on "
                                   "sample inputs and write the QDQ model precision int8 builds (uint8 activations, "
                                   "int8 per-channel weights, int32 biases), for cuvil or any other engine.")
    quantize.add_argument("model", type=Path, metavar="MODEL", help="the float model (.onnx, .pt)")
    quantize.add_argument("-o", "--output", type=Path, required=True, metavar="FILE.onnx", help="the QDQ model to write")
    quantize.add_argument("--samples", type=_positive_int, default=8, metavar="N",
                          help="calibration inputs (default 8)")
    quantize.add_argument("--inputs", default="random", metavar="FILE.npz",
                          help="an .npz file with an array per input name, first axis the sample (default: "
                               "seeded random inputs)")
    quantize.add_argument("--method", choices=("minmax", "percentile"), default="minmax",
                          help="how each activation's range is chosen (default minmax)")
    quantize.add_argument("--per-tensor", action="store_true", help="one weight scale per tensor, not per channel")
    quantize.add_argument("--shape", action="append", default=[], metavar="NAME=D1,D2,...",
                          help="static shape of an input whose shape the model leaves open (repeatable)")
    quantize.set_defaults(command=cmd_quantize)

    bench = commands.add_parser("bench", parents=[common], help="time a library or a model (vs onnxruntime)",
                                description="Time a built library (LIB.so) or build and time a model "
                                            "(an .onnx file). Each engine runs in its own process: the library "
                                            "from C (no Python in the loop) and through the Python runtime, "
                                            "onnxruntime and OpenVINO (--vs) with the same thread count. Prints "
                                            "median, min and p90 per call and the ratios cuvil/engine of the "
                                            "medians (with --rounds N, of each engine's best process).")
    bench.add_argument("target", type=Path, metavar="LIB|MODEL", help="a lib<model>.so, or an .onnx model")
    bench.add_argument("--vs", action="append", choices=VS_ENGINES, default=[],
                       help="also time this engine on the same inputs (repeat for both); openvino: its CPU "
                            "plugin in float32, when installed (pip install openvino)")
    bench.add_argument("--onnx", type=Path, metavar="FILE.onnx",
                       help="the ONNX model of LIB, for --vs when timing a library")
    bench.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                       help="threads of the build and of the other engines (default 1; a LIB keeps its own)")
    bench.add_argument("--runs", type=_positive_int, default=100, metavar="N", help="timed calls per process")
    bench.add_argument("--rounds", type=_positive_int, default=1, metavar="N",
                       help="processes per engine (alternating); the ratio compares each engine's best process")
    bench.add_argument("--shape", action="append", default=[], metavar="NAME=D1,D2,...",
                       help="an input shape for a model with symbolic dims (repeat per input)")
    bench.add_argument("--precision", choices=PRECISIONS_SUPPORTED,
                       help="build the MODEL in this precision (default fp32; a LIB has its own); OpenVINO "
                            "infers in the same one, onnxruntime in float32")
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.add_argument("--plot", type=Path, metavar="FILE.png",
                       help="also draw the latency per engine (median, min..p90) as a PNG (matplotlib)")
    bench.set_defaults(command=cmd_bench)
    return parser


def _config_option(parser):
    parser.add_argument("-f", "--file", type=Path, default=Path("cuvil.yaml"), metavar="FILE",
                        help="the build file (default: cuvil.yaml)")


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# --- build

def cmd_build(args) -> int:
    from .config import load_config
    from .progress import BuildDisplay
    from .project import build_project, open_project_cache

    spec = load_config(args.file)
    if args.select:
        spec.models = [model.model_copy(update={"select": args.select}) for model in spec.models]
    cache = open_project_cache(spec)
    # --json keeps stdout for the report: the progress goes to stderr
    with BuildDisplay(sys.stderr if args.json else sys.stdout) as display:
        result = build_project(spec, args.models or None, jobs=args.jobs, progress=display.say, cache=cache,
                               scheduler=args.scheduler, listener=display.step)
    built = result.artifacts
    if args.report:
        _write(args.report, json.dumps(result.dag.report(), indent=2) + "\n")
    if args.timeline:
        from .pictures import timeline_html
        _write(args.timeline, timeline_html(result.dag.report(), title=f"cuvil build {_shown(spec.path)}"))
    if args.json:
        print(json.dumps(_build_report(spec, result, args), indent=2))
        return EXIT_OK
    _print_build(spec, result, args)
    return EXIT_OK


def _print_build(spec, result, args) -> None:
    """The summary `cuvil build` and `cuvil-compile` print: each variant's library and figures, the steps."""
    built = result.artifacts
    print()
    for artifacts in built:
        info = artifacts.info
        print(f"{info['name']}/{info['target']}: {_shown(artifacts.library)}")
        unchanged = "" if getattr(artifacts, "changed", True) else " (unchanged)"
        print(f"    {_figures(artifacts.kernels, info['memory'])}, {artifacts.seconds:.1f} s{unchanged}")
        if "accuracy" in info:
            from .accuracy import summary
            print(f"    {summary(info['accuracy'])}")
    print(f"{len(built)} variant{'s' if len(built) != 1 else ''}: {result.dag.summary()} steps "
          f"in {result.seconds:.2f} s (cache: {_shown(spec.cache.dir)})")
    if getattr(args, "timeline", None):
        print(f"step timeline: {_shown(args.timeline)}")
    if getattr(args, "explain", False):
        from .explain import explain_variant, render
        for artifacts in built:
            info = artifacts.info
            print()
            print(render(explain_variant(result.dag, f"{info['name']}/{info['target']}/link", info["name"])))


# --- cuvil-compile: the one-shot form of `cuvil build` for one model

# --opt-level is cuvil.yaml's opt_level (passes/__init__.py OPT_LEVELS): 0 runs no pass at all (every
# buffer apart, no fusion), 1 the clean-ups (constant folding, dead code, common subexpressions) and the
# memory plan, 2 (the default) adds the fusions and Winograd, 3 adds elementwise-chain fusion.
_OUTPUT_LINK = {".so": "shared", ".a": "static", ".dll": "shared"}


def _compile_parser() -> argparse.ArgumentParser:
    from .config import PRECISIONS, SELECT_MODES, TARGETS
    parser = argparse.ArgumentParser(
        prog="cuvil-compile", description="Compile one model into a shared library in one command: the same "
        "cached build as `cuvil build` with a one-model cuvil.yaml of these settings, and the same bytes. "
        "Beside the library go its header, pkg-config file, CMake package and manifest.json.",
        epilog="example: cuvil-compile --model m.onnx --target x86_64-avx512 --opt-level 3 --precision int4 "
               "--threads 2 --output build/m.so --input-shape x=1,128")
    parser.add_argument("--version", action="version", version=f"cuvil-compile {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--model", required=True, type=Path, metavar="FILE",
                        help="the model: .onnx, or TorchScript .pt/.pth")
    parser.add_argument("-o", "--output", required=True, type=Path, metavar="FILE.so",
                        help="the library to write (.so; .a: a static archive; .dll: target x86_64-windows); "
                             "its folder gets the header and the other files")
    parser.add_argument("--target", default="native", choices=TARGETS, metavar="TARGET",
                        help=f"what to build for (default native): {', '.join(TARGETS)}; cuda-a10, cuda-a100, "
                             "cuda-l4, cuda-h100, cuda-h200 are the cuda-smXY target of that GPU")
    parser.add_argument("--opt-level", type=int, default=2, choices=range(4), metavar="{0,1,2,3}",
                        help="0: no passes; 1: clean-ups + memory plan; 2 (default): + fusions; "
                             "3: + elementwise-chain fusion (cuvil.yaml's opt_level)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS, help="default fp32")
    parser.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                        help="threads each session runs on (default 1)")
    parser.add_argument("--select", choices=SELECT_MODES, default="rules",
                        help="rules (default): kernels by shape rules; measure: the candidates of each node "
                             "timed on this machine (cuvil.yaml's select:)")
    parser.add_argument("--input-shape", action="append", default=[], type=_input_shape, dest="input_shapes",
                        metavar="NAME=D1,D2,...", help="static shape of an input the model leaves open (repeat "
                                                       "per input)")
    parser.add_argument("--batch", type=_positive_ints, metavar="N1,N2,...",
                        help="batch buckets: one compiled entry per batch size (dim 0 of every input), one "
                             "weights blob; runs of any batch up to the largest (cuvil.yaml's batch:)")
    parser.add_argument("--max-context", type=_positive_int, metavar="N",
                        help="decoder models: tokens of the KV cache (cuvil.yaml's generate: max_context)")
    parser.add_argument("--prefill-buckets", type=_positive_ints, metavar="N1,N2,...",
                        help="decoder models: prompt lengths with a compiled prefill (generate: prefill_buckets; "
                             "needs --max-context)")
    parser.add_argument("--name", type=_identifier, metavar="NAME",
                        help="the model's name in the library (lib<NAME>.so, <NAME>.h; default: from --output)")
    parser.add_argument("--prefix", type=_identifier, metavar="PREFIX",
                        help="prefix of the exported C symbols (default cuvil_)")
    parser.add_argument("-j", "--jobs", type=_positive_int, default=1, metavar="N",
                        help="compile up to N kernels in parallel (default 1)")
    parser.add_argument("--cache-dir", type=Path, metavar="DIR",
                        help="the step cache (default: $CUVIL_CACHE_DIR, else ~/.cache/cuvil)")
    parser.set_defaults(command=cmd_compile, validate=_check_compile_args)
    return parser


def _input_shape(text):
    name, sep, dims = text.partition("=")
    try:
        shape = [int(d) for d in dims.split(",")] if sep and name else None
    except ValueError:
        shape = None
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"expected NAME=D1,D2,... with positive integer dims, got {text!r}")
    return name, shape


def _positive_ints(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _identifier(text):
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an identifier (letters, digits, _; not starting "
                                         "with a digit)")
    return text


def _check_compile_args(parser, args) -> None:
    """What argparse cannot check alone; each mistake is a usage error (exit 2, no traceback)."""
    if args.batch and args.max_context is not None:
        parser.error("argument --batch: batch buckets and a generation library (--max-context) cannot be combined")
    if args.batch and len(set(args.batch)) != len(args.batch):
        parser.error(f"argument --batch: a batch size is given twice ({','.join(map(str, args.batch))})")
    if args.prefill_buckets and args.max_context is None:
        parser.error("argument --prefill-buckets: needs --max-context (a decoder's generation library)")
    from .config import SOURCE_SUFFIXES
    if not args.model.is_file():
        parser.error(f"argument --model: file not found: {args.model}")
    if args.model.suffix.lower() not in SOURCE_SUFFIXES:
        parser.error(f"argument --model: {args.model.name} is not a model file ({', '.join(SOURCE_SUFFIXES)})")
    suffix = args.output.suffix.lower()
    if suffix not in _OUTPUT_LINK:
        parser.error(f"argument --output: {args.output.name} must end in .so (or .a for a static archive, "
                     ".dll for target x86_64-windows)")
    if (suffix == ".dll") != (args.target == "x86_64-windows"):
        parser.error("argument --output: target x86_64-windows writes a .dll" if suffix != ".dll" else
                     "argument --output: a .dll is built for --target x86_64-windows only")
    names = [name for name, _ in args.input_shapes]
    if len(set(names)) != len(names):
        parser.error(f"argument --input-shape: an input is given twice ({', '.join(names)})")
    if args.name is None:
        stem = args.output.stem[3:] if args.output.stem.startswith("lib") and suffix != ".dll" else args.output.stem
        args.name = re.sub(r"[^A-Za-z0-9_]", "_", stem)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", args.name):
            parser.error(f"argument --output: no model name can be made from {args.output.name!r}: give --name")


def compile_config(args):
    """The one-model cuvil.yaml (a BuildSpec) that the flags of cuvil-compile stand for."""
    import yaml

    from backends.targets import CUDA_ALIASES

    from .cache import default_cache_dir
    from .config import parse_config
    folder = args.output.resolve().parent
    model = {"name": args.name, "source": str(args.model.resolve()),
             "targets": [CUDA_ALIASES.get(args.target, args.target)], "precision": args.precision,
             "opt_level": args.opt_level, "threads": args.threads, "select": args.select}
    if args.input_shapes:
        model["inputs"] = dict(args.input_shapes)
    if args.prefix:
        model["symbol_prefix"] = args.prefix
    if _OUTPUT_LINK[args.output.suffix.lower()] != "shared":
        model["link"] = _OUTPUT_LINK[args.output.suffix.lower()]
    if args.batch:
        model["batch"] = args.batch
    if args.max_context is not None:
        model["generate"] = {"max_context": args.max_context}
        if args.prefill_buckets:
            model["generate"]["prefill_buckets"] = args.prefill_buckets
    cache = (args.cache_dir or default_cache_dir()).expanduser().resolve()
    text = yaml.safe_dump({"version": 1, "output_dir": str(folder), "cache": {"dir": str(cache)},
                           "models": [model]}, sort_keys=False)
    # Never written: the path only names the flags in a message and is the base of no relative path.
    return parse_config(text, folder / "cuvil-compile (command line)")


def cmd_compile(args) -> int:
    """`cuvil-compile`: the build of a one-model config, installed into the folder of --output; the
    library is also linked (hard link, else a copy) under --output's own name when that is not
    lib<name>.so, so the folder holds exactly what `cuvil build` writes plus that name."""
    from .progress import BuildDisplay
    from .project import build_project, open_project_cache

    spec = compile_config(args)
    folder = args.output.resolve().parent
    with BuildDisplay(sys.stdout) as display:
        result = build_project(spec, jobs=args.jobs, progress=display.say, cache=open_project_cache(spec),
                               listener=display.step, folder_of=lambda model, target: folder)
    (artifacts,) = result.artifacts
    if artifacts.library.name != args.output.name:
        _link_or_copy(artifacts.library, folder / args.output.name)
        artifacts.library = folder / args.output.name
    _print_build(spec, result, args)
    return EXIT_OK


def _link_or_copy(source: Path, path: Path) -> None:
    """`path` with the bytes of `source`, replaced atomically (a process that has the old one mapped
    keeps it); a hard link where the file system allows, so a large library is not stored twice."""
    import os
    import shutil
    if path.is_file() and os.path.samefile(source, path):
        return
    tmp = path.with_name(f".cuvil-tmp-{path.name}")
    try:
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copy2(source, tmp)
        os.replace(tmp, path)
    except OSError as error:
        raise CuvilError(f"cannot write {path}: {error.strerror}",
                         hint="check that the output folder is writable") from None


def _build_report(spec, result, args) -> dict:
    """`cuvil build --json`: each variant's files and figures, and every step of the build graph."""
    steps = result.dag.report()["steps"]
    ran = sum(1 for s in steps if s["status"] == "ran")
    variants = []
    for artifacts in result.artifacts:
        info = artifacts.info
        variant = {"name": info["name"], "target": info["target"], "precision": info.get("precision"),
                   "library": str(artifacts.library), "files": [str(f) for f in artifacts.files],
                   "kernels": artifacts.kernels, "memory": info["memory"], "seconds": round(artifacts.seconds, 4),
                   "changed": artifacts.changed}
        if "accuracy" in info:
            variant["accuracy"] = info["accuracy"]
        if args.explain:
            from .explain import as_dict, explain_variant
            variant["explain"] = as_dict(explain_variant(result.dag, f"{info['name']}/{info['target']}/link",
                                                         info["name"]))
        variants.append(variant)
    return {"config": str(spec.path), "cache": {"dir": str(spec.cache.dir), "url": spec.cache.url},
            "scheduler": args.scheduler or (spec.executor.address if spec.executor.kind == "dask" else None),
            "seconds": round(result.seconds, 4), "summary": {"ran": ran, "cached": len(steps) - ran},
            "variants": variants, "steps": steps}


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as error:
        raise CuvilError(f"cannot write {path}: {error.strerror}", hint="check that the folder is writable") from None


def cmd_explain(args) -> int:
    from .config import load_config
    from .explain import as_dict, explain_variant, render
    from .project import plan_project, select_models

    spec = load_config(args.file)
    (model,) = select_models(spec, [args.model])
    target = args.target or model.targets[0]
    if target not in model.targets:
        raise CuvilError(f"model '{model.name}' has no target '{target}' (its targets: {', '.join(model.targets)})")
    dag, planned = plan_project(spec, [model.name], progress=None)
    link = next(link for _, t, _, link in planned if t == target)
    report = explain_variant(dag, link, model.name)
    print(json.dumps(as_dict(report), indent=2) if args.json else render(report, max_buffers=args.buffers))
    return EXIT_OK


def cmd_watch(args) -> int:
    from .watch import watch
    return watch(args.file, jobs=args.jobs, say=_say, max_builds=args.max_builds)


def cmd_serve(args) -> int:
    try:
        from .serve import Server
    except ImportError as error:
        raise CuvilError(f"cuvil serve needs the packages of the serve extra ({error.name} is missing)",
                         hint='pip install "cuvil[serve]"') from None
    token = None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise CuvilError(f"cannot read the token file {args.token_file}: {error}") from None
        if not token:
            raise CuvilError(f"the token file {args.token_file} is empty")
    if args.reserve_critical is not None and args.reserve_critical < 0:
        raise CuvilError("--reserve-critical must be 0 or more")
    server = Server(args.file, host=args.host, port=args.port, token=token, workers=args.workers,
                    max_body_bytes=args.max_body_mb * 1024 * 1024, say=_say, reserve=args.reserve_critical,
                    lower_nice=max(0, args.nice_lower))
    server.serve_forever(stop_after=args.stop_after)
    return EXIT_OK


def cmd_graph(args) -> int:
    from .config import load_config
    from .project import plan_project

    spec = load_config(args.file)
    if args.format in ("svg", "html"):
        text = _model_picture(spec, args)
    else:
        dag, planned = plan_project(spec, args.models or None, progress=None)
        if args.expand:
            from .build import add_kernel_steps, link_step_of
            for _, _, _, last in planned:
                link = link_step_of(dag, last)
                add_kernel_steps(dag, link, dag.get(dag.step(link).deps[0]))  # codegen says which kernels exist
        text = dag.render(args.format)
    if args.output:
        _write(args.output, text if text.endswith("\n") else text + "\n")
        print(f"wrote {_shown(args.output)}")
    else:
        print(text)
    return EXIT_OK


def _model_picture(spec, args) -> str:
    """`cuvil graph MODEL --format svg|html`: the compiled graph and memory plan of one variant."""
    from . import pictures
    from .explain import explain_variant
    from .project import plan_project, select_models

    if len(args.models) != 1:
        raise CuvilError(f"--format {args.format} draws one model's compiled graph: name one model",
                         hint=f"cuvil graph MODEL --format {args.format} -o MODEL.{args.format} "
                              f"(models: {', '.join(m.name for m in spec.models)})")
    (model,) = select_models(spec, args.models)
    target = args.target or model.targets[0]
    if target not in model.targets:
        raise CuvilError(f"model '{model.name}' has no target '{target}' (its targets: {', '.join(model.targets)})")
    dag, planned = plan_project(spec, [model.name], progress=None)
    link = next(link for _, t, _, link in planned if t == target)
    expl = explain_variant(dag, link, model.name)
    return pictures.graph_svg(expl) if args.format == "svg" else pictures.graph_html(expl)


def cmd_verify(args) -> int:
    import hashlib
    import tempfile

    from .cache import Cache
    from .config import load_config
    from .project import build_project
    from .runtime import load

    library = args.library.resolve()
    if not library.is_file():
        raise CuvilError(f"library not found: {library}")
    info = load(library).info
    spec = load_config(args.file)
    model = spec.model(info["name"])
    # a rebuild here, from nothing: not on the config's cluster, whose workers share the config's cache
    spec = spec.model_copy(update={"executor": spec.executor.model_copy(update={"kind": "local", "address": None})})
    with tempfile.TemporaryDirectory(prefix="cuvil-verify-") as tmp:
        result = build_project(spec, [model.name], progress=None, cache=Cache(Path(tmp) / "cache"),
                               output_dir=Path(tmp) / "out")
        rebuilt = next((a for a in result.artifacts if a.info["target"] == info["target"]), None)
        if rebuilt is None:
            raise CuvilError(f"{args.file}: model '{model.name}' has no target '{info['target']}'")
        same = True
        for mine in rebuilt.files:
            theirs = library.parent / mine.name
            ok = theirs.is_file() and theirs.read_bytes() == mine.read_bytes()
            same &= ok
            digest = hashlib.sha256(mine.read_bytes()).hexdigest()[:16]
            print(f"{'same     ' if ok else 'DIFFERENT'} {mine.name} (rebuilt sha256 {digest}...)")
    print("verified: the rebuild is byte-identical" if same else "the rebuild differs")
    return EXIT_OK if same else EXIT_PROBLEMS


def cmd_clean(args) -> int:
    import shutil

    from .config import load_config
    spec = load_config(args.file)
    targets = [spec.output_dir] + ([spec.cache.dir] if args.cache else [])
    for path in targets:
        if path.exists():
            shutil.rmtree(path)
            print(f"removed {_shown(path)}")
    return EXIT_OK


def cmd_cache_stats(args) -> int:
    from .config import load_config
    from .project import open_project_cache
    spec = load_config(args.file)
    stats = open_project_cache(spec).stats()
    print(f"{_shown(spec.cache.dir)}: {stats['entries']} entries, {_bytes(stats['bytes'])}")
    return EXIT_OK


def cmd_cache_prune(args) -> int:
    from .cache import parse_size
    from .config import load_config
    from .project import open_project_cache
    spec = load_config(args.file)
    result = open_project_cache(spec).prune(parse_size(args.max_size))
    print(f"removed {result['removed']} entries ({_bytes(result['removed_bytes'])}); "
          f"{_bytes(result['bytes'])} left in {_shown(spec.cache.dir)}")
    return EXIT_OK


def _say(message):
    print(message, flush=True)


# --- run

def cmd_run(args) -> int:
    import numpy as np

    from .runtime import load

    library = load(args.library)
    feeds = _read_inputs(args.inputs, library.input_names)
    outputs = library.run_tensors(feeds)  # a sequence's tensors one file each (x[0].npy...)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, file_name in zip(outputs, _file_names(list(outputs))):
        array = outputs[name]
        path = args.output_dir / f"{file_name}.npy"
        np.save(path, array)
        print(f"{name}: shape {list(array.shape)} {array.dtype} -> {_shown(path)}")
        print(f"    {_preview(array)}")
    return EXIT_OK


def _read_inputs(specs: list[str], input_names: list[str]) -> dict:
    import numpy as np

    feeds = {}
    for spec in specs:
        name, sep, file = spec.partition("=")
        if not sep:
            if len(input_names) != 1:
                raise CuvilError(f"--input {spec!r} does not name its input",
                                 hint=f"write --input NAME=FILE.npy; the inputs are {input_names}")
            name, file = input_names[0], spec
        if name in feeds:
            raise CuvilError(f"input {name!r} is given twice")
        try:
            feeds[name] = np.load(file, allow_pickle=False)
        except FileNotFoundError:
            raise CuvilError(f"input {name!r}: file not found: {file}") from None
        except (OSError, ValueError) as error:
            raise CuvilError(f"input {name!r}: cannot read {file} as a .npy array: {error}",
                             hint="save inputs with numpy.save (one array per .npy file)") from None
    missing = [n for n in input_names if n not in feeds]
    if missing:
        raise CuvilError(f"no file given for input(s) {missing}",
                         hint="give each input as --input NAME=FILE.npy")
    return feeds


def _file_names(names: list[str]) -> list[str]:
    """A safe, distinct file name stem for each tensor name (names may hold '/', ':' and worse)."""
    stems, taken = [], set()
    for name in names:
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "output"
        unique, i = stem, 1
        while unique in taken:
            i += 1
            unique = f"{stem}_{i}"
        taken.add(unique)
        stems.append(unique)
    return stems


def _preview(array, count=6) -> str:
    flat = array.reshape(-1)
    values = ", ".join(f"{v:.6g}" if array.dtype.kind == "f" else str(v) for v in flat[:count].tolist())
    return f"[{values}{', ...' if flat.size > count else ''}]"


# --- inspect

def cmd_inspect(args) -> int:
    from .cross import describe, is_foreign
    from .runtime import load

    # a cross target's library (aarch64) cannot be loaded here: its description is read from its bytes
    library = describe(args.library) if is_foreign(args.library) else load(args.library)
    info = library.info
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return EXIT_OK
    print(f"{_shown(library.path)}")
    print(f"  model      {info.get('name', '?')} (ABI {info.get('abi_version', '?')}, "
          f"symbol prefix {library.prefix})")
    cpu = f" (cpu {info['cpu']}{' ' + info['features'] if info.get('features') else ''})" if info.get("cpu") else ""
    cpu += f", {info['triple']}" if info.get("triple") else ""
    print(f"  target     {info.get('target', '?')}{cpu}, precision {info.get('precision', '?')}, "
          f"threads {info.get('threads', '?')}")
    for kind in ("inputs", "outputs"):
        print(f"  {kind}")
        width = max((len(t["name"]) for t in info[kind]), default=0)
        for tensor in info[kind]:
            print(f"    {tensor['name']:<{width}}  {tensor['dtype']} {tensor['shape']}")
    memory = info.get("memory", {})
    if memory:
        shared = memory.get("shared_bytes", 0)
        print(f"  memory     arena {_bytes(memory.get('arena_bytes', 0))} "
              f"(unplanned {_bytes(memory.get('naive_bytes', 0))}), weights {_bytes(memory.get('weights_bytes', 0))}"
              + (f", shared by the sessions {_bytes(shared)}" if shared else ""))
    if "kernels" in info:
        print(f"  kernels    {info['kernels']}")
    if "batch" in info:
        entries = ", ".join(f"{e['batch']} (arena {_bytes(e['arena_bytes'])})" for e in info["batch"]["entries"])
        print(f"  batch      buckets {entries}; session_run_batch takes 1 to {info['batch']['buckets'][-1]} rows")
    print(f"  passes     {', '.join(info.get('passes') or []) or '(none)'}")
    # the build's report of a bf16 / fp16 library is in the manifest installed beside it
    manifest = library.path.parent / "manifest.json"
    manifest = json.loads(manifest.read_text()) if manifest.is_file() else {}
    accuracy = manifest.get("accuracy") if library.path.name in manifest.get("files", {}) else None
    if accuracy:
        from .accuracy import summary
        print(f"  {summary(accuracy)}")
    source = info.get("source_sha256") or (manifest.get("source_sha256")
                                           if library.path.name in manifest.get("files", {}) else None)
    if "graph_sha256" in info:   # the imported graph's semantic hash (cuvil/semantic.py)
        print(f"  graph      sha256 {info['graph_sha256']}")
    print(f"  source     sha256 {source or '? (no manifest beside the library)'}")
    print(f"  spec hash  {info.get('spec_hash', '?')}")
    versions = info.get("versions") or {"cuvil": info.get("cuvil_version", "?")}
    print(f"  versions   {', '.join(f'{k} {v}' for k, v in sorted(versions.items()))}")
    return EXIT_OK


# --- bench

def cmd_bench(args) -> int:
    from . import bench

    report = bench.run_bench(args.target, args.vs, args.onnx, args.threads, args.runs, args.rounds,
                             bench.parse_shapes(args.shape), args.precision)
    if args.plot:
        from .pictures import bench_plot
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        bench_plot(report, args.plot)
        print(f"plot: {_shown(args.plot)}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({k: report[k] for k in ("library", "model", "threads", "precision", "results")}, indent=2))
        return EXIT_OK
    print(f"{_shown(args.target)}: model {report['model'] or '?'}, target {report['target'] or '?'}, "
          f"threads {report['threads'] or '?'}, precision {report['precision'] or '?'}")
    best = args.rounds > 1
    ratio_keys = [(bench.ratio_name(engine), f"vs {engine}") for engine in report["vs"]]
    print(f"  {'engine':<16}{'median ms':>11}{'min ms':>10}{'p90 ms':>10}"
          + (f"{'best process':>14}" if best else "") + "".join(f"{title:>17}" for _, title in ratio_keys))
    for key, r in report["results"].items():
        ratios = "".join(f"{r[k]:>17.2f}" if k in r else " " * 17 for k, _ in ratio_keys)
        process = f"{r['process_median_ms']:>14.3f}" if best else ""
        print(f"  {key:<16}{r['median_ms']:>11.3f}{r['min_ms']:>10.3f}{r['p90_ms']:>10.3f}{process}{ratios}".rstrip())
    if best:
        print(f"  (median, min, p90: over all {args.rounds} processes' calls; best process: the lowest of their "
              f"medians, which the ratio compares)")
    return EXIT_OK


# --- check

def cmd_quantize(args) -> int:
    from .bench import parse_shapes
    from .pipeline import calibrated_source
    options = {"samples": args.samples, "inputs": args.inputs, "method": args.method,
               "per_channel": not args.per_tensor}
    if args.inputs != "random" and not Path(args.inputs).is_file():
        raise CuvilError(f"--inputs: file not found: {args.inputs}", hint="an .npz file with an array per input name")
    data = calibrated_source(args.model, parse_shapes(args.shape), "int8", options)
    _write_bytes(args.output, data)
    print(f"wrote {args.output} (int8 QDQ, calibrated on {args.samples} "
          f"{'random' if args.inputs == 'random' else Path(args.inputs).name} inputs, {args.method})")
    return EXIT_OK


def _write_bytes(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    except OSError as error:
        raise CuvilError(f"cannot write {path}: {error.strerror}", hint="check that the folder is writable") from None


def cmd_schema(args) -> int:
    from .config import json_schema
    print(json.dumps(json_schema(), indent=2))
    return EXIT_OK


def cmd_check(args) -> int:
    from .config import load_config
    from .project import check_model, select_models

    spec = load_config(args.file)
    selected = select_models(spec, args.models or None)
    if args.json:
        reports = [check_model(spec, model) for model in selected]
        unsupported = sum(len(r.unsupported) for r in reports)
        print(json.dumps({"config": str(spec.path), "valid": True, "supported": not unsupported,
                          "models": [_check_dict(model, r) for model, r in zip(selected, reports)]}, indent=2))
        return EXIT_PROBLEMS if unsupported else EXIT_OK
    print(f"{_shown(spec.path)}: valid, {len(spec.models)} model{'s' if len(spec.models) != 1 else ''}")
    unsupported = 0
    for model in selected:
        report = check_model(spec, model)
        print(f"\n{model.name}  ({_shown(model.source)}; targets {', '.join(model.targets)}, {model.precision})")
        for kind, tensors in (("input", report.inputs), ("output", report.outputs)):
            for tensor in tensors:
                print(f"  {kind:<7} {tensor['name']}: {tensor['dtype']} {tensor['shape']}")
        total = sum(report.op_counts.values())
        ops = ", ".join(f"{op} {n}" for op, n in report.op_counts.items())
        print(f"  ops     {total} node{'s' if total != 1 else ''}: {ops or '(none)'}")
        for target, variant in report.variants.items():
            print(f"  {target}: {_figures(variant['kernels'], variant['memory'])}")
            for line in report.fallbacks.get(target, []):
                print(f"    not int8: {line}")
        for problem in report.unsupported:
            print(f"  unsupported: {problem}")
        unsupported += len(report.unsupported)
    if unsupported:
        print(f"\n{unsupported} node{'s' if unsupported != 1 else ''} cannot be compiled yet")
        return EXIT_PROBLEMS
    print("\nall ops, targets and precisions supported")
    return EXIT_OK


def _check_dict(model, report) -> dict:
    return {"name": model.name, "source": str(model.source), "targets": list(model.targets),
            "precision": model.precision, "inputs": report.inputs, "outputs": report.outputs,
            "ops": report.op_counts, "unsupported": report.unsupported, "variants": report.variants}


# --- formatting

def _figures(kernels: int, memory: dict) -> str:
    """What a variant's library holds, as `cuvil build` and `cuvil check` print it."""
    shared = memory.get("shared_bytes", 0)
    return (f"{kernels} kernels, arena {_bytes(memory['arena_bytes'])}, weights {_bytes(memory['weights_bytes'])}"
            + (f", shared by the sessions {_bytes(shared)}" if shared else ""))


def _shown(path) -> str:
    """A path relative to the working directory when it is below it, else absolute."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def _bytes(count: int) -> str:
    count = int(count)
    if count < 1024:
        return f"{count} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}"
