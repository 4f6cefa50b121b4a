"""Concurrent and interrupted runs, with real processes: two optimizations on one profile database,
and a run killed with SIGKILL during measurement and during tuning, then resumed."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kernorch import executor


def chain_model(path, width=32, depth=4):
    """x -> (MatMul + bias -> Relu) x depth -> Softmax: enough kernels to kill a run in the middle."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(depth):
        inits += [numpy_helper.from_array((rng.standard_normal((width, width)) / 6).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"r{i}"])]
        x = f"r{i}"
    nodes.append(helper.make_node("Softmax", [x], ["y"], axis=-1))
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, width])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, width])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "kernorch.cli", *[str(a) for a in args]]


FAST = ["--threads", "1", "--max-kernel-size", "3", "--runs", "0"]


def rows(db) -> int:
    if not os.path.exists(db):
        return 0
    try:
        with sqlite3.connect(str(db), timeout=30) as c:
            return c.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


def check_output(model, outdir):
    from kernorch.runtime import load
    m = load(outdir)
    feeds = executor.random_feeds(m.graph, 1)
    ref = executor.ort_session(model, 1).run(None, feeds)[0]
    assert executor.max_error(ref, m.run(feeds)["y"])["rel"] < 1e-4


def test_two_optimizations_share_one_database(tmp_path):
    model = chain_model(tmp_path / "m.onnx")
    db = tmp_path / "shared.sqlite"
    procs = [subprocess.Popen(cli("optimize", model, "-o", tmp_path / f"out{i}", "--db", db, *FAST),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out
    for i in range(2):
        check_output(model, tmp_path / f"out{i}")
    with sqlite3.connect(str(db)) as c:
        refused = c.execute("SELECT COUNT(*) FROM measurements WHERE status != 'ok'").fetchone()[0]
    assert refused == 0


def _kill_when(proc, condition, timeout=300.0, sig=signal.SIGKILL, group=True) -> bool:
    """Signal the run (its whole process group, or the run alone) once `condition` holds."""
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        if condition():
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
            proc.wait(120)
            return True
        time.sleep(0.2)
    return False


def test_a_killed_measurement_loses_nothing_and_resumes(tmp_path):
    """Killed outright, a run loses no stored measurement; it leaves its build directory behind,
    which the next run removes (its owner is gone)."""
    model = chain_model(tmp_path / "m.onnx", depth=5)
    db = tmp_path / "db.sqlite"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(cli("optimize", model, "-o", tmp_path / "out", "--db", db, *FAST),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    assert _kill_when(proc, lambda: rows(db) >= 8), "the run ended before it could be killed"
    stored = rows(db)
    time.sleep(1.0)
    assert not any("kernorch" in " ".join(p) for p in _children_of(proc.pid))  # its workers died with it
    left = [p for p in tmp.iterdir() if p.name.startswith("kernorch-build-")]
    assert len(left) == 1 and f"-{proc.pid}-" in left[0].name
    r = subprocess.run(cli("candidates", model, "--db", db, "--json", "--threads", "1", "--max-kernel-size", "3"),
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    import json
    rep = json.loads(r.stdout)
    assert rep["from_database"] >= stored - 1  # every stored measurement is served (one may be mid-commit)
    assert rep["refused"] == 0
    assert not left[0].exists()


def test_only_the_build_directories_of_gone_runs_are_swept(tmp_path):
    from kernorch import measure
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = measure._host_build_dirs()
    dirs = {name: tmp_path / name for name in (
        f"{host}{gone.pid}-abc",             # its run is gone: removed
        f"{host}{os.getpid()}-abc",          # a live run's
        f"kernorch-build-other-{gone.pid}-abc",  # another host's
        "kernorch-build-abc")}               # named as before (no owner to ask)
    for d in dirs.values():
        d.mkdir()
        (d / "k.so").write_bytes(b"")
    assert measure.sweep_build_dirs(str(tmp_path)) == [dirs[f"{host}{gone.pid}-abc"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n in dirs if n != f"{host}{gone.pid}-abc")


def test_a_terminated_run_removes_its_build_directory_and_keeps_its_measurements(tmp_path):
    """SIGTERM (a `kill`) unwinds the run as Ctrl-C does: exit code 143 and a message, its workers
    gone, its temporary directory of built kernels removed, every stored measurement kept."""
    model = chain_model(tmp_path / "m.onnx", depth=5)
    db = tmp_path / "db.sqlite"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(cli("optimize", model, "-o", tmp_path / "out", "--db", db, *FAST),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})

    def building() -> bool:
        return rows(db) >= 8 and any(p.name.startswith("kernorch-build-") for p in tmp.iterdir())
    # (the run alone, as `kill PID` does: it closes its workers itself)
    assert _kill_when(proc, building, sig=signal.SIGTERM, group=False), "the run ended before it could be terminated"
    err = proc.stderr.read()
    assert proc.returncode == 143 and "terminated: measurements so far are kept" in err, err
    assert not any(p.name.startswith("kernorch-build-") for p in tmp.iterdir())
    time.sleep(1.0)
    assert not any("kernorch" in " ".join(p) for p in _children_of(proc.pid))
    assert rows(db) >= 8


def _children_of(pid: int) -> list[list[str]]:
    import psutil
    out = []
    for p in psutil.process_iter(["ppid", "cmdline"]):
        if p.info["ppid"] == pid:
            out.append(p.info["cmdline"] or [])
    return out


def test_a_killed_tuning_run_keeps_its_trials(tmp_path):
    model = chain_model(tmp_path / "m.onnx", depth=2)
    db, tune = tmp_path / "db.sqlite", tmp_path / "tuning"
    args = ["optimize", model, "-o", tmp_path / "out", "--db", db, "--tune-dir", tune, "--budget", "12t", *FAST]
    proc = subprocess.Popen(cli(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    state = lambda: list(tune.rglob("kernels.json"))  # noqa: E731 - written after each tuned kernel
    assert _kill_when(proc, lambda: bool(state()), timeout=600), "the run ended before it could be killed"
    import json
    before = json.loads(state()[0].read_text())
    spent = sum(e.get("trials", 0) for e in before.values())
    assert spent > 0
    r = subprocess.run(cli(*args, "--json", "--force"), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["tuning"]["reused"] >= 1                      # the killed run's tuned kernels came back
    assert rep["tuning"]["new_trials"] <= 12 - spent + 8     # and their trials counted as spent
    check_output(model, tmp_path / "out")


def test_a_plain_script_without_a_main_guard_optimizes(tmp_path):
    """The API from a script with no `if __name__ == "__main__":` guard: the measurement workers
    never re-run the script, so nothing crashes and nothing is refused."""
    model = chain_model(tmp_path / "m.onnx", depth=1)
    script = tmp_path / "script.py"
    script.write_text(
        "import numpy as np, kernorch\n"
        f"c = kernorch.optimize({str(model)!r}, runs=0, db_path={str(tmp_path / 'db.sqlite')!r}, threads=1,\n"
        "                      repeats=2, min_repeat_ms=1.0, max_kernel_size=2)\n"
        "print('OUTPUT', c.run({'x': np.ones((8, 32), np.float32)})['y'].shape)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "OUTPUT (8, 32)" in r.stdout
    with sqlite3.connect(str(tmp_path / "db.sqlite")) as c:
        assert c.execute("SELECT COUNT(*) FROM measurements WHERE status != 'ok'").fetchone()[0] == 0
