"""Time a few kernels untuned vs default schedule vs library (numpy/OpenBLAS), same process.

Not a test: timings on the shared 2-core machine vary 2-5x between runs, so the variants are
interleaved round by round and medians are reported.  Usage:

    TVM_NUM_THREADS=2 .venv/bin/python benchmarks/schedule_speedup.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TVM_NUM_THREADS", "2")

import numpy as np  # noqa: E402

from kernorch.backends import library  # noqa: E402
from kernorch.backends import tvm as kt  # noqa: E402
from kernorch.ir import Graph, TensorType, make_prim  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_backend import layernorm_graph, softmax_graph  # noqa: E402  (the same kernels the tests check)

log = logging.getLogger("schedule_speedup")


def f32(*shape):
    return TensorType(tuple(shape), "float32")


def matmul_bias_relu():
    x, w, b = f32(256, 512), f32(512, 512), f32(512)
    ps = [make_prim("mm", "matmul", ["x", "w"], f32(256, 512)), make_prim("ba", "add", ["mm", "b"], f32(256, 512)),
          make_prim("y", "relu", ["ba"], f32(256, 512))]
    return Graph((("x", x), ("w", w), ("b", b)), ("y",), tuple(ps)), ["x", "w", "b"]


def softmax():
    return softmax_graph(1024, 1024)


def layernorm():
    return layernorm_graph(1024, 768)


def conv3x3():
    x, w, b = f32(1, 64, 56, 56), f32(64, 64, 3, 3), f32(64, 1, 1)
    attrs = dict(strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1), group=1)
    ps = [make_prim("c", "conv", ["x", "w"], f32(1, 64, 56, 56), **attrs),
          make_prim("cb", "add", ["c", "b"], f32(1, 64, 56, 56)), make_prim("y", "relu", ["cb"], f32(1, 64, 56, 56))]
    return Graph((("x", x), ("w", w), ("b", b)), ("y",), tuple(ps)), ["x", "w", "b"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    threads = int(os.environ["TVM_NUM_THREADS"])
    kt.set_threads(threads)
    target = kt.make_target(threads)
    try:
        import threadpoolctl
        blas = [(i["internal_api"], i.get("architecture"), i["num_threads"]) for i in threadpoolctl.threadpool_info()]
    except Exception:  # noqa: BLE001
        blas = "?"
    log.info("threads=%d target=%s blas=%s load=%s", threads, target, blas, os.getloadavg())
    rng = np.random.default_rng(0)
    for name, make in [("matmul256x512x512+bias+relu", matmul_bias_relu), ("softmax1024x1024", softmax),
                       ("layernorm1024x768", layernorm), ("conv1x64x56x56_3x3+bias+relu", conv3x3)]:
        graph, inputs = make()
        members = list(graph.prims)
        outputs = list(graph.outputs)
        arrays = [graph.constants[n] if n in graph.constants else rng.standard_normal(graph.type_of(n).shape).astype("float32")
                  for n in inputs]
        variants = {}
        for mode in ("none", "default"):
            t0 = time.perf_counter()
            mod = kt.schedule(kt.lower(graph, members, inputs, outputs), target, mode)
            variants[mode] = kt.build(mod, target)
            rule = mod["main"].attrs["kernorch.rule"] if mode == "default" else "-"
            log.info("%s %s: schedule+build %.2f s (rule %s)", name, mode, time.perf_counter() - t0, rule)
        if library.supports(graph, members, inputs, outputs) is None:
            lib = library.make(graph, members, inputs, outputs)
            outs = [np.empty(graph.type_of(o).shape, np.float32) for o in outputs]
            variants["library"] = lib
        ref = variants["none"](*arrays)[0]
        for k, v in variants.items():
            got = v(*arrays)[0]
            assert np.allclose(got, ref, rtol=1e-3, atol=1e-4), (name, k)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for k, v in variants.items():
                if k == "library":
                    t = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        for _ in range(5):
                            v.run_dps(*arrays, *outs)
                        t.append((time.perf_counter() - t0) / 5)
                    times[k].append(statistics.median(t))
                else:
                    number = 1 if k == "none" else 10
                    times[k].append(statistics.median(v.time(*arrays, number=number, repeat=3)))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        log.info("%s: %s | default speedup %.1fx", name, "  ".join(f"{k} {m:.3f} ms" for k, m in med.items()),
                 med["none"] / med["default"])


if __name__ == "__main__":
    main()
