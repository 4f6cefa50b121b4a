"""bench() and the peers: each system in its own process, structure, correctness against ONNX
Runtime, roofline fields, the kernel benchmark. Never asserts a timing (2-thread timings on this
shared box inflate 2-30x under load)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kernorch import calibrate, peers
from kernorch.bench import SYSTEMS, bench, save_json, summary_rows
from kernorch.ir import KernorchError
from kernorch.options import Options


def tiny_model(path) -> str:
    """MatMul + bias → Relu → Softmax: a linear op (FLOPs for the roofline) and a reduction."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Softmax", ["r"], ["y"], axis=-1)]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return str(path)


@pytest.fixture(scope="module")
def cal_cache(tmp_path_factory):
    """Calibrations go to a temporary file (shared by this module's tests), never the user's cache."""
    path = tmp_path_factory.mktemp("cal") / "calibration.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibrate, "cache_path", lambda: path)
        yield path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("m") / "tiny.onnx")


def test_bench_structure(tmp_path, cal_cache, model):
    opts = Options(db_path=str(tmp_path / "db.sqlite"), repeats=2, min_repeat_ms=1.0, max_kernel_size=3)
    r = bench(model, systems=("kernorch", "ort", "openvino", "tvm"), threads=2, rounds=2, block=2,
              outdir=tmp_path / "k", options=opts)
    assert set(r["systems"]) == {"kernorch", "ort", "openvino", "tvm"}
    for name, e in r["systems"].items():
        assert e["status"] == "ok", (name, e)
        assert e["runs"] == 4
        assert e["p10_ms"] <= e["median_ms"] <= e["p90_ms"]
        assert e["max_rel_error"] < 1e-4 and e["matches"]
        assert e["speedup_vs_ort"] > 0 and e["roofline_fraction"] > 0 and e["vs_best_peer"] > 0
    assert r["systems"]["ort"]["max_rel_error"] == 0.0 and r["systems"]["ort"]["speedup_vs_ort"] == 1.0
    assert r["best_peer"] in ("ort", "openvino", "tvm")
    assert r["systems"]["openvino"]["precision"] == "f32" and r["systems"]["openvino"]["hint"] == "LATENCY"
    assert r["timing_method"]["isolation"] == "each system alone in its own process"
    rf = r["roofline"]
    assert rf["flops"] >= 2 * 4 * 16 * 32
    assert rf["bytes"] == 4 * (4 * 16 + 16 * 32 + 32 + 4 * 32)
    assert rf["bound"] in ("compute", "memory") and rf["floor_ms"] == max(rf["compute_ms"], rf["memory_ms"])
    assert "cpu_pressure" in r["load_before"] or "loadavg" in r["load_before"]
    assert r["calibration"]["peak_gflops"] > 0 and r["calibration"]["peak_kernel"]
    assert (tmp_path / "k" / "bench.json").exists()  # beside the saved model, for the report
    p = save_json(r, tmp_path / "bench.json")
    assert json.loads(p.read_text())["systems"]["tvm"]["status"] == "ok"  # JSON-serializable
    assert len(summary_rows(r)) == 4


def test_systems_run_in_processes_of_their_own(model):
    import os
    feeds = {"x": np.ones((4, 16), np.float32)}
    with peers.Timer(1) as t:
        assert t.add("ort", model, feeds)["status"] == "ok"
        assert t.add("openvino", model, feeds)["status"] == "ok"
        pids = {n: p.workers[0].proc.pid for n, p in t.pools.items()}
        assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()
        times = t.rounds(2, block=1)
    assert {n: len(v) for n, v in times.items()} == {"ort": 2, "openvino": 2}


def test_failures_are_reported_not_raised(model, monkeypatch):
    import os
    feeds = {"x": np.ones((4, 16), np.float32)}
    with peers.Timer(1) as t:
        info = t.add("kernorch", os.devnull, feeds)   # not a saved model: fails in its own process
        assert info["status"] == "failed" and "manifest" in info["error"]
        assert t.add("torch", model, feeds)["status"] in ("skipped", "ok", "failed")
        assert t.add("ort", model, feeds)["status"] == "ok"
        assert "kernorch" not in t.systems and "ort" in t.systems


def test_unknown_system(model):
    with pytest.raises(KernorchError, match="unknown system"):
        bench(model, systems=("ort", "tensorflow"))
    assert {"kernorch", "ort", "openvino", "tvm"} <= set(SYSTEMS)


