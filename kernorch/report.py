"""A self-contained HTML report of an optimized model, and a PNG plot of benchmark results.

    write_report("out/")            # -> out/report.html  (reads report.json, plan.json, graph.json, bench.json)
    plot_bench(results, "b.png")    # latency per model per system, and speedup over ONNX Runtime

The report must open anywhere, offline, years later: one HTML file, inline CSS, inline SVG drawn
here (no JS/CSS libraries, no fonts, no network), and a few lines of inline JS that only highlight a
kernel's primitives when its table row is hovered. The graph layout is a plain layered drawing:
longest-path layering (a primitive sits one layer below its deepest producer), then a few
barycenter sweeps to order each layer. Every primitive is coloured by the kernel that runs it;
edges inside a kernel are drawn thick in its colour (never materialized), edges between kernels
thin and grey (tensors that go through memory).
"""
from __future__ import annotations

import html
import json
import logging
from pathlib import Path
from typing import Any, Iterable, Mapping

from .dynamic import example_bucket

log = logging.getLogger(__name__)

NODE_W, NODE_H, GAP_X, GAP_Y, MARGIN = 104, 22, 14, 34, 20
MAX_DRAWN_PRIMS = 6000  # beyond this the SVG gets too heavy for a browser to be useful

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#1d2330;max-width:1400px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #dde;padding-bottom:3px}
table{border-collapse:collapse;font-size:13px;margin:6px 0} th,td{border:1px solid #d5d9e2;padding:3px 8px;text-align:right}
th{background:#f1f3f8} td.l,th.l{text-align:left} .muted{color:#6b7385;font-size:12px}
.graph{overflow:auto;border:1px solid #d5d9e2;max-height:900px;background:#fcfcfe}
.sw{display:inline-block;width:11px;height:11px;border:1px solid #778;vertical-align:middle;margin-right:4px}
.ok{color:#17803d} .bad{color:#b3261e} tr.kern:hover{background:#fff6d6}
svg text{font-family:system-ui,Helvetica,Arial,sans-serif}
.hl rect{stroke:#000;stroke-width:2.5}
"""

JS = """
document.querySelectorAll('tr.kern').forEach(function(row){
  var k=row.getAttribute('data-k');
  row.addEventListener('mouseenter',function(){document.querySelectorAll('g.k'+k).forEach(function(g){g.classList.add('hl');});});
  row.addEventListener('mouseleave',function(){document.querySelectorAll('g.k'+k).forEach(function(g){g.classList.remove('hl');});});
});
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def kernel_color(i: int, impl: str = "tvm") -> str:
    """Distinct hues by the golden angle; Python kernels a little darker so they stand out."""
    from .backends import registry
    light = 74 if registry.native(impl) else 62
    return f"hsl({(i * 137.508) % 360:.0f},62%,{light}%)"


# ------------------------------------------------------------------------------------------------
# layout
# ------------------------------------------------------------------------------------------------

def layer_layout(graph, sweeps: int = 4) -> dict[str, tuple[int, int]]:
    """Prim name -> (layer, position in layer): longest-path layers, barycenter-ordered."""
    layer: dict[str, int] = {}
    preds: dict[str, list[str]] = {}
    for p in graph.prims:  # prims are in topological order
        ps = [t for t in dict.fromkeys(p.inputs) if t in layer]
        preds[p.name] = ps
        layer[p.name] = 1 + max((layer[t] for t in ps), default=-1)
    layers: list[list[str]] = [[] for _ in range(1 + max(layer.values(), default=-1))]
    for p in graph.prims:
        layers[layer[p.name]].append(p.name)
    succs: dict[str, list[str]] = {n: [] for n in layer}
    for n, ps in preds.items():
        for t in ps:
            succs[t].append(n)
    pos = {n: float(i) for row in layers for i, n in enumerate(row)}

    def reorder(row: list[str], nbrs: Mapping[str, list[str]]) -> list[str]:
        def key(n):
            xs = [pos[m] for m in nbrs[n]]
            return sum(xs) / len(xs) if xs else pos[n]
        row = sorted(row, key=key)
        for i, n in enumerate(row):
            pos[n] = float(i) - (len(row) - 1) / 2  # centred, so layers of different widths line up
        return row

    for row in layers:
        for i, n in enumerate(row):
            pos[n] = float(i) - (len(row) - 1) / 2
    for s in range(sweeps):
        if s % 2 == 0:
            layers = [reorder(row, preds) for row in layers]
        else:
            layers = [reorder(row, succs) for row in reversed(layers)][::-1]
    return {n: (li, i) for li, row in enumerate(layers) for i, n in enumerate(row)}


def graph_svg(graph, plan=None) -> str:
    """The primitive graph as inline SVG, primitives coloured by their plan kernel."""
    if len(graph.prims) > MAX_DRAWN_PRIMS:
        return f'<p class="muted">{len(graph.prims)} primitives: too many to draw (limit {MAX_DRAWN_PRIMS}).</p>'
    lay = layer_layout(graph)
    widths: dict[int, int] = {}
    for li, _ in lay.values():
        widths[li] = widths.get(li, 0) + 1
    maxw = max(widths.values(), default=1)
    width = 2 * MARGIN + maxw * (NODE_W + GAP_X) + 72  # room for the skip-edge arcs
    height = 2 * MARGIN + len(widths) * (NODE_H + GAP_Y)
    kernel_of: dict[str, int] = {}
    kernels = list(plan.kernels) if plan is not None else []
    shown = example_bucket(plan.meta) if plan is not None else 0  # a plan with buckets: the middle length's
    for i, k in enumerate(kernels):
        for m in k.members if k.bucket == shown else ():
            kernel_of[m] = i

    def xy(n: str) -> tuple[float, float]:
        li, i = lay[n]
        off = (maxw - widths[li]) / 2
        return MARGIN + (off + i) * (NODE_W + GAP_X), MARGIN + li * (NODE_H + GAP_Y)

    edges, nodes = [], []
    outs = set(graph.outputs)
    for p in graph.prims:
        x2, y2 = xy(p.name)
        for t in dict.fromkeys(p.inputs):
            if t not in lay:
                continue
            x1, y1 = xy(t)
            ax, ay, bx, by = x1 + NODE_W / 2, y1 + NODE_H, x2 + NODE_W / 2, y2
            k1, k2 = kernel_of.get(t), kernel_of.get(p.name)
            if k1 is not None and k1 == k2:
                style = f'stroke="{kernel_color(k1, kernels[k1].impl)}" stroke-width="3.5"'
            else:
                style = 'stroke="#9aa1b1" stroke-width="1"'
            span = lay[p.name][0] - lay[t][0]
            if span > 1:  # skip edges arc out to the right, so they do not run through the nodes between
                ax, ay, bx, by = x1 + NODE_W, y1 + NODE_H / 2, x2 + NODE_W, y2 + NODE_H / 2
                bulge = 24 + 6 * min(span, 8)
                d = f"M{ax:.0f},{ay:.0f} C{ax + bulge:.0f},{ay:.0f} {bx + bulge:.0f},{by:.0f} {bx:.0f},{by:.0f}"
            else:
                my = (ay + by) / 2
                d = f"M{ax:.0f},{ay:.0f} C{ax:.0f},{my:.0f} {bx:.0f},{my:.0f} {bx:.0f},{by:.0f}"
            edges.append(f'<path d="{d}" fill="none" {style}/>')
        k = kernel_of.get(p.name)
        fill = kernel_color(k, kernels[k].impl) if k is not None else "#ffffff"
        tip = f"{p.name}: {p.op} -> {p.type}"
        if p.origin:
            tip += f"\nfrom ONNX node {p.origin}"
        if k is not None:
            kk = kernels[k]
            tip += f"\nkernel #{k} {kk.id} ({kk.impl}, {kk.cost_ns / 1e3:.1f} us, {len(kk.members)} prims)"
        border = 'stroke="#222" stroke-width="2"' if p.name in outs else 'stroke="#667" stroke-width="0.8"'
        label = p.op if p.op != "opaque" else f"{p.attr('onnx_op', 'opaque')}*"
        cls = f' class="k{k}"' if k is not None else ""
        nodes.append(f'<g{cls}><title>{_e(tip)}</title><rect x="{x2:.0f}" y="{y2:.0f}" width="{NODE_W}" '
                     f'height="{NODE_H}" rx="5" fill="{fill}" {border}/><text x="{x2 + NODE_W / 2:.0f}" '
                     f'y="{y2 + 15:.0f}" font-size="11" text-anchor="middle">{_e(label[:16])}</text></g>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" id="graph" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}">' + "".join(edges) + "".join(nodes) + "</svg>")


_MARGINS = (56, 12, 12, 36)  # left, right, top, bottom of the inline charts


def _chart_frame(width: int, height: int, xlabel: str, ylabel: str) -> list[str]:
    """An inline chart's opening tag, axes and axis labels (the caller closes it with </svg>)."""
    L, R, T, B = _MARGINS
    return [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" height="{height}">',
            f'<line x1="{L}" y1="{height - B}" x2="{width - R}" y2="{height - B}" stroke="#333"/>',
            f'<line x1="{L}" y1="{T}" x2="{L}" y2="{height - B}" stroke="#333"/>',
            f'<text x="{(L + width) / 2:.0f}" y="{height - 4}" font-size="11" text-anchor="middle">{_e(xlabel)}</text>',
            f'<text x="12" y="{T + 8}" font-size="11">{_e(ylabel)}</text>']


def _series_color(i: int) -> str:
    return f"hsl({(i * 137.508) % 360:.0f},65%,40%)"


def line_chart_svg(series: Mapping[str, Iterable], xlabel: str = "seconds", ylabel: str = "ms",
                   width: int = 560, height: int = 260) -> str:
    """A small inline line chart of named (x, y) series (tuning curves)."""
    pts = {name: [(float(x), float(y)) for x, y in s] for name, s in series.items()}
    allp = [p for s in pts.values() for p in s]
    if not allp:
        return ""
    x0, x1 = min(p[0] for p in allp), max(p[0] for p in allp)
    y0, y1 = 0.0, max(p[1] for p in allp)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else 1.0)
    L, R, T, B = _MARGINS
    sx = lambda x: L + (x - x0) / (x1 - x0) * (width - L - R)  # noqa: E731
    sy = lambda y: height - B - (y - y0) / (y1 - y0) * (height - T - B)  # noqa: E731
    parts = _chart_frame(width, height, xlabel, ylabel)
    for f in (0, 0.5, 1):
        yv = y0 + f * (y1 - y0)
        parts.append(f'<text x="{L - 4}" y="{sy(yv) + 4:.0f}" font-size="10" text-anchor="end">{yv:.3g}</text>')
        xv = x0 + f * (x1 - x0)
        parts.append(f'<text x="{sx(xv):.0f}" y="{height - B + 14}" font-size="10" text-anchor="middle">{xv:.3g}</text>')
    for i, (name, s) in enumerate(pts.items()):
        color = _series_color(i)
        d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
        parts.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2"><title>{_e(name)}</title></polyline>')
        parts.append(f'<text x="{width - R - 4}" y="{T + 12 + 13 * i}" font-size="11" fill="{color}" text-anchor="end">{_e(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def scatter_svg(points: Mapping[str, Iterable], fits: Mapping[str, tuple[float, float]] | None = None,
                xlabel: str = "alone µs", ylabel: str = "in model µs", width: int = 560, height: int = 300) -> str:
    """Log-log scatter of named (x, y) point sets, with y = x and each set's fitted y = scale x + call."""
    import math
    pts = {n: [(float(x), float(y)) for x, y in ps if x > 0 and y > 0] for n, ps in points.items()}
    allv = [v for ps in pts.values() for p in ps for v in p]
    if not allv:
        return ""
    lo, hi = math.log10(min(allv)), math.log10(max(allv))
    lo, hi = math.floor(lo), max(math.ceil(hi), math.floor(lo) + 1)
    L, R, T, B = _MARGINS
    sx = lambda x: L + (math.log10(x) - lo) / (hi - lo) * (width - L - R)  # noqa: E731
    sy = lambda y: height - B - (math.log10(y) - lo) / (hi - lo) * (height - T - B)  # noqa: E731
    parts = _chart_frame(width, height, xlabel, ylabel)
    parts.append(f'<line x1="{sx(10 ** lo):.1f}" y1="{sy(10 ** lo):.1f}" x2="{sx(10 ** hi):.1f}" y2="{sy(10 ** hi):.1f}" '
                 f'stroke="#999" stroke-dasharray="4 3"><title>in model = alone</title></line>')
    for e in range(lo, hi + 1):
        parts.append(f'<text x="{L - 4}" y="{sy(10 ** e) + 4:.0f}" font-size="10" text-anchor="end">{10 ** e:g}</text>')
        parts.append(f'<text x="{sx(10 ** e):.0f}" y="{height - B + 14}" font-size="10" text-anchor="middle">{10 ** e:g}</text>')
    for i, (name, ps) in enumerate(pts.items()):
        color = _series_color(i)
        for x, y in ps:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}" fill-opacity="0.6">'
                         f'<title>{_e(name)}: {x:.1f} µs alone, {y:.1f} µs in model</title></circle>')
        fit = (fits or {}).get(name)
        if fit and ps:
            xs = [10 ** (lo + (hi - lo) * t / 40) for t in range(41)]
            line = [(x, fit[0] * x + fit[1]) for x in xs if lo <= math.log10(fit[0] * x + fit[1]) <= hi]
            if len(line) > 1:
                d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in line)
                parts.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        parts.append(f'<text x="{L + 8}" y="{T + 12 + 13 * i}" font-size="11" fill="{color}">{_e(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def bar_chart_svg(values: Mapping[str, float], unit: str = "ms", width: int = 560) -> str:
    """Horizontal bars (bench latencies), labelled."""
    if not values:
        return ""
    bar, gap, L = 18, 6, 110
    height = len(values) * (bar + gap) + 10
    vmax = max(values.values()) or 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" height="{height}">']
    for i, (name, v) in enumerate(values.items()):
        y = 5 + i * (bar + gap)
        w = max(1.0, v / vmax * (width - L - 90))
        parts.append(f'<text x="{L - 6}" y="{y + 13}" font-size="12" text-anchor="end">{_e(name)}</text>')
        parts.append(f'<rect x="{L}" y="{y}" width="{w:.1f}" height="{bar}" fill="{kernel_color(i)}" stroke="#667"/>')
        parts.append(f'<text x="{L + w + 5:.1f}" y="{y + 13}" font-size="12">{v:.3g} {_e(unit)}</text>')
    parts.append("</svg>")
    return "".join(parts)


# ------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------

def _table(columns: list[str] | None, rows: list[list], left: int = 1, cls: str = "",
           row_attrs: list[str] | None = None, also_left: tuple[int, ...] = ()) -> str:
    """Cells are already HTML; the first `left` columns (and `also_left`) are left-aligned text."""
    lefts = set(range(left)) | set(also_left)
    head = ""
    if columns:
        head = "<thead><tr>" + "".join(f'<th class="l">{_e(c)}</th>' if i in lefts else f"<th>{_e(c)}</th>"
                                       for i, c in enumerate(columns)) + "</tr></thead>"
    body = []
    for j, r in enumerate(rows):
        attrs = row_attrs[j] if row_attrs else ""
        cells = "".join(f'<td class="l">{c}</td>' if i in lefts else f"<td>{c}</td>" for i, c in enumerate(r))
        body.append(f"<tr{attrs}>{cells}</tr>")
    return f'<table class="{cls}">{head}<tbody>{"".join(body)}</tbody></table>'


def _ms(ns: float | None) -> str:
    return "–" if ns is None else f"{ns / 1e6:.3f}"


def _f(x: Any, fmt: str = ".3f") -> str:
    try:
        return format(float(x), fmt)
    except (TypeError, ValueError):
        return "–"


def _is_tuned(kernel, report: Mapping) -> str:
    """"yes" for a MetaSchedule kernel (or one listed in report.json's tuning section), "no" for
    kernorch's own schedules, "–" for Python kernels."""
    from .backends import registry
    tuning = report.get("tuning")
    tuned_ids = set(tuning.get("kernels", ())) if isinstance(tuning, Mapping) else set()
    if kernel.impl == "tvm-tuned" or kernel.id in tuned_ids or kernel.key in tuned_ids:
        return "yes"
    return "no" if registry.native(kernel.impl) else "–"


def _tuning_series(tuning: Any) -> dict[str, list]:
    """report.json "tuning": a list of (seconds, predicted_ms), or {"curve": [...]}, or {name: [...]}."""
    if isinstance(tuning, list):
        return {"predicted": tuning}
    if isinstance(tuning, Mapping):
        if isinstance(tuning.get("curve"), list):
            return {"predicted": tuning["curve"]}
        return {k: v for k, v in tuning.items() if isinstance(v, list) and v and isinstance(v[0], (list, tuple))}
    return {}


def _summary_section(report: Mapping, plan, bench: Mapping | None) -> str:
    timing = report.get("timing") or {}
    verify = report.get("verify") or {}
    rows = [["model", _e(report.get("model", "?"))],
            ["machine", _e((report.get("machine") or {}).get("name", "?"))],
            ["threads", _e(report.get("threads", "?"))],
            ["primitives / partitions / candidates", f"{report.get('primitives', '–')} / {report.get('partitions', '–')}"
                                                     f" / {report.get('candidates', '–')}"],
            ["kernels in the plan", str(len(plan.kernels)) if plan else "–"]]
    if report.get("rewrites"):
        from .rewrite import summary
        rows.append(["algebraic rewrites", _e(summary(report["rewrites"]))])
    if verify:
        ok = verify.get("ok")
        rows.append(["matches ONNX Runtime", f'<span class="{"ok" if ok else "bad"}">{"yes" if ok else "NO"}</span> '
                                             f'(max rel. error {_f(verify.get("max_rel_error"), ".2e")})'])
    out = "<h2>Summary</h2>" + _table(None, rows, left=2, cls="summary")
    pred = plan.predicted_ns if plan else report.get("predicted_ms", 0) * 1e6
    measured = timing.get("kernorch_ms")
    if measured is None and bench:
        measured = (bench.get("systems", {}).get("kernorch") or {}).get("median_ms")
    ctx = report.get("context") or {}
    boundary = int((plan.meta if plan else {}).get("boundary_ns", 0))
    tot = [["predicted (sum of the kernels measured alone, each plus a kernel boundary)", _ms(pred),
            f"boundary {boundary / 1e3:.2f} us x {len(plan.kernels)} kernels" if plan and boundary else ""],
           ["the kernels inside the executable (VM instrumentation, median)", _f(ctx.get("in_model_ms")),
            f"{ctx.get('runs', '')} runs" if ctx else ""],
           ["measured end to end (median)", _f(measured), f"{timing.get('runs', '')} runs" if timing else "bench"],
           ["ONNX Runtime, all optimizations, own process (median)", _f(timing.get("ort_ms")), ""]]
    if measured and pred:
        tot.append(["measured / predicted", _f(measured / (pred / 1e6), ".2f"), "cache effects, machine state"])
    out += "<h2>Predicted vs measured</h2>" + _table(["", "ms", "note"], tot, also_left=(2,), cls="totals")
    kms = ctx.get("kernel_ms") or []
    if plan and len(kms) == len(plan.kernels):
        pts: dict[str, list] = {}
        for k, ms in zip(plan.kernels, kms):
            pts.setdefault(k.impl, []).append((k.cost_ns / 1e3, ms * 1e3))
        out += ('<p class="muted">each kernel: time alone (x) against time inside the executable (y), µs</p>'
                + scatter_svg(pts))
    if plan:
        st = plan.stats
        base = [["optimal (solver)", _ms(plan.predicted_ns), "1.00x"]]
        for name, v in (("greedy", plan.greedy_ns), ("unfused", plan.unfused_ns)):
            base.append([name, _ms(v), f"{v / max(plan.predicted_ns, 1):.2f}x" if v else "–"])
        out += ("<h2>Optimal vs greedy vs unfused</h2>" + _table(["plan", "predicted ms", "optimal is faster by"], base,
                                                                 cls="baselines") +
                f'<p class="muted">solver: {_e(st.status)}, objective {_ms(st.objective_ns)} ms, bound '
                f'{_ms(st.bound_ns)} ms, gap {"n/a" if st.gap is None else f"{st.gap:.2%}"}, '
                f'{st.solve_seconds:.2f} s, {st.n_cuts} cuts, {st.n_rows}×{st.n_cols} ({st.n_nonzeros} nonzeros)</p>')
    secs = report.get("seconds") or {}
    if secs:
        total = sum(secs.values()) or 1.0
        out += "<h2>Time per stage</h2>" + _table(["stage", "seconds", "share"], [
            [_e(k), f"{v:.2f}", f"{v / total:.0%}"] for k, v in secs.items()] + [["total", f"{total:.2f}", ""]])
    return out


def _kernel_section(graph, plan, report: Mapping) -> str:
    if not plan:
        return ""
    total = plan.predicted_ns or 1
    ctx = (report.get("context") or {}).get("kernel_ms") or []
    ctx = ctx if len(ctx) == len(plan.kernels) else []
    rows, attrs = [], []
    for i, k in enumerate(plan.kernels):
        ops = [graph.by_name[m].op if graph is not None and m in graph.by_name else m for m in k.members]
        if not k.members:
            ops = [f"layout of {k.outputs[0]}: " + ("plain → blocked" if k.schedule.endswith("/block")
                                                       else "blocked → plain")]
        alts = ", ".join(f"{_e(a.impl)} {_e(a.schedule)} {a.cost_ns / 1e3:.1f}" for a in k.alternatives)
        in_ctx = [f"{ctx[i] * 1e3:.1f}", f"{ctx[i] * 1e6 / max(k.cost_ns, 1):.2f}x"] if ctx else []
        rows.append([f'<span class="sw" style="background:{kernel_color(i, k.impl)}"></span>{i}', _e(k.id), _e(k.impl),
                     _e(k.schedule), _e(" → ".join(ops)), str(len(k.members)), f"{k.cost_ns / 1e3:.1f}", f"{k.cost_ns / total:.1%}",
                     *in_ctx, _is_tuned(k, report), alts or "–"])
        attrs.append(f' class="kern" data-k="{i}"')
    cols = ["#", "id", "impl", "schedule", "primitives", "n", "cost µs", "share"] + (["in model µs", "in model / alone"] if ctx else [])
    cols += ["tuned", "alternatives (impl µs)"]
    note = ("; in model = median time of the call inside the executable (VM instrumentation)" if ctx else "")
    return ("<h2>Kernels</h2><p class=\"muted\">in execution order; cost = measured median of the kernel alone" + note +
            "; hover a row to find its primitives in the graph</p>" +
            _table(cols, rows, left=5, cls="kernels", row_attrs=attrs, also_left=(len(cols) - 2, len(cols) - 1)))


def _bench_section(bench: Mapping) -> str:
    rows, bars = [], {}
    for s, e in bench.get("systems", {}).items():
        if "median_ms" in e:
            bars[s] = e["median_ms"]
            rows.append([_e(s), e["status"], _f(e["median_ms"]), f"{_f(e['p10_ms'])}–{_f(e['p90_ms'])}", str(e["runs"]),
                         _f(e.get("speedup_vs_ort"), ".2f") + "x", _f(e.get("vs_best_peer"), ".2f") + "x",
                         _f(e.get("max_rel_error"), ".1e"),
                         _f(100 * e["roofline_fraction"], ".1f") + "%" if "roofline_fraction" in e else "–"])
        else:
            rows.append([_e(s), _e(e.get("status")), "–", _e(e.get("error") or e.get("note", "")), "0", "–", "–", "–",
                         "–"])
    rf = bench.get("roofline") or {}
    lb = bench.get("load_before") or {}
    note = (f'{bench.get("threads")} threads, each system alone in its own process, in turns, same inputs; '
            f'best peer: {_e(bench.get("best_peer", "–"))}; reference for errors: ONNX Runtime (all optimizations). '
            f'CPU pressure before timing: {_e(lb.get("cpu_pressure", {}).get("avg10", "?"))}% '
            f'(avg10), load average {_e(", ".join(f"{x:.2f}" for x in lb.get("loadavg", [])))}. ')
    if "floor_ms" in rf:
        note += (f'Roofline floor {rf["floor_ms"]:.3f} ms ({rf["bound"]}-bound: {rf["gflops"]:.3g} GFLOP at '
                 f'{rf["peak_gflops"]:.0f} GFLOP/s, {rf["bytes"] / 1e6:.3g} MB at {rf["bandwidth_gbs"]:.1f} GB/s; '
                 f'peak measured with {_e(rf.get("peak_kernel"))}).')
    return ("<h2>Benchmark</h2>" + f'<p class="muted">{note}</p>' +
            _table(["system", "status", "median ms", "p10–p90 ms", "runs", "vs ORT", "vs best peer", "max rel err",
                    "of roofline"], rows, left=2, cls="bench") + bar_chart_svg(bars))


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text()) if p.exists() else None
    except (OSError, ValueError) as e:
        log.warning("cannot read %s: %s", p, e)
        return None


def write_report(outdir, path=None) -> Path:
    """Write OUTDIR/report.html from whatever of report.json, plan.json, graph.json, bench.json is there."""
    from .ir import Graph
    from .plan import Plan
    d = Path(outdir)
    report = _read_json(d / "report.json") or {}
    bench = _read_json(d / "bench.json")
    plan = Plan.load(d / "plan.json") if (d / "plan.json").exists() else None
    gj = _read_json(d / "graph.json")
    graph = Graph.from_json(gj) if gj else None
    title = report.get("model") or (bench or {}).get("model") or d.name
    parts = [f"<h1>kernorch report: {_e(Path(str(title)).name)}</h1>",
             f'<p class="muted">{_e(d.resolve())}</p>']
    parts.append(_summary_section(report, plan, bench))
    if bench:
        parts.append(_bench_section(bench))
    parts.append(_kernel_section(graph, plan, report))
    series = _tuning_series(report.get("tuning"))
    if series:
        parts.append("<h2>Tuning</h2>" + line_chart_svg(series, "seconds", "predicted ms"))
    if graph is not None:
        shown = plan.bucket(example_bucket(plan.meta)) if plan else None
        n_k = len(shown.kernels) if plan else 0
        bucket = (f" (the plan of the bucket that serves the middle length; buckets {_e(plan.meta['buckets'])})"
                  if plan and plan.weights else "")
        parts.append(f"<h2>Primitive graph</h2><p class=\"muted\">{len(graph.prims)} primitives in {n_k} kernels{bucket}; a colour "
                     "is a kernel; thick coloured edges stay inside a kernel, thin grey ones go through memory; "
                     "bold border: graph output; * an ONNX operator kept whole. Hover a node for details.</p>"
                     f'<div class="graph">{graph_svg(graph, plan)}</div>')
    doc = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>kernorch: {_e(title)}</title>'
           f"<style>{CSS}</style></head><body>{''.join(parts)}<script>{JS}</script></body></html>")
    out = Path(path) if path else d / "report.html"
    out.write_text(doc, encoding="utf-8")
    return out


# ------------------------------------------------------------------------------------------------
# benchmark plot
# ------------------------------------------------------------------------------------------------

def _as_list(results: Any) -> list[Mapping]:
    if isinstance(results, Mapping) and "systems" in results:
        return [results]
    if isinstance(results, Mapping):
        return [r for r in results.values() if isinstance(r, Mapping) and "systems" in r]
    return [r for r in results if isinstance(r, Mapping) and "systems" in r]


def plot_bench(results, png_path) -> Path:
    """Two panels: median latency per model per system (log scale, p10–p90 whiskers) and speedup over ORT."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = _as_list(results)
    models = [r.get("model", "?") for r in runs]
    systems = list(dict.fromkeys(s for r in runs for s, e in r["systems"].items() if "median_ms" in e))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(models) + 5), 4.2))
    x = np.arange(len(models))
    w = 0.8 / max(len(systems), 1)
    for j, s in enumerate(systems):
        med = [r["systems"].get(s, {}).get("median_ms", np.nan) for r in runs]
        lo = [m - r["systems"].get(s, {}).get("p10_ms", m) for m, r in zip(med, runs)]
        hi = [r["systems"].get(s, {}).get("p90_ms", m) - m for m, r in zip(med, runs)]
        ax1.bar(x + j * w, med, w, yerr=[lo, hi], label=s, capsize=2)
        sp = [r["systems"].get(s, {}).get("speedup_vs_ort", np.nan) for r in runs]
        ax2.bar(x + j * w, sp, w, label=s)
    for ax in (ax1, ax2):
        ax.set_xticks(x + w * (len(systems) - 1) / 2)
        ax.set_xticklabels(models, rotation=20, ha="right")
    ax1.set_yscale("log")
    ax1.set_ylabel("median latency, ms (p10–p90)")
    ax1.set_title("latency")
    ax2.axhline(1.0, color="#444", lw=0.8)
    ax2.set_ylabel("speedup over ONNX Runtime (all opts)")
    ax2.set_title("speedup (higher is better)")
    ax1.legend(fontsize=8)
    threads = {r.get("threads") for r in runs}
    fig.suptitle(f"kernorch benchmark, {', '.join(map(str, threads))} thread(s)", fontsize=10)
    fig.tight_layout()
    p = Path(png_path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
