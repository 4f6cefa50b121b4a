"""The whole pipeline on a tiny model: optimize, verify, save, reload in a fresh process, re-run from
the database, and the CLI's commands and errors."""
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kernorch
from kernorch import cli, executor, pipeline
from kernorch.database import ProfileDB
from kernorch.options import Options


def tiny_model(path=None):
    """x[4,16] → MatMul(16x32) + bias → Relu → MatMul(32x8) → Softmax; plus a LayerNorm branch."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(rng.standard_normal((32,)).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="bias"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["z"], name="mm2"),
        helper.make_node("Softmax", ["z"], ["y"], axis=-1, name="softmax"),
    ]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [w1, b1, w2])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    if path is not None:
        onnx.save(m, str(path))
    return m


FAST = dict(threads=1, max_kernel_size=4, repeats=3, min_repeat_ms=1.0, workers=2, compare_untuned=2)


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipe")
    model = d / "tiny.onnx"
    tiny_model(model)
    db = d / "db.sqlite"
    opts = Options().with_(db_path=str(db), **FAST)
    compiled, run = pipeline.optimize(str(model), opts, runs=3)
    return d, model, db, opts, compiled, run


def test_optimize_matches_ort(optimized):
    d, model, db, opts, compiled, run = optimized
    feeds = executor.random_feeds(run.graph, seed=3)
    ref = executor.ort_session(model, 1).run(None, feeds)[0]
    got = compiled.run(feeds)["y"]
    assert executor.max_error(ref, got)["rel"] < 1e-4
    rep = compiled.report
    assert rep["verify"]["ok"]
    assert rep["timing"]["runs"] == 3 and rep["timing"]["kernorch_ms"] > 0
    ctx = rep["context"]
    assert len(ctx["kernel_ms"]) == len(run.plan.kernels) and all(ms > 0 for ms in ctx["kernel_ms"])
    assert sum(d["kernels"] for d in ctx["by_impl"].values()) == len(run.plan.kernels)
    plan = run.plan
    assert plan.stats.status == "optimal"
    assert plan.predicted_ns <= plan.unfused_ns
    covered = {m for k in plan.kernels for m in k.members}
    assert set(run.graph.outputs) <= covered


def test_second_run_is_served_from_database(optimized):
    d, model, db, opts, compiled, run = optimized
    run2 = pipeline.plan_model(str(model), opts)
    assert run2.measure_stats.measured == 0 and run2.measure_stats.refused == 0
    assert run2.measure_stats.cached == run2.measure_stats.jobs > 0
    # it starts from the context the first run learned, and so solves to the plan `refine` re-solved
    assert {i: pytest.approx(v) for i, v in run2.context.items()} == run.context
    from dataclasses import replace
    again = replace(run, seconds={})
    pipeline.orchestrate(again)
    assert run2.plan.predicted_ns == again.plan.predicted_ns
    assert pipeline._signature(run2.plan) == pipeline._signature(again.plan)


def _check_mixes(mixes_list, run, select_runs):
    mixes = {m["mix"]: m for m in mixes_list}
    assert set(mixes) == set(pipeline.MIXES)
    built = [m for m in mixes.values() if "chosen" in m]
    assert built and sum(m["chosen"] for m in built) == 1
    chosen = next(m for m in built if m["chosen"])
    if len(built) > 1:  # several distinct plans: each timed, the fastest kept
        assert all(m["runs"] == select_runs for m in built)
        assert chosen["measured_ms"] == min(m["measured_ms"] for m in built)
    for m in built:  # every mix uses only the libraries it allows
        assert set(m["impls"]) <= set(pipeline.MIXES[m["mix"]]) | {"tvm", "tvm-tuned"}
    for m in mixes.values():
        assert "same_as" not in m or "chosen" in mixes[m["same_as"]]
    if not (run.refined or {}).get("kept"):  # else refine replaced the selected plan
        assert chosen["predicted_ms"] == pytest.approx(run.plan.predicted_ns / 1e6)
        assert chosen["impls"] == dict(sorted(pipeline._impl_counts(run.plan).items()))
    return built


def test_runtime_mixes_recorded(optimized):
    d, model, db, opts, compiled, run = optimized
    _check_mixes(compiled.report["mixes"], run, opts.select_runs)


def test_select_times_distinct_mixes_and_keeps_the_fastest(optimized):
    """With library kernels made to look free, the mixes differ: each is emitted, timed, compared."""
    import copy
    from dataclasses import replace
    d, model, db, opts, compiled, run = optimized
    run2 = copy.copy(run)
    run2.mixes, run2.seconds = [], dict(run.seconds)
    run2.measurements = {k: (replace(m, median_ns=1) if k[1] in ("ort", "library") else m)
                         for k, m in run.measurements.items()}
    c2 = pipeline.select(run2)
    built = _check_mixes(run2.mixes, run2, opts.select_runs)
    assert len(built) >= 2
    feeds = executor.random_feeds(run.graph, seed=2)
    assert np.allclose(c2.run(feeds)["y"], compiled.run(feeds)["y"], rtol=1e-4, atol=1e-6)


def test_refine_fits_the_context_and_stores_it(optimized):
    d, model, db, opts, compiled, run = optimized
    ref = compiled.report["refined"]
    impls = {k.impl for k in run.plan.kernels}
    assert set(ref["fits"]) <= impls | {"tvm", "tvm-tuned", "ort", "library"} and ref["fits"]
    for f in ref["fits"].values():
        assert pipeline.SCALE_RANGE[0] <= f["scale"] <= pipeline.SCALE_RANGE[1] and f["call_us"] >= 0
    with ProfileDB(db) as pdb:
        stored = pdb.context(run.machine.fingerprint(opts.threads))
    assert set(stored) == set(ref["fits"])
    assert "changed" in ref


def test_refine_keeps_a_different_plan_only_if_it_measures_faster(optimized, monkeypatch):
    """Make the fit say library kernels are 4x slower inside the model: the re-solved plan differs,
    is emitted, timed against the selected one, and the faster of the two is kept."""
    import copy
    from dataclasses import replace
    d, model, db, opts, compiled, run = optimized
    run2 = copy.copy(run)
    run2.mixes, run2.seconds, run2.context, run2.refined = [], {}, {}, None
    run2.options = run.options.with_(db_path=str(d / "refine.sqlite"))
    # library kernels look free to select(), so its plan uses them ...
    run2.measurements = {k: (replace(m, median_ns=1) if k[1] in ("ort", "library") else m)
                         for k, m in run.measurements.items()}
    c1 = pipeline.select(run2)
    if not any(k.impl in ("ort", "library") for k in run2.plan.kernels):
        pytest.skip("no library kernel in this plan")
    # ... and then the executable "shows" them 4x slower plus 1 s per call
    monkeypatch.setattr(pipeline, "fit_context", lambda plan, ms: {"ort": (4.0, 1e9, 1), "library": (4.0, 1e9, 1)})
    c2, ctx = pipeline.refine(run2, c1)
    ref = run2.refined
    assert ref["changed"] and ref["runs"] == opts.select_runs and set(ref["measured_ms"]) == {"selected", "refined"}
    assert not set(ref["impls"]) & {"ort", "library"}
    faster = min(ref["measured_ms"], key=ref["measured_ms"].get)
    assert ref["kept"] == (faster == "refined") and (c2 is not c1) == ref["kept"]
    assert c2.plan is run2.plan and len(ctx["kernel_ms"]) == len(run2.plan.kernels)
    feeds = executor.random_feeds(run.graph, seed=4)
    assert np.allclose(c2.run(feeds)["y"], compiled.run(feeds)["y"], rtol=1e-4, atol=1e-6)


def test_fit_context_recovers_scale_and_call_cost():
    from kernorch.plan import Kernel
    alone = [10_000, 50_000, 200_000, 800_000, 30_000]
    kernels = [Kernel(f"c{i}.ort", "k", "ort", ("a",), (), ("a",), a) for i, a in enumerate(alone)]
    kernels.append(Kernel("c9.tvm", "k", "tvm", ("a",), (), ("a",), 40_000))
    inside_ms = [(1.5 * a + 20_000) / 1e6 for a in alone] + [0.08]
    fits = pipeline.fit_context(type("P", (), {"kernels": kernels})(), inside_ms)
    s, c, n = fits["ort"]
    assert s == pytest.approx(1.5) and c == pytest.approx(20_000) and n == 5
    assert fits["tvm"] == (pytest.approx(2.0), 0.0, 1)  # one kernel: the ratio only
    # implausible fits fall back to the ratio, clipped to SCALE_RANGE
    wild = pipeline.fit_context(type("P", (), {"kernels": kernels[:5]})(), [a * 100 / 1e6 for a in alone])
    assert wild["ort"] == (pipeline.SCALE_RANGE[1], 0.0, 5)


def test_context_weighs_the_choices(optimized):
    d, model, db, opts, compiled, run = optimized
    costs = pipeline.best_costs(run.measurements)
    plain, _ = pipeline.problem_for(run.graph, run.enumeration.candidates, costs)
    weighed, _ = pipeline.problem_for(run.graph, run.enumeration.candidates, costs, {"tvm": (2.0, 1000.0)})
    for a, b in zip(plain.choices, weighed.choices):
        assert b.alone_ns == a.cost_ns
        assert b.cost_ns == (round(2 * a.cost_ns + 1000) if a.impl == "tvm" else a.cost_ns)


def test_no_select_emits_the_plan_over_every_implementation(optimized):
    import copy
    d, model, db, opts, compiled, run = optimized
    args = cli.parser().parse_args(["optimize", str(model), "-o", str(d / "x"), "--no-select"])
    assert cli.options_from(args).select is False
    assert cli.options_from(args).context is True
    args = cli.parser().parse_args(["optimize", str(model), "-o", str(d / "x"), "--no-context"])
    assert cli.options_from(args).context is False
    run2 = copy.copy(run)
    run2.mixes, run2.options = [], run.options.with_(select=False)
    pipeline.select(run2)
    assert [m["mix"] for m in run2.mixes] == ["all"] and run2.mixes[0]["chosen"]


def test_profile_attributes_every_call_to_its_kernel(optimized):
    compiled = optimized[4]
    prof = compiled.profile(executor.random_feeds(compiled.graph, 0), runs=1)
    kernels = [p["kernel"] for p in prof if p["kernel"] is not None]
    assert kernels == list(range(len(compiled.plan.kernels)))
    assert all(p["ms"] >= 0 for p in prof)


def test_save_load_in_fresh_process(optimized, tmp_path):
    d, model, db, opts, compiled, run = optimized
    out = tmp_path / "saved"
    compiled.save(out)
    with pytest.raises(kernorch.KernorchError, match="exists"):
        compiled.save(out)
    x = np.random.default_rng(5).standard_normal((4, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code = (f"import numpy as np, kernorch; m = kernorch.load({str(out)!r}); "
            f"np.save({str(tmp_path / 'y.npy')!r}, m.run({{'x': np.load({str(tmp_path / 'x.npy')!r})}})['y'])")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert np.allclose(np.load(tmp_path / "y.npy"), compiled.run({"x": x})["y"], rtol=1e-5, atol=1e-6)
    # a manifest from another version is refused with a clear message
    mf = json.loads((out / "manifest.json").read_text())
    mf["kernorch"] = "0.0.0-other"
    (out / "manifest.json").write_text(json.dumps(mf))
    with pytest.raises(kernorch.KernorchError, match="optimize the model again"):
        kernorch.load(out)


def test_run_rejects_bad_inputs(optimized):
    compiled = optimized[4]
    with pytest.raises(kernorch.KernorchError, match="missing input"):
        compiled.run({})
    with pytest.raises(kernorch.KernorchError, match="shape"):
        compiled.run({"x": np.zeros((2, 16), np.float32)})


def test_cli_plan_and_db(optimized, tmp_path, capsys):
    d, model, db, opts, compiled, run = optimized
    out = tmp_path / "plan.json"
    assert cli.main(["plan", str(model), "--db", str(db), "--threads", "1", "--max-kernel-size", "4",
                     "-o", str(out)]) == 0
    assert json.loads(out.read_text())["stats"]["status"] == "optimal"
    assert "predicted: optimal" in capsys.readouterr().out
    assert cli.main(["candidates", str(model), "--db", str(db), "--threads", "1", "--max-kernel-size", "4",
                     "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["measured"] == 0 and rep["from_database"] == rep["jobs"]
    assert cli.main(["db", "stats", "--db", str(db), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["measurements"] > 0 and st["context_fits"] > 0  # optimize's refine stored its fits


def test_cli_errors_are_clear(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "missing.onnx")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "bad.onnx").write_bytes(b"not a model at all")
    assert cli.main(["inspect", str(tmp_path / "bad.onnx")]) == 2
    assert "not a valid ONNX model" in capsys.readouterr().err
    model = tmp_path / "tiny.onnx"
    tiny_model(model)
    assert cli.main(["inspect", str(model), "--shape", "nope=1x2"]) == 2
    assert "not model inputs" in capsys.readouterr().err
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "f").write_text("x")
    assert cli.main(["optimize", str(model), "-o", str(tmp_path / "out")]) == 2
    assert "--force" in capsys.readouterr().err


def test_cli_inspect_verify(tmp_path, capsys):
    model = tmp_path / "tiny.onnx"
    tiny_model(model)
    assert cli.main(["inspect", str(model), "--verify", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["verify"]["ok"] and rep["primitives"] >= 5
    assert set(rep["primitive_kinds"]) <= {"elementwise", "reduce", "broadcast", "layout", "linear", "opaque"}


def test_plan_survives_a_kernel_that_fails_to_build(optimized, monkeypatch):
    """A kernel refused at emit time is dropped and the program re-solved (fallback)."""
    d, model, db, opts, compiled, run = optimized
    from kernorch import emit as em
    victim = next(k for k in run.plan.kernels if k.impl == "tvm")
    real = em.build_module
    calls = {"n": 0}

    def flaky(graph, plan, threads):
        calls["n"] += 1
        if any(k.key == victim.key and k.impl == "tvm" for k in plan.kernels):
            raise RuntimeError("simulated build failure")
        return real(graph, plan, threads)

    monkeypatch.setattr(em, "build_module", flaky)
    monkeypatch.setattr(pipeline, "_failing_kernel",
                        lambda r: next((k for k in r.plan.kernels if k.key == victim.key and k.impl == "tvm"), None))
    import copy
    run2 = copy.copy(run)
    compiled2 = pipeline.emit(run2)
    assert calls["n"] >= 2
    assert all(not (k.key == victim.key and k.impl == "tvm") for k in run2.plan.kernels)
    feeds = executor.random_feeds(run.graph, seed=1)
    assert np.allclose(compiled2.run(feeds)["y"], compiled.run(feeds)["y"], rtol=1e-4, atol=1e-6)


def test_mismatch_names_the_first_diverging_kernel(optimized, monkeypatch):
    """verify() turns a mismatch into an error naming the first kernel whose output diverges."""
    d, model, db, opts, compiled, run = optimized
    from kernorch import executor as ex
    victim = run.plan.kernels[1]
    tensor = victim.outputs[0]
    real_run = ex.run

    def corrupted(graph, feeds, keep_all=False):
        values = real_run(graph, feeds, keep_all=keep_all)
        if keep_all:  # the reference now disagrees with what the victim kernel computes
            values = dict(values)
            values[tensor] = values[tensor] + 1.0
        return values

    monkeypatch.setattr(ex, "run", corrupted)
    feeds = ex.random_feeds(run.graph, 0)
    where = pipeline.bisect(run, feeds, 1e-3)
    assert where is not None and where.startswith(victim.id) and tensor in where
    real_model_run = compiled.run
    monkeypatch.setattr(compiled, "run", lambda f: {k: v + 1.0 for k, v in real_model_run(f).items()})
    with pytest.raises(kernorch.KernorchError, match=f"first diverging kernel: {victim.id}"):
        pipeline.verify(run, compiled, model)
