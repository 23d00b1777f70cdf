"""LLM generation: Cuvil's generation library against onnxruntime-genai on the same ONNX folder.

    python benchmarks/llm.py FOLDER [FOLDER...] [--threads 1 2] [--prompt 128] [--new 64] [--repeat 3]
    python benchmarks/llm.py --tinyllama DIR --threads 1 --rounds 2    # the 1.1B-shaped int4 (big)

FOLDER is what onnxruntime-genai's model builder writes (model.onnx, genai_config.json). For each
folder and thread count, each engine runs in a process of its own (its peak RSS is its own) and
generates `--new` tokens greedily after a `--prompt`-token prompt (seeded random ids), `--repeat`
times, in `--rounds` processes alternating between the engines; the best figure counts (the
machine is shared: the best is the least disturbed):

  first token   prompt in, first new token chosen (prefill + the first argmax)
  decode        tokens/s of the other new tokens (one decode step and argmax each)
  peak RSS      of the engine's process (ru_maxrss), weights and KV cache included

and the memory-bandwidth floor: the read bandwidth numpy measures on this machine (1 and 2
threads) divided by the bytes of weights one decode step reads (every initializer except those only
gathered from, the embedding table), the decode rate no engine can pass. Cuvil builds its library
(generate: max_context = prompt + new, prefill bucket = prompt) through the step cache first.
onnxruntime-genai reads a copy of genai_config.json with its thread counts set (intra_op =
threads, inter_op = 1) and EOS ids outside the vocabulary dropped (the builder may add the
tokenizer's end-of-turn id past it, which the generator refuses).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/profile.py would shadow the standard library's `profile`, which transformers' LLaMA
# (through torch's dynamo and cProfile) imports in make_decoder: this folder leaves the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


TINYLLAMA = dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048)


def make_decoder(folder: Path, config: dict, precision: str = "int4", keep_hf: bool = False) -> Path:
    """onnxruntime-genai's builder output for a LLaMA of `config` with seeded random weights (the
    Hugging Face folder written under `folder`/hf first, deleted once built: a 1.1B model's float32
    weights are 4.4 GB); nothing is downloaded. Returns `folder`/`precision`."""
    out = folder / precision
    if (out / "genai_config.json").exists():
        return out
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    hf = folder / "hf"
    if not (hf / "config.json").exists():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(hf)
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, config["vocab_size"])}}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                             eos_token="</s>").save_pretrained(hf)
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(hf), "-o", str(out),
                    "-p", precision, "-e", "cpu", "-c", str(folder / "cache")], check=True)
    if not keep_hf:
        shutil.rmtree(hf)
        shutil.rmtree(folder / "cache", ignore_errors=True)
    return out


def prompt_ids(folder: Path, n: int) -> list[int]:
    vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
    return [int(t) for t in np.random.default_rng(0).integers(3, vocab, n)]


def peak_rss_mb() -> float:
    """The process's peak resident set (VmHWM: ru_maxrss would carry the parent's peak across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_cuvil(library: str, prompt: list[int], new: int, repeat: int) -> dict:
    import cuvil
    lib = cuvil.load(library)
    gen = lib._generation()
    session = lib.session()
    logits = np.empty(gen.vocab_size, np.float32)
    ids = np.array(prompt, np.int64)
    best_first, best_decode, tokens = float("inf"), float("inf"), []
    for _ in range(repeat):
        session.reset()
        t0 = time.perf_counter()
        session._check(gen.prefill(session._handle, ids.ctypes.data, len(ids), logits.ctypes.data), "prefill")
        token = gen.sample(logits.ctypes.data, None, None)
        t1 = time.perf_counter()
        out = [token]
        for _ in range(new - 1):
            session._check(gen.decode(session._handle, token, logits.ctypes.data), "decode")
            token = gen.sample(logits.ctypes.data, None, None)
            out.append(token)
        t2 = time.perf_counter()
        best_first, best_decode, tokens = min(best_first, t1 - t0), min(best_decode, t2 - t1), out
    return {"first_token_ms": best_first * 1e3, "decode_tok_s": (new - 1) / best_decode,
            "peak_rss_mb": peak_rss_mb(), "tokens": tokens}


