"""Pictures: a model's compiled graph, a build's step timeline, a benchmark's latencies.

- `graph_svg(explanation)`: the compiled graph (one box per kernel call, the ops
  it fuses listed inside, the tensors between them) laid out by Graphviz `dot`,
  above the memory plan's lifetimes (each arena buffer a bar from the first to
  the last schedule step that uses it, at its offset). `cuvil graph MODEL
  --format svg`.
- `graph_html(explanation)`: the same as one self-contained HTML page (no
  Graphviz, no network: the layout is computed here, layer by layer), with the
  kernels and buffers as tables; hovering a kernel highlights its tensors.
  `cuvil graph MODEL --format html`.
- `timeline_html(report)`: the steps of a build on a time axis, one lane per
  thread or Dask worker. `cuvil build --timeline out.html`.
- `bench_plot(report, path)`: median latency per engine with min..p90 ranges,
  a PNG by matplotlib. `cuvil bench ... --plot out.png`.

The pages draw with inline SVG and a few lines of script; when the script has
run, `<body data-rendered="ok">` (what the headless-browser test looks for).
"""
from __future__ import annotations

import html
import json
import shutil
import subprocess

from .errors import CuvilError

_KIND_COLOURS = {"export": "#8c564b", "import": "#1f77b4", "pass": "#17becf", "codegen": "#9467bd",
                 "kernel": "#ff7f0e", "link": "#2ca02c", "accuracy": "#d62728"}
_FUSED = "#fde9c9"
_PLAIN = "#e8eef7"


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _size(count) -> str:
    count = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return ""


def fused_ops(computes: str) -> list[str]:
    """The ops one kernel computes: "Conv + Add(residual) + Relu" -> three, "FusedElementwise[Mul, Add]" -> two."""
    if "[" in computes and computes.endswith("]"):
        head, body = computes[:-1].split("[", 1)
        parts = [p.strip() for p in body.replace(" -> ", ",").split(",") if p.strip()]
        return parts or [head]
    return [p.strip() for p in computes.split(" + ")]


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape) or "scalar"


# -- the compiled graph ------------------------------------------------------------------------

def _boxes(expl) -> dict[str, dict]:
    """One box per graph node, keyed "k<i>" by its first kernel call (as `Explanation.edges` names it):
    its fused ops, its output shape (its last call's: earlier ones may write scratch, e.g. Winograd's
    transforms) and the kernels it calls."""
    boxes, first = {}, {}
    for i, k in enumerate(expl.kernels):
        key = first.setdefault(k.node, f"k{i}")
        box = boxes.setdefault(key, {"node": k.node, "ops": fused_ops(k.computes), "precision": k.precision,
                                     "symbols": []})
        box["shape"] = _shape(k.output_shape)
        box["symbols"].append(k.symbol)
    for box in boxes.values():
        calls = len(box["symbols"])
        box["lines"] = box["ops"] + [box["shape"] + (f" ({calls} kernel calls)" if calls > 1 else "")] + \
            ([box["precision"][:40]] if box["precision"] else [])
    return boxes


def graph_dot(expl) -> str:
    """The compiled graph in Graphviz's language: a box per kernel call, its fused ops as rows."""
    lines = ["digraph compiled {", '  graph [rankdir=TB, fontname="Helvetica", fontsize=10];',
             '  node [shape=plain, fontname="Helvetica", fontsize=10];', '  edge [fontname="Helvetica", fontsize=8, color="#666666"];']
    for key, box in _boxes(expl).items():
        colour = _FUSED if len(box["ops"]) > 1 else _PLAIN
        rows = "".join(f"<TR><TD>{_e(op)}</TD></TR>" for op in box["ops"])
        rows += "".join(f'<TR><TD><FONT POINT-SIZE="8">{_e(text)}</FONT></TD></TR>'
                        for text in box["lines"][len(box["ops"]):])
        label = (f'<<TABLE BORDER="1" CELLBORDER="0" CELLSPACING="0" CELLPADDING="3" BGCOLOR="{colour}">'
                 f'<TR><TD><B>{_e(box["node"][:48])}</B></TD></TR>{rows}</TABLE>>')
        lines.append(f'  {key} [label={label}, tooltip="{_e(", ".join(box["symbols"]))}"];')
    for end in sorted({e for a, b, _ in expl.edges for e in (a, b) if not e.startswith("k")}):
        lines.append(f'  "{_e(end)}" [shape=ellipse, style=filled, fillcolor="#eeeeee", label="{_e(end.split(":", 1)[1])}"];')
    for a, b, value in expl.edges:
        a = a if a.startswith("k") else f'"{_e(a)}"'
        b = b if b.startswith("k") else f'"{_e(b)}"'
        lines.append(f'  {a} -> {b} [tooltip="{_e(value)}"];')
    return "\n".join(lines + ["}"])


