"""Several symbolic dimensions at once (batch and seq): dimensions that are polynomials of several
symbols, one generic graph fitted over every combination of their probes, kernels whose parameters
hold only a product of symbols, and one executable serving the product of the ranges."""
import random
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kernorch import dynamic, examples, fission
from kernorch.frontend import onnx as frontend
from kernorch.ir import KernorchError, SymDim, from_json_value, kernel_graph, to_json_value
from kernorch.rewrite import rewrite

BS = (dynamic.parse_range("batch=1..8"), dynamic.parse_range("seq=1..256"))


def flat_model(hidden: int = 96):
    """x[batch, seq, 64] flattened to [batch*seq, 64] (Reshape to -1, 64, as exporters write a
    GEMM over every token), two GEMMs with a relu between, reshaped back by the shape of x."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((64, hidden)) * 0.1).astype(np.float32), "W"),
             numpy_helper.from_array((rng.standard_normal((hidden, 64)) * 0.1).astype(np.float32), "W2"),
             numpy_helper.from_array(np.array([-1, 64], np.int64), "flat")]
    nodes = [helper.make_node("Shape", ["x"], ["shp"], name="shape"),
             helper.make_node("Reshape", ["x", "flat"], ["x2"], name="flatten"),
             helper.make_node("MatMul", ["x2", "W"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["o"], name="mm2"),
             helper.make_node("Reshape", ["o", "shp"], ["y"], name="unflatten")]
    g = helper.make_graph(nodes, "flat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 64])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def fissioned(model, b: int, s: int):
    return fission.fission(rewrite(frontend.load(model, {"x": (b, s, 64)})).graph)


def test_a_dimension_over_several_symbols_evaluates_prints_and_round_trips():
    d = SymDim.of([((("batch", 1), ("seq", 1)), 4), ((("seq", 1),), 2), ((), 3)])
    assert d.names == ("batch", "seq") and str(d) == "4*batch*seq+2*seq+3"
    assert d.subs({"batch": 2, "seq": 5}) == 53 and d.partial({"batch": 2}) == SymDim("seq", (3, 10, 0))
    assert from_json_value(to_json_value(d)) == d and "terms" in to_json_value(d)
    with pytest.raises(KernorchError, match="uses 2 symbols"):
        d.coeffs
    with pytest.raises(KernorchError, match="'seq' is not bound"):
        d.subs({"batch": 1})
    # one symbol: written as plans and structural keys always had it
    one = SymDim("seq", (1, 4, 0))
    assert to_json_value(one) == {"symbol": "seq", "coeffs": [1, 4, 0]} and one.names == ("seq",)
    assert SymDim.of([((), 7)]) == 7 and SymDim.of([((("s", 1),), 2), ((("s", 1),), -2)]) == 0


def test_polynomials_of_several_symbols_fit_exactly_or_not_at_all():
    names, grid = ("b", "s"), [(b, s) for b in (2, 3, 5, 7) for s in (61, 67, 71, 73)]

    def fitted(f):
        return dynamic.fit_grid(names, grid, [f(b, s) for b, s in grid])
    assert fitted(lambda b, s: 7) == 7
    assert fitted(lambda b, s: b * s) == SymDim.of([((("b", 1), ("s", 1)), 1)])
    assert fitted(lambda b, s: 4 * b * s * s + s + 1) == SymDim.of([((("b", 1), ("s", 2)), 4), ((("s", 1),), 1), ((), 1)])
    assert fitted(lambda b, s: b * b + 3 * s) == SymDim.of([((("b", 2),), 1), ((("s", 1),), 3)])
    assert fitted(lambda b, s: b * s // 2) is None
    assert fitted(lambda b, s: b ** 3 * s) is None  # three values of b fit, the fourth does not


def test_the_generic_graph_over_batch_and_seq_binds_to_what_fission_gives_at_any_pair():
    for model in (examples.transformer_block(seq="seq", batch="batch"), flat_model()):
        generic = dynamic.generic_graph(model, BS)
        assert dynamic.symbols(generic) == {"batch", "seq"}
        pairs = [(1, 1), (8, 256), (1, 256), (8, 1)] + [(random.Random(i).randint(1, 8), random.Random(i).randint(1, 256))
                                                        for i in range(4)]
        for b, s in pairs:
            want, got = fissioned(model, b, s), dynamic.bind(generic, {"batch": b, "seq": s})
            assert got.prims == want.prims and got.inputs == want.inputs, (b, s)
    flat = dynamic.generic_graph(flat_model(), BS)
    assert str(flat.by_name["h"].type) == "float32[batch*seqx96]"


def test_the_symbols_of_the_model_are_each_given_a_range_or_bound():
    model = examples.transformer_block(seq="seq", batch="batch")
    with pytest.raises(KernorchError, match="batch.*not bound: give each a range"):
        dynamic.generic_graph(model, BS[1])
    with pytest.raises(KernorchError, match="names a symbol twice"):
        dynamic.generic_graph(model, (BS[1], BS[1]))


def test_several_symbols_are_sampled_on_every_combination_weighted_by_both():
    ranges = (("batch", 1, 8), ("seq", 1, 512))
    at = dynamic.samples(ranges, count=3)
    assert [dict(b) for b, _ in at][:3] == [{"batch": 1, "seq": 1}, {"batch": 1, "seq": 23}, {"batch": 1, "seq": 512}]
    assert len(at) == 9 and sum(w for _, w in at) == pytest.approx(1.0)
    assert dict(at)[(("batch", 3), ("seq", 23))] == pytest.approx(0.25)  # (1/2 x 1/2)
    assert dynamic.middle(ranges) == {"batch": 3, "seq": 23}
    assert dynamic.sample_key({"seq": 23, "batch": 3}) == (3, 23) and dynamic.sample_key({"seq": 23}) == 23
    assert dynamic.probe_points(ranges) == ()
    with pytest.raises(KernorchError, match="weigh one symbol"):
        dynamic.samples(ranges, lengths=(3, 4))


def test_a_kernel_over_a_product_of_symbols_gets_a_variable_for_it():
    """A GEMM over the flattened rows batch*seq: no parameter holds batch or seq alone, so the
    PrimFunc gets a variable batch_seq (TVM binds a variable only where a dimension is one:
    "variables (batch, seq) are used, but are not passed in as API arguments"); its bound is the
    product of theirs, and it computes the GEMM at every pair."""
    import tvm
    from kernorch.backends.tvm.lower import DERIVED_ATTR, bounds_of, lower, symbol_vars
    from kernorch.backends.tvm.schedule import schedule
    from kernorch.backends.tvm.target import make_target
    generic = dynamic.generic_graph(flat_model(), BS)
    kg = kernel_graph(generic, ["h", "r"], ["x2", "W"], ["r"])
    mod = lower(kg, kg.prims, ["x2", "W"], ["r"])
    assert set(symbol_vars(mod["main"])) == {"batch_seq"} and DERIVED_ATTR in mod["main"].attrs
    target = make_target(1)
    mod = schedule(mod, target, "default", {"batch": 8, "seq": 256})
    assert bounds_of(mod["main"]) == {"batch": 8, "seq": 256, "batch_seq": 2048}
    ex = tvm.compile(mod, target=target)
    w = np.asarray(generic.constants["W"])
    for b, s in ((1, 1), (3, 7), (8, 256)):
        x = np.random.default_rng(b * s).standard_normal((b * s, 64)).astype(np.float32)
        out = tvm.runtime.empty((b * s, 96), "float32", tvm.cpu())
        ex["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
        np.testing.assert_allclose(out.numpy(), np.maximum(x @ w, 0), rtol=1e-4, atol=1e-4, err_msg=f"{b}x{s}")


def test_a_kernel_that_needs_a_symbol_none_of_its_parameters_holds_is_refused():
    from kernorch.backends.tvm.lower import Symbols
    sym = Symbols()
    bs = SymDim.of([((("batch", 1), ("seq", 1)), 1)])
    sym.define([(bs, 64)])
    assert str(sym.expr(SymDim.of([((("batch", 1), ("seq", 1)), 4)]))) == "T.int64(4) * batch_seq"
    with pytest.raises(KernorchError, match="uses batch .* none of its parameters holds on its own"):
        sym.expr(SymDim("batch", (0, 1, 0)))


def test_one_executable_serves_batch_and_seq_together(tmp_path, capsys):
    """kernorch optimize --shape batch=1..4 --shape seq=1..64: one saved executable, right against
    ONNX Runtime at both ends of each range and at random pairs, a pair outside refused by name;
    buckets (one symbol's) are refused with several symbols."""
    import onnxruntime as ort

    import kernorch
    from kernorch import cli
    for i, model in enumerate((flat_model(), examples.transformer_block(seq="seq", batch="batch", dim=64, heads=2,
                                                                          hidden=64))):
        path, out = tmp_path / f"m{i}.onnx", tmp_path / f"out{i}"
        onnx.save(model, str(path))
        cmd = ["optimize", str(path), "-o", str(out), "--threads", "1", "--shape", "batch=1..4", "--shape",
               "seq=1..64", "--db", str(tmp_path / "db.sqlite"), "--max-kernel-size", "2", "--samples", "3",
               "--runs", "0"]
        assert cli.main(cmd) == 0, capsys.readouterr().err
        assert "weighted over batch=1..4,seq=1..64" in capsys.readouterr().out
        m = kernorch.load(str(out))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        rng = random.Random(i)
        for b, s in [(1, 1), (4, 64), (1, 64), (4, 1)] + [(rng.randint(1, 4), rng.randint(1, 64)) for _ in range(4)]:
            x = np.random.default_rng(b * 100 + s).standard_normal((b, s, 64)).astype(np.float32)
            np.testing.assert_allclose(m.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=1e-4, atol=1e-4,
                                       err_msg=f"batch={b}, seq={s}")
        with pytest.raises(KernorchError, match="batch must be in 1..4"):
            m.run({"x": np.zeros((5, 3, 64), np.float32)})
    assert cli.main(cmd + ["--buckets", "8"]) == 2
    assert "--buckets cuts the range of one symbol" in capsys.readouterr().err


def _kernel_over(graph, inputs, tile, bounds):
    """`graph` (over the symbols of `bounds`: {symbol: largest value}) compiled in `tile`, and a
    check of it at a binding against its numpy reference (the largest error)."""
    from kernorch import measure as meas
    from kernorch.backends import tvm as tb
    target = tb.make_target(1)
    mod = tb.schedule(tb.lower(graph, graph.prims, list(inputs), list(graph.outputs), tile), target, tile, bounds)
    kernel = tb.build(mod, target)
    job = meas.KernelJob("k", "tvm", tile, graph, tuple(inputs), tuple(graph.outputs), bounds=tuple(bounds.items()))

    def error_at(**binding) -> float:
        bj = job.at(tuple(binding.items()))
        values = meas.make_inputs(bj, seed=sum(binding.values()))
        got = kernel(*meas.kernel_args(bj, values), out_shapes=meas.written_shapes(bj.graph, bj.outputs, tile))
        got = meas.unpack_outputs(bj.graph, bj.outputs, tile, got)
        return max(float(np.abs(np.asarray(a) - np.asarray(r)).max()) for a, r in zip(got, meas.reference(bj, values)))
    return error_at, mod["main"].script()


PAIRS = ((1, 1), (2, 7), (3, 13), (8, 64), (5, 33))


def _gemm_over_batch(k=256, n=64, transposed=False, read_transposed=False):
    """x[batch, seq, k] @ w[k, n]: its output as it is, or `transposed` to [batch, n, seq]; with
    `read_transposed`, x read from xt[batch, k, seq] (the batch and the rows apart in an input)."""
    from kernorch.ir import Graph, TensorType, make_prim
    b, s = SymDim("batch", (0, 1, 0)), SymDim("seq", (0, 1, 0))
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    ps = [make_prim("x", "transpose", ["xt"], TensorType((b, s, k)), perm=(0, 2, 1))] if read_transposed else []
    ps.append(make_prim("mm", "matmul", ["x", "w"], TensorType((b, s, n))))
    if transposed:
        ps.append(make_prim("y", "transpose", ["mm"], TensorType((b, n, s)), perm=(0, 2, 1)))
    x = ("xt", TensorType((b, k, s))) if read_transposed else ("x", TensorType((b, s, k)))
    return Graph((x,), (ps[-1].name,), tuple(ps), {"w": w})


PASSES = ((1, 1), (2, 7), (8, 64), (5, 103), (8, 100), (8, 128))  # (5 x 103: two passes, the second of 3 rows)


@pytest.mark.parametrize("tile, transposed", [("t4x16p", False), ("t4x16pr", False), ("t6x16r", False),
                                              ("t4x16p", True), ("t6x16r", True)])
def test_a_gemm_over_a_batch_of_sequences_sharing_its_weights_runs_their_rows_as_one(tile, transposed):
    """x[batch, seq, 256] @ w: the batch and the rows are one axis of the input (and of the output,
    or the output `transposed` to [batch, 64, seq], row i written at batch i // seq, position i %
    seq), and the tile runs over batch x seq rows (the buffers padded to the tile sized by the
    longest pass, not by the batch), in passes of FLAT_ROWS_PASS rows over views of the
    parameters; right at every pair, one pass or more."""
    from kernorch.backends.tvm.schedule import FLAT_ROWS_PASS
    error_at, text = _kernel_over(_gemm_over_batch(transposed=transposed), ("x", "w"), tile, {"batch": 8, "seq": 128})
    assert FLAT_ROWS_PASS == 512 and max(error_at(batch=n, seq=m) for n, m in PASSES) < 1e-3
    assert "for pass_at in range((batch * seq + T.int64(511)) // T.int64(512)):" in text
    assert "in0_x_rows = in0_x.view(T.int64(1), batch * seq, T.int64(256)" in text
    assert ("pass_at * T.int64(512)) // seq" in text) == transposed
    allocs = [line for line in text.splitlines() if "alloc_buffer" in line]
    assert allocs and not any("batch" in line or "seq" in line for line in allocs), allocs


@pytest.mark.parametrize("tile", ["default", "t4x16p", "t4x16pr", "t6x16r"])
def test_a_gemm_whose_input_parts_the_batch_from_the_rows_pads_the_rows_alone(tile):
    """The GEMM's input read from [batch, 256, seq] (and the default schedule: no tile): the batch
    is a loop outside the row tiles and only seq is padded to the tile (both padded, a 384 x 1536
    GEMM over batch=1..8 x seq=1..512 took 7x and 5.6x the time of seq alone at 1x1 and 1x512, Zen
    2); right at every pair."""
    transposed = tile != "default"
    graph = _gemm_over_batch(read_transposed=transposed)
    error_at, text = _kernel_over(graph, ("xt" if transposed else "x", "w"), tile, {"batch": 8, "seq": 64})
    assert max(error_at(batch=n, seq=m) for n, m in PAIRS) < 1e-3
    assert "pass_at" not in text
    if transposed:  # the padded buffer: the batch as it is, seq rounded up to the tile's rows
        # (but at seq=1, where the batch is the rows: `test_at_one_or_two_rows_the_batch_is_the_rows`)
        assert "(seq + T.int64(" in text
        padded = [line for line in text.splitlines() if "alloc_buffer" in line and "(batch + T.int64(" in line]
        assert all(", T.int64(1), T.int64(64))" in line for line in padded)


def test_a_gemm_is_run_as_rows_of_its_batch_only_where_each_row_is_computed_alone():
    """`schedule._row_wise`: a GEMM over seq rows computes each row from its own row; a sum over the
    rows, or a product whose operand has the batch (a batched product), does not run as rows of
    batch x seq (computed right either way)."""
    import importlib

    import tvm

    from kernorch.backends import tvm as tb
    from kernorch.ir import Graph, TensorType, make_prim
    sched = importlib.import_module("kernorch.backends.tvm.schedule")
    s = SymDim("seq", (0, 1, 0))
    w = np.zeros((32, 16), np.float32)
    gemm = Graph((("x", TensorType((1, s, 32))),), ("y",), (make_prim("y", "matmul", ["x", "w"], TensorType((1, s, 16))),),
                 {"w": w})
    total = Graph((("x", TensorType((1, s, 32))),), ("y",),
                  (make_prim("y", "reduce_sum", ["x"], TensorType((1, 1, 32)), axes=(1,), keepdims=1),), {})
    for graph, inputs, expect in ((gemm, ["x", "w"], True), (total, ["x"], False)):
        func = tb.lower(graph, graph.prims, inputs, ["y"])["main"]
        seq = next(d for p in func.params for d in p.shape if isinstance(d, tvm.tirx.Var))
        assert sched._row_wise(func, seq) == expect, graph.prims[0].op
    b = SymDim("batch", (0, 1, 0))
    batched = Graph((("x", TensorType((b, s, 64))), ("v", TensorType((b, 64, 32)))), ("y",),
                    (make_prim("y", "matmul", ["x", "v"], TensorType((b, s, 32))),), {})
    error_at, text = _kernel_over(batched, ("x", "v"), "t4x16r", {"batch": 8, "seq": 64})
    assert max(error_at(batch=n, seq=m) for n, m in PAIRS) < 1e-3 and "pass_at" not in text


def test_row_copies_over_seq_run_under_a_symbolic_batch():
    """A tile with row copies over seq rows (kernorch.kernels.Tile.copies) on x[batch, seq, 256] @ w:
    the copies are picked by the rows of a pass over batch x seq; right at every pair on both sides
    of each change of copy; the test among the copies is written over the lengths of a pass."""
    from kernorch.kernels import Tile
    tile = "t6x16p~6:1@18100,2@27400,4@45600,11@102000~4:1@19100,2@23700,6@47900,16@121000~1:1@16000"
    picks = [Tile.parse(tile).pick(n) for n in range(1, 65)]
    assert {1, 4, 6} <= set(picks)
    changes = [n for n in range(2, 65) if picks[n - 1] != picks[n - 2]]
    error_at, text = _kernel_over(_gemm_over_batch(), ("x", "w"), tile, {"batch": 8, "seq": 64})
    rows = sorted({1, 64, *changes, *(n - 1 for n in changes)})
    assert max(error_at(batch=1, seq=m) for m in rows) < 1e-3
    assert max(error_at(batch=n, seq=m) for n in (3, 8) for m in (1, 2, 3, 13, 64)) < 1e-3
    assert "pass_at" in text and "T.Select(T.Select(" not in text


def test_the_small_row_copies_run_a_static_batch_inside_each_weight_panel():
    """Under a static batch sharing the weights (a symbolic one: `test_at_one_or_two_rows_the_batch_is_the_rows`),
    the copies a GEMM over seq rows runs at one and two rows walk the batch inside each column
    panel of the weights (fetched once for the whole batch); the copy for longer rows keeps the
    batch outside. Right at lengths on both sides of the copies'."""
    from kernorch.ir import Graph, TensorType, make_prim
    s = SymDim("seq", (0, 1, 0))
    w = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    g = Graph((("x", TensorType((4, s, 256))),), ("y",),
              (make_prim("y", "matmul", ["x", "w"], TensorType((4, s, 64))),), {"w": w})
    error_at, text = _kernel_over(g, ("x", "w"), "t6x16p", {"seq": 64})
    assert max(error_at(seq=m) for m in (1, 2, 3, 7, 64)) < 1e-3
    # the fused parallel loops: the two-row copy, then the 6-row tile (the one-row copy is serial
    # here); loop i0 is the batch, i1 the rows, i2 the columns: its outer part i2_0 the panels
    fused = re.findall(r"for (\w+)_fused in T.parallel", text)
    assert fused == ["i2_0_i0_i1_0", "i0_i2_0_i1_0"], fused


def test_at_one_or_two_rows_the_batch_is_the_rows():
    """At seq=1 and 2 a GEMM under a batch sharing its weights (where its rows do not run as batch x
    seq: its input read from [batch, 256, seq]) runs the kernel at seq=1, where the
    batch is its rows, in the tile over them (padded to the tile; its own one- and two-row copies
    for a batch of one or two), once per position of seq; right at seq=1 and 2 for every batch and
    at longer rows. Weights that differ along the batch (a batched product) keep one or two rows
    per element."""
    from kernorch.ir import Graph, TensorType, make_prim
    b, s = SymDim("batch", (0, 1, 0)), SymDim("seq", (0, 1, 0))
    error_at, text = _kernel_over(_gemm_over_batch(read_transposed=True), ("xt", "w"), "t6x16p", {"batch": 8, "seq": 64})
    assert max(error_at(batch=n, seq=m) for n in range(1, 9) for m in (1, 2, 5)) < 1e-3
    assert "T.sblock_alloc_buffer(((batch + T.int64(5)) // T.int64(6) * T.int64(6), T.int64(1), T.int64(64))" in text
    assert "batch <= T.int64(1)" in text and "batch <= T.int64(2)" in text and "for seq_at in range(seq):" in text
    assert "batch >= T.int64(4)" in text  # (two rows: the passes per position from 4 sequences on)
    # a product whose right operand has the batch too: no such copy
    wb = Graph((("x", TensorType((b, s, 64))), ("v", TensorType((b, 64, 32)))), ("y",),
               (make_prim("y", "matmul", ["x", "v"], TensorType((b, s, 32))),), {})
    error_at, text = _kernel_over(wb, ("x", "v"), "t6x16r", {"batch": 8, "seq": 64})
    assert max(error_at(batch=n, seq=m) for n in (1, 3, 8) for m in (1, 2, 5)) < 1e-3
    assert "(batch + T.int64(" not in text


def test_tiles_over_seq_rows_under_a_batch_are_probed_along_seq_at_batch_one():
    """With batch and seq ranging, a weight GEMM's tiles are timed along seq at batch=1 too
    (between its samples, for the row copies' curves), and its families are read there."""
    from kernorch import pipeline
    from kernorch.database import Measurement
    from kernorch.measure import KernelJob
    from kernorch.options import Options
    ranges = (("batch", 1, 8), ("seq", 1, 512))
    options = Options(threads=1, max_kernel_size=1, ranges=ranges)
    graph = dynamic.generic_graph(examples.transformer_block(seq="seq", dim=64, heads=2, hidden=128, batch="batch"),
                                  [dynamic.Range(n, lo, hi) for n, lo, hi in ranges])
    mm = next(p for p in graph.prims if p.op == "matmul" and pipeline._rows_only_symbolic(graph, p))
    probes = pipeline._row_probes(mm, options)
    assert probes == tuple((("batch", 1), ("seq", v)) for v in (2, 3, 8, 64, 181))
    # the families read the times at batch=1 by seq: a 4-row tile ahead at 7..8 rows gets a copy there
    def times(mr):
        return {(b, n): b * (20000 + 9000 * -(-n // mr) * mr // 4) for b in (1, 3, 8) for n in (1, 2, 3, 8, 23, 64, 181, 512)}
    jobs = [KernelJob("k", "tvm", f"t{mr}x16p", None, (), (), probes=probes) for mr in (4, 6)]
    ms = {j.ident: Measurement("t", "k", "tvm", j.schedule, "v", "ok", 1000, samples_ns=tuple(sorted(times(mr).items())))
          for j, mr in zip(jobs, (4, 6))}
    fams = pipeline._families(ms, {("mm", None): jobs}, ("mm", None), None, ranges)
    (name, at), = fams.items()
    assert "~4:" in name and "~6:" in name and set(at) == {1, 2, 3, 8, 23, 64, 181, 512}, fams


@pytest.mark.parametrize("tile", ["t4x16r", "t6x16r", "t8x32r"])
def test_an_attention_over_a_symbolic_batch_and_length_runs_in_one_kernel(tile):
    """Scores, softmax and values over batch=1..8 x seq=1..64 (queries and keys of the length): one
    kernel, the batch a loop outside the row tiles (refused before: "a symbolic batch over symbolic
    rows", so gpt_like over batch and seq ran its attention split in three kernels); right at every
    pair."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_backend import attention_graph
    b, s = SymDim("batch", (0, 1, 0)), SymDim("seq", (0, 1, 0))
    g, inputs = attention_graph(m=s, n=s, d=16, batch=b, deferred=True)
    error_at, text = _kernel_over(g, inputs, tile, {"batch": 8, "seq": 64})
    assert max(error_at(batch=n, seq=m) for n, m in PAIRS) < 1e-4
    # scheduled as over a static batch: the same parallel loops (a narrow-key copy of t8x32r has its own)
    one, _ = attention_graph(m=s, n=s, d=16, batch=2, deferred=True)
    _, static = _kernel_over(one, inputs, tile, {"seq": 64})
    assert text.count("T.parallel(") == static.count("T.parallel(") >= 1 and re.search(r'_rf(_update)?"\)', text)


def test_the_runtime_binds_each_symbol_from_a_dimension_that_holds_it_alone():
    """An input's dimensions are read one symbol at a time: batch*seq after batch and seq are bound
    (checked against them), and an input whose only dimension over both is their product is
    refused by name."""
    from types import SimpleNamespace

    from kernorch.ir import TensorType
    from kernorch.runtime import CompiledModel
    model = SimpleNamespace(ranges={"batch": (1, 8), "seq": (1, 64)})
    b, s = SymDim("batch", (0, 1, 0)), SymDim("seq", (0, 1, 0))
    bs = SymDim.of([((("batch", 1), ("seq", 1)), 1)])
    binding: dict = {}
    assert CompiledModel._shape(model, "x", TensorType((bs, b, s)), (12, 3, 4), binding) == (12, 3, 4)
    assert binding == {"batch": 3, "seq": 4}
    assert CompiledModel._shape(model, "x", TensorType((bs, b, s)), (13, 3, 4), {}) == (12, 3, 4)  # (then refused)
    with pytest.raises(KernorchError, match="does not tell batch and seq apart"):
        CompiledModel._shape(model, "flat", TensorType((bs, 64)), (12, 64), {})
    with pytest.raises(KernorchError, match="seq must be in 1..64"):
        CompiledModel._shape(model, "x", TensorType((b, s, 64)), (2, 65, 64), {})


def test_plans_per_sample_over_two_symbols_dispatch_along_one():
    """`sample_choices` over batch x seq (here its own plans given): per value of one symbol, its
    slice of the samples (every batch at that seq) runs the plan predicted the fastest over it, an
    own plan of one of its samples or the one plan, an own plan only where it is `gain` faster over
    the slice; the symbol whose slices are the fastest in all dispatches. `joined_samples` then cuts
    that symbol's range (dynamic.sample_edges between its values) and names it (DISPATCH_ON); the
    plans where every sample runs the one plan are the one plan."""
    from kernorch import pipeline
    from kernorch.database import Measurement
    from kernorch.measure import MeasureStats
    from kernorch.options import Options
    from kernorch.plan import Kernel, Plan, SolverStats
    ranges = (("batch", 1, 8), ("seq", 1, 512))
    keys = [(b, s) for b in (1, 3, 8) for s in (1, 23, 512)]
    at = tuple((k, 1.0 / len(keys)) for k in keys)

    def plan_of(tag):
        return Plan((Kernel("k0", tag, "tvm", ("x",), ("x",), ("y",), 1, schedule=tag),), (), ("y",),
                    SolverStats("optimal", 1, 1, 0.0, 0.0, 0), meta={"ranges": "batch=1..8,seq=1..512"})

    def timed(tag, ns):  # ns(batch, seq): the kernel's time at each sample
        t = [(k, ns(*k)) for k in keys]
        return (tag, "tvm", tag), Measurement("m", tag, "tvm", tag, "v", "ok", sum(v for _, v in t) // len(t), (),
                                              samples_ns=tuple(t))
    one, long, wide = plan_of("one"), plan_of("long"), plan_of("wide")
    measured = pipeline.Measured(dict([timed("one", lambda b, s: 100), timed("long", lambda b, s: 50 if s == 512 else 200),
                                       timed("wide", lambda b, s: 80 if b == 8 else 300)]), MeasureStats(), at=at)
    options = Options(threads=1, ranges=ranges)
    # the own plan of every seq=512 sample is `long` (2x faster there), of 8x1 `wide` (1.25x there,
    # 3x slower at the other batches): along seq, 512's slice runs `long`; along batch, 8's slice
    # would run `wide` only where it wins over the slice, and `long` nowhere (slower over every batch)
    own = [long if s == 512 else wide if (b, s) == (8, 1) else one for b, s in keys]
    chosen = pipeline._sliced_choices(own, one, measured, ranges, 0, 0.03)
    assert [c.kernels[0].key for c in chosen] == ["long" if s == 512 else "one" for _, s in keys]
    plan = pipeline.joined_samples(chosen, one, measured, options, {**one.meta, "boundary_ns": "0"})
    assert plan.meta[dynamic.DISPATCH_ON] == "seq" and dynamic.dispatch_symbol(plan.meta) == "seq"
    assert dynamic.plan_buckets(plan.meta) == [(1, 108), (109, 512)] and plan.meta[dynamic.BUCKET_BOUNDS] == "range"
    assert [k.key for k in plan.bucket(0).kernels] == ["one"] and [k.key for k in plan.bucket(1).kernels] == ["long"]
    assert dynamic.example_bucket(plan.meta) == 0  # (seq's middle, 23)
    # asked for a gain the slice does not reach (`long` is 2x faster over seq=512): the one plan
    assert pipeline.joined_samples(pipeline._sliced_choices(own, one, measured, ranges, 0, 0.6), one, measured,
                                   options, one.meta) is one
    # where a batch's slice gains the most: `wide` at every batch=8 sample, `long` nowhere
    own = [wide if b == 8 else one for b, s in keys]
    plan = pipeline.joined_samples(pipeline._sliced_choices(own, one, measured, ranges, 0, 0.03), one, measured,
                                   options, one.meta)
    assert plan.meta[dynamic.DISPATCH_ON] == "batch" and dynamic.plan_buckets(plan.meta) == [(1, 4), (5, 8)]
    # samples whose plans differ along both symbols are no dispatch of one symbol
    with pytest.raises(KernorchError, match="one symbol dispatches"):
        pipeline.slices([wide if (b, s) == (8, 512) else one for b, s in keys], keys, ranges)


def test_a_plan_dispatching_along_one_of_two_symbols_runs_right(tmp_path):
    """Over batch=1..4 x seq=1..64, the one plan's kernels made 20x slower at seq=64: the samples
    there get plans of their own, and the plan dispatches along one symbol (`sample_plans`). Built,
    the executable runs each pair in the bucket of that symbol's value (its profile's kernels), right
    against ONNX Runtime on both sides of every edge and at both ends of the other symbol."""
    import onnxruntime as ort
    from dataclasses import replace

    from kernorch import pipeline
    from kernorch.options import Machine, Options
    path = tmp_path / "block.onnx"
    onnx.save(examples.transformer_block(seq="seq", batch="batch", dim=64, heads=2, hidden=64), str(path))
    options = Options(threads=1, max_kernel_size=2, repeats=3, min_repeat_ms=1.0, workers=2, compare_untuned=0,
                      db_path=str(tmp_path / "db.sqlite"), ranges=(("batch", 1, 4), ("seq", 1, 64)), samples=3,
                      sample_gain=0.0)
    planned = pipeline.plan_model(str(path), options)
    one, measured, graph = planned.plan, planned.measured, planned.loaded.graph
    assert planned.one is None and not dynamic.plan_buckets(one.meta)
    ones = {(k.key, k.impl, k.schedule) for k in one.kernels}
    slowed = {i: replace(m, samples_ns=tuple((n, t * 20 if n[1] == 64 else t) for n, t in m.samples_ns))
              if i in ones else m for i, m in measured.measurements.items()}
    plan = pipeline.sample_plans(graph, planned.enumeration, replace(measured, measurements=slowed), options,
                                 one.meta, one)
    name, parts = dynamic.dispatch_symbol(plan.meta), dynamic.plan_buckets(plan.meta)
    assert name in ("batch", "seq") and len(parts) >= 2 and plan.meta[dynamic.DISPATCH_ON] == name
    compiled = pipeline.emit(graph, plan, options, Machine.host())
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    other = {"batch": "seq", "seq": "batch"}[name]
    values = sorted({v for lo, hi in parts for v in (lo, hi)})
    for v in values:
        for w in (1, dict(batch=4, seq=64)[other]):
            b, s = (v, w) if name == "batch" else (w, v)
            x = np.random.default_rng(b * 100 + s).standard_normal((b, s, 64)).astype(np.float32)
            np.testing.assert_allclose(compiled.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=1e-4,
                                       atol=1e-4, err_msg=f"batch={b}, seq={s}")
            ran = {plan.kernels[p["kernel"]].bucket for p in compiled.profile({"x": x}, runs=1) if p["kernel"] is not None}
            assert ran == {dynamic.bucket_of(parts, v)}, (b, s)
            assert {k.bucket for k in compiled.plan_for({"x": x}).kernels} == ran


def test_the_dispatch_over_two_symbols_is_timed_along_the_one_dispatching(monkeypatch):
    """`measured_dispatch` over batch x seq times the dispatching executable against the one plan's
    at the probes of the dispatching symbol's buckets (here scripted), the other symbol at its
    middle, and keeps a slice's own plan only where it ran DISPATCH_GAIN faster over its bucket;
    the choices stay one per slice, and with none kept the one plan's executable is the result."""
    from kernorch import executed, executor, pipeline
    from kernorch.measure import MeasureStats
    from kernorch.options import Machine, Options
    from kernorch.plan import Kernel, Plan, SolverStats

    def plan_of(tag):
        k = Kernel("k0", tag, "tvm", ("x",), ("x",), ("y",), 1, schedule=tag)
        return Plan((k,), (), ("y",), SolverStats("optimal", 1, 1, 0.0, 0.0, 0),
                    meta={"ranges": "batch=1..8,seq=1..512"})
    one, long = plan_of("one"), plan_of("long")
    options = Options(threads=1, ranges=(("batch", 1, 8), ("seq", 1, 512)))
    keys = [(b, s) for b in (1, 3, 8) for s in (1, 23, 512)]
    measured = pipeline.Measured({}, MeasureStats(), at=tuple((k, 1 / 9) for k in keys))

    class Exe:
        def __init__(self, plan):
            self.plan = plan
    monkeypatch.setattr(executed, "emit", lambda g, plan, o, m, *_: Exe(plan))
    monkeypatch.setattr(dynamic, "bind", lambda g, binding: binding)
    monkeypatch.setattr(executor, "random_feeds", lambda binding, seed=0: binding)
    timed = []

    def run(speed):
        monkeypatch.setattr(executed, "alternated", lambda a, b, feeds, **_: (
            timed.append(dict(feeds)), speed(a.plan, feeds), 1.0, 1.0)[1:])
        timed.clear()
        choices = [long if s == 512 else one for _, s in keys]
        plan = pipeline.joined_samples(choices, one, measured, options, one.meta)
        assert plan.meta[dynamic.DISPATCH_ON] == "seq"
        planned = pipeline.Planned(pipeline.Loaded("m", None, None), None, measured, plan, None, {}, Machine.host(),
                                   one, tuple(choices))
        return executed.measured_dispatch(Exe(plan), planned, options)

    def runs(plan, seq):
        parts = dynamic.plan_buckets(plan.meta)
        return (plan.bucket(dynamic.bucket_of(parts, seq)) if parts else plan).kernels[0].key
    compiled, planned = run(lambda plan, feeds: 0.95 if runs(plan, feeds["seq"]) == "long" else 1.0)
    assert {f["batch"] for f in timed} == {3} and [f["seq"] for f in timed] == [109, 236, 512]
    assert compiled.plan is planned.plan and dynamic.plan_buckets(planned.plan.meta) == [(1, 108), (109, 512)]
    assert [c.kernels[0].key for c in planned.choices] == ["long" if s == 512 else "one" for _, s in keys]
    compiled, planned = run(lambda plan, feeds: 1.0)
    assert planned.plan is one and compiled.plan is one and planned.choices == (one,) * 9
