"""The whole pipeline on a tiny model: optimize, verify, save, reload in a fresh process, re-run from
the database, micro-kernel tiles in the plan, and the CLI's commands and errors."""
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from unittest import mock

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kernorch
from kernorch import cli, executor, pipeline
from kernorch.backends import registry
from kernorch.options import Options


def tiny_model(path=None):
    """x[4,16] → MatMul(16x32) + bias → Relu → MatMul(32x16) → Softmax."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(rng.standard_normal((32,)).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="bias"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["z"], name="mm2"),
        helper.make_node("Softmax", ["z"], ["y"], axis=-1, name="softmax"),
    ]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], [w1, b1, w2])
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
    compiled, planned = pipeline.optimize(str(model), opts, runs=3)
    return d, model, db, opts, compiled, planned


def test_optimize_matches_ort(optimized):
    d, model, db, opts, compiled, planned = optimized
    feeds = executor.random_feeds(compiled.graph, seed=3)
    ref = executor.ort_session(model, 1).run(None, feeds)[0]
    got = compiled.run(feeds)["y"]
    assert executor.max_error(ref, got)["rel"] < 1e-4
    rep = compiled.report
    assert rep["verify"]["ok"]
    assert rep["timing"]["runs"] >= 2 and rep["timing"]["kernorch_ms"] > 0 and rep["timing"]["ort_ms"] > 0
    ctx = rep["context"]
    plan = planned.plan
    assert len(ctx["kernel_ms"]) == len(plan.kernels) and all(ms > 0 for ms in ctx["kernel_ms"])
    assert sum(d["kernels"] for d in ctx["by_impl"].values()) == len(plan.kernels)
    assert plan.stats.status == "optimal"
    assert plan.predicted_ns <= plan.unfused_ns
    covered = {m for k in plan.kernels for m in k.members}
    assert set(compiled.graph.outputs) <= covered


def test_every_kernel_of_the_plan_costs_its_time_alone_plus_the_machines_kernel_boundary(optimized):
    d, model, db, opts, compiled, planned = optimized
    boundary = int(planned.plan.meta["boundary_ns"])  # the calibration's, rounded to 10 ns
    assert boundary >= 0 and boundary % 10 == 0
    measurements = planned.measured.measurements
    for k in planned.plan.kernels:
        assert k.cost_ns == int(measurements[(k.key, k.impl, k.schedule)].median_ns) + boundary
    problem, _ = pipeline.problem_for(planned.loaded.graph, planned.enumeration.candidates,
                                      planned.measured.measurements, opts, boundary_ns=1000)
    bare, _ = pipeline.problem_for(planned.loaded.graph, planned.enumeration.candidates,
                                   planned.measured.measurements, opts)
    assert [c.cost_ns - 1000 for c in problem.choices] == [c.cost_ns for c in bare.choices]


def test_contractions_run_in_their_fastest_tile_with_packed_weights(optimized):
    """Both matmuls have a constant weight: each is timed in every tile, the fastest is kept for
    the kernels around it (a kernel with a row-wise epilogue also gets the fastest tile with rows
    outside), and the executable takes the weight packed for that tile."""
    d, model, db, opts, compiled, planned = optimized
    tiles = planned.measured.tiles
    from kernorch.kernels import Tile
    assert len(tiles) == 2 and all(Tile.parse(t).pack for t in tiles.values())   # (serial or not: measured)
    by_prim = pipeline.tile_jobs(planned.loaded.graph, planned.enumeration.candidates, opts, planned.machine)
    rows_outside = pipeline.fastest_schedules(planned.measured.measurements, by_prim, rows_outer=True)
    assert rows_outside and all(Tile.parse(t).rows_outer for t in rows_outside.values())
    allowed = {*tiles.values(), *rows_outside.values(), "default"}
    mm = [k for k in planned.plan.kernels if any(planned.loaded.graph.by_name[m].op == "matmul" for m in k.members)]
    assert mm and all(k.schedule in allowed for k in mm)
    packed = [layout for _, layout in compiled.executable.weight_names if layout != "plain"]
    tiled = [k for k in mm if k.schedule != "default"]
    assert len(packed) == len(tiled) > 0 and all(layout.startswith("KN>N") for layout in packed)


def test_only_compiled_kernels_without_permission(optimized):
    from kernorch.backends import registry
    d, model, db, opts, compiled, planned = optimized
    assert all(registry.native(k.impl) for k in planned.plan.kernels)
    assert [i.name for i in registry.allowed(opts)] == ["tvm", "tvm-tuned"]
    assert "reference" in [i.name for i in registry.allowed(opts.with_(python_kernels=True))]


def test_second_run_is_served_from_database(optimized):
    d, model, db, opts, compiled, planned = optimized
    again = pipeline.plan_model(str(model), opts)
    st = again.measured.stats
    assert st.measured == 0 and st.refused == 0 and st.cached == st.jobs > 0
    assert again.plan.predicted_ns == planned.plan.predicted_ns
    assert [(k.key, k.impl, k.schedule) for k in again.plan.kernels] == \
        [(k.key, k.impl, k.schedule) for k in planned.plan.kernels]


def test_the_executable_links_the_kernels_its_builders_compiled(optimized, tmp_path, caplog):
    """The builders keep each kernel's object file beside the profile database; the executable
    links those of its kernels instead of compiling them again, and computes the same. A kernel
    whose object is gone (or every one: the directory is gone) is compiled alone into that object
    first and linked like the others; an object that does not link leaves every kernel compiled in
    the module, with a warning."""
    from kernorch.backends.tvm import relax as rx
    d, model, db, opts, compiled, planned = optimized
    native = {s for s, k in zip(rx.kernel_symbols(planned.plan), planned.plan.kernels) if registry.native(k.impl)}
    assert native and set(compiled.executable.linked) == native
    objs = sorted(opts.object_cache().glob("*.o"))
    assert len(objs) >= len(native)
    feeds = executor.random_feeds(compiled.graph, seed=7)
    want = compiled.run(feeds)["y"]

    def emitted(name: str, prepare) -> object:
        o = opts.with_(db_path=str(tmp_path / name / "db.sqlite"))
        shutil.copytree(opts.object_cache(), o.object_cache())
        prepare(o.object_cache())
        got = pipeline.emit(planned.loaded.graph, planned.plan, o, planned.machine)
        np.testing.assert_allclose(got.run(feeds)["y"], want, rtol=1e-6, atol=1e-6)
        return got.executable
    # each builder named its object by the kernel's lowered module too: emitted again, nothing is
    # scheduled; without those names each kernel is scheduled again and finds the same object
    def names(executable) -> dict:
        return {n: q.name for n, q in executable.linked.items()}
    with mock.patch.object(rx, "schedule", side_effect=AssertionError("scheduled again")):
        assert names(emitted("named", lambda directory: None)) == names(compiled.executable)
    assert names(emitted("unnamed", lambda directory: shutil.rmtree(directory / "scheduled"))) == \
        names(compiled.executable)
    first, obj = sorted(compiled.executable.linked.items())[0]
    partly = emitted("partly", lambda directory: (directory / obj.name).unlink())
    assert names(partly) == names(compiled.executable)
    assert partly.linked[first].exists()
    assert set(emitted("none", lambda directory: shutil.rmtree(directory)).linked) == native

    def damage(directory):
        for q in directory.glob("*.o"):
            q.write_bytes(b"not an object")
    with caplog.at_level("WARNING"):
        assert emitted("damaged", damage).linked == {}
    assert "compiling every kernel instead" in caplog.text


def test_a_reoptimize_loads_the_executable_it_compiled_before(optimized, monkeypatch):
    """optimize keeps the compiled library beside the profile database; emitting the same plan
    again loads it instead of compiling (tvm.compile would fail here), and it computes the same.
    A damaged library is compiled again; another weight gives another library."""
    import tvm
    from kernorch.backends.tvm import relax as rx
    d, model, db, opts, compiled, planned = optimized
    cache = opts.executable_cache()
    assert cache.parent == db.parent and len(list(cache.glob("*.so"))) == 1
    # the fresh compile runs the library it kept (not its LLVM IR compiled again in memory)
    assert [m.kind for m in compiled.executable.ex.imports] == ["library"]
    assert compiled.executable.library == next(cache.glob("*.so"))
    feeds = executor.random_feeds(compiled.graph, seed=5)
    real_compile = tvm.compile
    def refuse(*a, **k):
        raise AssertionError("compiled again")
    monkeypatch.setattr(tvm, "compile", refuse)
    again = pipeline.emit(planned.loaded.graph, planned.plan, opts, planned.machine)
    np.testing.assert_array_equal(again.run(feeds)["y"], compiled.run(feeds)["y"])
    from kernorch.runtime import load
    again.save(d / "again")       # a loaded library is copied, not exported again
    load(d / "again").save(d / "again2")
    np.testing.assert_array_equal(load(d / "again2").run(feeds)["y"], compiled.run(feeds)["y"])
    # (another path: this process holds the first one open, and dlopen would hand it back)
    other_opts = opts.with_(db_path=str(d / "other" / "db.sqlite"))
    shutil.copytree(opts.object_cache(), other_opts.object_cache())  # (the same kernels linked: the same name)
    damaged = other_opts.executable_cache() / next(cache.glob("*.so")).name
    damaged.write_bytes(b"not a library")
    monkeypatch.setattr(tvm, "compile", real_compile)
    rebuilt = pipeline.emit(planned.loaded.graph, planned.plan, other_opts, planned.machine)
    np.testing.assert_array_equal(rebuilt.run(feeds)["y"], compiled.run(feeds)["y"])
    assert damaged.read_bytes()[:4] == b"\x7fELF"
    graph = planned.loaded.graph
    name = next(iter(graph.constants))
    other = replace(graph, constants={**graph.constants, name: np.asarray(graph.constants[name]) + 1})
    target = rx.make_target(opts.threads)
    params = rx.weights(graph, planned.plan)
    mod = rx.build_module(graph, planned.plan, target, params)
    assert rx.executable_key(mod, target, graph, params) != rx.executable_key(mod, target, other, params)


def test_profile_attributes_every_call_to_its_kernel(optimized):
    compiled = optimized[4]
    prof = compiled.profile(executor.random_feeds(compiled.graph, 0), runs=1)
    kernels = [p["kernel"] for p in prof if p["kernel"] is not None]
    assert kernels == list(range(len(compiled.plan.kernels)))
    assert all(p["ms"] >= 0 for p in prof)
    # every call checks the model's inputs, not its weights (the executable's own, checked at load)
    assert compiled.graph.constants and [p["call"] for p in prof].count("vm.builtin.check_tensor_info") == len(
        compiled.graph.inputs)


def two_layers_model(path):
    """x[16,64] through two identical layers (MatMul by a 64x64 weight, then Relu): each layer's
    kernels repeat the other's (same keys), with their own weights."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w{i}") for i in range(2)]
    nodes = []
    for i in range(2):
        nodes += [helper.make_node("MatMul", ["x" if i == 0 else "r0", f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Relu", [f"m{i}"], ["y" if i == 1 else f"r{i}"], name=f"relu{i}")]
    g = helper.make_graph(nodes, "layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 64])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))


def test_a_repeated_kernel_is_compiled_once_and_profiled_at_each_call(tmp_path):
    """Plan kernels with the same key, implementation and schedule (a model's repeated layers) call
    one PrimFunc (relax.kernel_symbols): the module holds each once, the outputs stay right, and
    the profile still attributes each call to its own plan kernel, in order."""
    from tvm import tirx
    from kernorch.backends.tvm import relax as rx
    model = tmp_path / "layers.onnx"
    two_layers_model(model)
    opts = Options().with_(**FAST).with_(max_kernel_size=1, db_path=str(tmp_path / "db.sqlite"))
    compiled, planned = pipeline.optimize(str(model), opts, runs=0)
    plan = compiled.plan
    idents = [(k.key, k.impl, k.schedule) for k in plan.kernels]
    assert len(set(idents)) < len(idents)                       # the layers' kernels repeat
    symbols = rx.kernel_symbols(plan)
    assert [symbols[idents.index(i)] for i in idents] == symbols  # each repeat calls the first
    mod = rx.build_module(planned.loaded.graph, plan, rx.make_target(opts.threads), rx.weights(planned.loaded.graph, plan))
    prims = [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)
             and gv.name_hint.startswith("k")]
    assert sorted(prims) == sorted(set(symbols))
    feeds = executor.random_feeds(compiled.graph, 0)
    ref = executor.ort_session(str(model), 1).run(None, feeds)[0]
    assert executor.max_error(ref, compiled.run(feeds)["y"])["rel"] < 1e-4
    prof = compiled.profile(feeds, runs=1)
    assert [p["kernel"] for p in prof if p["kernel"] is not None] == list(range(len(plan.kernels)))


def test_save_load_in_fresh_process(optimized, tmp_path):
    d, model, db, opts, compiled, planned = optimized
    out = tmp_path / "saved"
    compiled.save(out)
    assert sorted(p.name for p in out.iterdir()) == ["graph.json", "manifest.json", "model.so", "plan.json",
                                                    "report.json", "weights.npz"]
    with pytest.raises(kernorch.KernorchError, match="exists"):
        compiled.save(out)
    x = np.random.default_rng(5).standard_normal((4, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code = (f"import numpy as np, kernorch; m = kernorch.load({str(out)!r}); "
            f"np.save({str(tmp_path / 'y.npy')!r}, m.run({{'x': np.load({str(tmp_path / 'x.npy')!r})}})['y'])")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert np.allclose(np.load(tmp_path / "y.npy"), compiled.run({"x": x})["y"], rtol=1e-5, atol=1e-6)
    compiled.save(out, force=True)  # a kernorch output may be overwritten
    # a manifest of another format is refused with a clear message
    mf = json.loads((out / "manifest.json").read_text())
    mf["format"] = 2
    (out / "manifest.json").write_text(json.dumps(mf))
    with pytest.raises(kernorch.KernorchError, match="optimize the model again"):
        kernorch.load(out)


def test_run_rejects_bad_inputs(optimized):
    compiled = optimized[4]
    with pytest.raises(kernorch.KernorchError, match="missing input"):
        compiled.run({})
    with pytest.raises(kernorch.KernorchError, match="shape"):
        compiled.run({"x": np.zeros((2, 16), np.float32)})
    with pytest.raises(kernorch.KernorchError, match="unknown inputs"):
        compiled.run({"x": np.zeros((4, 16), np.float32), "extra": np.zeros(1)})
    with pytest.raises(kernorch.KernorchError, match="dtype"):
        compiled.run({"x": np.zeros((4, 16), np.complex64)})


def test_run_takes_aligned_float32_inputs_without_a_copy_and_others_with_one(optimized):
    compiled = optimized[4]
    x = np.random.default_rng(6).standard_normal((4, 16)).astype(np.float32)
    want = compiled.run({"x": x})["y"]
    for variant in (x.astype(np.float64), np.asfortranarray(x), x.copy(order="C")):
        np.testing.assert_allclose(compiled.run({"x": variant})["y"], want, rtol=1e-6)


def test_cli_plan_and_db(optimized, tmp_path, capsys):
    d, model, db, opts, compiled, planned = optimized
    out = tmp_path / "plan.json"
    assert cli.main(["plan", str(model), "--db", str(db), "--threads", "1", "--max-kernel-size", "4",
                     "-o", str(out)]) == 0
    assert json.loads(out.read_text())["stats"]["status"] == "optimal"
    text = capsys.readouterr().out
    assert "predicted: optimal" in text and "schedule" in text
    assert cli.main(["candidates", str(model), "--db", str(db), "--threads", "1", "--max-kernel-size", "4",
                     "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["measured"] == 0 and rep["from_database"] == rep["jobs"]
    assert len(rep["tiles"]) == 2 and all(t["kept"] in t["tiles_us"] for t in rep["tiles"])
    assert cli.main(["db", "stats", "--db", str(db), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["measurements"] > 0 and st["block_solutions"] >= 0 and st["runs_kept"] >= 0
    assert cli.main(["db", "stats", "--db", str(db)]) == 0
    assert f"{st['block_solutions']} proven block solutions" in capsys.readouterr().out


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


def test_mismatch_names_the_first_diverging_kernel(optimized, monkeypatch):
    """verify() turns a mismatch into an error naming the first kernel whose output diverges."""
    d, model, db, opts, compiled, planned = optimized
    from kernorch import executor as ex
    from kernorch import verify
    victim = planned.plan.kernels[1]
    tensor = victim.outputs[0]
    real_run = ex.run

    def corrupted(graph, feeds, keep_all=False):
        values = real_run(graph, feeds, keep_all=keep_all)
        if keep_all:  # the reference now disagrees with what the victim kernel computes
            values = dict(values)
            values[tensor] = values[tensor] + 1.0
        return values

    monkeypatch.setattr(ex, "run", corrupted)
    feeds = ex.random_feeds(compiled.graph, 0)
    where = verify.bisect(compiled, feeds, 1e-3)
    assert where is not None and where.startswith(victim.id) and tensor in where
    real_model_run = compiled.run
    monkeypatch.setattr(compiled, "run", lambda f: {k: v + 1.0 for k, v in real_model_run(f).items()})
    with pytest.raises(kernorch.KernorchError, match=f"first diverging kernel: {victim.id}"):
        verify.verify(compiled, model, opts)


def test_two_models_of_one_architecture_keep_their_own_weights(optimized, tmp_path):
    """Same structure, other weights: both optimized and run in one process, each gives its own outputs."""
    d, model, db, opts, compiled, planned = optimized
    other = tiny_model()
    for init in other.graph.initializer:
        arr = numpy_helper.to_array(init) * -0.5
        init.CopyFrom(numpy_helper.from_array(arr.astype(np.float32), init.name))
    onnx.save(other, str(tmp_path / "other.onnx"))
    compiled2, _ = pipeline.optimize(str(tmp_path / "other.onnx"), opts, runs=0)
    feeds = executor.random_feeds(compiled.graph, seed=9)
    for m, c in ((model, compiled), (tmp_path / "other.onnx", compiled2)):
        ref = executor.ort_session(m, 1).run(None, feeds)[0]
        assert executor.max_error(ref, c.run(feeds)["y"])["rel"] < 1e-4
    assert not np.allclose(compiled.run(feeds)["y"], compiled2.run(feeds)["y"])


def test_a_blocked_kernel_reading_a_graph_input_gets_its_conversion(tmp_path):
    """Found by the fuzz suite (seed 154): a blocked kernel that reads the model's input must be
    preceded by the input's conversion to the blocked layout."""
    from fuzzgraphs import random_model
    model, _ = random_model(154)
    opts = Options(db_path=str(tmp_path / "db.sqlite"), threads=1, max_kernel_size=3, repeats=1, min_repeat_ms=0.2,
                   compare_untuned=0)
    compiled, planned = pipeline.optimize(model, opts, runs=0)
    feeds = executor.random_feeds(compiled.graph, 154)
    ref = executor.ort_session(model, 1).run(None, feeds)
    for r, o in zip(ref, model.graph.output):
        assert executor.max_error(r, compiled.run(feeds)[o.name])["rel"] < 1e-4


def chain_model(path, n=6):
    """x[256,512] through `n` cheap elementwise nodes: each costs its memory traffic, so a fused run
    of them costs about what one of them does."""
    ops = ["Relu", "Neg", "Abs"]
    nodes = [helper.make_node(ops[i % len(ops)], ["x" if i == 0 else f"t{i - 1}"], [f"t{i}" if i < n - 1 else "y"],
                              name=f"n{i}") for i in range(n)]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 512])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 512])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))


@pytest.mark.parametrize("estimate_ns", [1, 10**10])
def test_pruned_measurement_ends_with_a_plan_of_measured_kernels(tmp_path, monkeypatch, estimate_ns):
    """prune: fused kernels are measured only when the solver wants them on their estimates; the
    loop ends when every kernel of the plan was measured. Estimates below any time: the solver keeps
    asking until it has what it wants; above any time: no fused kernel is measured at all."""
    import kernorch.estimate
    monkeypatch.setattr(kernorch.estimate, "fused_estimate_ns", lambda *a: estimate_ns)
    model = tmp_path / "chain.onnx"
    chain_model(model)
    base = Options().with_(**FAST).with_(max_kernel_size=3, cost_model="analytic")
    pruned = pipeline.plan_model(str(model), base.with_(db_path=str(tmp_path / "a.sqlite")))
    full = pipeline.plan_model(str(model), base.with_(db_path=str(tmp_path / "b.sqlite"), prune=False))
    assert not pruned.plan.estimated
    ms = pruned.measured.measurements
    assert all((k.key, k.impl, k.schedule) in ms and ms[(k.key, k.impl, k.schedule)].ok for k in pruned.plan.kernels)
    assert full.measured.stats.estimated == 0 and full.measured.stats.rounds == 0
    def fused_keys(measurements):
        return {key for (key, _, sched), m in measurements.items() if "+" in m.description and sched != "none"}
    fused, measured_fused = fused_keys(full.measured.measurements), fused_keys(ms)
    if estimate_ns == 1:
        assert pruned.measured.stats.rounds >= 1 and measured_fused
        assert any(len(k.members) > 1 for k in pruned.plan.kernels)
    else:
        assert pruned.measured.stats.rounds == 0 and not measured_fused
        assert pruned.measured.stats.estimated == len(fused) > 0
        assert all(len(k.members) == 1 for k in pruned.plan.kernels)


def test_refining_stops_once_the_measured_kernels_plan_is_within_reach_of_the_bound(tmp_path, monkeypatch):
    """Before every round, the first too, the loop ends when the best plan of measured kernels
    costs within SETTLE_WITHIN of the bound on the program with the unmeasured fusions at their
    estimates: the plan then holds only measured kernels, and the fusions left are counted as
    never measured. With SETTLE_WITHIN 0 the loop goes on until the plan wants nothing unmeasured."""
    import kernorch.estimate
    monkeypatch.setattr(kernorch.estimate, "fused_estimate_ns", lambda *a: 1)  # every fusion looks free
    monkeypatch.setattr(pipeline, "promising", lambda m, wanted, *a, **k: list(wanted)[:1])  # one a round
    model = tmp_path / "chain.onnx"
    chain_model(model)
    base = Options().with_(**FAST).with_(max_kernel_size=3, cost_model="analytic")
    monkeypatch.setattr(pipeline, "SETTLE_WITHIN", 0.0)
    full = pipeline.plan_model(str(model), base.with_(db_path=str(tmp_path / "a.sqlite")))
    monkeypatch.setattr(pipeline, "SETTLE_WITHIN", 1e9)   # any measured plan is close enough
    early = pipeline.plan_model(str(model), base.with_(db_path=str(tmp_path / "b.sqlite")))
    assert full.measured.stats.rounds > 1 and early.measured.stats.rounds == 0
    for planned in (full, early):
        ms = planned.measured.measurements
        assert not planned.plan.estimated
        assert all(ms[(k.key, k.impl, k.schedule)].ok for k in planned.plan.kernels)
    assert early.measured.stats.estimated > full.measured.stats.estimated
    assert early.measured.stats.estimated == len(early.measured.pending)


def test_the_plan_of_measured_kernels_is_none_while_a_prim_waits_for_a_pending_fusion(tmp_path):
    """A prim whose own kernels were all refused is computed only by fusions: while those are
    pending there is no plan of measured kernels (None, with `or_none`; the refine loop goes on),
    and without `or_none` the solve names the prim."""
    model = tmp_path / "chain.onnx"
    chain_model(model)
    opts = Options().with_(**FAST).with_(max_kernel_size=3, cost_model="analytic", db_path=str(tmp_path / "a.sqlite"))
    planned = pipeline.plan_model(str(model), opts)
    graph, en, measured = planned.loaded.graph, planned.enumeration, planned.measured
    prim = graph.prims[2].name
    alone = {c.key for c in en.candidates if c.members == (prim,)}
    kept = {i: m for i, m in measured.measurements.items() if i[0] not in alone and
            not any(prim in c.members and c.key == i[0] for c in en.candidates if len(c.members) > 1)}
    view = pipeline.measured_only(replace(measured, measurements=kept))
    assert pipeline.orchestrate(graph, en, view, opts, or_none=True) is None
    with pytest.raises(kernorch.KernorchError, match=prim):
        pipeline.orchestrate(graph, en, view, opts)
    assert pipeline.orchestrate(graph, en, pipeline.measured_only(measured), opts, or_none=True) is not None



def test_the_plan_of_measured_kernels_is_none_where_they_cover_every_prim_but_make_no_plan(tmp_path, monkeypatch):
    """Kernels that cover every prim but make no plan (two fusions each taking a tensor the other
    computes inside: bert_like's position ids over seq, Zen 2) are, with `or_none`, no plan of
    measured kernels yet (None); without it, the solver's error."""
    from kernorch import plan as plan_mod
    from kernorch.orchestrate import NoPlan
    model = tmp_path / "chain.onnx"
    chain_model(model)
    opts = Options().with_(**FAST).with_(max_kernel_size=3, cost_model="analytic", db_path=str(tmp_path / "a.sqlite"))
    planned = pipeline.plan_model(str(model), opts)
    view = pipeline.measured_only(planned.measured)

    def no_plan(*a, **k):
        raise NoPlan("no executable plan exists: the candidate kernels cannot compute every graph output")
    monkeypatch.setattr(plan_mod, "make_plan", no_plan)
    assert pipeline.orchestrate(planned.loaded.graph, planned.enumeration, view, opts, or_none=True) is None
    with pytest.raises(NoPlan):
        pipeline.orchestrate(planned.loaded.graph, planned.enumeration, view, opts)


def test_a_rerun_resumes_the_estimates_even_after_a_fusion_was_refused(tmp_path, monkeypatch):
    """A run keeps the estimates of what it never measured under a name for its set of fusions; the
    next run finds them by that name even when a fusion the first run measured was refused, which
    makes it neither pending nor known (the name once left it out, and the next run measured again)."""
    import sqlite3
    import kernorch.estimate
    # pairs look free, so the solver wants them; triples look too dear ever to measure
    monkeypatch.setattr(kernorch.estimate, "fused_estimate_ns", lambda g, *a: 1 if len(g.prims) == 2 else 10**10)
    monkeypatch.setattr(pipeline, "promising", lambda m, wanted, *a, **k: list(wanted))  # no fill-up
    model = tmp_path / "chain.onnx"
    chain_model(model)
    opts = Options().with_(**FAST).with_(max_kernel_size=3, cost_model="analytic", db_path=str(tmp_path / "a.sqlite"))
    first = pipeline.plan_model(str(model), opts)
    assert first.measured.state and first.measured.stats.estimated > 0  # some fusions never measured
    fused = [(k, s) for (k, _, s), m in first.measured.measurements.items() if "+" in m.description and s != "none"]
    assert fused
    with sqlite3.connect(opts.db_path) as c:
        c.execute("UPDATE measurements SET status='refused', reason='test' WHERE key=? AND schedule=?", fused[0])
    again = pipeline.plan_model(str(model), opts)
    assert again.measured.state == first.measured.state
    assert again.measured.stats.rounds == 0 and again.measured.stats.measured == 0


def test_estimates_err_low():
    """The estimate of a fused kernel: the cheapest call plus half of what its most expensive member
    alone takes beyond it, unless the roofline says more."""
    from kernorch.estimate import fused_estimate_ns, kernel_floor_ns
    from kernorch.ir import Graph, TensorType, make_prim
    t = TensorType((256, 256))
    g = Graph((("x", t),), ("b",), (make_prim("a", "exp", ["x"], t), make_prim("b", "relu", ["a"], t)))
    floor = kernel_floor_ns(g, 300.0, 40.0)
    assert floor == int(2 * 256 * 256 * 4 / 240.0)
    assert fused_estimate_ns(g, 300.0, 40.0, {"a": 10_000, "b": 4_000}, 1_000) == max(floor, 900 + 4_550)


def _job(*prims, op: str = "exp"):
    """A pending job as promising() sees it: its kernel graph's prims, each a name (of an `op`) or
    a (name, op) pair."""
    from types import SimpleNamespace as NS
    return NS(graph=NS(prims=tuple(NS(name=p, op=op) if isinstance(p, str) else NS(name=p[0], op=p[1])
                                   for p in prims)))


def test_a_round_fills_up_with_one_fusion_of_each_family():
    """The fill-up takes one fusion built around the same contraction (else the same reductions,
    else the same first prim): their outcomes go together. The wanted kernels are never capped."""
    from kernorch.measure import MeasureStats
    pending = {
        ("s1", "tvm", "t14x32r"): _job(("t", "transpose"), ("mm", "matmul")),
        ("s2", "tvm", "t14x32r"): _job(("mm", "matmul"), ("d", "div")),
        ("s2", "tvm", "t4x64r"): _job(("mm", "matmul"), ("d", "div")),       # the same family in another tile
        ("r1", "tvm", "default"): _job(("d", "div"), ("mx", "reduce_max")),
        ("r2", "tvm", "default"): _job(("mx", "reduce_max"), ("sb", "sub")),
        ("e1", "tvm", "default"): _job(("sb", "sub"), ("ex", "exp")),
        ("e2", "tvm", "default"): _job(("ex", "exp"), ("sm", "add")),         # another first prim: its own
        ("w1", "tvm", "default"): _job(("sb", "sub"), ("x", "exp"), ("y", "exp")),  # e1's first prim
    }
    ids = list(pending)
    m = pipeline.Measured({}, MeasureStats(measured=100, seconds=50.0), pending=pending,
                          estimates={i: 500 + n for n, i in enumerate(ids)}, members_ns=dict.fromkeys(ids, 1000.0))
    assert pipeline.promising(m, [], solve_s=1.0) == [ids[0], ids[3], ids[5], ids[6]]
    assert pipeline.promising(m, ids[1:3], solve_s=1.0) == ids[1:3] + [ids[0], ids[3], ids[5], ids[6]]
    with mock.patch.object(pipeline, "FILL_PER_FAMILY", 2), mock.patch.object(pipeline, "FILL_MIN", 16):
        assert pipeline.promising(m, [], solve_s=1.0) == ids[:2] + ids[3:]  # the third fusion around mm left out


def test_a_refine_round_measures_what_the_plan_wants_then_the_most_promising():
    """promising(): the wanted kernels first, then pending fusions by estimate / members alone,
    as many as one solve's time measures (at least FILL_MIN, at most 512)."""
    from kernorch.measure import MeasureStats
    pending = {(f"k{i}", "tvm", "default"): _job(f"p{i}") for i in range(600)}
    promise = {i: (int(i[0][1:]) * 7919) % 600 / 600 for i in pending}
    m = pipeline.Measured({}, MeasureStats(measured=100, seconds=50.0), pending=pending,
                          estimates={i: 1000 * p for i, p in promise.items()}, members_ns={i: 1000.0 for i in pending})
    wanted = [("k5", "tvm", "default"), ("k9", "tvm", "default")]
    rest = sorted((i for i in pending if i not in wanted), key=lambda i: (promise[i], i))
    for floor in (4, 16):
        with mock.patch.object(pipeline, "FILL_MIN", floor):
            few = pipeline.promising(m, wanted, solve_s=1.0)       # 0.5 s a kernel: 2 in a solve, `floor` at least
        assert few[:2] == wanted and len(few) == 2 + floor
        assert few[2:] == rest[:floor]
    assert len(pipeline.promising(m, wanted, solve_s=20.0)) == 2 + 40
    assert len(pipeline.promising(m, wanted, solve_s=10_000.0)) == 2 + 512


def test_a_refine_round_fills_up_with_what_the_solver_may_still_ask_for():
    """With the learned model: the fusions it expects to save first; then, where too few, those whose
    estimates still undercut their members alone (the solver would ask for them one round at a
    time), by estimate / members; never one the solver cannot want."""
    from kernorch.measure import MeasureStats
    ids = [(f"k{i}", "tvm", "default") for i in range(40)]
    saves = ids[:3]      # predicted at half their members; the others at 10x, estimated (bound) at 0.5x-0.9x or 1.5x
    estimates = {i: (500 if i in saves else 500 + 10 * n if n < 30 else 1500) for n, i in enumerate(ids)}
    m = pipeline.Measured({}, MeasureStats(measured=100, seconds=50.0), pending={i: _job(i[0]) for i in ids},
                          estimates=estimates, members_ns=dict.fromkeys(ids, 1000.0), sigma=0.3,
                          predicted={i: (500.0 if i in saves else 10_000.0) for i in ids})
    with mock.patch.object(pipeline, "FILL_MIN", 16):
        batch = pipeline.promising(m, [ids[39]], solve_s=1.0)
    assert batch[0] == ids[39] and batch[1:4] == saves
    assert batch[4:] == ids[3:16]                    # 16 in all, the most attractive estimates next
    every = pipeline.promising(m, [], solve_s=1000.0)
    assert set(every) == set(ids[:30])               # estimates at 1.5x their members: never


def test_a_fusion_the_model_does_not_estimate_fills_up_a_round_only_against_the_plan():
    """A pending fusion without a learned prediction (an attention, pipeline._learnable) while the
    model predicts the others is not taken as likely to save against its members alone (every
    fused attention beats them), only where its estimate undercuts what the plan spends on its prims."""
    from types import SimpleNamespace
    from kernorch.measure import MeasureStats
    ids = [(f"k{i}", "tvm", "default") for i in range(4)]
    learned, cheap, dear = ids[0], ids[1], ids[2]
    graphs = {i: _job(f"p{n}") for n, i in enumerate(ids)}
    plan = SimpleNamespace(kernels=[SimpleNamespace(cost_ns=600.0 if n == 1 else 100.0, members=[f"p{n}"])
                                    for n in range(4)])
    m = pipeline.Measured({}, MeasureStats(measured=100, seconds=50.0), pending=graphs,
                          estimates={learned: 500, cheap: 300, dear: 300, ids[3]: 5000},
                          members_ns=dict.fromkeys(ids, 1000.0), sigma=0.3, predicted={learned: 500.0, ids[3]: 10_000.0})
    # against members alone all three undercut them; against the plan only `cheap` (300 < 600) does
    assert pipeline.promising(m, [], solve_s=1.0, plan=plan) == [learned, cheap]


def test_fusions_the_model_does_not_estimate_are_raised_by_the_least_ratio_measured_of_their_kind(monkeypatch):
    """Attentions (two contractions) keep their bound (pipeline._learnable); once the run measured
    some, the others' bounds are raised by the least ratio of measured time to bound among those of
    their schedule (their tile), or among all while none of their schedule was measured, while the
    learned estimates stay as they were between refits."""
    from kernorch import costmodel as cm
    from kernorch.database import Measurement
    from kernorch.measure import MeasureStats
    from tests.test_costmodel import Shifting
    ids = [(f"a{i}", "tvm", "t4x64r") for i in range(4)] + [("f", "tvm", "default")]
    other = [(f"b{i}", "tvm", "t14x32r") for i in range(2)]
    durations = {ids[0]: 3000, ids[1]: 2500, other[0]: 4000}

    def fake_measure(jobs, *args):
        return {j.ident: Measurement("", *j.ident, "", "ok", durations[j.ident], (), "") for j in jobs}, MeasureStats()
    monkeypatch.setattr(pipeline, "_measure_with_fallback", fake_measure)
    bounds = {i: 1000 for i in ids + other}
    attention = _job(("q", "matmul"), ("s", "exp"), ("v", "matmul"))
    m = pipeline.Measured({}, MeasureStats(), pending={i: _with_ident(attention, i) for i in ids + other}, bounds=bounds,
                          members_ns=dict.fromkeys(ids + other, 5000.0), predicted={ids[4]: 4000.0}, sigma=0.1,
                          model=Shifting(), rows={ids[4]: (cm.Row(ids[4], {}, 2000.0),)})
    m = pipeline.replace(m, estimates=pipeline._estimates(m))
    assert [m.estimates[i] for i in ids[:4] + other] == [1000] * 6   # nothing of their kind measured: the bound
    m = pipeline.refine(m, ids[:1], None, None, None)
    assert m.unlearned == {"t4x64r": 3.0} and [m.estimates[i] for i in ids[1:4] + other] == [3000] * 5
    m = pipeline.refine(m, ids[1:2], None, None, None)
    assert m.unlearned == {"t4x64r": 2.5} and [m.estimates[i] for i in ids[2:4] + other] == [2500] * 4
    m = pipeline.refine(m, other[:1], None, None, None)    # the other tile: raised by its own ratio
    assert m.unlearned == {"t4x64r": 2.5, "t14x32r": 4.0}
    assert [m.estimates[i] for i in ids[2:4] + other[1:]] == [2500, 2500, 4000]
    assert m.estimates[ids[4]] > bounds[ids[4]]               # the learned estimate, not raised
    ok = [pipeline._learnable(g) for g in _attention_and_gemm_graphs()]
    assert ok == [False, True]


def _with_ident(job, ident):
    """`_job`'s pending job as refine() measures it: with its ident."""
    from types import SimpleNamespace as NS
    return NS(graph=job.graph, ident=ident)


def _fake_measure_at(durations):
    """A `_measure_with_fallback` that times each job at `durations[ident]`: one time, or its time
    at each length of a range ({length: ns}, weighted evenly)."""
    from kernorch.database import Measurement
    from kernorch.measure import MeasureStats

    def fake(jobs, *args):
        out = {}
        for j in jobs:
            t = durations[j.ident]
            at = tuple(sorted(t.items())) if isinstance(t, dict) else ()
            median = int(sum(ns for _, ns in at) / len(at)) if at else t
            out[j.ident] = Measurement("", *j.ident, "", "ok", median, (), "", samples_ns=at)
        return out, MeasureStats()
    return fake


def test_fusions_around_a_contraction_are_raised_by_those_measured_around_it(monkeypatch):
    """Every fusion around one contraction has the same bound (nine tenths of the contraction
    alone): once CONTRACTION_AFTER of them are measured in a schedule, the others of that
    contraction and schedule are raised by the least ratio of time to bound those took, never
    above the contraction's time alone (1 / LINEAR_FACTOR); fusions around another contraction, in
    another schedule, or around none keep their bounds, and so does a fusion with two contractions."""
    from kernorch.estimate import LINEAR_FACTOR
    from kernorch.measure import MeasureStats
    gemm = [(f"g{n}", "tvm", "t8x32p") for n in range(5)]
    tile, other, memory, two = ("h", "tvm", "t4x64p"), ("o", "tvm", "t8x32p"), ("x", "tvm", "default"), \
        ("w", "tvm", "t8x32p")
    jobs = {i: _job(("mm", "matmul"), (f"e{n}", "add")) for n, i in enumerate(gemm)}
    jobs.update({tile: _job(("mm", "matmul"), ("b", "add")), other: _job(("mm2", "matmul"), ("c", "add")),
                 memory: _job(("p", "exp"), ("q", "add")), two: _job(("mm", "matmul"), ("mm2", "matmul"))})
    durations = {gemm[0]: 1080, gemm[1]: 1050, gemm[2]: 1060, other: 1300}
    monkeypatch.setattr(pipeline, "_measure_with_fallback", _fake_measure_at(durations))
    m = pipeline.Measured({}, MeasureStats(), pending={i: _with_ident(j, i) for i, j in jobs.items()},
                          bounds=dict.fromkeys(jobs, 1000), members_ns=dict.fromkeys(jobs, 5000.0))
    m = pipeline.replace(m, estimates=pipeline._estimates(m))
    m = pipeline.refine(m, gemm[:2], None, None, None)
    assert set(m.estimates.values()) == {1000}               # two measured: not yet
    m = pipeline.refine(m, gemm[2:3], None, None, None)
    assert [m.estimates[i] for i in gemm[3:]] == [1050, 1050]  # the least of 1.08, 1.05, 1.06
    assert [m.estimates[i] for i in (tile, other, memory, two)] == [1000] * 4
    durations.update({gemm[0]: 2000, gemm[3]: 2000, gemm[4]: 2000})
    m = pipeline.Measured({}, MeasureStats(), pending={i: _with_ident(j, i) for i, j in jobs.items()},
                          bounds=dict.fromkeys(jobs, 1000), members_ns=dict.fromkeys(jobs, 5000.0))
    m = pipeline.refine(m, gemm[3:] + [gemm[0]], None, None, None)
    assert [m.estimates[i] for i in gemm[1:3]] == [int(1000 / LINEAR_FACTOR)] * 2  # at most the contraction alone


def test_over_a_range_fusions_around_a_contraction_are_raised_at_each_length(monkeypatch):
    """Over a range the ratios are taken of the weighted times and bounds, and in the view of one
    length (`at_sample`) of the times and bounds there."""
    from kernorch.measure import MeasureStats
    gemm = [(f"g{n}", "tvm", "t8x32p") for n in range(4)]
    jobs = {i: _job(("mm", "matmul"), (f"e{n}", "add")) for n, i in enumerate(gemm)}
    durations = {i: {1: 550, 64: 1500} for i in gemm[:3]}
    monkeypatch.setattr(pipeline, "_measure_with_fallback", _fake_measure_at(durations))
    m = pipeline.Measured({}, MeasureStats(), pending={i: _with_ident(j, i) for i, j in jobs.items()},
                          bounds=dict.fromkeys(jobs, 1000), bounds_at=dict.fromkeys(jobs, (500, 1500)),
                          members_ns=dict.fromkeys(jobs, 5000.0), at=((1, 0.5), (64, 0.5)))
    m = pipeline.refine(m, gemm[:3], None, None, None)
    assert m.estimates[gemm[3]] == 1025                                  # 1025 / 1000 weighted
    assert pipeline.at_sample(m, 0).estimates[gemm[3]] == 550            # 1.1x its bound at seq=1
    assert pipeline.at_sample(m, 1).estimates[gemm[3]] == 1500           # 1.0x at seq=64


def test_a_fusion_is_at_least_nine_tenths_of_a_measured_fusion_it_holds(monkeypatch):
    """A fusion around one contraction that holds every prim of one measured around it in its
    schedule is raised to SUBSET_FLOOR of the slowest such one, from the first measurement on (no
    CONTRACTION_AFTER) and past the family raise's cap (1 / LINEAR_FACTOR of its bound); one that
    does not hold it and one in another schedule keep their bounds; over a range the floor is taken
    at each length; SUBSET_FLOOR = 0 turns it off."""
    from kernorch.measure import MeasureStats
    base, wider, widest = ("g0", "tvm", "t8x32p"), ("g1", "tvm", "t8x32p"), ("g2", "tvm", "t8x32p")
    apart, elsewhere = ("g3", "tvm", "t8x32p"), ("g4", "tvm", "t4x64p")
    jobs = {base: _job(("mm", "matmul"), ("b", "add")), wider: _job(("ln", "div"), ("mm", "matmul"), ("b", "add")),
            widest: _job(("ln", "div"), ("mm", "matmul"), ("b", "add"), ("r", "add")),
            apart: _job(("mm", "matmul"), ("r", "add")), elsewhere: _job(("ln", "div"), ("mm", "matmul"), ("b", "add"))}
    durations = {base: {1: 2000, 64: 6000}, wider: {1: 3000, 64: 5000}}
    monkeypatch.setattr(pipeline, "_measure_with_fallback", _fake_measure_at(durations))

    def start():
        return pipeline.Measured({}, MeasureStats(), pending={i: _with_ident(j, i) for i, j in jobs.items()},
                                 bounds=dict.fromkeys(jobs, 1000), bounds_at=dict.fromkeys(jobs, (500, 1500)),
                                 members_ns=dict.fromkeys(jobs, 5000.0), at=((1, 0.5), (64, 0.5)))
    m = pipeline.refine(start(), [base], None, None, None)
    assert [m.estimates[i] for i in (wider, widest)] == [3600, 3600]  # 0.9 x 4000, its weighted time
    assert [m.estimates[i] for i in (apart, elsewhere)] == [1000, 1000]
    assert [pipeline.at_sample(m, k).estimates[widest] for k in (0, 1)] == [1800, 5400]
    m = pipeline.refine(m, [wider], None, None, None)                 # the slowest held one counts
    assert m.estimates[widest] == 3600 and pipeline.at_sample(m, 0).estimates[widest] == 2700
    monkeypatch.setattr(pipeline, "SUBSET_FLOOR", 0)
    m = pipeline.refine(start(), [base], None, None, None)
    assert [m.estimates[i] for i in (wider, widest, apart, elsewhere)] == [1000] * 4


def _attention_and_gemm_graphs():
    """A kernel graph of a fused attention (two matmuls) and one of a GEMM with its bias."""
    from kernorch.ir import Graph, TensorType, make_prim
    t = TensorType((4, 8))
    q = make_prim("s", "matmul", ["q", "k"], TensorType((4, 4)))
    o = make_prim("o", "matmul", ["s", "v"], t)
    attention = Graph((("q", t), ("k", TensorType((8, 4))), ("v", TensorType((4, 8)))), ("o",), (q, o), {})
    g = make_prim("y", "matmul", ["x", "w"], t)
    b = make_prim("z", "add", ["y", "bias"], t)
    import numpy as np
    gemm = Graph((("x", TensorType((4, 8))),), ("z",), (g, b), {"w": np.zeros((8, 8), np.float32),
                                                              "bias": np.zeros((4, 8), np.float32)})
    return attention, gemm


def test_the_fill_up_stays_in_the_partitions_the_plan_wants_fusions_in():
    from kernorch.measure import MeasureStats

    ids = {n: (n, "tvm", "default") for n in ("ab", "bc", "cd", "de")}
    m = pipeline.Measured({}, MeasureStats(measured=100, seconds=50.0),
                          pending={i: _job(*n) for n, i in ids.items()}, estimates=dict.fromkeys(ids.values(), 500),
                          members_ns=dict.fromkeys(ids.values(), 1000.0))
    near = {"a": 0, "b": 0, "c": 1, "d": 2, "e": 2}  # a fusion is in its first prim's partition
    assert pipeline.promising(m, [ids["ab"]], solve_s=1.0, near=near) == [ids["ab"], ids["bc"]]
    assert set(pipeline.promising(m, [ids["ab"], ids["de"]], solve_s=1.0, near=near)) == set(ids.values()) - {ids["cd"]}
    assert len(pipeline.promising(m, [ids["ab"]], solve_s=1.0)) == 4  # anywhere without `near`


def test_the_fill_up_weighs_a_fusion_against_what_the_plan_spends_on_its_prims():
    """A fusion whose estimate undercuts its members alone but not the fused kernel the plan already
    has for them is not worth a measurement; one that undercuts the plan's kernels is."""
    from types import SimpleNamespace as NS
    from kernorch.measure import MeasureStats
    from kernorch.plan import Kernel

    a, b = ("ab", "tvm", "default"), ("cd", "tvm", "default")
    m = pipeline.Measured({}, MeasureStats(measured=100, seconds=50.0), pending={a: _job("a", "b"), b: _job("c", "d")},
                          estimates={a: 800, b: 800}, members_ns={a: 1000.0, b: 1000.0}, sigma=0.3,
                          predicted={a: 5000.0, b: 5000.0})
    assert set(pipeline.promising(m, [], solve_s=1.0)) == {a, b}
    plan = NS(kernels=(Kernel("k0", "x", "tvm", ("a", "b"), (), (), 700), Kernel("k1", "y", "tvm", ("c",), (), (), 500),
                       Kernel("k2", "z", "tvm", ("d",), (), (), 500)))
    assert pipeline.promising(m, [], solve_s=1.0, plan=plan) == [b]
    with mock.patch.object(pipeline, "FILL_AGAINST_PLAN", False):  # the replay's other fill: members alone
        assert set(pipeline.promising(m, [], solve_s=1.0, plan=plan)) == {a, b}


def test_a_fusion_with_a_row_wise_epilogue_is_also_offered_its_rows_outside_tile():
    """The fastest tile of a contraction alone may walk column panels outside; a fusion that ends
    in a reduction over the columns (a softmax) is also timed in the contraction's fastest
    rows-outside tile, which runs that epilogue per row tile in cache; a fusion with an elementwise
    epilogue, or a reduction over the rows, only in the fastest tile."""
    from kernorch import candidates as cands
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Machine
    f32 = lambda *s: TensorType(s, "float32")  # noqa: E731
    s, red, rows = f32(64, 128), f32(64, 1), f32(1, 128)
    g = Graph((("q", f32(64, 32)), ("kt", f32(32, 128))), ("y", "z2"), (
        make_prim("s", "matmul", ["q", "kt"], s), make_prim("r", "relu", ["s"], s),
        make_prim("mx", "reduce_max", ["r"], red, axes=(1,), keepdims=1), make_prim("y", "sub", ["r", "mx"], s),
        make_prim("z", "reduce_sum", ["r"], rows, axes=(0,), keepdims=1), make_prim("z2", "neg", ["z"], rows)))
    tiles = {("s", None): "t8x32"}
    row_tiles = {("s", None): "t8x32r"}
    opts = Options(threads=1, layouts=False, compare_untuned=0)
    def schedules(members):
        c = cands.make_candidate(g, members)
        return sorted(j.schedule for j in pipeline.candidate_jobs(g, [c], opts, Machine.host(), tiles, row_tiles)
                      if j.impl == "tvm")
    assert schedules(["s", "r", "mx", "y"]) == ["t8x32", "t8x32r"]
    assert schedules(["s", "r"]) == ["t8x32"]
    assert schedules(["s", "r", "z"]) == ["t8x32"]
    assert schedules(["mx", "y"]) == ["default"]


def test_a_pooling_is_no_row_wise_epilogue():
    """A reduction without axes (a pooling window) neither makes a fusion row-wise nor attention."""
    from kernorch import candidates as cands
    from kernorch.ir import Graph, TensorType, make_prim
    attrs = dict(mode="max", kernel=(2, 2), strides=(2, 2), pads=(0, 0, 0, 0), dilations=(1, 1))
    x, y = TensorType((1, 4, 8, 8), "float32"), TensorType((1, 4, 4, 4), "float32")
    g = Graph((("x", x),), ("y",), (make_prim("y", "pool", ["x"], y, **attrs),))
    assert not cands.reduces_last_axis(g, g.by_name["y"])


def test_an_attention_takes_its_scores_register_tiles_even_where_the_default_won():
    """Over a symbolic length the default schedule races the scores' tiles and may win alone; the
    attention around those scores is still built from a register tile (the default schedule would
    compute it whole matrix by whole matrix): over a static shape the fastest, over a symbolic one
    every one of them. The scores' other fusions keep the winner."""
    from kernorch import candidates as cands
    from kernorch.ir import Graph, SymDim, TensorType, make_prim
    from kernorch.options import Machine
    f32 = lambda *s: TensorType(s, "float32")  # noqa: E731
    s, red = f32(64, 64), f32(64, 1)
    g = Graph((("q", f32(64, 32)), ("kt", f32(32, 64)), ("v", f32(64, 32))), ("o",), (
        make_prim("s", "matmul", ["q", "kt"], s), make_prim("mx", "reduce_max", ["s"], red, axes=(1,), keepdims=1),
        make_prim("d", "sub", ["s", "mx"], s), make_prim("e", "exp", ["d"], s),
        make_prim("sm", "reduce_sum", ["e"], red, axes=(1,), keepdims=1), make_prim("p", "div", ["e", "sm"], s),
        make_prim("o", "matmul", ["p", "v"], f32(64, 32))))
    opts = Options(threads=1, layouts=False, compare_untuned=0)

    def schedules(members):
        c = cands.make_candidate(g, members)
        return sorted(j.schedule for j in pipeline.candidate_jobs(g, [c], opts, Machine.host(), {("s", None): "default"},
                                                                  None, {("s", None): ("t4x32r", "t8x32r")})
                      if j.impl == "tvm")
    assert cands.attention_parts(g, ["s", "mx", "d", "e", "sm", "p", "o"]) == ("s", ("mx", "d", "e", "sm", "p"), "o")
    assert schedules(["s", "mx", "d", "e", "sm", "p", "o"]) == ["t4x32r"]
    assert schedules(["s", "mx"]) == ["default"]
    seq = SymDim("seq", (0, 1, 0))
    s, red = f32(seq, seq), f32(seq, 1)
    g = Graph((("q", f32(seq, 32)), ("kt", f32(32, seq)), ("v", f32(seq, 32))), ("o",), (
        make_prim("s", "matmul", ["q", "kt"], s), make_prim("mx", "reduce_max", ["s"], red, axes=(1,), keepdims=1),
        make_prim("d", "sub", ["s", "mx"], s), make_prim("e", "exp", ["d"], s),
        make_prim("sm", "reduce_sum", ["e"], red, axes=(1,), keepdims=1), make_prim("p", "div", ["e", "sm"], s),
        make_prim("o", "matmul", ["p", "v"], f32(seq, 32))))
    assert schedules(["s", "mx", "d", "e", "sm", "p", "o"]) == ["t4x32r", "t8x32r"]
