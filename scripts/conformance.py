#!/usr/bin/env python
"""Run ONNX's backend node tests through cuvil.backend and write docs/conformance.md.

    python scripts/conformance.py -j 4                 # every node test, 4 processes
    python scripts/conformance.py -k 'reduce|topk'      # tests whose name or op matches
    python scripts/conformance.py --ops Gather,Slice    # the tests of some ops
    python scripts/conformance.py --json results.json   # also keep per-test results

Each test runs in a worker process (a crash of one test costs that test, not
the run). The tests of random ops (Bernoulli, training Dropout with a non-zero
ratio) expect values from numpy's unseeded generator, which cannot be matched:
such a test passes when its outputs have the expected shapes and dtypes AND a
statistical check of the op's law passes (`cuvil.backend._check_random`: the
rate of ones vs p, Dropout's kept fraction vs 1 - ratio and its 1 / (1 - ratio)
scaling, 4-sigma bounds from the sample size; seeded ops must repeat their bits). Without a filter the markdown report is written; with one, only a
summary is printed (and --json written) unless --doc is given.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The core op set of issue 4: every node test of these ops counts.
CORE_OPS = (
    "Add And ArgMax AveragePool BatchNormalization Cast Clip Concat ConstantOfShape Conv ConvTranspose CumSum "
    "DequantizeLinear Div Einsum Equal Erf Exp Expand Flatten GRU Gather Gelu Gemm GlobalAveragePool Greater "
    "HardSigmoid HardSwish InstanceNormalization LSTM LayerNormalization LeakyRelu Less MatMul MatMulInteger Max "
    "MaxPool Min Mul Neg Not Pad Pow QLinearConv QuantizeLinear Range ReduceMax ReduceMean ReduceSum Relu Reshape "
    "Resize Shape Sigmoid Slice Softmax Split Sqrt Squeeze Sub Tanh TopK Transpose Unsqueeze Where"
).split()


def _cases():
    warnings.filterwarnings("ignore")
    from cuvil.backend import load_node_tests
    return load_node_tests()


def summarise(exc: BaseException) -> str:
    """A short, stable bucket for a failure: the error class and its message's
    first line with names, numbers and quoted text blanked."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, AssertionError):
        if "Not equal to tolerance" in str(exc) or "Arrays are not equal" in str(exc) or "Mismatched" in str(exc):
            return "AssertionError: wrong values"
        text = re.sub(r"\(.*?\)", "(...)", text)
    text = re.sub(r"/tmp/[^\s:]*", "…", text)
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r"\bnode '…'(: | \(\w+\): )?", "", text)
    text = re.sub(r"\d+", "N", text)
    text = re.sub(r"\[[^\]]*\]", "[…]", text)
    return f"{type(exc).__name__}: {text[:140]}"


def worker(names: list[str], out_path: str, cache_dir: str | None) -> None:
    """Run the named tests, appending one JSON line per finished test to out_path."""
    if cache_dir:
        os.environ["CUVIL_CACHE_DIR"] = cache_dir
    from cuvil.backend import internal_exception, run_node_test
    by_name = {c.name: (c, op) for c, op in _cases()}
    with open(out_path, "a") as out:
        for name in names:
            case, op = by_name[name]
            start = time.perf_counter()
            result = {"name": name, "op": op}
            try:
                steps = run_node_test(case)
                result.update(status="pass", folded=steps == 0)
            except BaseException as exc:  # noqa: BLE001 - every failure is a result
                if isinstance(exc, KeyboardInterrupt):
                    raise
                result.update(status="fail", reason=summarise(exc), internal=internal_exception(exc),
                              detail="".join(traceback.format_exception_only(type(exc), exc))[-2000:])
            result["seconds"] = round(time.perf_counter() - start, 3)
            out.write(json.dumps(result) + "\n")
            out.flush()


