"""`cuvil explain`: what the passes did to a model, the kernels it became, and its arena.

    fold_batchnorm      175 -> 122 nodes  53 BatchNormalization folded into Conv

For each pass: node counts before and after, and the pass's own account of
its rewrites (`describe(before, after)` in its module, which reads the two
graphs only, so passes stay pure). Then the kernel schedule with the ops each
kernel computes (a FusedConv's epilogue, a FusedElementwise's program), and
the memory plan: arena against naive bytes, and each buffer's offset and
lifetime.

`explain_graphs` works on graphs already made (the build's cached pass
steps, see `explain_variant`); `explain_model` runs import and passes itself.
Both lower and plan through `pipeline.plan` with the variant's parameters, so
the kernels, arena and weights shown are those of the library the build makes.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PassRecord:
    name: str
    nodes_before: int
    nodes_after: int
    summary: str


@dataclass
class KernelRecord:
    node: str
    op: str
    computes: str        # "Conv + Add(residual) + Relu", "FusedElementwise[Mul, Add, Relu]"...
    symbol: str
    output_shape: tuple
    # The reduced precision the kernel computes in ("bf16 (dpbf16)"), or why a node the precision
    # pass marked computes in float32; "" for float32 work nobody asked otherwise.
    precision: str = ""


@dataclass
class Explanation:
    model: str
    passes: list[PassRecord]
    kernels: list[KernelRecord]
    kernels_before: int          # kernel calls the imported graph would need with no pass
    views: int                   # schedule steps that are views (no code runs)
    memory: dict                 # arena_bytes, naive_bytes, weights_bytes, in_place, strategy, concats_in_place
    buffers: list[tuple]         # (offset, bytes, first step, last step, value)
    op_counts_before: dict = field(default_factory=dict)
    op_counts_after: dict = field(default_factory=dict)
    # (from, to, tensor) between kernels "k<i>" (index in `kernels`), graph inputs "in:<name>" and
    # outputs "out:<name>"; views (no code) are looked through to the kernel that made their data
    edges: list[tuple[str, str, str]] = field(default_factory=list)
    # measured selection (cuvil/select.py): {"cpu": the machine's model, "nodes": {node: {"kernel":
    # the one taken, "rules": the shape rules' one, "times_ms": {candidate: ms}}}}; empty for a build
    # by the shape rules
    selection: dict = field(default_factory=dict)

    @property
    def distinct_kernels(self) -> int:
        return len({k.symbol for k in self.kernels})


def computes(node) -> str:
    """What one node's kernel computes, fused ops included."""
    if node.domain == "cuvil" and node.op in ("FusedConv", "FusedGemm", "FusedMatMul"):
        parts = [node.op.replace("Fused", "")]
        if int(node.attr("has_residual", 0)):
            parts.append("Add(residual)")
        if node.attr("activation"):
            parts.append(str(node.attr("activation")))
        return " + ".join(parts)
    if node.domain == "cuvil" and node.op == "DepthwiseBlock":
        def conv(what, prefix, residual=False):
            act = node.attr(f"{prefix}activation")
            return " + ".join([what] + (["Add(residual)"] if residual else []) + ([str(act)] if act else []))
        kh, kw = node.attr("kernel_shape")
        parts = [conv("Conv1x1", "expand_")] if node.inputs[1] else []
        parts.append(conv(f"DepthwiseConv{kh}x{kw}/{node.attr('strides')[0]}", ""))
        if node.inputs[5]:
            parts.append(conv("Conv1x1", "project_", bool(node.inputs[7])))
        return "DepthwiseBlock[" + " -> ".join(parts) + "]"
    if node.domain == "cuvil" and node.op == "FusedAttention":
        scale = [node.attr("scale_op")] if node.attr("scale_op") else []
        mask = ["Add(mask)"] if len(node.inputs) > 3 and node.inputs[3] else []
        return "FusedAttention[" + " -> ".join(["MatMul"] + scale + mask + ["Softmax", "MatMul"]) + "]"
    if node.domain == "cuvil" and node.op == "FusedElementwise":
        return f"FusedElementwise[{', '.join(step.split()[0] for step in node.attr('program') or [])}]"
    return node.op


