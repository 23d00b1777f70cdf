"""A library checks the CPU before it makes a session: code compiled for a target's instructions
never runs on a CPU without them (SIGILL); session_create fails with an error naming the feature.

The oracle for what this CPU has is the kernel's own list (/proc/cpuinfo `flags`)."""
import subprocess
from pathlib import Path

import pytest
from onnx import TensorProto, helper

import cuvil
from backends.native.driver import CPUID_BITS, cpu_check
from backends.targets import CHECKED_FEATURES, TARGETS, required_features, resolve_target
from cuvil.errors import RuntimeFailure

# LLVM's feature names -> Linux's /proc/cpuinfo flags
CPUINFO = {"avx512bf16": "avx512_bf16", "avx512vnni": "avx512_vnni", "avx512fp16": "avx512_fp16",
           "amx-bf16": "amx_bf16", "amx-tile": "amx_tile", "amx-int8": "amx_int8"}


def _cpu_flags() -> set:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("no flags line in /proc/cpuinfo")


def _has(feature: str) -> bool:
    return CPUINFO.get(feature, feature) in _cpu_flags()


def test_the_cpuid_bits_agree_with_the_kernel(tmp_path):
    """missing_cpu_feature() compiled for each checked feature alone reports it missing exactly when
    /proc/cpuinfo does not list it."""
    assert set(CPUID_BITS) == set(CHECKED_FEATURES)
    src = ["#include <stdio.h>", "#include <cpuid.h>"]
    for i, feature in enumerate(CHECKED_FEATURES):
        src.append(cpu_check([feature], "t").replace("missing_cpu_feature", f"missing_{i}")
                   .replace("target_name[]", f"target_name_{i}[]"))
    src.append("int main(void) {")
    src += [f'    puts(missing_{i}() ? "missing" : "present");' for i in range(len(CHECKED_FEATURES))]
    src.append("    return 0;\n}")
    (tmp_path / "check.c").write_text("\n".join(src) + "\n")
    subprocess.run(["gcc", "-O1", "-Wno-unused-const-variable", "-o", str(tmp_path / "check"),
                    str(tmp_path / "check.c")], check=True)
    out = subprocess.run([str(tmp_path / "check")], check=True, capture_output=True, text=True).stdout.split()
    assert dict(zip(CHECKED_FEATURES, out)) == {f: "present" if _has(f) else "missing" for f in CHECKED_FEATURES}


def test_native_needs_only_what_this_cpu_has():
    needed = required_features(resolve_target("native"))
    assert needed and all(_has(f) for f in needed)


def test_a_library_for_a_cpu_with_more_refuses_to_make_a_session():
    lacking = [(name, f) for name in ("x86_64-sapphirerapids", "x86_64-znver4", "x86_64-avx512", "x86_64-avx2")
               for f in required_features(TARGETS[name]) if not _has(f)]
    if not lacking:
        pytest.skip("this CPU has every feature of every named target")
    target = lacking[0][0]
    first_missing = next(f for f in required_features(TARGETS[target]) if not _has(f))
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    lib = cuvil.compile(model, target=target)
    with pytest.raises(RuntimeFailure, match=f"built for target '{target}', whose code uses {first_missing}, "
                                             "which this CPU does not have"):
        lib.session()