def _dot_svg(dot: str) -> str:
    exe = shutil.which("dot")
    if exe is None:
        raise CuvilError("--format svg needs Graphviz's `dot`, which is not installed",
                         hint="install it (apt-get install graphviz, brew install graphviz), or use --format html, "
                              "which needs nothing")
    done = subprocess.run([exe, "-Tsvg"], input=dot.encode(), capture_output=True, timeout=120)
    if done.returncode != 0:
        raise CuvilError(f"Graphviz `dot` failed: {done.stderr.decode(errors='replace').strip()[:400]}")
    text = done.stdout.decode()
    return text[text.index("<svg"):]


def lifetimes_svg(expl, width: int = 900, height: int = 320) -> str:
    """The memory plan: x = schedule step, y = arena offset; one bar per buffer while it is live."""
    buffers = expl.buffers
    arena = max((off + size for off, size, *_ in buffers), default=0) or 1
    steps = max((last for *_, last, _ in buffers), default=0) + 1
    left, top, plot_w, plot_h = 70, 30, width - 90, height - 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11" class="lifetimes">',
           f'<text x="{left}" y="18" font-weight="bold">memory plan: arena {_e(_size(expl.memory["arena_bytes"]))} '
           f'for {_e(_size(expl.memory["naive_bytes"]))} of intermediates, {len(buffers)} buffers</text>',
           f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#999"/>']
    for i, (offset, size, first, last, value) in enumerate(buffers):
        x = left + plot_w * first / steps
        w = max(plot_w * (last + 1 - first) / steps, 1.0)
        y = top + plot_h * offset / arena
        h = max(plot_h * size / arena, 1.0)
        hue = (i * 47) % 360
        out.append(f'<rect class="buffer" data-value="{_e(value)}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" '
                   f'height="{h:.1f}" fill="hsl({hue},60%,70%)" stroke="#555" stroke-width="0.5">'
                   f'<title>{_e(value)}: {_e(_size(size))} at offset {offset}, steps {first}-{last}</title></rect>')
        if w > 70 and h > 13:   # a label where it fits; the tooltip always has it
            out.append(f'<text x="{x + 4:.1f}" y="{y + min(h, 26) / 2 + 4:.1f}" font-size="10" pointer-events="none">'
                       f'{_e(value[: int(w / 6)])} ({_e(_size(size))})</text>')
    out.append(f'<text x="{left}" y="{height - 10}">schedule step 0 .. {steps - 1}</text>')
    out.append(f'<text x="8" y="{top + 10}">offset 0</text><text x="8" y="{top + plot_h}">{_e(_size(arena))}</text>')
    return "\n".join(out + ["</svg>"])


def graph_svg(expl) -> str:
    """One SVG document: the compiled graph by Graphviz, the memory plan's lifetimes below it."""
    graph = _dot_svg(graph_dot(expl))
    import re
    match = re.search(r'<svg[^>]*\bwidth="([\d.]+)pt"[^>]*\bheight="([\d.]+)pt"', graph, re.S)
    gw, gh = (float(match.group(1)) * 4 / 3, float(match.group(2)) * 4 / 3) if match else (900.0, 600.0)
    lw, lh = 900, 320
    width, height = max(gw, lw), gh + lh + 20
    title = (f'<text x="10" y="20" font-family="Helvetica" font-size="14" font-weight="bold">{_e(expl.model)}: '
             f'{len(expl.kernels)} kernel calls ({expl.distinct_kernels} distinct), '
             f'arena {_e(_size(expl.memory["arena_bytes"]))}</text>')
    inner = graph.replace("<svg", f'<svg x="0" y="30"', 1)
    lifetimes = lifetimes_svg(expl, lw, lh).replace("<svg", f'<svg x="0" y="{gh + 40:.0f}"', 1)
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<svg xmlns="http://www.w3.org/2000/svg" '
            f'xmlns:xlink="http://www.w3.org/1999/xlink" width="{width:.0f}" height="{height + 30:.0f}" '
            f'viewBox="0 0 {width:.0f} {height + 30:.0f}">\n<rect width="100%" height="100%" fill="white"/>\n'
            f"{title}\n{inner}\n{lifetimes}\n</svg>\n")


