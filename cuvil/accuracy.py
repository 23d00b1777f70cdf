"""The accuracy report of a reduced-precision build: the library against the float32 build of the
same model, target and threads, on the same inputs.

For each output, over all samples: max |y - y32|, that over max |y32| (max rel err), the cosine
similarity of the flattened outputs, and, where the output looks like class scores (2-D, at
least 2 columns, float), the share of rows whose arg max agrees (top-1). Inputs are seeded
random (normal floats; integers 0 or 1, valid indices for any embedding) or an .npz file with
an array per input name whose first axis is the sample. `min_cosine` makes a build fail with a
CuvilError naming the worst output.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from .errors import ConfigError, CuvilError

SEED = 0


def sample_inputs(info: dict, samples: int, source: str = "random", seed: int = SEED,
                  what: str = "accuracy.inputs") -> list[dict]:
    """`samples` feeds for a library whose description is `info` (random ones drawn with `seed`)."""
    if source == "random":
        rng = np.random.default_rng(seed)
        feeds = []
        for _ in range(samples):
            feed = {}
            for spec in info["inputs"]:
                if spec["dtype"] == "string":   # words drawn from a few, so that lookups hit and miss
                    words = np.array(["0", "1", "a", "b", ""], dtype=object)
                    feed[spec["name"]] = words[rng.integers(0, len(words), spec["shape"])]
                    continue
                dtype = np.dtype(spec["dtype"])
                if dtype.kind == "f":
                    feed[spec["name"]] = rng.standard_normal(spec["shape"]).astype(dtype)
                elif dtype.kind == "b":
                    feed[spec["name"]] = rng.integers(0, 2, spec["shape"]).astype(bool)
                else:
                    feed[spec["name"]] = rng.integers(0, 2, spec["shape"]).astype(dtype)
            feeds.append(feed)
        return feeds
    try:
        arrays = np.load(source, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{what}: cannot read {source} as an .npz file: {error}") from None
    missing = [spec["name"] for spec in info["inputs"] if spec["name"] not in arrays]
    if missing:
        raise ConfigError(f"{what}: {source} has no array for input(s) {missing}",
                          hint="one array per input name, its first axis the sample")
    count = min(samples, *(len(arrays[spec["name"]]) for spec in info["inputs"]))
    return [{spec["name"]: np.asarray(arrays[spec["name"]][i], dtype=object if spec["dtype"] == "string" else spec["dtype"])
             for spec in info["inputs"]}
            for i in range(count)]


def compare(got: list[dict], want: list[dict]) -> dict:
    """The report's figures per output: `got` the reduced-precision library's outputs per sample,
    `want` the float32 one's."""
    report = {}
    for name in want[0]:
        if want[0][name].dtype == object:   # a string output: the share of elements that agree
            same = np.concatenate([(g[name] == w[name]).ravel() for g, w in zip(got, want)])
            report[name] = {"max_abs_err": 0.0 if same.all() else float("inf"),
                            "max_rel_err": 0.0 if same.all() else float("inf"),
                            "cosine": float(np.mean(same)) if same.size else 1.0}
            continue
        y = np.concatenate([g[name].astype(np.float64).ravel() for g in got])
        y32 = np.concatenate([w[name].astype(np.float64).ravel() for w in want])
        diff = float(np.max(np.abs(y - y32))) if y.size else 0.0
        norms = float(np.linalg.norm(y) * np.linalg.norm(y32))
        cosine = float(y @ y32 / norms) if norms else float(np.array_equal(y, y32))
        entry = {"max_abs_err": diff, "max_rel_err": diff / max(float(np.max(np.abs(y32))), 1e-30) if y.size else 0.0,
                 "cosine": cosine}
        shape = want[0][name].shape
        if len(shape) == 2 and shape[1] >= 2 and want[0][name].dtype.kind == "f":
            agree = [np.argmax(g[name], axis=1) == np.argmax(w[name], axis=1) for g, w in zip(got, want)]
            entry["top1_agreement"] = float(np.mean(np.concatenate(agree)))
        report[name] = entry
    return report