def test_calibration_is_cached(cal_cache):
    a = calibrate.calibrate(2)
    assert a["peak_gflops"] > 0 and a["bandwidth_gbs"] > 0 and a["peak_kernel"] in a["gemm_gflops_by_tile"]
    assert a["boundary_ns"] >= 0 and a["boundary_step_alone_ns"] > 0
    assert a["boundary_step_in_chain_ns"] == pytest.approx(a["boundary_ns"] + a["boundary_step_alone_ns"]) \
        or a["boundary_ns"] == 0
    assert cal_cache.exists()
    b = calibrate.calibrate(2)
    assert b["created"] == a["created"] or a.get("loaded")  # a loaded calibration may be re-measured


def test_a_recalibration_keeps_the_kernel_boundary(tmp_path, monkeypatch):
    """A calibration taken under load is measured again; the ceilings keep their best, and the
    boundary its first value (it is in every kernel's cost, and plans must not move with it), and
    so does the last level's capacity (it decides how a model's kernels are timed)."""
    path = tmp_path / "calibration.json"
    runs = iter([(100.0, 10.0, 300.0, True), (200.0, 8.0, 250.0, False)])

    def fake_run():
        peak, bw, boundary, busy = next(runs)
        monkeypatch.setattr(calibrate, "measure_gemm", lambda t: {"peak_gflops": peak, "peak_kernel": "t",
                                                                  "gemm_gflops_by_tile": {"t": peak}})
        monkeypatch.setattr(calibrate, "measure_bandwidth", lambda: {"bandwidth_gbs": bw})
        monkeypatch.setattr(calibrate, "measure_boundary", lambda t: {"boundary_ns": boundary})
        monkeypatch.setattr(calibrate, "measure_last_level", lambda l2, l3: {"last_level_kib": boundary * 100})
        monkeypatch.setattr(calibrate, "machine_busy", lambda: busy)
    fake_run()
    a = calibrate.calibrate(2, path=path)
    assert (a["peak_gflops"], a["boundary_ns"], a["loaded"]) == (100.0, 300.0, True)
    fake_run()
    b = calibrate.calibrate(2, path=path)  # the cached one was loaded and the machine is quiet: again
    assert (b["peak_gflops"], b["bandwidth_gbs"], b["boundary_ns"], b["loaded"]) == (200.0, 10.0, 300.0, False)
    assert a["last_level_kib"] == b["last_level_kib"] == 30000


def test_the_last_level_is_where_a_stream_of_reads_falls_halfway_to_memory():
    """calibrate.knee_kib: the largest buffer read at least halfway between the smallest one's rate
    and the largest one's; none where the rate hardly falls (no level seen). The sweep starts at 4x
    L2 and grows by 1.5x and 4/3 in turn; measured, the capacity is never above what sysfs says."""
    sizes = calibrate.last_level_sizes(2048, 512)
    assert sizes[:6] == [8192, 12288, 16384, 24576, 32768, 49152] and sizes[-1] <= 512 * 1024
    assert all(b > a for a, b in zip(sizes, sizes[1:]))
    rates = [29.0, 28.9, 29.0, 28.5, 28.8, 18.5, 17.8, 16.2]   # a Xeon VM (family 6 model 167), GB/s
    assert calibrate.knee_kib(sizes[:8], rates) == 32768
    assert calibrate.knee_kib(sizes[:8], [29.0, 28, 27, 26, 25, 25, 24.5, 24]) is None   # memory as fast as cache
    assert calibrate.knee_kib(sizes[:3], [29.0, 10.0, 9.0]) == 8192
    m = calibrate.measure_last_level(64, 1024)   # small buffers: quick; at most the 1 MiB reported
    assert 0 < m["last_level_kib"] <= 1024 and len(m["last_level_sweep"]) >= 3


def test_kernel_benchmark_compares_every_contraction(tmp_path, cal_cache, model):
    from kernorch.kbench import bench_kernels
    opts = Options(db_path=str(tmp_path / "db.sqlite"), repeats=2, min_repeat_ms=1.0)
    r = bench_kernels(model, opts, threads=(1,), repeats=2)
    (k,) = r["kernels"]
    e = k["by_threads"]["1"]
    assert k["kernel"].startswith("matmul 4x16 · W16x32") and k["count"] == 1
    assert e["schedule"].startswith("t") and e["ratio"] > 0 and 0 < e["of_peak"]
    assert e["ort_gflops"] > 0 and e["kernorch_gflops"] > 0 and e["schedule"] in e["tiles_us"]
    assert r["summary"]["1"]["kernels"] == 1


