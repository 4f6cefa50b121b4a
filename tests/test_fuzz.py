"""Random ONNX graphs optimized end to end and compared with ONNX Runtime (the fuzz suite).

    make test                                                   # the fast profile: a few seeded graphs
    .venv/bin/python -m pytest -m fuzz --hypothesis-profile=long  # thousands (hours)
    KERNORCH_FUZZ_LOG=fuzz.jsonl ...                            # one line per graph: seed, ops, outcome

Each graph (tests/fuzzgraphs.py) is checked by ONNX Runtime first (a graph ORT rejects is not a
test of kernorch and is discarded), then optimized with a tiny measurement budget: every kernel is
still built, checked against the numpy reference of its primitives and timed, the plan is solved
and emitted, and `optimize` verifies the executable against ONNX Runtime (a mismatch raises,
naming the first diverging kernel). The outputs are compared once more here on other inputs.
A graph that fails is reproduced from its seed: `random_model(seed)`.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fuzzgraphs import random_model
from kernorch import executor, pipeline
from kernorch.options import Options

pytestmark = pytest.mark.fuzz


@pytest.fixture(scope="module")
def fuzz_options(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    return Options(db_path=str(d / "db.sqlite"), threads=1, max_kernel_size=3, repeats=1, min_repeat_ms=0.2,
                   compare_untuned=0, workers=2)


def _log(entry: dict) -> None:
    path = os.environ.get("KERNORCH_FUZZ_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_graph_matches_onnx_runtime(seed, fuzz_options):
    model, ops = random_model(seed)
    feeds = executor.random_feeds(pipeline.load(model, fuzz_options).graph, seed)
    try:
        sess = executor.ort_session(model, 1)
        ref = sess.run(None, feeds)
    except Exception as e:  # noqa: BLE001 - ONNX Runtime rejects the graph: not a kernorch case
        _log({"seed": seed, "ops": ops, "outcome": "rejected by ONNX Runtime", "error": str(e)[:200]})
        assume(False)
    if not all(np.isfinite(r).all() for r in ref):
        _log({"seed": seed, "ops": ops, "outcome": "non-finite reference"})
        assume(False)
    try:
        compiled, planned = pipeline.optimize(model, fuzz_options, runs=0)
        got = compiled.run(feeds)
        names = [o.name for o in sess.get_outputs()]
        for n, r in zip(names, ref):
            err = executor.max_error(np.asarray(r), got[n])
            assert err["rel"] <= 1e-3, (seed, n, err)
    except BaseException as e:
        _log({"seed": seed, "ops": ops, "outcome": "mismatch or error", "error": f"{type(e).__name__}: {e}"[:500]})
        raise
    _log({"seed": seed, "ops": ops, "outcome": "ok", "kernels": len(planned.plan.kernels),
          "blocked": sum(1 for k in planned.plan.kernels if k.schedule.startswith("b"))})
