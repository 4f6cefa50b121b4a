"""The profile database and the worker pool: persistence, kill-safety, timeouts, crashes."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from dataclasses import replace

import numpy as np
import pytest

from kernorch.database import Measurement, ProfileDB
from kernorch.workers import WorkerPool


def _m(key, impl="tvm", ns=100, status="ok"):
    return Measurement("tgt", key, impl, "default", "v1", status, ns if status == "ok" else None, (ns, ns), "", 0.1, "add")


def test_a_kernel_over_a_range_keeps_its_time_at_each_length(tmp_path):
    """The times at each length a kernel over a range was timed at come back with it; a database
    written before they were kept gets the column, and its old rows read as having none."""
    import sqlite3
    old = tmp_path / "old.sqlite"
    with sqlite3.connect(old) as c:  # the table as it was, with one row
        c.execute("CREATE TABLE measurements (id INTEGER PRIMARY KEY AUTOINCREMENT, target TEXT NOT NULL, "
                  "key TEXT NOT NULL, impl TEXT NOT NULL, schedule TEXT NOT NULL, versions TEXT NOT NULL, "
                  "status TEXT NOT NULL, median_ns INTEGER, runs_ns TEXT, reason TEXT, build_s REAL, "
                  "description TEXT, created REAL NOT NULL)")
        c.execute("INSERT INTO measurements(target,key,impl,schedule,versions,status,median_ns,runs_ns,created) "
                  "VALUES ('tgt','k0','tvm','default','v1','ok',50,'[50]',0)")
    for path in (old, tmp_path / "new.sqlite"):
        with ProfileDB(path) as db:
            db.add(Measurement("tgt", "k1", "tvm", "t8x32p", "v1", "ok", 70, (70,), samples_ns=((1, 10), (512, 900))))
        with ProfileDB(path) as db:  # opened again: the column is there once
            got = db.lookup_many("tgt", "v1", [("k0", "tvm", "default"), ("k1", "tvm", "t8x32p")])
            assert got[("k1", "tvm", "t8x32p")].samples_ns == ((1, 10), (512, 900))
            if path == old:
                assert got[("k0", "tvm", "default")].samples_ns == () and got[("k0", "tvm", "default")].median_ns == 50


def test_add_lookup_fastest_counts(tmp_path):
    with ProfileDB(tmp_path / "db.sqlite") as db:
        db.add(_m("k1", ns=100))
        db.add(_m("k1", ns=90))
        db.add(_m("k1", ns=95))                  # taken again, slower: the fastest still counts
        db.add(_m("k1", status="refused"))      # a later refusal does not hide a measurement
        db.add(_m("k2", status="refused"))
        assert db.lookup("tgt", "k1", "tvm", "default", "v1").median_ns == 90
        assert db.lookup("tgt", "k1", "tvm", "default", "v2") is None
        assert db.lookup("other", "k1", "tvm", "default", "v1") is None
        many = db.lookup_many("tgt", "v1", [("k1", "tvm", "default"), ("k2", "tvm", "default"), ("k3", "tvm", "default")])
        assert set(many) == {("k1", "tvm", "default"), ("k2", "tvm", "default")}
        assert not many[("k2", "tvm", "default")].ok
        assert [m.median_ns for m in db.history("tgt", "v1", [("k1", "tvm", "default")])[("k1", "tvm", "default")]] \
            == [100, 90, 95, None]
        s = db.stats()
        assert s["measurements"] == 5
        assert len(db.export()) == 5
        assert db.clear(refused_only=True) == 2
        assert db.lookup("tgt", "k2", "tvm", "default", "v1") is None
        assert db.clear() == 3
        assert db.stats()["measurements"] == 0


def test_survives_killed_writer(tmp_path):
    """A process killed mid-run keeps every row it committed."""
    path = tmp_path / "db.sqlite"
    script = textwrap.dedent(f"""
        import time
        from kernorch.database import Measurement, ProfileDB
        db = ProfileDB({str(path)!r})
        for i in range(1000000):
            db.add(Measurement("t", f"k{{i}}", "tvm", "default", "v", "ok", i + 1, (i + 1,), "", 0.0, ""))
            if i == 20:
                print("ready", flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    with ProfileDB(path) as db:
        n = db.stats()["measurements"]
        assert n >= 21
        assert db.lookup("t", "k20", "tvm", "default", "v").median_ns == 21


def _square(x):
    return x * x


def _sleep(s):
    time.sleep(s)
    return s


def _crash():
    os.kill(os.getpid(), signal.SIGSEGV)


def _raise():
    raise ValueError("bad kernel")


@pytest.mark.parametrize("preload", [False, True], ids=["spawned", "forked"])
def test_pool_contains_hangs_and_crashes(preload):
    with WorkerPool(2, preload=preload) as pool:
        got = {r.index: r for r in pool.run(_square, [(i,) for i in range(6)], timeout=60)}
        assert [got[i].value for i in range(6)] == [0, 1, 4, 9, 16, 25]
        rs = list(pool.run(_sleep, [(30,), (0.01,)], timeout=2))
        by = {r.index: r for r in rs}
        assert not by[0].ok and "timed out" in by[0].error
        assert by[1].ok
        rs = {r.index: r for r in pool.run(_crash, [()], timeout=30)}
        assert not rs[0].ok and "crashed" in rs[0].error
        rs = {r.index: r for r in pool.run(_raise, [()], timeout=30)}
        assert not rs[0].ok and "bad kernel" in rs[0].error
        # the pool still works after all of that
        assert [r.value for r in pool.run(_square, [(3,)], timeout=30)] == [9]


@pytest.mark.parametrize("preload", [False, True], ids=["spawned", "forked"])
def test_workers_die_with_a_killed_parent(tmp_path, preload):
    """SIGKILL the process that owns the pool mid-task: its workers do not linger (Linux). Forked
    workers' parent is the server, which ends as the process it serves does."""
    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signal is Linux only")
    pids = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import time
        from kernorch.workers import WorkerPool
        pool = WorkerPool(2, preload={preload})
        open({str(pids)!r}, "w").write(" ".join(str(w.proc.pid) for w in pool.workers))
        for _ in pool.run(time.sleep, [(60,), (60,)], timeout=120):
            pass
    """)
    p = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.time() + 60
    while not (pids.exists() and pids.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    workers = [int(x) for x in pids.read_text().split()]
    time.sleep(1.0)  # the tasks are running
    p.kill()
    p.wait()
    deadline = time.time() + 10
    alive = workers
    while alive and time.time() < deadline:
        alive = [w for w in workers if os.path.exists(f"/proc/{w}") and
                 open(f"/proc/{w}/stat").read().split(")")[1].split()[0] != "Z"]
        time.sleep(0.1)
    assert not alive, f"workers {alive} outlived their parent"


# -- measurement: a crashed or hung worker is retried, and never a verdict on its own ----------------

def crash_first_time(job, path, repeats, min_repeat_ms, verify, cutoff_s=None, big_bytes=None, evict=0, cached=False):
    """Crash the worker the first time this job is timed (a flag file remembers), then time it."""
    import pathlib
    from kernorch import measure
    flag = pathlib.Path(os.environ["KERNORCH_TEST_FLAG"])
    if not flag.exists():
        flag.write_text("crashed once")
        os.kill(os.getpid(), signal.SIGSEGV)
    return measure._time_task(job, path, repeats, min_repeat_ms, verify, cutoff_s, big_bytes, evict, cached)  # unpatched in the worker


def test_measure_retries_a_crashed_worker_once(tmp_path, monkeypatch):
    from kernorch import measure
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Options
    t = TensorType((8, 8), "float32")
    g = Graph((("x", t), ("w", t)), ("y",), (make_prim("y", "matmul", ["x", "w"], t),))
    job = measure.KernelJob("k-test", "tvm", "default", g, ("x", "w"), ("y",))
    monkeypatch.setenv("KERNORCH_TEST_FLAG", str(tmp_path / "flag"))
    monkeypatch.setattr(measure, "_time_task", crash_first_time)
    opts = Options(threads=1, repeats=2, min_repeat_ms=0.1)
    with ProfileDB(tmp_path / "db.sqlite") as db:
        res, stats = measure.measure([job], db, opts)
    assert (tmp_path / "flag").exists()
    assert res[job.ident].ok and stats.measured == 1 and stats.refused == 0


def crash_bad_kernels(job, path, repeats, min_repeat_ms, verify, cutoff_s=None, big_bytes=None, evict=0, cached=False):
    """The worker dies whenever it times a kernel whose key starts with "k-bad"."""
    from kernorch import measure
    if job.key.startswith("k-bad"):
        os.kill(os.getpid(), signal.SIGKILL)
    return measure._time_task(job, path, repeats, min_repeat_ms, verify, cutoff_s, big_bytes, evict, cached)


def test_a_crashing_kernel_is_refused_only_when_it_crashes_again_in_a_healthy_run(tmp_path, monkeypatch):
    from kernorch import measure
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Machine, Options
    t = TensorType((8, 8), "float32")
    g = Graph((("x", t), ("w", t)), ("y",), (make_prim("y", "matmul", ["x", "w"], t),))
    bad = measure.KernelJob("k-bad", "tvm", "default", g, ("x", "w"), ("y",))
    good = measure.KernelJob("k-good", "tvm", "default", g, ("x", "w"), ("y",))
    monkeypatch.setattr(measure, "_time_task", crash_bad_kernels)
    opts = Options(threads=1, repeats=2, min_repeat_ms=0.1)
    with ProfileDB(tmp_path / "db.sqlite") as db:
        res, stats = measure.measure([bad], db, opts)          # nothing else measured: not healthy
        assert res[bad.ident].status == "failed" and "crashed" in res[bad.ident].reason
        res, _ = measure.measure([bad], db, opts)             # failed again, still no healthy kernel
        assert res[bad.ident].status == "failed"
        res, stats = measure.measure([bad, good], db, opts)   # again, while another kernel measures fine
        assert res[good.ident].ok and res[bad.ident].status == "refused" and "again" in res[bad.ident].reason
        res, stats = measure.measure([bad, good], db, opts)   # a verdict now: served, not retried
        assert stats.cached == 2 and res[bad.ident].status == "refused"
        target = Machine.host().fingerprint(1)
        statuses = [m.status for m in db.history(target, measure.versions("tvm"), [bad.ident])[bad.ident]]
        assert statuses == ["failed", "failed", "refused"]
        assert db.clear(refused_only=True) == 3              # db clear --refused retries both kinds


def test_a_kernel_that_fails_its_check_is_refused_at_once(tmp_path, monkeypatch):
    from kernorch import measure
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Options
    t = TensorType((8, 8), "float32")
    g = Graph((("x", t), ("w", t)), ("y",), (make_prim("y", "matmul", ["x", "w"], t),))
    job = measure.KernelJob("k-wrong", "tvm", "t7x13p", g, ("x", "w"), ("y",))  # not a tile of this kernel
    with ProfileDB(tmp_path / "db.sqlite") as db:
        res, stats = measure.measure([job], db, Options(threads=1, repeats=2, min_repeat_ms=0.1))
    assert res[job.ident].status == "refused" and stats.refused == 1


def test_the_reference_check_compares_where_the_reference_is_finite():
    from kernorch import measure
    from kernorch.ir import Graph, KernorchError, TensorType, make_prim
    t = TensorType((4,), "float32")
    job = measure.KernelJob("k", "tvm", "default", Graph((("x", t),), ("y",), (make_prim("y", "relu", ["x"], t),)),
                            ("x",), ("y",))
    want = np.array([1.0, -np.inf, 2.0, 4.0], np.float32)
    assert measure.check(job, [want + np.float32(1e-4)], [want]) == pytest.approx(2.5e-5, rel=1e-2)
    assert measure.check(job, [np.array([1.0, 7.0, 2.0, 4.0], np.float32)], [want]) == 0.0  # not compared at -inf
    for bad in ([1.0, -np.inf, 2.0, 4.01], [np.nan, -np.inf, 2.0, 4.0], [1.0, -np.inf, np.inf, 4.0]):
        with pytest.raises(KernorchError, match="output y"):
            measure.check(job, [np.array(bad, np.float32)], [want])
    with pytest.raises(KernorchError, match="shape"):
        measure.check(job, [want[:3]], [want])


def test_random_inputs_depend_only_on_the_kernel(monkeypatch):
    """Inputs are views of one process-wide noise buffer: the same kernel gets the same values
    whatever ran before it in the process (the buffer grows with the same seed), other kernels
    others, all in the safe domain, and nothing can write them."""
    from kernorch import measure
    from kernorch.ir import Graph, TensorType, make_prim

    def job(key, n):
        t = TensorType((n, 3), "float32")
        g = Graph((("x", t), ("z", t)), ("y",), (make_prim("y", "add", ["x", "z"], t),))
        return measure.KernelJob(key, "tvm", "default", g, ("x", "z"), ("y",))

    monkeypatch.setattr(measure, "_NOISE", np.empty(0, np.float32))
    small = measure.make_inputs(job("a", 5))
    big = measure.make_inputs(job("b", 1 << 20))  # grows the buffer
    again = measure.make_inputs(job("a", 5))
    monkeypatch.setattr(measure, "_NOISE", np.empty(0, np.float32))
    fresh = measure.make_inputs(job("a", 5))
    for a, b, c in zip(small, again, fresh):
        assert a.shape == (5, 3) and a.dtype == np.float32
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert not np.array_equal(small[0], small[1])
    assert not np.array_equal(small[0], big[0][:5])
    for x in small + big:
        assert x.min() >= 0.1 and x.max() < 1.0
        with pytest.raises(ValueError):
            x[0, 0] = 0.0


def test_a_dominated_generated_kernel_is_timed_once(tmp_path):
    """A generated kernel far slower than the best measured implementation of its key stops after
    one call instead of `repeats` (measure less where the answer is already clear)."""
    from kernorch import measure
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Machine, Options
    t = TensorType((64, 64), "float32")
    g = Graph((("x", t), ("w", t)), ("y",), (make_prim("y", "matmul", ["x", "w"], t),))
    # (no minimum repeat time: the calls are `repeats` exactly, as many as a cold call's flush
    # leaves room for otherwise, which depends on the machine's caches)
    opts = Options(threads=1, repeats=4, min_repeat_ms=0.0)
    target = Machine.host().fingerprint(opts.threads)
    fast = Measurement(target, "k-dom", "tvm", "t8x32", measure.versions("tvm"), "ok", 1, (1,), "", 0.0, "matmul")
    jobs = [measure.KernelJob("k-dom", "tvm", "default", g, ("x", "w"), ("y",)),
            measure.KernelJob("k-other", "tvm", "default", g, ("x", "w"), ("y",))]
    with ProfileDB(tmp_path / "db.sqlite") as db:
        db.add(fast)  # a (pretend) 1 ns tile of k-dom; nothing for k-other
        res, stats = measure.measure(jobs + [measure.KernelJob("k-dom", "tvm", "t8x32", g, ("x", "w"), ("y",))],
                                     db, opts)
    assert stats.cached == 1 and stats.measured == 2
    # the wall time splits into building and timing (what the summary of a run prints)
    assert 0 < stats.build_seconds and 0 < stats.time_seconds
    assert stats.build_seconds + stats.time_seconds <= stats.seconds
    assert len(res[jobs[0].ident].runs_ns) == 1          # cut after one call
    assert len(res[jobs[1].ident].runs_ns) == 4          # no cheaper implementation known: fully timed


@pytest.mark.parametrize("symbolic", [False, True])
def test_a_fused_kernel_far_slower_than_its_members_alone_is_timed_once(tmp_path, symbolic):
    """A fused kernel DOMINATED times slower than its members each measured alone (found in the
    database, from an earlier call) stops after one call, over a range after one call at each
    sample (their times kept): the plan can always run the members instead. Another fused kernel,
    whose members have no measurement, is timed fully."""
    from kernorch import measure
    from kernorch.ir import Graph, SymDim, TensorType, make_prim, structural_key
    from kernorch.options import Machine, Options
    rows = SymDim("seq", (0, 1, 0)) if symbolic else 64
    t = TensorType((rows, 64), "float32")
    g = Graph((("x", t), ("w", TensorType((64, 64), "float32"))), ("z",),
              (make_prim("y", "matmul", ["x", "w"], t), make_prim("z", "relu", ["y"], t)))
    opts = Options(threads=1, repeats=4, min_repeat_ms=0.0)
    target = Machine.host().fingerprint(opts.threads)
    samples = (((("seq", 8),), 0.5), ((("seq", 64),), 0.5)) if symbolic else ()
    bounds = (("seq", 64),) if symbolic else ()
    fused = measure.KernelJob("k-fused", "tvm", "default", g, ("x", "w"), ("z",), samples=samples, bounds=bounds)
    unknown = replace(fused, graph=Graph(g.inputs, ("z",), (make_prim("y", "matmul", ["x", "w"], t),
                                                           make_prim("z", "sigmoid", ["y"], t))), key="k-unknown")
    with ProfileDB(tmp_path / "db.sqlite") as db:
        for p in g.prims:  # (pretend) 1 ns kernels of each member alone
            db.add(Measurement(target, structural_key([p], g, [p.name]), "tvm", "default", measure.versions("tvm"),
                               "ok", 1, (1,), "", 0.0, p.op))
        res, _ = measure.measure([fused, unknown], db, opts)
    assert len(res[fused.ident].runs_ns) == 1 and len(res[unknown.ident].runs_ns) == 4
    assert [n for n, _ in res[fused.ident].samples_ns] == ([8, 64] if symbolic else [])


def test_remeasure_times_kernels_again_and_the_fastest_counts(tmp_path):
    """--remeasure: each kernel is timed again until it has REMEASURE_TRIES measurements, and the
    fastest counts (a slow stored timing is replaced, a faster one kept)."""
    from kernorch import measure
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Machine, Options
    t = TensorType((32, 32), "float32")
    g = Graph((("x", t), ("w", t)), ("y",), (make_prim("y", "matmul", ["x", "w"], t),))
    opts = Options(threads=1, repeats=3, min_repeat_ms=0.1)
    target = Machine.host().fingerprint(opts.threads)
    ver = measure.versions("tvm")
    slow = measure.KernelJob("k-slow", "tvm", "default", g, ("x", "w"), ("y",))
    fast = measure.KernelJob("k-fast", "tvm", "default", g, ("x", "w"), ("y",))
    done = measure.KernelJob("k-done", "tvm", "default", g, ("x", "w"), ("y",))

    def row(key, ns):
        return Measurement(target, key, "tvm", "default", ver, "ok", ns, (ns, ns), "", 0.0, "matmul")
    with ProfileDB(tmp_path / "db.sqlite") as db:
        db.add(row("k-slow", 10**9))   # 1 s, stored under load: any real timing of a 32x32 matmul beats it
        db.add(row("k-fast", 1))       # 1 ns: no real timing beats it
        for _ in range(measure.REMEASURE_TRIES):
            db.add(row("k-done", 10**9))
        jobs = [slow, fast, done]
        res, stats = measure.measure(jobs, db, opts)                       # not asked: all served
        assert stats.cached == 3 and stats.measured == 0
        res, stats = measure.measure(jobs, db, opts.with_(remeasure=True))
        assert stats.cached == 1 and stats.measured == 2 and stats.remeasured == 2
        assert 1 < res[slow.ident].median_ns < 10**9
        assert res[fast.ident].median_ns == 1 and res[done.ident].median_ns == 10**9
        assert db.lookup(target, "k-slow", "tvm", "default", ver).median_ns == res[slow.ident].median_ns
        assert len(db.history(target, ver, [slow.ident])[slow.ident]) == 2


def _tvm_threads():
    import tvm
    return tvm.runtime.num_threads()


@pytest.mark.parametrize("preload", [False, True], ids=["spawned", "forked"])
def test_workers_start_with_their_environment(preload):
    """TVM reads its thread count when its pool starts, before the worker runs any task: the
    variable must already be set when the worker process starts (TVM's default here is 1); a
    worker forked from the preloaded server (which imported TVM) sets it before its first task."""
    before = os.environ.get("TVM_NUM_THREADS")
    with WorkerPool(1, {"TVM_NUM_THREADS": "2"}, preload=preload) as pool:
        r = pool.call(_tvm_threads, (), timeout=60)
    assert r.ok and r.value == 2
    assert os.environ.get("TVM_NUM_THREADS") == before  # the parent's environment is unchanged


def _environment_of(names):
    import sys
    return {n: os.environ.get(n) for n in names}, "tvm" in sys.modules


def test_forked_workers_see_the_callers_environment_as_it_is_now(monkeypatch):
    """The server was started with the environment of its time (another test's, or the run's
    start); a worker forked from it later has the caller's environment as it is when the worker
    starts, the pool's variables over it, and TVM already imported (what the server preloads)."""
    from kernorch.workers import start_server
    start_server()
    monkeypatch.setenv("KERNORCH_TEST_LATER", "set after the server started")
    with WorkerPool(1, {"KERNORCH_TEST_POOL": "pool"}, preload=True) as pool:
        r = pool.call(_environment_of, (("KERNORCH_TEST_LATER", "KERNORCH_TEST_POOL"),), 60)
    assert r.ok, r.error
    env, preloaded = r.value
    assert env == {"KERNORCH_TEST_LATER": "set after the server started", "KERNORCH_TEST_POOL": "pool"}
    assert preloaded


def _open_and_add(path: str, i: int, barrier, errors) -> None:
    barrier.wait()  # every process opens the new database at the same moment
    try:
        with ProfileDB(path) as db:
            db.add(Measurement("t", f"k{i}", "tvm", "default", "v", "ok", 1000 + i, (1000 + i,), "", 0.0, "add"))
    except Exception as e:  # noqa: BLE001 - reported to the test
        errors.put(f"{type(e).__name__}: {e}")


def test_processes_opening_one_new_database_at_once_all_succeed(tmp_path):
    """Creating the schema and switching to WAL lock the file, and SQLite may refuse at once
    ("database is locked") instead of waiting: every process opening the same new database at the
    same moment still gets in (seen once when two optimizations started together)."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    for round_ in range(5):
        path = str(tmp_path / f"new{round_}.sqlite")
        barrier, errors = ctx.Barrier(8), ctx.Queue()
        procs = [ctx.Process(target=_open_and_add, args=(path, i, barrier, errors)) for i in range(8)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert errors.empty(), errors.get()
        with ProfileDB(path) as db:
            assert db.stats()["measurements"] == 8


# -- the timing protocol: weights cold, as the model reads them --------------------------------------

class _StubKernel:
    """Records how it is timed; every call 'takes' `secs`."""

    def __init__(self, secs):
        self.secs, self.calls, self.on = secs, [], []

    def tensors(self, *inputs, out_shapes=None):
        return (list(inputs), [object()])  # fresh device tensors each time

    def time(self, *inputs, number=10, repeat=5, warmup=1, min_repeat_ms=0, out_shapes=None, cold=(), evict=0,
             tensors=None):
        self.calls.append(dict(number=number, repeat=repeat, min_repeat_ms=min_repeat_ms, cold=list(cold)))
        self.on.append(tensors)
        if evict:
            self.calls[-1]["evict"] = evict
        return [self.secs] * repeat


@pytest.mark.parametrize("secs, calls", [(1e-3, 50), (1e-6, 200), (1.0, 5)])
def test_kernels_with_weights_are_timed_one_cold_call_at_a_time(secs, calls):
    from kernorch import measure
    from kernorch.ir import Graph, TensorType, make_prim
    t = TensorType((4, 8), "float32")
    g = Graph((("x", TensorType((4, 3), "float32")),), ("y",),
              (make_prim("y", "matmul", ["x", "w"], t),), constants={"w": np.ones((3, 8), np.float32)})
    job = measure.KernelJob("k", "tvm", "default", g, ("x", "w"), ("y",))
    assert measure.cold_args(job) == [1]
    # an output larger than the caches of the cores writing it is flushed too (parameter 2: after the inputs)
    assert measure.cold_args(job, big_bytes=4 * 8 * 4 - 1) == [1, 2] and measure.cold_args(job, big_bytes=4 * 8 * 4) == [1]
    k = _StubKernel(secs)
    runs = measure._timed(k, [None, None], repeats=5, min_repeat_ms=10, cold=[1])
    # one call to size the run, then as many single cold calls as 5 repeats of 10 ms hold (5..200),
    # on the same device tensors (on fresh ones the first 30 or so calls with the caches evicted ran
    # up to 1.8x slower: see measure._timed)
    assert [c["cold"] for c in k.calls] == [[1], [1]] and k.calls[1]["repeat"] == calls == len(runs)
    assert k.on[0] is not None and k.on[0] is k.on[1]
    hot = _StubKernel(secs)
    measure._timed(hot, [None], repeats=5, min_repeat_ms=10, cold=[])
    assert hot.calls == [dict(number=1, repeat=5, min_repeat_ms=10, cold=[])]


def test_a_model_whose_weights_fit_in_the_last_level_is_timed_finding_them_there(tmp_path):
    """Weights that all fit in half the last-level cache are not flushed before each call but
    evicted to that level (each thread reads twice its own caches first); the measurements of such
    a model have a database namespace of their own, and the plan says where its weights were."""
    from dataclasses import replace
    from kernorch import measure, pipeline
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Machine, Options
    t = TensorType((4, 8), "float32")
    g = Graph((("x", TensorType((4, 3), "float32")),), ("y",),
              (make_prim("y", "matmul", ["x", "w"], t),), constants={"w": np.ones((3, 8), np.float32)})
    m = Machine.host()
    small, tiny = replace(m, l3_kib=1), replace(m, l3_kib=0)   # 96 bytes of weights: half of 1 KiB holds them
    assert measure.weights_fit(g, small) and not measure.weights_fit(g, tiny)
    big = Graph(g.inputs, g.outputs, g.prims, constants={"w": np.ones((32, 8), np.float32)})  # 1 KiB
    huge = replace(m, l3_kib=1 << 20)   # the host's L3 as a VM reports it; measured, the last level is less
    assert measure.weights_fit(big, huge) and not measure.weights_fit(big, huge, last_level_kib=1)
    assert measure.weights_fit(g, huge, last_level_kib=1) and measure.weights_fit(big, small, last_level_kib=1 << 20) is False
    assert measure.evict_bytes(m) == 2 * (m.l1d_kib + m.l2_kib) * 1024
    job = measure.KernelJob("k", "tvm", "default", g, ("x", "w"), ("y",))
    assert measure.cold_args(job, cached=True) == [] and measure.cold_args(job, 4 * 8 * 4 - 1, cached=True) == [2]
    k = _StubKernel(1e-3)
    measure._timed(k, [None, None], repeats=5, min_repeat_ms=10, cold=[], evict=1000)
    assert [c.get("evict") for c in k.calls] == [1000, 1000] and k.calls[1]["repeat"] == 50  # one call per repeat
    o = Options(threads=2)
    assert pipeline.model_options(g, o, small).weights_cached and not pipeline.model_options(g, o, tiny).weights_cached
    assert measure.target_of(m, o.with_(weights_cached=True)) == measure.target_of(m, o) + "|weights-cached"


def test_a_kernel_is_timed_with_its_output_flushed():
    """`cold` positions past the inputs are outputs: BuiltKernel.time flushes them before each call
    (one call per repeat); the threshold is half the L2 of the cores that write the output."""
    from kernorch import measure
    from kernorch.backends import tvm as tb
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Machine
    t = TensorType((64, 64), "float32")
    g = Graph((("x", t), ("w", t)), ("y",), (make_prim("y", "matmul", ["x", "w"], t),))
    target = tb.make_target(1)
    k = tb.build(tb.schedule(tb.lower(g, g.prims, ["x", "w"], ["y"], "default"), target, "default"), target)
    x = np.ones((64, 64), np.float32)
    runs = k.time(x, x, repeat=3, cold=[2], warmup=0)
    assert len(runs) == 3 and all(r > 0 for r in runs)
    m = Machine.host()
    assert measure.big_output_bytes(m, 2) == m.l2_kib * 1024 * min(2, m.cores) * measure.OUTPUT_L2_SHARE
    assert measure.big_output_bytes(m, 0) == m.l2_kib * 1024 * measure.OUTPUT_L2_SHARE


def test_every_kernel_is_timed_evicted_and_weights_that_do_not_fit_flushed_too(tmp_path, monkeypatch):
    """Every kernel is timed with the cores' caches evicted before each call, a kernel that reads
    no weight as well (it finds its activations in the last level in the model); a model's weights
    that do not fit in the last level are flushed before each call besides (`cached` False), those
    that fit are not."""
    from kernorch import measure
    from kernorch.backends import tvm as tb
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Machine, Options
    t = TensorType((64, 64), "float32")
    g = Graph((("x", t),), ("y",), (make_prim("y", "relu", ["x"], t),))
    w = Graph((("x", t),), ("y",), (make_prim("y", "matmul", ["x", "w"], t),), constants={"w": np.ones((64, 64), np.float32)})
    target = tb.make_target(1)
    paths = {}
    for name, graph, ins in (("relu", g, ["x"]), ("mm", w, ["x", "w"])):
        paths[name] = str(tmp_path / f"{name}.so")
        tb.build(tb.schedule(tb.lower(graph, graph.prims, ins, ["y"], "default"), target, "default"), target).export(
            paths[name])
    relu = measure.KernelJob("r", "tvm", "default", g, ("x",), ("y",))
    mm = measure.KernelJob("m", "tvm", "default", w, ("x", "w"), ("y",))
    seen = []
    monkeypatch.setattr(measure, "_timed", lambda k, inputs, repeats, ms, cold, evict=0, **kw: (
        seen.append((list(cold), evict)), [1e-6])[1])
    measure._time_task(relu, paths["relu"], 3, 1.0, False, evict=1000, cached=False)
    measure._time_task(mm, paths["mm"], 3, 1.0, False, evict=1000, cached=False)
    measure._time_task(mm, paths["mm"], 3, 1.0, False, evict=1000, cached=True)
    measure._time_task(relu, paths["relu"], 3, 1.0, False)
    assert seen == [([], 1000), ([1], 1000), ([], 1000), ([], 0)]
    o, m = Options(threads=2), Machine.host()
    for cached in (False, True):
        args = measure._timing_args(mm, paths["mm"], o.with_(weights_cached=cached), m)
        assert args[-2:] == (measure.evict_bytes(m), cached)


def test_versions_name_the_timing_protocol():
    from kernorch import measure
    assert f"timing-{measure.TIMING_PROTOCOL}" in measure.versions("tvm")


def test_a_fused_kernel_that_refuses_winograd_falls_back_to_the_direct_tile_then_the_default(tmp_path):
    """A Winograd variant takes one output block after its GEMMs: a fused conv kernel with two
    outputs refuses it and is timed in its contraction's fastest direct tile instead; a kernel
    that refuses that tile as well ends with the default schedule."""
    import numpy as np
    from kernorch import pipeline
    from kernorch import primitives as P
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Machine, Options
    lanes = Machine.host().lanes
    xs, ws = TensorType((1, 16, 8, 8), "float32"), TensorType((2 * lanes, 16, 3, 3), "float32")
    attrs = dict(strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1), group=1)
    ct = P.infer("conv", [xs, ws], attrs)
    g = Graph((("x", xs),), ("c", "r"), (make_prim("c", "conv", ["x", "w"], ct, **attrs),
                                         make_prim("r", "relu", ["c"], ct)),
              constants={"w": np.random.default_rng(0).standard_normal(ws.shape).astype(np.float32)})
    wino = pipeline.meas.KernelJob("k-two-out", "tvm", f"b{lanes}/w4t2x{2 * lanes}", g, ("x", "w"), ("c", "r"))
    direct = {("c", lanes): f"b{lanes}/t8x{2 * lanes}p"}
    assert pipeline._fallback_schedule(wino, direct) == f"b{lanes}/t8x{2 * lanes}p"
    assert pipeline._fallback_schedule(wino, {}) == f"b{lanes}/default"
    from dataclasses import replace
    assert pipeline._fallback_schedule(replace(wino, schedule=direct[("c", lanes)]), direct) == f"b{lanes}/default"
    with ProfileDB(tmp_path / "db.sqlite") as db:
        res, _ = pipeline._measure_with_fallback([wino], db, Options(threads=1, repeats=2, min_repeat_ms=0.1),
                                                 Machine.host(), "test", direct=direct)
    by_schedule = {k[2]: m for k, m in res.items()}
    assert by_schedule[wino.schedule].status == "refused"
    assert by_schedule[f"b{lanes}/t8x{2 * lanes}p"].ok
    assert f"b{lanes}/default" not in by_schedule  # the direct tile applied: no second fallback


def first_call() -> bool:
    """Whether no timing ran before this one (the flag file, KERNORCH_TEST_FLAG, gets a character
    per call): the fake timings below run in worker processes."""
    import pathlib
    flag = pathlib.Path(os.environ["KERNORCH_TEST_FLAG"])
    calls = flag.read_text() if flag.exists() else ""
    flag.write_text(calls + "x")
    return not calls


def disturbed_then_quiet(job, path, repeats, min_repeat_ms, verify, cutoff_s=None, big_bytes=None, evict=0, cached=False):
    """A kernel over seq timed twice: the first time slowed at seq=512, the second at seq=1."""
    first = first_call()
    at = [(1, 5e-6), (512, 9e-4)] if first else [(1, 8e-6), (512, 5e-4)]
    return {"runs": [1e-3, 1e-3] if first else [2e-3, 2e-3], "error": None, "at": at}


def test_a_kernel_over_a_range_keeps_the_faster_of_two_timings_at_each_length(tmp_path, monkeypatch):
    """A disturbance can slow a whole job, every length of it: a contraction's tile over a range
    (timed between the samples too: its times become the row copies' cost curves) is timed once
    more after the others, and its time at each length is the faster of the two (noise only ever
    slows); the runs are those of the faster timing overall. Both stored; the database serves the
    merged one. A kernel at one shape, or over a range without probes, is timed once."""
    from kernorch import measure
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Options
    t = TensorType((8, 8), "float32")
    g = Graph((("x", t), ("w", t)), ("y",), (make_prim("y", "matmul", ["x", "w"], t),))
    samples = (((("seq", 1),), 0.5), ((("seq", 512),), 0.5))
    job = measure.KernelJob("k-range", "reference", "default", g, ("x", "w"), ("y",), samples=samples,
                            probes=(((("seq", 5),),)))
    monkeypatch.setenv("KERNORCH_TEST_FLAG", str(tmp_path / "flag"))
    monkeypatch.setattr(measure, "_time_task", disturbed_then_quiet)
    opts = Options(threads=1, repeats=2, min_repeat_ms=0.1, python_kernels=True)
    with ProfileDB(tmp_path / "db.sqlite") as db:
        res, stats = measure.measure([job], db, opts)
        m = res[job.ident]
        assert m.samples_ns == ((1, 5000), (512, 500000)) and m.runs_ns == (1000000, 1000000)
        assert stats.measured == 1 and (tmp_path / "flag").read_text() == "xx"
        res, stats = measure.measure([job], db, opts)
        assert stats.cached == 1 and res[job.ident] == m
    static = measure.KernelJob("k-static", "reference", "default", g, ("x", "w"), ("y",))
    fusion = measure.KernelJob("k-fusion", "reference", "default", g, ("x", "w"), ("y",), samples=samples)
    for j in (static, fusion):
        (tmp_path / "flag").unlink()
        with ProfileDB(tmp_path / f"{j.key}.sqlite") as db:
            res, _ = measure.measure([j], db, opts)
        assert (tmp_path / "flag").read_text() == "x" and res[j.ident].runs_ns == (1000000, 1000000)


def fast_then_slow(job, path, repeats, min_repeat_ms, verify, cutoff_s=None, big_bytes=None, evict=0, cached=False):
    """A kernel at one shape: 1 ms the first time, 2 ms after."""
    return {"runs": [1e-3, 1e-3] if first_call() else [2e-3, 2e-3], "error": None}


def test_a_queued_kernel_is_timed_again_by_the_runs_next_measurement(tmp_path, monkeypatch):
    """With the run's workers, a kernel queued for a second timing (Workers.time_later: one the
    run timed since the last such call; the others are forgotten) waits until the next measure
    call has built its kernels, so that its
    two timings are apart; that call times it before its own kernels and keeps the faster in
    Workers.retimed for the run (its own results are its jobs'). time_again times what is left;
    pipeline.settled folds both into a Measured (its kernels only), and returns it unchanged when
    no time changed."""
    from kernorch import measure, pipeline
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.options import Machine, Options
    t = TensorType((8, 8), "float32")
    g = Graph((("x", t), ("w", t)), ("y",), (make_prim("y", "matmul", ["x", "w"], t),))
    a, b, c = (measure.KernelJob(k, "reference", "default", g, ("x", "w"), ("y",)) for k in ("k-a", "k-b", "k-c"))
    flag = tmp_path / "flag"
    monkeypatch.setenv("KERNORCH_TEST_FLAG", str(flag))
    monkeypatch.setattr(measure, "_time_task", fast_then_slow)
    opts = Options(threads=1, repeats=2, min_repeat_ms=0.1, python_kernels=True)
    machine = Machine.host()
    with ProfileDB(tmp_path / "db.sqlite") as db, measure.Workers(opts) as workers:
        first, _ = measure.measure([a], db, opts, machine, workers=workers)
        assert flag.read_text() == "x" and set(workers.timed) == {a.ident} and not workers.again
        workers.time_later({a.ident: first[a.ident], ("k-unknown", "tvm", "default"): first[a.ident]})
        assert set(workers.again) == {a.ident}
        second, _ = measure.measure([b], db, opts, machine, workers=workers)
        assert set(second) == {b.ident} and not workers.again and flag.read_text() == "xxx"
        assert workers.retimed == {a.ident: first[a.ident]}   # 2 ms the second time: the first stands
        measured = pipeline.Measured({**first, **second}, measure.MeasureStats(), {}, {})
        assert pipeline.settled(measured, db, opts, machine, workers) is measured   # nothing left, nothing faster
        assert not workers.retimed
        slow = replace(second[b.ident], median_ns=9_000_000, runs_ns=(9_000_000,))
        measured = replace(measured, measurements={**measured.measurements, b.ident: slow})
        measure.measure([c], db, opts, machine, workers=workers)
        workers.time_later({b.ident: slow})
        workers.time_later({c.ident: second[b.ident]})   # c was timed before the last call: forgotten
        assert set(workers.again) == {b.ident} and not workers.timed
        out = pipeline.settled(measured, db, opts, machine, workers)
        assert out.measurements[b.ident].median_ns == 2_000_000 and c.ident not in out.measurements
        assert not workers.again


def test_cpus_a_vm_names_alike_keep_their_measurements_apart():
    """A Zen 1 and a Zen 3 VM both say "AMD EPYC" with the same AVX2 flags: the family/model and the
    caches tell them apart, so one's timings never serve the other."""
    from kernorch.options import Machine
    zen1 = Machine("AMD EPYC", ("avx", "avx2", "fma"), 2, 256, 32, 512, 8192, cpu="AuthenticAMD 23/1/2")
    zen3 = Machine("AMD EPYC", ("avx", "avx2", "fma"), 2, 256, 32, 512, 32768, cpu="AuthenticAMD 25/1/1")
    assert zen1.fingerprint(2) != zen3.fingerprint(2)
    assert zen1.fingerprint(2) != replace(zen1, cpu="AuthenticAMD 23/49/0").fingerprint(2)
    assert zen1.fingerprint(2) != zen1.fingerprint(1) and zen1.fingerprint(2) == replace(zen1).fingerprint(2)
    assert Machine.from_json(zen3.to_json()) == zen3
    older = {k: v for k, v in zen1.to_json().items() if k != "cpu"}   # saved before the cpu was read
    assert Machine.from_json(older).same_cpu(zen1) and not Machine.from_json(older).same_cpu(zen3)
    assert not zen1.same_cpu(replace(zen1, cpu="AuthenticAMD 23/49/0"))
    host = Machine.host()
    assert host.cpu == "" or len(host.cpu.split()) == 2


def test_random_conditions_never_send_an_index_out_of_range():
    """A kernel that takes a Gather's `index < 0` as an input (fission normalizes a negative index
    as where(index < 0, index + n, index)) gets conditions that keep its zero indices in range,
    so the reference and the kernel never gather row n of n (such kernels were refused as broken);
    a condition with no index behind it stays random (a mask keeps some of each)."""
    from kernorch import measure
    from kernorch.ir import Graph, TensorType, make_prim
    b, i = TensorType((64,), "bool"), TensorType((64,), "int64")
    out = TensorType((64, 2), "float32")
    g = Graph((("neg", b), ("ids", i)), ("rows",),
              (make_prim("shifted", "add", ["ids", "n"], i), make_prim("index", "where", ["neg", "shifted", "ids"], i),
               make_prim("rows", "gather", ["table", "index"], out, axis=0)),
              constants={"n": np.array(3, np.int64), "table": np.ones((3, 2), np.float32)})
    job = measure.KernelJob("gather-key", "tvm", "default", g, ("neg", "ids", "table", "n"), ("rows",))
    neg, ids, *_ = measure.make_inputs(job)
    assert not neg.any() and not ids.any()
    np.testing.assert_array_equal(measure.reference(job, measure.make_inputs(job))[0], np.ones((64, 2)))
    x = TensorType((64,), "float32")
    masked = Graph((("keep", b), ("x", x)), ("y",), (make_prim("y", "where", ["keep", "x", "low"], x),),
                   constants={"low": np.array(-1e4, np.float32)})
    keep = measure.make_inputs(measure.KernelJob("mask-key", "tvm", "default", masked, ("keep", "x", "low"), ("y",)))[0]
    assert keep.any() and not keep.all()
    fixed = np.arange(64) % 3 == 0   # a constant condition is the kernel's own: never replaced
    const = Graph((("x", x),), ("y",), (make_prim("y", "where", ["keep", "x", "low"], x),),
                  constants={"keep": fixed, "low": np.array(-1e4, np.float32)})
    got = measure.make_inputs(measure.KernelJob("const-key", "tvm", "default", const, ("keep", "x", "low"), ("y",)))[0]
    np.testing.assert_array_equal(got, fixed)


def test_the_libraries_of_kernels_not_queued_again_are_removed(tmp_path):
    """Workers.time_later keeps the built library of a kernel it queues and removes the others'
    (a run keeps only what it may time again), and a run's directory of built kernels goes with
    its workers."""
    from kernorch import measure
    from kernorch.options import Options
    with measure.Workers(Options(threads=1)) as workers:
        d = Path(workers.build_dir())
        paths = {}
        for k in ("k-keep", "k-drop"):
            paths[k] = d / f"{k}.so"
            paths[k].write_bytes(b"so")
            Path(str(paths[k]) + ".json").write_text("{}")
            workers.timed[(k, "tvm", "default")] = (None, str(paths[k]))
        m = Measurement("t", "k-keep", "tvm", "default", "", "ok", 1, (1,), "")
        workers.time_later({("k-keep", "tvm", "default"): m})
        assert paths["k-keep"].exists() and not paths["k-drop"].exists()
        assert not Path(str(paths["k-drop"]) + ".json").exists()
        assert workers.again[("k-keep", "tvm", "default")].first == m
    assert not d.exists()