def run_all(names: list[str], ops: dict, jobs: int, cache_dir: str | None, progress=True) -> dict:
    """Spread names over `jobs` worker processes; a worker that dies is restarted
    on its remaining tests and the test it was running counts as a crash."""
    results: dict[str, dict] = {}
    pending = [names[i::jobs] for i in range(jobs)]
    tmp = Path(tempfile.mkdtemp(prefix="cuvil-conformance-"))
    procs = {}
    started = time.time()
    shown = shown_bucket = -1

    def start(slot):
        todo = [n for n in pending[slot] if n not in results]
        if not todo:
            return
        lst = tmp / f"names{slot}.json"
        lst.write_text(json.dumps(todo))
        out = tmp / f"out{slot}.jsonl"
        cmd = [sys.executable, __file__, "--worker", str(lst), "--worker-out", str(out)]
        if cache_dir:
            cmd += ["--cache-dir", cache_dir]
        procs[slot] = (subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), todo, out)

    def collect(out):
        if out.exists():
            for line in out.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    results[r["name"]] = r

    for slot in range(jobs):
        start(slot)
    while procs:
        time.sleep(0.5)
        for slot in list(procs):
            proc, todo, out = procs[slot]
            if proc.poll() is None:
                continue
            stderr = proc.stderr.read().decode(errors="replace")
            collect(out)
            del procs[slot]
            left = [n for n in todo if n not in results]
            if left:
                crashed = left[0]
                tail = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit code {proc.returncode}"
                results[crashed] = {"name": crashed, "op": ops[crashed], "status": "fail",
                                    "reason": f"crash: the worker process died ({tail[:100]})", "detail": stderr[-2000:]}
                start(slot)
        done = len(results) + sum(_count_lines(out) for _, _, out in procs.values())
        if progress and done != shown:
            shown = done
            if sys.stderr.isatty():
                print(f"\r{done}/{len(names)} tests, {time.time() - started:.0f} s", end="", file=sys.stderr, flush=True)
            elif done // 200 != shown_bucket or done == len(names):
                shown_bucket = done // 200
                print(f"{done}/{len(names)} tests, {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    return results


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


# -- the report ------------------------------------------------------------------------------

def _pct(a, b):
    return f"{100.0 * a / b:.1f}%" if b else "-"


def _reasons(rows, limit=3) -> str:
    counts = collections.Counter(r["reason"] for r in rows if r["status"] != "pass")
    parts = [f"{n}× {reason}" for reason, n in counts.most_common(limit)]
    if len(counts) > limit:
        parts.append(f"{sum(n for _, n in counts.most_common()[limit:])}× other")
    return "; ".join(p.replace("|", "\\|") for p in parts)


def write_doc(results: dict, path: Path, exclude_count: int | None = None) -> str:
    import numba
    import onnx

    import cuvil
    by_op = collections.defaultdict(list)
    for r in results.values():
        by_op[r["op"]].append(r)
    core = [r for op in CORE_OPS for r in by_op.get(op, [])]
    everything = list(results.values())
    passed = lambda rows: sum(r["status"] == "pass" for r in rows)
    folded = lambda rows: sum(r["status"] == "pass" and r.get("folded") for r in rows)
    lines = [
        "# Conformance: ONNX backend node tests",
        "",
        f"Generated by `python scripts/conformance.py` (cuvil {cuvil.__version__}, onnx {onnx.__version__}, "
        f"numba {numba.__version__}). Do not edit by hand; rerun the script.",
        "",
        "| | tests | passed | rate |",
        "|---|---:|---:|---:|",
        f"| core op set ({len(CORE_OPS)} ops, issue 4) | {len(core)} | {passed(core)} | {_pct(passed(core), len(core))} |",
        f"| all node tests | {len(everything)} | {passed(everything)} | {_pct(passed(everything), len(everything))} |",
        "",
        f"Tests where an exception other than a CuvilError escaped cuvil (a bug): "
        f"{sum(bool(r.get('internal')) or r.get('reason', '').startswith('crash') for r in everything)}.",
        "",
        "How it is measured:",
        "",
        "- Every node test onnx generates (`onnx.backend.test.loader.load_model_tests(kind='node')`) runs through "
        "`cuvil.backend.CuvilBackend`: `prepare` compiles the model with `cuvil.compile`, `run` feeds the test's "
        "inputs, and each output must match the expected one in shape, dtype and value "
        "(`np.testing.assert_allclose` at the test's own rtol/atol where onnx sets them, else rtol=1e-3, atol=1e-5; "
        "integers and bools exactly).",
        "- Random ops (Bernoulli and its expanded form, training Dropout with a non-zero ratio) cannot match "
        "numpy's unseeded draws: such a test passes when the shapes and dtypes match AND a statistical check "
        "passes (rate of ones vs p, Dropout's kept fraction vs 1 - ratio and its 1 / (1 - ratio) scaling, "
        "within 4 standard deviations of the sample; an unseeded model is run 200 times and pooled, a seeded "
        "one must give the same bits on every run; `cuvil/backend.py`).",
        "- A test counts for the op whose node its generator exported, so a function op's `_expanded` "
        "variant (the function body as a graph) counts for that op. An op with no cuvil kernel whose schema "
        "defines a function (Attention, RMSNormalization, RotaryEmbedding...) is compiled from that body "
        "(`cuvil/frontends/expand.py`), as it is for any model.",
        "- Cuvil compiles for static shapes. Inputs whose value decides a shape or a kernel parameter "
        "(Reshape's shape, Slice's starts/ends/axes/steps, TopK's k, Pad's pads, reduction axes, Range's bounds, "
        "ConstantOfShape's shape...; the list is `cuvil.backend.BUILD_TIME_INPUTS`) are baked into the library as "
        "constants when the backend first sees them. "
        f"{folded(everything)} passing tests ({folded(core)} of the core set) then need no kernel at all: "
        "every node was folded at build time (Shape, Size, Range, ConstantOfShape of known values...).",
        "- The skip list of the test suite (`tests/test_conformance.py`, `EXCLUDE`) gives the reason for every "
        "test that does not pass.",
        "",
        "## Core op set",
        "",
        "| op | tests | passed | why not |",
        "|---|---:|---:|---|",
    ]
    for op in CORE_OPS:
        rows = by_op.get(op, [])
        lines.append(f"| {op} | {len(rows)} | {passed(rows)} | {_reasons(rows)} |")
    lines += ["", "## Failure buckets (all node tests)", "", "| tests | reason |", "|---:|---|"]
    buckets = collections.Counter(r["reason"] for r in everything if r["status"] != "pass")
    for reason, n in buckets.most_common(40):
        lines.append(f"| {n} | {reason.replace('|', chr(92) + '|')} |")
    if len(buckets) > 40:
        lines.append(f"| {sum(n for _, n in buckets.most_common()[40:])} | {len(buckets) - 40} other reasons |")
    lines += ["", "## Every op", "", "| op | tests | passed | why not |", "|---|---:|---:|---|"]
    for op in sorted(by_op):
        rows = by_op[op]
        lines.append(f"| {op}{' (core)' if op in CORE_OPS else ''} | {len(rows)} | {passed(rows)} | {_reasons(rows, 2)} |")
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def exclude_block(results: dict) -> str:
    """Python source of the EXCLUDE table: reason -> the ops all of whose tests fail
    for it ("op:Name") and the single tests."""
    failed = [r for r in results.values() if r["status"] != "pass"]
    by_op = collections.defaultdict(list)
    for r in results.values():
        by_op[r["op"]].append(r)
    whole_ops = {op for op, rows in by_op.items()
                 if all(r["status"] != "pass" for r in rows) and len({r["reason"] for r in rows}) == 1}
    table = collections.defaultdict(list)
    for r in sorted(failed, key=lambda r: (r["op"], r["name"])):
        if r["op"] in whole_ops:
            entry = f"op:{r['op']}"
            if entry not in table[r["reason"]]:
                table[r["reason"]].append(entry)
        else:
            table[r["reason"]].append(r["name"])
    lines = ["EXCLUDE = {"]
    for reason in sorted(table, key=lambda k: (-len(table[k]), k)):
        lines.append(f"    {reason!r}: [")
        entries = table[reason]
        row = "       "
        for e in entries:
            piece = f" {e!r},"
            if len(row) + len(piece) > 118:
                lines.append(row)
                row = "       "
            row += piece
        lines.append(row)
        lines.append("    ],")
    lines.append("}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-j", "--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("-k", "--filter", help="regular expression on test name or op")
    ap.add_argument("--ops", help="comma-separated ops (the op a test counts for)")
    ap.add_argument("--core", action="store_true", help="only the core op set")
    ap.add_argument("--json", help="write per-test results here")
    ap.add_argument("--from-json", help="read results from an earlier --json instead of running the tests")
    ap.add_argument("--exclude-block", action="store_true",
                    help="print the EXCLUDE table of tests/test_conformance.py for these results")
    ap.add_argument("--doc", default=None, help="markdown report path (default docs/conformance.md for a full run)")
    ap.add_argument("--cache-dir", default=os.environ.get("CUVIL_CACHE_DIR", str(ROOT / ".cuvil-cache" / "conformance")))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        worker(json.loads(Path(args.worker).read_text()), args.worker_out, args.cache_dir)
        return 0

    cases = _cases()
    ops = {c.name: op for c, op in cases}
    names = [c.name for c, _ in cases]
    if args.core:
        names = [n for n in names if ops[n] in CORE_OPS]
    if args.ops:
        wanted = set(args.ops.split(","))
        names = [n for n in names if ops[n] in wanted]
    if args.filter:
        rx = re.compile(args.filter)
        names = [n for n in names if rx.search(n) or rx.search(ops[n])]
    full = len(names) == len(cases)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = run_all(names, ops, max(1, args.jobs), args.cache_dir)
    results = {n: results[n] for n in names if n in results}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    doc = args.doc or (str(ROOT / "docs" / "conformance.md") if full else None)
    if doc:
        write_doc(results, Path(doc))
        print(f"wrote {doc}")
    if args.exclude_block:
        print(exclude_block(results))
        return 0
    core = [r for r in results.values() if r["op"] in CORE_OPS]
    ok = lambda rows: sum(r["status"] == "pass" for r in rows)
    print(f"core: {ok(core)}/{len(core)}   all: {ok(list(results.values()))}/{len(results)}")
    internal = sorted(n for n, r in results.items() if r.get("internal") or r.get("reason", "").startswith("crash"))
    print(f"internal exceptions (not a CuvilError: bugs): {len(internal)}" + (f" {internal}" if internal else ""))
    for reason, n in collections.Counter(r["reason"] for r in results.values() if r["status"] != "pass").most_common(25):
        print(f"{n:5d}  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