def run_genai(folder: str, prompt: list[int], new: int, repeat: int) -> dict:
    import onnxruntime_genai as og
    model = og.Model(folder)
    best_first, best_decode, tokens = float("inf"), float("inf"), []
    for _ in range(repeat):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + new)
        generator = og.Generator(model, params)
        t0 = time.perf_counter()
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        generator.generate_next_token()
        out = [int(generator.get_next_tokens()[0])]
        t1 = time.perf_counter()
        while len(out) < new and not generator.is_done():
            generator.generate_next_token()
            out.append(int(generator.get_next_tokens()[0]))
        t2 = time.perf_counter()
        best_first, best_decode, tokens = min(best_first, t1 - t0), min(best_decode, t2 - t1), out
        del generator
    return {"first_token_ms": best_first * 1e3, "decode_tok_s": (len(tokens) - 1) / best_decode,
            "peak_rss_mb": peak_rss_mb(), "tokens": tokens}


def genai_folder(folder: Path, threads: int, into: Path) -> Path:
    """A folder with the model's files linked and genai_config.json's threads (and EOS ids) set."""
    config = json.loads((folder / "genai_config.json").read_text())
    model = config["model"]
    eos = model.get("eos_token_id", [])
    eos = [e for e in (eos if isinstance(eos, list) else [eos]) if e < model["vocab_size"]]
    model["eos_token_id"] = eos if len(eos) != 1 else eos[0]
    model["decoder"]["session_options"].update(intra_op_num_threads=threads, inter_op_num_threads=1)
    into.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name != "genai_config.json" and not (into / item.name).exists():
            (into / item.name).symlink_to(item.resolve())
    (into / "genai_config.json").write_text(json.dumps(config, indent=2))
    return into


def build_cuvil(folder: Path, threads: int, prompt: int, new: int, out: Path) -> tuple[str, dict]:
    import cuvil
    name = f"llm_t{threads}"
    lib = cuvil.compile(folder / "model.onnx", name=name, threads=threads, jobs=2,
                        generate={"max_context": prompt + new, "prefill_buckets": [prompt]})
    path = lib.save(out / name)
    return str(path), lib.info


def weight_bytes_per_token(folder: Path) -> int:
    """Bytes of initializers a decode step reads: all but those read only by Gather (the embedding)."""
    import onnx
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    readers = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            readers.setdefault(name, set()).add((node.op_type, i))
    total = 0
    for tensor in model.graph.initializer:
        if readers.get(tensor.name) == {("Gather", 0)}:
            continue
        size = int(np.prod(tensor.dims)) if tensor.dims else 1
        total += size * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    return total


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeat: int = 5) -> float:
    """GB/s of summing a float32 array far larger than the caches, over `threads` threads: a Numba
    loop (vectorised, several accumulators: fastmath) that releases the GIL, one slice a thread."""
    from concurrent.futures import ThreadPoolExecutor

    import numba

    @numba.njit(nogil=True, fastmath=True, cache=False)
    def total(a):
        s = np.float32(0)
        for i in range(a.size):
            s += a[i]
        return s

    data = np.ones(nbytes // 4, np.float32)
    parts = np.array_split(data, threads)
    total(parts[0][:1024])
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):
            t0 = time.perf_counter()
            list(pool.map(total, parts))
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def worker(args) -> None:
    prompt = json.loads(args.prompt_ids)
    if args.engine == "cuvil":
        result = run_cuvil(args.target, prompt, args.new, args.repeat)
    else:
        result = run_genai(args.target, prompt, args.new, args.repeat)
    print(json.dumps(result))


