"""The HTML report: built from a synthetic saved model dir (no optimize, no TVM), checked as data and
rendered in a real headless browser (Debian chromium; skipped when none is installed)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kernorch import primitives
from kernorch.examples import candy_like
from kernorch.fission import fission
from kernorch.frontend.onnx import load
from kernorch.plan import Alternative, Kernel, Plan, SolverStats
from kernorch.report import layer_layout, plot_bench, write_report


def _tiny_graph():
    return fission(load(candy_like(size=16, width=4, blocks=1)))


def _chain_plan(graph) -> Plan:
    """Kernels of up to 3 consecutive prims along a chain; linear prims alone in a micro-kernel tile,
    one kernel as a Python ('reference') kernel."""
    kernels, cur = [], []

    def flush():
        if cur:
            i = len(kernels)
            linear = primitives.kind(graph.by_name[cur[0]].op) == "linear"
            ins = sorted({t for m in cur for t in graph.by_name[m].inputs if t not in cur})
            kernels.append(Kernel(f"c{i}.x", f"key{i}", "reference" if i == 1 else "tvm", tuple(cur), tuple(ins),
                                  (cur[-1],), 1000 * (i + 1), (Alternative(f"c{i}.y", "tvm", tuple(cur), 2000 * (i + 1)),),
                                  "t8x32p" if linear else "default"))
            cur.clear()

    for p in graph.prims:
        linear = primitives.kind(p.op) == "linear"
        if cur and (linear or len(cur) == 3 or cur[-1] not in p.inputs):
            flush()
        cur.append(p.name)
        if linear:
            flush()
    flush()
    total = sum(k.cost_ns for k in kernels)
    stats = SolverStats("optimal", total, total, 0.0, 0.02, 1, 10, 20, 40)
    return Plan(tuple(kernels), (), tuple(graph.outputs), stats, unfused_ns=2 * total, greedy_ns=int(1.3 * total),
                meta={"model": "candy_like"})


def _bench_dict() -> dict:
    sys_ = {"ort": {"status": "ok", "median_ms": 1.0, "p10_ms": 0.9, "p90_ms": 1.2, "runs": 3, "speedup_vs_ort": 1.0,
                    "vs_best_peer": 1.0, "max_rel_error": 0.0, "roofline_fraction": 0.3},
            "kernorch": {"status": "ok", "median_ms": 0.8, "p10_ms": 0.7, "p90_ms": 0.9, "runs": 3,
                         "speedup_vs_ort": 1.25, "vs_best_peer": 1.25, "max_rel_error": 2e-7, "roofline_fraction": 0.37},
            "torch": {"status": "skipped", "note": "PyTorch is not installed"},
            "tvm": {"status": "failed", "error": "TVMError: <boom & co>"}}
    return {"model": "candy_like", "threads": 2, "systems": sys_, "best_peer": "ort",
            "load_before": {"cpu_pressure": {"avg10": 1.5}, "loadavg": [0.5, 0.4, 0.3]},
            "roofline": {"floor_ms": 0.3, "bound": "compute", "gflops": 0.03, "bytes": 1e5, "peak_gflops": 100.0,
                         "bandwidth_gbs": 20.0, "peak_kernel": "1024x1024x1024 t14x32p"}}


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory) -> Path:
    """A saved-model directory with everything the report reads (except model.so/weights, unused)."""
    d = tmp_path_factory.mktemp("saved")
    graph = _tiny_graph()
    plan = _chain_plan(graph)
    plan.save(d / "plan.json")
    (d / "graph.json").write_text(json.dumps(replace(graph, constants={}).to_json()))
    report = {"model": "candy_like.onnx", "machine": {"name": "Test CPU"}, "threads": 2, "primitives": len(graph.prims),
              "partitions": 2, "candidates": 99, "predicted_ms": plan.predicted_ns / 1e6,
              "verify": {"ok": True, "max_rel_error": 1e-7},
              "timing": {"runs": 3, "kernorch_ms": 0.8, "ort_ms": 1.0},
              "seconds": {"load": 0.1, "fission": 0.05, "measure": 3.0, "orchestrate": 0.02},
              "tuning": [[0, 1.2], [5, 0.9], [10, 0.85]],
              "rewrites": {"applied": [{"rule": "before_resize", "node": "c", "flops_before": 8, "flops_after": 2}],
                           "flops_before": 3.2e9, "flops_after": 1.1e9},
              "context": {"runs": 3, "kernel_ms": [0.01 * (i + 1) for i in range(len(plan.kernels))], "other_ms": 0.01,
                          "in_model_ms": 0.123, "alone_ms": 0.1}}
    (d / "report.json").write_text(json.dumps(report))
    (d / "bench.json").write_text(json.dumps(_bench_dict()))
    return d


def test_layout_is_layered():
    g = _tiny_graph()
    lay = layer_layout(g)
    assert set(lay) == {p.name for p in g.prims}
    for p in g.prims:
        for t in p.inputs:
            if t in lay:
                assert lay[t][0] < lay[p.name][0], (t, p.name)
    assert len(set(lay.values())) == len(lay)  # no two prims in one slot


def test_report_contents(saved_dir):
    out = write_report(saved_dir)
    assert out == saved_dir / "report.html"
    doc = out.read_text()
    plan = Plan.load(saved_dir / "plan.json")
    n_prims = json.loads((saved_dir / "report.json").read_text())["primitives"]
    assert doc.count('<tr class="kern"') == len(plan.kernels)
    svg = re.search(r'<svg[^>]*id="graph".*?</svg>', doc, re.S).group(0)
    root = ET.fromstring(svg)  # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}g")) == n_prims
    for needle in ('class="bench"', "in model / alone", "0.123", "t8x32p", "vs best peer", "<circle",
                   "Optimal vs greedy", "Time per stage", "Tuning", "1.25", "&lt;boom &amp; co&gt;",
                   "PyTorch is not installed", "<polyline", "1024x1024x1024 t14x32p",
                   "before_resize x1: contractions 3.20 -&gt; 1.10 GFLOP"):
        assert needle in doc, needle
    assert "http://" not in doc.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing fetched from outside


def test_tuned_column_by_implementation():
    from kernorch.report import _is_tuned
    k = _chain_plan(_tiny_graph()).kernels[0]
    assert _is_tuned(replace(k, impl="tvm"), {}) == "no"
    assert _is_tuned(replace(k, impl="tvm-tuned"), {}) == "yes"
    assert _is_tuned(replace(k, impl="reference"), {}) == "–"
    assert _is_tuned(replace(k, impl="tvm"), {"tuning": {"kernels": [k.key]}}) == "yes"


def test_report_with_only_some_files(tmp_path, saved_dir):
    shutil.copy(saved_dir / "graph.json", tmp_path / "graph.json")
    (tmp_path / "report.json").write_text(json.dumps({"model": "m.onnx"}))
    doc = write_report(tmp_path).read_text()
    assert 'id="graph"' in doc and "Benchmark" not in doc


def test_plot_bench(tmp_path):
    b = _bench_dict()
    p = plot_bench([b, dict(b, model="other")], tmp_path / "b.png")
    import matplotlib.image
    img = matplotlib.image.imread(str(p))
    assert img.shape[0] > 100 and img.std() > 0.01


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _headless(browser: str, url: str, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
           "--enable-logging=stderr", "--v=0", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp)


def _console_errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]


def test_report_renders_in_browser(saved_dir, tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip("no headless browser found (apt-get install -y chromium chromium-driver)")
    # the check must be able to fail: a page with a JS error shows up in the log
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>no_such_function();</script></body></html>")
    assert any("Uncaught" in ln for ln in _console_errors(_headless(browser, bad.as_uri(), tmp_path,
                                                                     "--dump-dom").stderr))

    page = write_report(saved_dir).as_uri()
    dom = _headless(browser, page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'id="graph"' in dom.stdout and 'class="kernels"' in dom.stdout and 'class="bench"' in dom.stdout
    assert _console_errors(dom.stderr) == []

    shot = tmp_path / "shot.png"
    r = _headless(browser, page, tmp_path, f"--screenshot={shot}", "--window-size=1200,2400")
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    assert _console_errors(r.stderr) == []
    import matplotlib.image
    img = np.asarray(matplotlib.image.imread(str(shot)))
    assert img.std() > 0.02  # not a blank page
    # some pixels carry kernel colours (saturated), not only black text on white
    rgb = img[..., :3]
    assert (rgb.max(axis=-1) - rgb.min(axis=-1) > 0.2).mean() > 0.001