def explain_graphs(model: str, stages: list[tuple[str, object]], params) -> Explanation:
    """stages: [("import", graph), (pass name, graph after it), ...]; params: the variant's
    pipeline.VariantParams, so the kernels, arena and weights are the ones its build makes."""
    from backends.schedule import kernel_calls
    from passes import describe

    from . import pipeline

    records = []
    for (_, before), (name, after) in zip(stages, stages[1:]):
        records.append(PassRecord(name, len(before.nodes), len(after.nodes), describe(name, before, after)))
    first, final = stages[0][1], stages[-1][1]
    before_calls = len(kernel_calls(pipeline.lower(first.copy(), params.target, params.threads)))
    planned = pipeline.plan(final, params)
    nodes = {n.name: n for n in final.nodes}
    lowered = planned.graph.values    # the final graph's values and the lowering's scratch values
    kernels = []
    for call in planned.calls:
        node = nodes.get(call.node)
        out = call.args[-1] if isinstance(call.args[-1], str) else ""
        shape = tuple(lowered[out].shape) if out in lowered else ()
        kernels.append(KernelRecord(call.node, node.op if node else "?", computes(node) if node else "?",
                                    call.kernel.symbol, shape, _precision(call, node, params.target)))
    edges = _kernel_edges(final, [call.node for call in planned.calls])
    arena = planned.arena
    buffers = sorted((arena.offsets[r], lowered[r].nbytes, *arena.lifetimes[r], r) for r in arena.offsets)
    return Explanation(model, records, kernels, before_calls, len(planned.schedule) - len(planned.calls),
                       {**planned.figures(), "in_place": len(arena.in_place), "strategy": arena.strategy,
                        "concats_in_place": dict(sorted(arena.concats.items()))},
                       buffers, first.op_counts(), final.op_counts(), edges)


def _kernel_edges(graph, called: list[str]) -> list[tuple[str, str, str]]:
    """Which kernel's output each kernel reads (and the graph's inputs and outputs), for pictures."""
    kernel_of = {}
    for i, name in enumerate(called):
        kernel_of.setdefault(name, f"k{i}")
    producer = {out: node for node in graph.nodes for out in node.outputs}

    def source(value, depth=0):
        node = producer.get(value)
        if node is None:
            return f"in:{value}" if value in graph.inputs else None   # a constant: not drawn
        if node.name in kernel_of:
            return kernel_of[node.name]
        for v in node.inputs if depth < 64 else ():  # a view: its data is its input's
            found = source(v, depth + 1)
            if found is not None:
                return found
        return None

    nodes = {n.name: n for n in graph.nodes}
    edges = []
    for name, kernel in kernel_of.items():
        for value in nodes[name].inputs if name in nodes else ():
            found = source(value) if value else None
            if found is not None and found != kernel:
                edges.append((found, kernel, value))
    edges += [(found, f"out:{out}", out) for out in graph.outputs if (found := source(out)) is not None]
    return list(dict.fromkeys(edges))


def _precision(call, node, target=None) -> str:
    if call.precision or node is None or not node.attr("precision"):
        return call.precision
    marked = node.attr("precision")
    from backends.numba_cpu.gemm import LOWP_FORMATS
    from backends.numba_cpu.ukernel_lowp import method_for
    from backends.targets import is_cuda, missing_feature_reason
    if target is not None and is_cuda(target):
        return (f"float32 (marked {marked}: on CUDA targets only Gemm / MatMul / Conv weight products compute in "
                f"{marked}; this op's GPU kernel is float32)")
    if target is not None and marked in LOWP_FORMATS and method_for(LOWP_FORMATS[marked], target) is None:
        return f"float32 (marked {marked}: {missing_feature_reason(target, marked)})"
    return f"float32 (marked {marked}: the target has no kernel for it, or its operands do not fit one)"


def explain_model(source, input_shapes=None, opt_level=2, passes=None, disable_passes=(), pass_options=None,
                  name="model", target="native", threads=1, precision="fp32", calibration=None) -> Explanation:
    """Import a model (path, bytes or onnx.ModelProto) and run its passes here, uncached."""
    from . import pipeline

    source = pipeline.calibrated_source(source, input_shapes or {}, precision, calibration)
    graph = pipeline.import_any(source, input_shapes or {})   # TorchScript / TensorFlow exported first
    resolved = pipeline.resolve_variant_target(target, precision)
    names, options = pipeline.pass_list(opt_level, passes, disable_passes, pass_options, precision,
                                        gpu=pipeline.is_gpu(resolved))
    graph = pipeline.canonical_graph(graph, options)   # what the build's passes read: canonical names
    stages = [("import", graph)]
    pipeline.run_passes(graph, names, options, on_pass=lambda n, b, a: stages.append((n, a)))
    params = pipeline.VariantParams(name, resolved, threads, pipeline.memory_options(names, options))
    return explain_graphs(name, stages, params)


