"""What a kernel boundary costs inside kernorch's executable.

    .venv/bin/python benchmarks/boundary.py [--threads 2] [--n 51] [--size 4096]

A chain of N small parallel kernels (x*1.0001+0.5 on `size` floats each) and a chain of one are
emitted by kernorch's own emitter and timed end to end (median of 7 repeats of 200 calls, from
Python, as `CompiledModel` calls them). The cost of a kernel boundary is (t_N - t_1) / (N - 1):
the VM's call, TVM's thread pool handing the parallel loop to its workers and back, and the
kernel's own pass over 2 x `size` x 4 bytes (in L1). Each configuration runs in a fresh process
with the thread count set when it starts; kernorch sets no environment variable at import, so TVM's
pool spins between kernels as TVM intends.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _time(n: int, size: int, threads: int) -> dict:
    import numpy as np
    from kernorch.backends.tvm import relax as rx
    from kernorch.ir import Graph, TensorType, make_prim
    from kernorch.plan import Kernel, Plan, SolverStats
    t = TensorType((size,))
    prims, prev = [], "x"
    for i in range(n):
        m, a = f"m{i}", f"a{i}"
        prims += [make_prim(m, "mul", [prev, "c"], t), make_prim(a, "add", [m, "d"], t)]
        prev = a
    consts = {"c": np.full((1,), 1.0001, np.float32), "d": np.full((1,), 0.5, np.float32)}
    g = Graph((("x", t),), (prev,), tuple(prims), consts)
    groups = [[prims[2 * i].name, prims[2 * i + 1].name] for i in range(n)]
    kernels = []
    for i, members in enumerate(groups):
        ins = tuple(dict.fromkeys(x for m in members for x in g.by_name[m].inputs if x not in members))
        kernels.append(Kernel(f"k{i}", f"key{i}", "tvm", tuple(members), ins, (members[-1],), 0, (), "default"))
    plan = Plan(tuple(kernels), (), (prev,), SolverStats("optimal", 0, 0, 0.0, 0.0, 0))
    ex = rx.build_executable(g, plan, threads)
    call = ex.bind({"x": np.random.default_rng(0).standard_normal(size).astype(np.float32)})
    for _ in range(100):
        call()
    reps = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(200):
            call()
        reps.append((time.perf_counter() - t0) / 200)
    return {"kernels": len(kernels), "us": float(np.median(reps)) * 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=51)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from kernorch.backends.tvm import thread_env
    from kernorch.workers import WorkerPool
    # the worker imports the timing function by its module's name: run as a script, that is not "__main__"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from boundary import _time as timed
    res = {}
    for n in (1, args.n):
        with WorkerPool(1, thread_env(args.threads)) as pool:
            r = pool.call(timed, (n, args.size, args.threads), 600)
        if not r.ok:
            raise SystemExit(r.error)
        res[f"{n} kernels"] = r.value
    one, many = res["1 kernels"]["us"], res[f"{args.n} kernels"]["us"]
    out = {"threads": args.threads, "chain": args.n, "floats": args.size, "results": res,
           "per_boundary_us": (many - one) / (args.n - 1)}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"chain of {args.n} kernels: {many:.1f} us; chain of one: {one:.1f} us; "
              f"per kernel boundary: {out['per_boundary_us']:.2f} us ({args.threads} threads, {args.size} floats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
