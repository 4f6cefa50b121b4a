"""The reference executor: run a primitive graph with each primitive's numpy reference.

It is the oracle for everything downstream: fission is checked by comparing it with ONNX Runtime
(`compare_with_ort`), and the emitter bisects a mismatching kernel by asking for every intermediate
(`run(..., keep_all=True)`).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import numpy as np

from . import primitives
from .ir import Graph, KernorchError

log = logging.getLogger(__name__)


def check_feeds(graph: Graph, feeds: Mapping[str, np.ndarray]) -> None:
    """Names, shapes and dtypes of the feeds must match the graph inputs exactly."""
    want = dict(graph.inputs)
    missing = [n for n in want if n not in feeds]
    unknown = [n for n in feeds if n not in want]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing input(s) {', '.join(map(repr, missing))}")
        if unknown:
            parts.append(f"unknown input(s) {', '.join(map(repr, unknown))}")
        raise KernorchError(f"graph {graph.name!r}: {'; '.join(parts)} (inputs: {', '.join(map(repr, want))})")
    for name, t in want.items():
        v = np.asarray(feeds[name])
        if tuple(v.shape) != tuple(t.shape):
            raise KernorchError(f"graph {graph.name!r}: input {name!r} has shape {tuple(v.shape)}, expected {t}")
        if str(v.dtype) != t.dtype:
            raise KernorchError(f"graph {graph.name!r}: input {name!r} has dtype {v.dtype}, expected {t.dtype}")


def run(graph: Graph, feeds: Mapping[str, np.ndarray], keep_all: bool = False) -> dict[str, np.ndarray]:
    """Run the prims in order. Returns the graph outputs, or every tensor (inputs, constants and
    prim results) when `keep_all`; otherwise intermediates are freed after their last use."""
    check_feeds(graph, feeds)
    values: dict[str, Any] = dict(graph.constants)
    values.update({k: np.asarray(v) for k, v in feeds.items()})
    last_use: dict[str, int] = {}
    if not keep_all:
        for i, p in enumerate(graph.prims):
            for t in p.inputs:
                last_use[t] = i
    outs = set(graph.outputs)
    for i, p in enumerate(graph.prims):
        try:
            values[p.name] = primitives.run(p, [values[t] for t in p.inputs])
        except KernorchError:
            raise
        except Exception as e:
            raise KernorchError(f"prim {p.name} ({p.op}, from ONNX node {p.origin!r}) failed: "
                                f"{type(e).__name__}: {e}") from e
        if not keep_all:
            for t in dict.fromkeys(p.inputs):
                if last_use.get(t) == i and t not in outs and t not in graph.constants:
                    values.pop(t, None)
    if keep_all:
        return values
    return {o: values[o] for o in graph.outputs}


def random_feeds(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Floats: standard normal; integers: small non-negative values (valid ids/indices); bools: coin flips."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, t in graph.inputs:
        shape = tuple(t.shape)
        dt = np.dtype(t.dtype)
        if dt.kind == "f":
            feeds[name] = rng.standard_normal(shape).astype(dt)
        elif dt.kind in "iu":
            feeds[name] = rng.integers(0, 4, size=shape).astype(dt)
        elif dt.kind == "b":
            feeds[name] = rng.random(shape) < 0.5
        else:
            raise KernorchError(f"cannot make random values for input {name!r} of dtype {t.dtype}")
    return feeds


def ort_session(model: Any, threads: int | None = None, level: str = "ORT_ENABLE_ALL", spinning: bool | str = "stop"):
    """An ONNX Runtime session with an explicit thread count (timings and results stay reproducible).

    `spinning`: "stop" (default) lets its workers spin during a run, as ONNX Runtime does by default,
    but stops them when the run ends ("session.force_spinning_stop"): timed interleaved with another
    system, still-spinning workers take the 2 cores that system needs next (measured on yolox_tiny:
    kernorch 72-77 ms timed after a spinning ORT session, 51-61 ms alone). True: ORT's default;
    False: no spinning at all.
    """
    import onnx
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or min(2, os.cpu_count() or 1)
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    if spinning == "stop":
        so.add_session_config_entry("session.force_spinning_stop", "1")
    elif not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    where = "the model" if isinstance(model, (bytes, onnx.ModelProto)) else str(model)
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    try:
        return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so,
                                    providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own Fail, InvalidGraph, ...
        lines = str(e).strip().splitlines()
        text = lines[-1] if lines else type(e).__name__
        raise KernorchError(f"{where}: ONNX Runtime cannot load it ({text[-300:]}); kernorch checks its results "
                            "against ONNX Runtime and times it beside it") from None


def max_error(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """Max absolute error, and the same relative to the output's scale max|ref| (at least 1e-30)."""
    if ref.shape != got.shape:
        return {"abs": float("inf"), "rel": float("inf"), "scale": float("nan"),
                "note": f"shape {got.shape} vs reference {ref.shape}"}
    r = ref.astype(np.float64)
    g = got.astype(np.float64)
    same_nonfinite = ~np.isfinite(r) & (np.isnan(r) & np.isnan(g) | (r == g))
    diff = np.where(same_nonfinite, 0.0, np.abs(r - g))
    diff = np.where(np.isnan(diff), np.inf, diff)
    finite = r[np.isfinite(r)]
    scale = float(np.abs(finite).max()) if finite.size else 0.0
    err = float(diff.max()) if diff.size else 0.0
    return {"abs": err, "rel": err / max(scale, 1e-30), "scale": scale}


def compare_with_ort(model: Any, graph: Graph, shapes: Mapping[str, Any] | None = None, seed: int = 0,
                     threads: int | None = None) -> dict[str, dict[str, float]]:
    """Per-output max errors of `graph` (run by the reference executor) against ONNX Runtime running
    `model` (a path or ModelProto) on the same random inputs. `shapes` is accepted for symmetry with
    `load`; the inputs' shapes are the graph's (already bound)."""
    feeds = random_feeds(graph, seed)
    sess = ort_session(model, threads)
    names = [o.name for o in sess.get_outputs()]
    ref = dict(zip(names, sess.run(names, feeds)))
    got = run(graph, feeds)
    out = {}
    for name in graph.outputs:
        if name not in ref:
            raise KernorchError(f"graph output {name!r} is not an output of the ONNX model ({names})")
        out[name] = max_error(np.asarray(ref[name]), got[name])
        log.debug("%s: %s", name, out[name])
    return out