def explain_variant(dag, link_step: str, model: str) -> Explanation:
    """Explain one planned variant from its build steps: the import and pass steps are read from
    the step cache (or run and cached), so explaining after a build costs no pass run."""
    from .build import link_step_of, variant_params

    codegen = dag.step(link_step_of(dag, link_step)).deps[0]
    chain, name = [], dag.step(codegen).deps[0]
    while True:
        step = dag.step(name)
        chain.append(step)
        if step.kind != "pass":
            break
        name = step.deps[0]
    chain.reverse()
    stages = [("import", dag.get(chain[0].name))]
    stages += [(step.params["pass"], dag.get(step.name)) for step in chain[1:]]
    selection = _selection(dag, codegen)
    if selection:   # the kernels the codegen step lowers with
        from .select import apply
        stages[-1] = (stages[-1][0], apply(stages[-1][1], dag.step(codegen).params["select"]["kernels"]))
    report = explain_graphs(model, stages, variant_params(dag, link_step))
    report.selection = selection
    return report


def _selection(dag, codegen: str) -> dict:
    """The measured selection of a variant (its select step's output and the CPU it was measured
    on), or {} for a variant built by the shape rules."""
    if "select" not in dag.step(codegen).params:
        return {}
    step = f"{codegen.rsplit('/', 1)[0]}/select"
    return {"cpu": dag.step(step).params["cpu"], "nodes": dag.get(step)}


# -- text -----------------------------------------------------------------------------------

def _size(count) -> str:
    count = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return ""


def render(report: Explanation, max_buffers: int = 24) -> str:
    lines = [f"model {report.model}"]
    if report.passes:
        width = max(len(p.name) for p in report.passes)
        lines.append("passes")
        for p in report.passes:
            lines.append(f"  {p.name:<{width}}  {p.nodes_before:5d} -> {p.nodes_after:<5d} {p.summary}")
    else:
        lines.append("passes  (none)")
    lines.append(f"kernels  {len(report.kernels)} calls of {report.distinct_kernels} distinct kernels "
                 f"(without passes: {report.kernels_before} calls); {report.views} views (no code)")
    width = max((len(k.node) for k in report.kernels), default=4)
    width = min(width, 40)
    for k in report.kernels:
        shape = "x".join(str(d) for d in k.output_shape) or "scalar"
        lines.append(f"  {k.node[:width]:<{width}}  {k.computes:<36} -> {shape}"
                     + (f"  [{k.precision}]" if k.precision else ""))
    if report.selection:
        nodes = report.selection["nodes"]
        lines.append(f"select  measured on {report.selection['cpu']}: {len(nodes)} nodes with a choice")
        for node, result in nodes.items():
            fastest_first = sorted(result["times_ms"].items(), key=lambda kv: kv[1])
            times = ", ".join(f"{name} {ms:.3f} ms" for name, ms in fastest_first)
            lines.append(f"  {node[:width]:<{width}}  {result['kernel']:<12} rules {result['rules']:<12} ({times})")
    m = report.memory
    ratio = m["arena_bytes"] / m["naive_bytes"] if m["naive_bytes"] else 0.0
    shared = f", shared by the sessions {_size(m['shared_bytes'])}" if m.get("shared_bytes") else ""
    lines.append(f"arena  {_size(m['arena_bytes'])} for {_size(m['naive_bytes'])} of intermediates "
                 f"({ratio:.1%}; strategy {m['strategy']}, {m['in_place']} in place); "
                 f"weights {_size(m['weights_bytes'])}{shared}")
    for node, how in m.get("concats_in_place", {}).items():
        lines.append(f"  Concat {node}: {how}")
    shown = sorted(report.buffers, key=lambda b: (-b[1], b[0]))[:max_buffers]
    for offset, size, first, last, value in sorted(shown):
        lines.append(f"  @{offset:<10d} {_size(size):>10}  steps {first:>3}-{last:<3} {value}")
    if len(report.buffers) > len(shown):
        lines.append(f"  ... and {len(report.buffers) - len(shown)} smaller buffers")
    return "\n".join(lines)


def as_dict(report: Explanation) -> dict:
    return {"model": report.model,
            "passes": [vars(p) for p in report.passes],
            "kernels": [{**vars(k), "output_shape": list(k.output_shape)} for k in report.kernels],
            "kernels_before": report.kernels_before, "distinct_kernels": report.distinct_kernels,
            "memory": report.memory,
            "buffers": [dict(zip(("offset", "bytes", "first", "last", "value"), b)) for b in report.buffers],
            "op_counts_before": report.op_counts_before, "op_counts_after": report.op_counts_after,
            "edges": [list(e) for e in report.edges], "selection": report.selection}