def in_process(engine: str, target: str, prompt: list[int], new: int, repeat: int, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, __file__, "--worker", engine, target, "--prompt-ids", json.dumps(prompt),
           "--new", str(new), "--repeat", str(repeat)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{engine} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def best(runs: list[dict]) -> dict:
    """The best figures of several rounds (each the best of its repeats), the last round's tokens."""
    return {"first_token_ms": min(r["first_token_ms"] for r in runs),
            "decode_tok_s": max(r["decode_tok_s"] for r in runs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "tokens": runs[-1]["tokens"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="*", type=Path)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="generations per process (the best counts)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per engine, alternating")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--tinyllama", type=Path, metavar="DIR",
                        help="also run a TinyLlama-1.1B-shaped int4 decoder (seeded random weights), made in DIR "
                             "by onnxruntime-genai's builder when DIR/int4 is missing (about 2 minutes, 4.4 GB of "
                             "float32 weights on disk while it runs, 0.9 GB kept)")
    parser.add_argument("--worker", nargs=2, metavar=("ENGINE", "TARGET"), help=argparse.SUPPRESS)
    parser.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.engine, args.target = args.worker
        worker(args)
        return 0
    if args.tinyllama:
        args.folders.append(make_decoder(args.tinyllama.resolve(), TINYLLAMA, "int4"))
    bandwidth = {t: read_bandwidth(t) for t in sorted(set(args.threads))}
    results = []
    with tempfile.TemporaryDirectory(prefix="cuvil-llm-bench-") as tmp:
        for folder in args.folders:
            folder = folder.resolve()
            prompt = prompt_ids(folder, args.prompt)
            per_token = weight_bytes_per_token(folder)
            for threads in args.threads:
                started = time.perf_counter()
                library, info = build_cuvil(folder, threads, args.prompt, args.new, Path(tmp))
                build_s = time.perf_counter() - started
                peer_folder = genai_folder(folder, threads, Path(tmp) / f"{folder.name}-genai-t{threads}")
                # rounds alternate between the engines, so a burst of load elsewhere hits both
                runs = {"cuvil": [], "genai": []}
                for _ in range(args.rounds):
                    # the bandwidth too, between the runs: the best of its measurements, as theirs
                    bandwidth[threads] = max(bandwidth[threads], read_bandwidth(threads))
                    runs["cuvil"].append(in_process("cuvil", library, prompt, args.new, args.repeat, threads))
                    runs["genai"].append(in_process("genai", str(peer_folder), prompt, args.new, args.repeat, threads))
                ours, peer = best(runs["cuvil"]), best(runs["genai"])
                same = sum(a == b for a, b in zip(ours.pop("tokens"), peer.pop("tokens")))
                floor = bandwidth[threads] * 1e9 / per_token
                results.append({"model": str(folder), "threads": threads, "cuvil": ours, "onnxruntime_genai": peer,
                                "same_tokens": same, "weights_bytes": info["memory"]["weights_bytes"],
                                "weight_bytes_per_token": per_token, "read_gb_s": bandwidth[threads],
                                "floor_tok_s": floor, "build_s": build_s})
                print(f"{folder.name} threads={threads}: first token {ours['first_token_ms']:.1f} ms vs "
                      f"{peer['first_token_ms']:.1f} ms ({ours['first_token_ms'] / peer['first_token_ms']:.2f}x); "
                      f"decode {ours['decode_tok_s']:.1f} vs {peer['decode_tok_s']:.1f} tok/s "
                      f"({ours['decode_tok_s'] / peer['decode_tok_s']:.2f}x; floor {floor:.1f} tok/s, cuvil at "
                      f"{100 * ours['decode_tok_s'] / floor:.0f} %); peak RSS {ours['peak_rss_mb']:.0f} vs "
                      f"{peer['peak_rss_mb']:.0f} MB (weights {info['memory']['weights_bytes'] / 2**20:.0f} MiB: Cuvil "
                      f"{ours['peak_rss_mb'] * 2**20 / info['memory']['weights_bytes']:.2f}x); build {build_s:.0f} s; "
                      f"same greedy tokens {same}/{args.new}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
