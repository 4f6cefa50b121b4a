"""Hostile and malformed inputs: every case ends with a clear error naming the problem and exit code
2 from the CLI (never a traceback, never a silently wrong result). The table below is the list.

| case                                   | where        | the error says                              |
|----------------------------------------|--------------|---------------------------------------------|
| missing file                           | inspect      | no such file                                |
| a directory                            | inspect      | is a directory                              |
| not an ONNX file / truncated file      | inspect      | not a valid ONNX model                      |
| empty graph                            | inspect      | empty graph                                 |
| unsupported opset                      | inspect      | opset N is not supported                    |
| custom-domain operator                 | inspect      | node 'n' (Op) is in domain                  |
| unsupported operator                   | inspect      | node 'n' (Op): operator Op is not supported |
| external data missing                  | inspect      | external data ... missing                   |
| unbound symbolic dimension             | inspect      | unbound symbolic dimension(s) ... --shape   |
| --shape of a non-input                 | inspect      | not model inputs                            |
| a tensor too large for this host       | optimize     | the tensor ..., takes ... fits up to        |
| operator kept whole, no permission     | optimize     | has no compiled kernel ... --allow-python   |
| input of an unknown name               | run          | unknown inputs                              |
| input of a wrong shape                 | run          | has shape ... optimized for                 |
| input of a wrong dtype                 | run          | has dtype                                   |
| input with NaN or Inf                  | run          | NaN/Inf                                     |
| weights changed after saving           | run / load   | weights.npz does not match the hash         |
| library swapped                        | run / load   | model.so does not match the hash            |
| unknown file in the saved directory    | run / load   | unknown files                               |
| saved in another format                | run / load   | format ... optimize the model again         |
| a CPU without the library's ISA        | run / load   | lacks ... optimize the model on this machine|
| --force on a directory not ours        | optimize     | not a kernorch output                       |
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kernorch import cli, pipeline
from kernorch.options import Options


def model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "hostile", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def good_model():
    w = numpy_helper.from_array(np.ones((8, 16), np.float32), "w")
    return model([helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"), helper.make_node("Relu", ["m"], ["y"])],
                 [vi("x", [4, 8])], [vi("y", [4, 16])], [w])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    onnx.save(good_model(), str(d / "m.onnx"))
    opts = Options(db_path=str(d / "db.sqlite"), threads=1, repeats=2, min_repeat_ms=1.0, max_kernel_size=2)
    compiled, _ = pipeline.optimize(str(d / "m.onnx"), opts, runs=0)
    compiled.save(d / "out")
    np.save(d / "x.npy", np.ones((4, 8), np.float32))
    return d


def fresh_copy(saved, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(saved / "out", out)
    return out


def expect(capsys, argv, *needles):
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


# -- the model file ---------------------------------------------------------------------------------

def test_missing_file_and_directory(tmp_path, capsys):
    expect(capsys, ["inspect", tmp_path / "nope.onnx"], "no such file")
    expect(capsys, ["inspect", tmp_path], "is a directory")


def test_not_onnx_and_truncated(tmp_path, capsys):
    (tmp_path / "text.onnx").write_text("hello, I am not a model")
    expect(capsys, ["inspect", tmp_path / "text.onnx"], "not a valid ONNX model")
    blob = good_model().SerializeToString()
    (tmp_path / "cut.onnx").write_bytes(blob[: len(blob) // 2])
    expect(capsys, ["inspect", tmp_path / "cut.onnx"], "not a valid ONNX model")


def test_empty_graph_and_opsets_and_domains(tmp_path, capsys):
    onnx.save(model([], [], []), str(tmp_path / "empty.onnx"))
    expect(capsys, ["inspect", tmp_path / "empty.onnx"], "empty graph")
    m = good_model()
    m.opset_import[0].version = 7
    onnx.save(m, str(tmp_path / "old.onnx"))
    expect(capsys, ["inspect", tmp_path / "old.onnx"], "opset 7 is not supported")
    custom = model([helper.make_node("Magic", ["x"], ["y"], name="spell", domain="com.example")],
                   [vi("x", [2])], [vi("y", [2])])
    custom.opset_import.append(helper.make_opsetid("com.example", 1))
    onnx.save(custom, str(tmp_path / "custom.onnx"))
    expect(capsys, ["inspect", tmp_path / "custom.onnx"], "node 'spell' (Magic)", "domain")


def test_a_model_onnx_runtime_cannot_load_is_refused_by_name(tmp_path, capsys):
    """kernorch checks its results against ONNX Runtime: a model it cannot load (an IR version newer
    than it reads) is refused with ONNX Runtime's reason, not an internal error, and before the
    optimize measures anything."""
    m = good_model()
    m.ir_version = 99
    onnx.save(m, str(tmp_path / "new.onnx"))
    expect(capsys, ["optimize", tmp_path / "new.onnx", "-o", tmp_path / "out", "--threads", "1", "--runs", "0",
                    "--db", tmp_path / "db.sqlite", "--max-kernel-size", "1"],
           "new.onnx: ONNX Runtime cannot load it", "IR version")
    assert not (tmp_path / "db.sqlite").exists()  # (refused before anything is measured)


def test_unsupported_operator_names_the_node(tmp_path, capsys):
    m = model([helper.make_node("LpNormalization", ["x"], ["y"], name="lpn")], [vi("x", [2, 3])], [vi("y", [2, 3])])
    onnx.save(m, str(tmp_path / "lp.onnx"))
    expect(capsys, ["inspect", tmp_path / "lp.onnx"], "'lpn' (LpNormalization)", "not supported")


def test_missing_external_data(tmp_path, capsys):
    m = good_model()
    onnx.save(m, str(tmp_path / "ext.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    (tmp_path / "weights.bin").unlink()
    expect(capsys, ["inspect", tmp_path / "ext.onnx"], "external data", "weights.bin")


def test_unbound_symbols_and_bad_shapes(tmp_path, capsys):
    m = good_model()
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    onnx.save(m, str(tmp_path / "sym.onnx"))
    expect(capsys, ["inspect", tmp_path / "sym.onnx"], "unbound symbolic dimension", "--shape")
    expect(capsys, ["inspect", tmp_path / "sym.onnx", "--shape", "nope=1x2"], "not model inputs")


def test_a_tensor_too_large_to_measure_here_is_refused_before_anything_is_measured(tmp_path, capsys):
    """x @ x^T over a symbolic length: at seq=10^6 its square output takes 3.6 TiB (3725 GiB); refused by name,
    node and shape, with the widest range that fits (the scores of the transformer block over
    seq=1..10^8 ran the first stage for minutes without a word); bound statically, the same."""
    from kernorch import footprint
    m = model([helper.make_node("Transpose", ["x"], ["t"], name="tr", perm=[1, 0]),
               helper.make_node("MatMul", ["x", "t"], ["y"], name="square")],
              [vi("x", ["seq", 8])], [vi("y", ["seq", "seq"])])
    onnx.save(m, str(tmp_path / "sq.onnx"))
    db = tmp_path / "db.sqlite"
    expect(capsys, ["optimize", tmp_path / "sq.onnx", "-o", tmp_path / "o", "--db", db, "--shape", "seq=1..1000000"],
           "sq.onnx: at seq=1000000", "(node square)", "float32[1000000x1000000]", "3725.3 GiB",
           "of memory: the range fits up to seq=")
    expect(capsys, ["candidates", tmp_path / "sq.onnx", "--db", db, "--shape", "x=1000000x8"],
           "sq.onnx: the tensor y (node square)", "float32[1000000x1000000]")
    assert not (tmp_path / "o").exists()
    # the boundary: the largest length whose square fits in an eighth of the memory given
    graph = pipeline.load(str(tmp_path / "sq.onnx"), Options(ranges=(("seq", 1, 4096),))).graph
    memory = 8 * 4 * 1000 * 1000
    footprint.check(graph, (("seq", 1, 1000),), "sq", memory)
    with pytest.raises(Exception, match=r"fits up to seq=1000 \(--shape seq=1\.\.1000\)"):
        footprint.check(graph, (("seq", 1, 1001),), "sq", memory)
    with pytest.raises(Exception, match="not even seq=2000 fits"):
        footprint.check(graph, (("seq", 2000, 4096),), "sq", memory)
    footprint.check(graph, (("seq", 1, 4096),), "sq", 0)  # (a host that does not say: not checked)


def test_operator_kept_whole_needs_permission(tmp_path, capsys):
    m = model([helper.make_node("Hardmax", ["x"], ["y"], name="hm", axis=-1)], [vi("x", [2, 6])], [vi("y", [2, 6])])
    onnx.save(m, str(tmp_path / "hm.onnx"))
    expect(capsys, ["optimize", tmp_path / "hm.onnx", "-o", tmp_path / "o", "--db", tmp_path / "db.sqlite",
                    "--threads", "1"], "'hm' (Hardmax)", "--allow-python-kernels")


# -- running a saved model --------------------------------------------------------------------------

def test_run_with_bad_inputs(saved, tmp_path, capsys):
    out = saved / "out"
    expect(capsys, ["run", out, "--input", f"z={saved / 'x.npy'}"], "unknown inputs")
    np.save(tmp_path / "small.npy", np.ones((2, 8), np.float32))
    expect(capsys, ["run", out, "--input", f"x={tmp_path / 'small.npy'}"], "has shape (2, 8)", "optimized for")
    np.save(tmp_path / "c.npy", np.ones((4, 8), np.complex64))
    expect(capsys, ["run", out, "--input", f"x={tmp_path / 'c.npy'}"], "has dtype complex64")
    bad = np.ones((4, 8), np.float32)
    bad[1, 2] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    expect(capsys, ["run", out, "--input", f"x={tmp_path / 'nan.npy'}"], "NaN/Inf", "(1, 2)")
    assert cli.main(["run", str(out), "--input", f"x={saved / 'x.npy'}"]) == 0


def test_tampered_weights_and_library(saved, tmp_path, capsys):
    out = fresh_copy(saved, tmp_path)
    w = dict(np.load(out / "weights.npz", allow_pickle=False))
    w = {k: v + 1 for k, v in w.items()}
    np.savez(out / "weights.npz", **w)
    expect(capsys, ["run", out, "--input", f"x={saved / 'x.npy'}"], "weights.npz does not match the hash")
    out2 = tmp_path / "out2"
    shutil.copytree(saved / "out", out2)
    (out2 / "model.so").write_bytes((out2 / "model.so").read_bytes() + b"\0")
    expect(capsys, ["run", out2, "--input", f"x={saved / 'x.npy'}"], "model.so does not match the hash")


def test_unknown_files_other_formats_other_cpus(saved, tmp_path, capsys):
    out = fresh_copy(saved, tmp_path)
    (out / "evil.py").write_text("print('hi')")
    expect(capsys, ["run", out, "--input", f"x={saved / 'x.npy'}"], "unknown files", "evil.py")
    (out / "evil.py").unlink()
    mf = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(dict(mf, format=1)))
    expect(capsys, ["run", out, "--input", f"x={saved / 'x.npy'}"], "optimize the model again")
    mf["machine"]["isa"] = mf["machine"]["isa"] + ["avx1024_imaginary"]
    (out / "manifest.json").write_text(json.dumps(mf))
    expect(capsys, ["run", out, "--input", f"x={saved / 'x.npy'}"], "avx1024_imaginary", "optimize the model on this")


def test_force_never_deletes_a_directory_that_is_not_ours(saved, tmp_path, capsys):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "holiday.jpg").write_bytes(b"\xff\xd8")
    expect(capsys, ["optimize", saved / "m.onnx", "-o", mine, "--force", "--db", saved / "db.sqlite",
                    "--threads", "1", "--max-kernel-size", "2", "--runs", "0"], "not a kernorch output")
    assert (mine / "holiday.jpg").exists()


def test_a_negative_pointwise_allowance_is_refused(tmp_path, capsys):
    onnx.save(good_model(), str(tmp_path / "m.onnx"))
    expect(capsys, ["optimize", tmp_path / "m.onnx", "-o", tmp_path / "out", "--max-pointwise", "-1"],
           "--max-pointwise -1")
