"""Random ONNX graphs optimized end to end and compared with ONNX Runtime (the fuzz suite).

    make test                                                   # the fast profile: a few seeded graphs
    .venv/bin/python -m pytest -m fuzz --hypothesis-profile=long  # thousands (hours), stops at a failure
    .venv/bin/python tests/fuzz_long.py --minutes 60              # seeds in a row, goes on after failures
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

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fuzzgraphs import Discard, check, random_model
from fuzzgraphs import fuzz_options as make_options

pytestmark = pytest.mark.fuzz


@pytest.fixture(scope="module")
def fuzz_options(tmp_path_factory):
    return make_options(str(tmp_path_factory.mktemp("fuzz") / "db.sqlite"))


def _log(entry: dict) -> None:
    path = os.environ.get("KERNORCH_FUZZ_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_graph_matches_onnx_runtime(seed, fuzz_options):
    try:
        entry = check(seed, fuzz_options)
    except Discard as d:
        _log({"seed": seed, "ops": random_model(seed)[1], "outcome": str(d)})
        assume(False)
    except BaseException as e:
        _log({"seed": seed, "ops": random_model(seed)[1], "outcome": "mismatch or error",
              "error": f"{type(e).__name__}: {e}"[:500]})
        raise
    _log(entry)
