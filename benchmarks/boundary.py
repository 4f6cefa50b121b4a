"""What a kernel boundary costs inside kernorch's executable.

    .venv/bin/python benchmarks/boundary.py [--threads 2] [--n 51] [--size 4096]

A chain of N small kernels (x*1.0001+0.5 on `size` floats each; kernorch.calibrate.chain_model) and
a chain of one are emitted by kernorch's own emitter and timed end to end (median of 7 repeats of
at least 2 ms each, from Python, as `CompiledModel` calls them). The cost of a kernel boundary here
is (t_N - t_1) / (N - 1): the VM's call, the thread pool when the kernel is parallel (at 4096
floats the default rules keep it serial), and the kernel's own pass over 2 x `size` x 4 bytes (in
L1). The calibration (kernorch.calibrate.measure_boundary) subtracts that pass, timed alone as the
profile database times kernels, and the orchestration program adds the rest to every kernel. Each
configuration runs in a fresh process with the thread count set when it starts; kernorch sets no
environment variable at import, so TVM's pool spins between kernels as TVM intends.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _time(n: int, size: int, threads: int) -> dict:
    from kernorch.calibrate import time_chain
    return {"kernels": n, "us": time_chain(n, size, threads) * 1e6}


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