def _layers(expl) -> dict[str, int]:
    """Layer of each drawn node: graph inputs 0, a kernel one below the deepest kernel it reads."""
    ids = list(_boxes(expl))
    ends = sorted({e for a, b, _ in expl.edges for e in (a, b) if not e.startswith("k")})
    preds = {n: [] for n in ids + ends}
    for a, b, _ in expl.edges:
        preds[b].append(a)
    layer = {}

    def depth(n, seen=()):
        if n not in layer:
            layer[n] = 0 if not preds[n] or n in seen else 1 + max(depth(p, seen + (n,)) for p in preds[n])
        return layer[n]

    for n in ids + ends:
        depth(n)
    last = max(layer.values(), default=0)
    for n in ends:
        if n.startswith("out:"):
            layer[n] = last + 1 if any(layer[m] == last for m in ids) else last
    return layer


def _graph_layout_svg(expl) -> str:
    """The compiled graph drawn here (no Graphviz): layers top to bottom, nodes side by side."""
    layer = _layers(expl)
    boxes = _boxes(expl)
    box_w, gap_x, gap_y, line = 230, 30, 46, 15
    heights = {n: line * (1 + len(boxes[n]["lines"])) + 8 if n in boxes else 26 for n in layer}
    rows: dict[int, list[str]] = {}
    for n in sorted(layer, key=lambda n: (layer[n], int(n[1:]) if n.startswith("k") else -1, n)):
        rows.setdefault(layer[n], []).append(n)
    pos, y = {}, 20
    widest = max((len(r) for r in rows.values()), default=1)
    width = widest * (box_w + gap_x) + gap_x
    for level in sorted(rows):
        row = rows[level]
        x0 = (width - len(row) * (box_w + gap_x) + gap_x) / 2
        for j, n in enumerate(row):
            pos[n] = (x0 + j * (box_w + gap_x), y)
        y += max(heights[n] for n in row) + gap_y
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y:.0f}" '
           f'viewBox="0 0 {width:.0f} {y:.0f}" font-family="Helvetica, Arial, sans-serif" font-size="11" class="graph">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" '
           'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#666"/></marker></defs>']
    for a, b, value in expl.edges:
        (ax, ay), (bx, by) = pos[a], pos[b]
        x1, y1, x2, y2 = ax + box_w / 2, ay + heights[a], bx + box_w / 2, by
        mid = (y1 + y2) / 2
        out.append(f'<path class="edge" data-from="{a}" data-to="{b}" d="M {x1:.1f} {y1:.1f} C {x1:.1f} {mid:.1f}, '
                   f'{x2:.1f} {mid:.1f}, {x2:.1f} {y2:.1f}" fill="none" stroke="#666" marker-end="url(#arrow)">'
                   f'<title>{_e(value)}</title></path>')
    for n, (x, y0) in pos.items():
        h = heights[n]
        if not n.startswith("k"):
            out.append(f'<g class="end" data-id="{_e(n)}"><rect x="{x:.1f}" y="{y0:.1f}" width="{box_w}" height="{h}" '
                       f'rx="13" fill="#eeeeee" stroke="#888"/><text x="{x + box_w / 2:.1f}" y="{y0 + 17:.1f}" '
                       f'text-anchor="middle">{_e(n)}</text></g>')
            continue
        box = boxes[n]
        fill = _FUSED if len(box["ops"]) > 1 else _PLAIN
        parts = [f'<g class="kernel" data-id="{n}"><title>{_e(", ".join(box["symbols"]))}</title>'
                 f'<rect x="{x:.1f}" y="{y0:.1f}" width="{box_w}" height="{h}" rx="4" fill="{fill}" stroke="#555"/>',
                 f'<text x="{x + 6:.1f}" y="{y0 + line:.1f}" font-weight="bold">{_e(box["node"][:34])}</text>']
        for r, text in enumerate(box["lines"]):
            style = ' fill="#555" font-size="10"' if r >= len(box["ops"]) else ""
            parts.append(f'<text x="{x + 12:.1f}" y="{y0 + line * (r + 2):.1f}"{style}>{_e(text)}</text>')
        out.append("".join(parts) + "</g>")
    return "\n".join(out + ["</svg>"])


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin-top: 28px; }}
table {{ border-collapse: collapse; font-size: 12px; }} td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; }}
.legend span {{ display: inline-block; padding: 2px 8px; margin-right: 8px; border: 1px solid #999; }}
.hl rect {{ stroke: #d62728 !important; stroke-width: 2.5 !important; }} path.hl {{ stroke: #d62728; stroke-width: 2.5; }}
</style></head>
<body>
<h1>{title}</h1>
{body}
<script id="data" type="application/json">{data}</script>
<script>
"use strict";
(function () {{
{script}
  document.body.dataset.rendered = "ok";
}})();
</script>
</body></html>
"""

_GRAPH_SCRIPT = """
  const data = JSON.parse(document.getElementById("data").textContent);
  const edges = Array.from(document.querySelectorAll("path.edge"));
  for (const node of document.querySelectorAll("g.kernel, g.end")) {
    const id = node.dataset.id;
    node.addEventListener("mouseenter", () => {
      node.classList.add("hl");
      for (const e of edges) if (e.dataset.from === id || e.dataset.to === id) e.classList.add("hl");
    });
    node.addEventListener("mouseleave", () => {
      node.classList.remove("hl");
      for (const e of edges) e.classList.remove("hl");
    });
  }
  document.getElementById("count").textContent = String(data.kernels.length);
"""


def _data(obj) -> str:
    # JSON inside <script>: "</" would end the element early
    return json.dumps(obj).replace("</", "<\\/")


def graph_html(expl) -> str:
    """The compiled graph and the memory plan as one self-contained page."""
    from .explain import as_dict
    m = expl.memory
    kernels = "".join(f"<tr><td>k{i}</td><td>{_e(k.node)}</td><td>{_e(k.computes)}</td><td>{_e(_shape(k.output_shape))}"
                      f"</td><td>{_e(k.precision)}</td><td><code>{_e(k.symbol)}</code></td></tr>"
                      for i, k in enumerate(expl.kernels))
    buffers = "".join(f"<tr><td>{_e(v)}</td><td>{off}</td><td>{_e(_size(size))}</td><td>{first}-{last}</td></tr>"
                      for off, size, first, last, v in expl.buffers)
    body = (f'<p><span id="count"></span> kernel calls of {expl.distinct_kernels} distinct kernels '
            f"(without passes: {expl.kernels_before}); arena {_e(_size(m['arena_bytes']))} for "
            f"{_e(_size(m['naive_bytes']))} of intermediates, weights {_e(_size(m['weights_bytes']))}.</p>"
            f'<p class="legend"><span style="background:{_FUSED}">fused kernel (ops listed inside)</span>'
            f'<span style="background:{_PLAIN}">single op</span> hover a box to highlight its tensors</p>'
            f"<h2>Compiled graph</h2>{_graph_layout_svg(expl)}"
            f"<h2>Memory plan: buffer lifetimes</h2>{lifetimes_svg(expl)}"
            f"<h2>Kernels</h2><table><tr><th></th><th>node</th><th>computes</th><th>output</th><th>precision</th>"
            f"<th>symbol</th></tr>{kernels}</table>"
            f"<h2>Buffers</h2><table><tr><th>tensor</th><th>offset</th><th>bytes</th><th>steps</th></tr>{buffers}</table>")
    return _PAGE.format(title=_e(f"{expl.model}: compiled graph"), body=body, data=_data(as_dict(expl)),
                        script=_GRAPH_SCRIPT)


# -- the build's step timeline -----------------------------------------------------------------

_TIMELINE_SCRIPT = """
  const data = JSON.parse(document.getElementById("data").textContent);
  const steps = data.steps.filter(s => s.status === "ran");
  const lanes = Array.from(new Set(steps.map(s => s.worker || "main"))).sort();
  const end = Math.max(0.001, ...steps.map(s => s.started + s.seconds));
  const left = 190, width = 1100, laneH = 22, top = 30;
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  const height = top + lanes.length * laneH + 40;
  svg.setAttribute("width", String(left + width + 20));
  svg.setAttribute("height", String(height));
  svg.setAttribute("font-family", "Helvetica, Arial, sans-serif");
  svg.setAttribute("font-size", "11");
  function el(name, attrs, text) {
    const e = document.createElementNS(svgNS, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e);
    return e;
  }
  lanes.forEach((lane, i) => {
    el("text", {x: 4, y: top + i * laneH + 15}, lane);
    el("line", {x1: left, x2: left + width, y1: top + (i + 1) * laneH, y2: top + (i + 1) * laneH, stroke: "#eee"});
  });
  for (let t = 0; t <= 10; t++) {
    const x = left + width * t / 10;
    el("line", {x1: x, x2: x, y1: top - 4, y2: height - 30, stroke: "#ddd"});
    el("text", {x: x - 10, y: height - 14}, (end * t / 10).toFixed(2) + " s");
  }
  for (const s of steps) {
    const lane = lanes.indexOf(s.worker || "main");
    const bar = el("rect", {class: "step", x: left + width * s.started / end, y: top + lane * laneH + 3,
      width: Math.max(1, width * s.seconds / end), height: laneH - 6, fill: data.colours[s.kind] || "#999",
      stroke: "#fff", "stroke-width": 0.7});
    const tip = document.createElementNS(svgNS, "title");
    tip.textContent = s.name + " (" + s.kind + ", " + s.seconds.toFixed(3) + " s)";
    bar.appendChild(tip);
  }
  document.getElementById("chart").appendChild(svg);
  document.getElementById("summary").textContent = steps.length + " steps ran on " + lanes.length +
    " lane(s) in " + end.toFixed(2) + " s (" + (steps.length / end).toFixed(1) + " steps/s); " +
    (data.steps.length - steps.length) + " cached";
"""


def timeline_html(report: dict, title: str = "cuvil build") -> str:
    """A build's steps (`StepGraph.report()`) on a time axis, one lane per thread or worker."""
    legend = "".join(f'<span style="background:{c}">{k}</span>' for k, c in _KIND_COLOURS.items())
    body = (f'<p id="summary"></p><p class="legend">{legend}</p><div id="chart"></div>'
            "<p>Each bar is a step that ran (hover for its name); cached steps took no time and are not drawn.</p>")
    return _PAGE.format(title=_e(f"{title}: step timeline"), body=body,
                        data=_data({"steps": report["steps"], "colours": _KIND_COLOURS}), script=_TIMELINE_SCRIPT)


# -- benchmark plot ----------------------------------------------------------------------------

def bench_plot(report: dict, path) -> None:
    """Median latency per engine, the bar's whisker from min to p90 (`cuvil bench --plot`)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CuvilError("--plot needs matplotlib, which is not installed", hint="pip install 'cuvil[plot]'") from None
    results = report["results"]
    names = list(results)
    # microseconds for models that run in less than 0.1 ms, so the labels keep their digits
    scale, unit = (1000.0, "µs") if max((r["median_ms"] for r in results.values()), default=1) < 0.1 else (1.0, "ms")
    medians = [results[n]["median_ms"] * scale for n in names]
    low = [(results[n]["median_ms"] - results[n]["min_ms"]) * scale for n in names]
    high = [max(results[n]["p90_ms"] - results[n]["median_ms"], 0.0) * scale for n in names]
    precision = report.get("precision") or "?"
    labels = [f"{n}\n({precision if n.startswith('cuvil') or n == 'openvino' else 'fp32'})" for n in names]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(names) + 2), 4.2), dpi=120)
    colours = ["#2ca02c" if n.startswith("cuvil") else "#1f77b4" for n in names]
    bars = ax.bar(labels, medians, yerr=[low, high], capsize=6, color=colours)
    for bar, value, above in zip(bars, medians, high):
        ax.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, value + above), ha="center",
                    va="bottom", xytext=(0, 3), textcoords="offset points", fontsize=8)
    ax.set_ylabel(f"latency per call, {unit} (median; whiskers min..p90)")
    ax.set_title(f"{report.get('model') or '?'}: threads {report.get('threads') or '?'}, precision {precision}")
    ax.set_ylim(0, max(m + h for m, h in zip(medians, high)) * 1.2 if medians else 1)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as error:
        raise CuvilError(f"cannot write {path}: {error.strerror}") from None
    finally:
        plt.close(fig)