def test_kernel_benchmark_offers_a_conv_without_blocked_tiles_its_plain_ones():
    """A 150-channel conv (no multiple of the lanes: no blocked tile) is benchmarked in the
    plain-layout tiles and the default schedule the plan can give it, not in a blocked default."""
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.kbench import contractions, kernel_jobs
    from kernorch.options import Machine
    attrs = dict(strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group=1)
    g = Graph((("x", TensorType((1, 64, 16, 16), "float32")),), ("y",),
              (make_prim("y", "conv", ["x", "w"], TensorType((1, 150, 16, 16), "float32"), **attrs),),
              constants={"w": np.zeros((150, 64, 1, 1), np.float32)})
    (c,) = contractions(g)
    schedules = [j.schedule for j in kernel_jobs(c, Machine.host())]
    assert schedules[-1] == "default" and len(schedules) > 1 and not any("/" in s for s in schedules)


def test_kernel_benchmark_summarizes_the_convolutions_apart():
    """The blocked-layout target is per model over its convolutions: the summary gives their geomean
    and lowest ratio beside those of every contraction; a kernel without a ratio counts in neither."""
    from kernorch.kbench import summary
    def row(kernel, ratio=None):
        return {"kernel": kernel, "by_threads": {"2": {} if ratio is None else {"ratio": ratio}}}
    s = summary([row("conv 1x8x8x8 · W8x8x3x3 s1 g1", 2.0), row("conv 1x8x8x8 · W8x8x1x1 s1 g1", 0.5),
                 row("matmul 4x16 · W16x32", 0.25), row("conv 1x3x8x8 · W8x3x3x3 s1 g1")], 2)
    assert s["kernels"] == 3 and s["min_ratio"] == 0.25 and abs(s["geomean_ratio"] - 0.25 ** (1 / 3)) < 1e-9
    assert s["conv_kernels"] == 2 and s["conv_min_ratio"] == 0.5 and abs(s["conv_geomean_ratio"] - 1.0) < 1e-9
    assert "conv_kernels" not in summary([row("matmul 4x16 · W16x32", 1.0)], 2)


def test_a_system_is_timed_only_once_the_last_ones_threads_are_idle():
    """A system whose threads keep running after its turn (a thread pool spinning) delays the next
    system's turn until they stop, so the next one runs alone."""
    import threading
    import time
    from kernorch.peers import Timer
    ends, starts = [], []

    def spin():
        until = time.perf_counter() + 0.15
        while time.perf_counter() < until:
            pass
        ends.append(time.perf_counter())

    with Timer(1) as t:
        t.add_local("a", lambda: threading.Thread(target=spin).start())
        t.add_local("b", lambda: starts.append(time.perf_counter()))
        t.rounds(1, block=1, warmup=0)
    assert ends and starts and starts[0] >= max(ends), (starts, ends)  # b's first call: after every spin
    assert t.info["a"]["quiet_wait_s"] >= 0.05


def test_a_thread_waiting_for_a_core_counts_as_busy():
    """The quiet wait reads each thread's state, not only its CPU time: on a loaded machine a
    spinning thread can get no core for the whole window (no CPU time used) and is still not
    asleep. A spinning thread counts as runnable, a sleeping one and the caller do not (in a fresh
    process: no other thread pool's threads)."""
    import os
    import subprocess
    import sys
    script = ("import os, threading, time\n"
              "from kernorch.peers import _threads\n"
              "stop = threading.Event()\n"
              "threading.Thread(target=stop.wait).start()\n"
              "deadline = time.monotonic() + 5\n"  # (on a loaded machine a thread can stay queued a while)
              "while _threads(os.getpid())[1] and time.monotonic() < deadline:\n"
              "    time.sleep(0.01)\n"
              "idle = _threads(os.getpid())[1]\n"
              "def spin():\n"
              "    while not stop.is_set():\n"
              "        pass\n"
              "threading.Thread(target=spin).start()\n"
              "time.sleep(0.05)\n"
              "busy = _threads(os.getpid())[1]\n"
              "stop.set()\n"
              "print(idle, busy)\n")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # (no BLAS pool threads)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent, env=env)
    idle, busy = map(int, out.stdout.split())
    assert idle == 0 and busy == 1, out


def test_each_turn_warms_a_system_up_for_a_while_before_timing_it():
    """However short a call, a turn's untimed calls last at least WARMUP_S: a system is timed in
    the state a loop of calls keeps it in, not the one the wait for the others left it in."""
    import time
    from kernorch.peers import WARMUP_S, Timer
    calls = []
    with Timer(1) as t:
        t.add_local("a", lambda: calls.append(time.perf_counter()))
        times = t.rounds(1, block=3, warmup=1)
    assert len(times["a"]) == 3 and len(calls) > 4
    assert calls[-3] - calls[0] >= WARMUP_S


