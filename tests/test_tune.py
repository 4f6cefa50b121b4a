"""Budgeted MetaSchedule tuning: the allocator on synthetic curves (pure), and the re-solve loop on a
tiny model with a handful of trials (temp profile DB and tuning directory; CPU only, ~1-2 min)."""
from dataclasses import replace

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kernorch import executor, pipeline, tune, verify
from kernorch.database import ProfileDB
from kernorch.ir import KernorchError
from kernorch.options import Machine, Options
from kernorch.tune import Arm, allocate, expected_gain, flattened, parse_budget


# -- budget and allocator ------------------------------------------------------------------------

def test_parse_budget():
    assert parse_budget("200t") == tune.Budget(200, "t")
    assert parse_budget("200") == tune.Budget(200, "t")
    assert parse_budget("20m") == tune.Budget(1200, "s")
    assert parse_budget("90s") == tune.Budget(90, "s")
    assert parse_budget("1.5h") == tune.Budget(5400, "s")
    with pytest.raises(KernorchError):
        parse_budget("lots")


def test_flattened():
    assert not flattened([(0, 100.0)])
    assert not flattened([(0, 100.0), (8, 50.0), (16, 49.5)])          # one flat chunk: patience 2
    assert flattened([(0, 100.0), (8, 50.0), (16, 49.5), (24, 49.4)])
    assert not flattened([(0, 100.0), (8, 99.9), (16, 99.9), (24, 60.0)])


def test_allocator_prefers_weighted_gain_and_respects_budget():
    arms = [Arm("small", 1, [(0, 1000.0)]), Arm("big", 1, [(0, 5000.0)]), Arm("repeated", 12, [(0, 1000.0)])]
    picks = allocate(arms, remaining=8, chunk=4, max_arms=4)
    assert [k for k, _ in picks] == ["repeated", "big"]        # 12 x 1000 > 5000 > 1000
    assert sum(t for _, t in picks) <= 8
    assert allocate(arms, remaining=0, chunk=4) == []
    assert allocate(arms, remaining=3, chunk=4) == [("repeated", 3)]
    assert allocate(arms, remaining=1, chunk=4) == []          # less than half a chunk: not worth a call


def test_allocator_stops_flattened_and_failed_kernels():
    flat = Arm("flat", 10, [(0, 1000.0), (4, 500.0), (8, 499.0), (12, 498.0)])
    failed = Arm("failed", 10, [(0, 1000.0)], done=True)
    live = Arm("live", 1, [(0, 100.0), (4, 60.0)])
    assert expected_gain(flat, 5) == 0 and expected_gain(failed, 5) == 0
    assert allocate([flat, failed, live], remaining=100, chunk=4) == [("live", 4)]
    assert allocate([flat, failed], remaining=100, chunk=4) == []


def test_allocator_time_budget_counts_overhead():
    a = Arm("a", 1, [(0, 1000.0)], cost_per_trial=2.0, overhead=5.0)
    assert allocate([a], remaining=20, chunk=8) == [("a", 7)]     # (20 - 5) // 2
    assert allocate([a], remaining=6, chunk=8) == []


def test_simulated_budget_goes_where_it_pays():
    """Rounds of allocate() against synthetic tuning curves: the kernel with the larger weighted
    headroom gets most trials, flattened kernels stop, and the total never exceeds the budget."""
    floors = {"a": 0.2, "b": 0.9, "c": 0.5}    # tuned / default after many trials
    weights = {"a": 4, "b": 4, "c": 1}
    curves = {k: [(0, 1000.0)] for k in floors}
    budget, spent = 96, 0
    for _ in range(100):
        arms = [Arm(k, weights[k], curves[k]) for k in floors]
        picks = allocate(arms, budget - spent, chunk=8, max_arms=1)
        if not picks:
            break
        for k, t in picks:
            n = curves[k][-1][0] + t
            curves[k].append((n, 1000.0 * (floors[k] + (1 - floors[k]) * np.exp(-n / 16))))
            spent += t
    trials = {k: c[-1][0] for k, c in curves.items()}
    assert spent <= budget
    assert trials["a"] > trials["b"] and trials["a"] > trials["c"]