# The library file of a variant's bundle: a shared library here or on aarch64 Linux, a Windows DLL,
# a WebAssembly module.
LIBRARY_SUFFIXES = (".so", ".dll", ".wasm")


class _Emulated:
    """A library for another machine (a cross target) run once per call under qemu-user, Wine or
    wasmtime (cuvil/cross.py), with the interface of a session of a library loaded here."""

    def __init__(self, path: Path):
        from .cross import describe
        self.path = path
        self.info = describe(path).info

    def run_all(self, feeds: list) -> list:
        from .cross import run_emulated_many
        return run_emulated_many(self.path, feeds)


class _Loaded:
    def __init__(self, path: Path):
        from .runtime import Library
        library = Library(path)
        self.info, self.session = library.info, library.session()

    def run_all(self, feeds: list) -> list:
        return [self.session.run(f) for f in feeds]


def _runner(path: Path):
    """Something that runs the library at `path` on feeds: loaded here, or for a cross target's
    library under its emulator (a CuvilError naming the package to install when it is missing:
    a reduced-precision build is measured, not assumed)."""
    from .cross import emulator_problem, is_foreign
    from .runtime import library_platform
    if not is_foreign(path):
        return _Loaded(path)
    platform = library_platform(path)
    problem = emulator_problem(platform)
    if problem:
        raise CuvilError(f"the accuracy report of a reduced-precision {platform} build runs the library on this "
                         f"machine, and {problem}",
                         hint="install it, or build this target in fp32")
    return _Emulated(path)


def measure(files: dict, reference: dict, options: dict, shared: dict | None = None) -> dict:
    """The reduced-precision variant's files with the report in its manifest (the build step);
    `shared` holds the variant's shared library when `files` has only the static archive."""
    with tempfile.TemporaryDirectory(prefix="cuvil-accuracy-") as tmp:
        paths = []
        for folder, bundle in (("reduced", shared or files), ("fp32", reference)):
            (Path(tmp) / folder).mkdir()
            name = next(n for n in sorted(bundle) if n.endswith(LIBRARY_SUFFIXES))
            (Path(tmp) / folder / name).write_bytes(bundle[name])
            paths.append(Path(tmp) / folder / name)
        reduced, fp32 = (_runner(path) for path in paths)
        feeds = sample_inputs(reduced.info, options["samples"], options["inputs"])
        outputs = compare(reduced.run_all(feeds), fp32.run_all(feeds))
    report = {"reference": "fp32", "samples": len(feeds),
              "inputs": "random" if options["inputs"] == "random" else Path(options["inputs"]).name,
              "outputs": outputs}
    limit = options.get("min_cosine")
    if limit is not None:
        report["min_cosine"] = limit
        worst = min(outputs, key=lambda n: outputs[n]["cosine"])
        if outputs[worst]["cosine"] < limit:
            raise CuvilError(f"output '{worst}' has a cosine similarity of {outputs[worst]['cosine']:.10f} to "
                             f"the float32 build, below accuracy.min_cosine {limit}",
                             hint="keep the sensitive nodes in float32 (pass_options: {assign_precision: "
                                  "{keep_fp32: [...]}}; int4: {quantize_weights: {keep_fp32: [...]}} or a smaller "
                                  "quantization.group_size), use bf16 instead of fp16 or the reverse, or lower "
                                  "min_cosine")
    manifest = json.loads(files["manifest.json"])
    manifest["accuracy"] = report
    return {**files, "manifest.json": (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()}


def summary(report: dict) -> str:
    """One line for `cuvil build`."""
    outputs = report["outputs"].values()
    text = (f"accuracy vs fp32 ({report['samples']} {report['inputs']} samples): cosine >= "
            f"{min(o['cosine'] for o in outputs):.6f}, max rel err {max(o['max_rel_err'] for o in outputs):.2e}")
    top1 = [o["top1_agreement"] for o in outputs if "top1_agreement" in o]
    return text + (f", top-1 agreement {min(top1):.1%}" if top1 else "")