def test_a_turn_of_short_calls_lasts_a_while():
    """`Timer.block_lasting`: as many timed runs per turn as make the fastest system's turn last the
    seconds asked (each system's call timed once), never fewer than the least: 3 calls of 0.7 ms are
    at the mercy of one interruption, 3 of 30 ms are not."""
    from kernorch.ir import KernorchError
    from kernorch.peers import Timer
    once = {"a": 0.001, "b": 0.0005}
    with Timer(1) as t:
        for name in once:
            t.add_local(name, lambda: None)
        t._block = lambda name, runs, warmup: [once[name]] * runs
        assert t.block_lasting(0.02, 3) == 40   # the faster one's 0.5 ms sets it
        once.update(a=0.03, b=0.05)
        assert t.block_lasting(0.02, 3) == 3

        def failing(name, runs, warmup):  # a system that fails is left to `rounds` to report
            if name == "b":
                raise KernorchError("b: crashed")
            return [0.002] * runs
        t._block = failing
        assert t.block_lasting(0.02, 3) == 10


def test_systems_are_compared_round_by_round():
    """Two systems timed in turns while the machine changes pace between rounds: the median of the
    per-round ratios is their true ratio (2), where the ratio of their overall medians is not."""
    pace = [1.0, 1.5, 1.5, 1.0, 1.5]          # the machine's slowdown in each round
    times = {"a": [], "b": []}
    for p in pace:
        times["a"] += [2.0 * p] * 3            # a takes 2 s at the round's pace, b 1 s
        times["b"] += [1.0 * p, 1.0 * p, 9.0]  # one run of b disturbed: the round's median keeps the rest
    assert peers.round_ratios(times, "a", "b", block=3) == [2.0] * 5
    assert peers.round_ratios({"a": [1.0] * 7, "b": [1.0] * 5}, "a", "b", block=3) == [1.0]   # whole rounds only
    assert peers.round_ratios({"a": [1.0] * 3}, "a", "b", block=3) == []
    skewed = {"a": [2.0] * 3 + [3.0] * 6, "b": [1.0] * 6 + [1.5] * 3}   # a's slow rounds were not all b's
    assert float(np.median(skewed["a"]) / np.median(skewed["b"])) == 3.0
    assert peers.round_ratios(skewed, "a", "b", block=3) == [2.0, 3.0, 2.0]


def test_replicas_of_a_system_count_as_their_median_replica_each_round():
    """Each round, a system timed in several processes counts as the replica with the median of
    their medians (one unlucky process outvoted); labels without replicas pass through; a round
    some replica lacks is dropped."""
    times = {"a#0": [1.0, 1.0, 1.1, 5.0, 5.0, 5.0], "a#1": [2.0, 2.0, 2.0, 1.0, 1.0, 1.2],
             "a#2": [9.0, 9.0, 9.0, 3.0, 3.0, 3.0], "b": [1.0] * 6, "c#0": [1.0] * 6, "c#1": [4.0] * 3}
    got = peers.median_replicas(times, block=3)
    assert got["a"] == [2.0, 2.0, 2.0, 3.0, 3.0, 3.0]    # round 1: medians 1, 2, 9; round 2: 5, 1, 3
    assert got["b"] == [1.0] * 6
    assert got["c"] == [1.0] * 3                          # (the lower middle of two; one whole round)
    assert peers.round_ratios(got, "a", "b", block=3) == [2.0, 3.0]


def test_speedups_are_the_medians_of_the_per_round_ratios():
    """bench's speedups compare the systems round by round: kernorch twice as fast as ONNX Runtime
    in the same phase of the machine reads 2.0, though the machine slowed between the rounds and
    once between two turns of a round (round 2: kernorch slow, ONNX Runtime not yet), where the
    ratio of the overall medians reads 1.33."""
    from kernorch import bench as bench_module
    times = {"kernorch": [1.0, 1.0, 1.5, 1.5, 1.5], "ort": [2.0, 2.0, 2.0, 3.0, 3.0]}
    results = {"systems": {"kernorch": {}, "ort": {}}}
    bench_module._summarize(results, times, ["kernorch", "ort"], block=1)
    assert results["systems"]["kernorch"]["speedup_vs_ort"] == 2.0
    assert results["systems"]["kernorch"]["vs_best_peer"] == 2.0 and results["best_peer"] == "ort"
    assert round(float(np.median(times["ort"]) / np.median(times["kernorch"])), 2) == 1.33