# -- the loop on a tiny model ----------------------------------------------------------------------

def tiny_model(path):
    """x[8,32] → MatMul(32x32) + bias → Relu → Softmax."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal((32,)).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("Softmax", ["r"], ["y"], axis=-1)]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    import onnx
    onnx.save(m, str(path))
    return path


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    model = tiny_model(d / "tiny.onnx")
    opts = Options().with_(db_path=str(d / "db.sqlite"), tune_dir=str(d / "tuning"), budget="4t", threads=1,
                           max_kernel_size=4, max_pointwise=0, repeats=3, min_repeat_ms=1.0, workers=2,
                           compare_untuned=0, prune=False)
    machine = Machine.host()
    with ProfileDB(opts.resolved_db()) as db:
        loaded = pipeline.load(str(model), opts)
        opts = pipeline.model_options(loaded.graph, opts, machine)  # the stages as plan_model runs them
        en = pipeline.enumerate_candidates(loaded.graph, opts)
        measured = pipeline.measure_candidates(loaded.graph, en, db, opts, machine)
        meta = pipeline.plan_meta(loaded.source, machine, opts)

        def solve(m):
            return pipeline.orchestrate(loaded.graph, en, m, opts, meta), m

        before, _ = solve(measured)
        plan, measured, history = tune.tune_loop(loaded.graph, en, measured, before, db, opts, machine, solve)
    return d, model, opts, before, plan, measured, history, loaded, en, solve


@pytest.mark.slow
def test_loop_tunes_within_budget_and_never_worsens_the_plan(tuned):
    d, model, opts, before, plan, measured, history, loaded, en, solve = tuned
    assert 0 < history["new_trials"] and history["spent"] <= 4
    assert history["rounds"] >= 1 and history["kernel_curves"]
    assert plan.predicted_ns <= before.predicted_ns
    times = [t for t, _ in history["curve"]]
    assert times == sorted(times) and history["curve"][-1][1] == pytest.approx(plan.predicted_ns / 1e6)
    # every prim computed (at least once: the program lets a kernel recompute one where its
    # measurements make that the cheaper plan, as a run of the full suite found for the output)
    covered = {m for k in plan.kernels for m in k.members}
    assert covered == {p.name for p in loaded.graph.prims}
    with ProfileDB(opts.resolved_db()) as db:
        rows = [m for m in db.rows() if m.impl == "tvm-tuned"]
    assert rows and all(m.schedule.startswith("ms:") for m in rows)
    assert any(m.ok and m.median_ns > 0 for m in rows)
    assert (d / "tuning").is_dir() and any((d / "tuning").rglob("database_tuning_record.json"))


@pytest.mark.slow
def test_second_run_reuses_tuning(tuned):
    d, model, opts, before, plan, measured, history, loaded, en, solve = tuned
    again = pipeline.plan_model(str(model), opts)
    assert again.tuning["new_trials"] == 0 and again.tuning["reused"] >= 1
    assert again.plan.predicted_ns <= before.predicted_ns
    assert again.measured.stats.measured == 0


@pytest.mark.slow
def test_emitted_model_with_tuned_kernels_matches_ort(tuned):
    d, model, opts, before, plan, measured, history, loaded, en, solve = tuned
    tuned_keys = {k for (k, impl, _), m in measured.measurements.items() if impl == "tvm-tuned" and m.ok}
    assert tuned_keys
    # make the tuned kernels free, so the plan takes them and the emitter must rebuild them
    free = replace(measured, measurements={k: (replace(m, median_ns=1) if k[1] == "tvm-tuned" and m.ok else m)
                                           for k, m in measured.measurements.items()})
    plan, _ = solve(free)
    assert any(k.impl == "tvm-tuned" for k in plan.kernels)
    compiled = pipeline.emit(loaded.graph, plan, opts, Machine.host())
    assert verify.verify(compiled, str(model), opts)["ok"]
    feeds = executor.random_feeds(loaded.graph, seed=5)
    ref = executor.ort_session(str(model), 1).run(None, feeds)[0]
    assert executor.max_error(ref, compiled.run(feeds)["y"])["rel"] < 1e-4
