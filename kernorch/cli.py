"""The command line: a thin layer over the Python API.

    kernorch inspect MODEL [--shape N=1x3x224x224] [--json] [--verify]
    kernorch candidates MODEL [--json]
    kernorch plan MODEL [-o plan.json]
    kernorch optimize MODEL -o OUTDIR [--force]
    kernorch run OUTDIR --input x.npy
    kernorch db stats|export|clear [--refused]
    kernorch bench MODEL [--against ort,openvino,tvm,torch] [--threads N] [--rounds N] [--kernels]
    kernorch report OUTDIR
    kernorch demo
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .ir import KernorchError
from .options import Options


def _common(p: argparse.ArgumentParser, model: bool = True) -> None:
    if model:
        p.add_argument("model", help="an ONNX model file")
        p.add_argument("--shape", action="append", default=[], metavar="NAME=D1xD2...|SYM=LO..HI",
                       help="bind an input's symbolic dimensions, e.g. input=1x3x224x224; or let a symbolic "
                            "dimension range over LO..HI, e.g. seq=1..512 (one executable for every length; "
                            "repeat it for several: --shape batch=1..8 --shape seq=1..512)")
        p.add_argument("--no-rewrites", action="store_true",
                       help="keep the model's arithmetic as exported (no algebraic rewrites before fission)")
    p.add_argument("--threads", type=int, default=None, help="threads for kernorch's kernels and for every peer")
    p.add_argument("--db", default=None, help="profile database (default: in the user's cache directory)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kernorch", description="Optimal kernel orchestration for ONNX models")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="operator counts before/after fission, primitive kinds")
    _common(p)
    p.add_argument("--verify", action="store_true", help="run the fissioned graph and compare with ONNX Runtime")
    p = sub.add_parser("candidates", help="partition, enumerate and measure candidate kernels")
    _common(p)
    _tuning_args(p)
    p = sub.add_parser("plan", help="everything up to the optimal plan")
    _common(p)
    _tuning_args(p)
    p.add_argument("-o", "--output", help="write the plan as JSON")
    p = sub.add_parser("optimize", help="the whole pipeline: a verified, timed, saved executable")
    _common(p)
    _tuning_args(p)
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.add_argument("--force", action="store_true", help="overwrite an existing output directory")
    p.add_argument("--runs", type=int, default=20, help="timed runs for the end-to-end comparison")
    p = sub.add_parser("run", help="run a saved model")
    _common(p, model=False)
    p.add_argument("outdir")
    p.add_argument("--input", action="append", default=[], metavar="[NAME=]FILE.npy")
    p.add_argument("--output", help="write outputs to this .npz")
    p = sub.add_parser("db", help="the profile database")
    _common(p, model=False)
    p.add_argument("action", choices=["stats", "export", "clear"])
    p.add_argument("--refused", action="store_true", help="clear: only the refusals (to retry them after a fix)")
    p = sub.add_parser("bench", help="time kernorch against ONNX Runtime, OpenVINO, TVM, PyTorch, each in its own "
                                     "process; --kernels: each contraction kernel against ONNX Runtime's")
    _common(p)
    _tuning_args(p)
    p.add_argument("--against", default="ort,ort-basic,openvino,tvm,torch", help="peers, comma-separated")
    p.add_argument("--rounds", type=int, default=10, help="turns per system (3 timed runs each)")
    p.add_argument("--kernels", action="store_true",
                   help="benchmark every distinct contraction of the model against ONNX Runtime's one-node operator")
    p.add_argument("--kernel-threads", default="1,2", help="thread counts for --kernels")
    p.add_argument("--budget-trials", type=int, default=0, help="MetaSchedule trials for the TVM peer")
    p.add_argument("-o", "--output", help="kernorch model dir (loaded if saved there, else saved there)")
    p = sub.add_parser("report", help="write OUTDIR/report.html")
    _common(p, model=False)
    p.add_argument("outdir")
    p = sub.add_parser("demo", help="optimize a bundled example model and compare it with the best peer")
    _common(p, model=False)
    _tuning_args(p)
    p.add_argument("--example", default="transformer_block")
    p.add_argument("--rounds", type=int, default=7, help="turns per system (3 timed runs each)")
    return ap


def _tuning_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-kernel-size", type=int, default=None, help="primitives per candidate kernel")
    p.add_argument("--max-pointwise", type=int, default=None,
                   help="elementwise primitives a candidate may hold beyond --max-kernel-size when they compute "
                        "only from its own values and weights (a GELU after a GEMM)")
    p.add_argument("--max-candidates", type=int, default=None, help="candidates per partition")
    p.add_argument("--max-partition", type=int, default=None, help="primitives per partition")
    p.add_argument("--measure-all", action="store_true",
                   help="time every fused candidate up front, instead of only those the solver wants on an "
                        "optimistic estimate (slower; the plan is the same unless an estimate was too high)")
    p.add_argument("--lengths", default=None, metavar="FILE",
                   help="observed values of the --shape range's dimension (integers in a text file): the range is "
                        "timed at their percentiles evenly spaced from the 10th to the 90th (--samples of them) "
                        "instead of its ends and the lengths between")
    p.add_argument("--buckets", default=None, metavar="E1,E2|samples|one",
                   help="cut the --shape range after these lengths (8,64 over 1..512: 1..8, 9..64, 65..512); each "
                        "bucket gets its own plan and the executable dispatches on the length at run time; "
                        "'samples': a plan per length the range is timed at (1, 8, 64, 512), each refined there from "
                        "the kernels measured over the range, each serving the lengths nearest it; 'one': one plan "
                        "for the whole range (by default a length the range is timed at gets its own plan, among "
                        "the kernels measured, where that is predicted at least 3 %% faster there)")
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help="time every kernel over the --shape range at N lengths, its ends and N - 2 between them "
                        "evenly spaced on a log scale (default 4: 1, 8, 64, 512 over 1..512; 3: 1, 23, 512); "
                        "more follow the range more closely and take longer to measure; with several symbols N each "
                        "(default 3), every combination timed")
    p.add_argument("--cost-model", choices=("learned", "analytic"), default=None,
                   help="what an unmeasured fusion is estimated at: the analytic bound raised by the shipped "
                        "learned model where it is confident the fusion loses (learned, default), or the bound alone")
    p.add_argument("--allow-python-kernels", action="store_true",
                   help="let operators without a compiled kernel (TopK, NonZero, ...) run through onnx's "
                        "reference evaluator as Python callbacks inside the executable (slow; off by default)")
    p.add_argument("--remeasure", action="store_true",
                   help="time every kernel again (until it has 3 measurements); the fastest counts, so "
                        "timings disturbed by other work on the machine are replaced; over a range, the "
                        "executables compared in turns are timed again too (the new timing is kept)")
    p.add_argument("--time-limit", type=float, default=None, help="solver time limit (s)")
    p.add_argument("--budget", default=None, metavar="200t|20m",
                   help="MetaSchedule tuning budget for the kernels that can change the plan: trials (200t) "
                        "or time (20m, 90s); a level, so a re-run with the same budget tunes nothing new")
    p.add_argument("--tune-dir", default=None, help="tuning databases (default: in the user's cache directory)")


def options_from(args) -> Options:
    from .frontend.onnx import parse_shape
    o = Options()
    kw = {}
    if getattr(args, "shape", None):
        from .dynamic import parse_range
        ranges = [parse_range(s) for s in args.shape if ".." in s]   # seq=1..512: a symbolic dimension
        kw["shapes"] = tuple(parse_shape(s) for s in args.shape if ".." not in s)
        kw["ranges"] = tuple((r.name, r.lo, r.hi) for r in ranges)
        if ranges and getattr(args, "budget", None):
            raise KernorchError("--budget (MetaSchedule tuning) needs static shapes; it cannot tune over "
                                f"{ranges[0].name}={ranges[0].lo}..{ranges[0].hi} yet")
    if getattr(args, "lengths", None):
        if not kw.get("ranges"):
            raise KernorchError("--lengths weighs a range: give one with --shape NAME=LO..HI")
        from .dynamic import parse_lengths
        kw["lengths"] = parse_lengths(args.lengths)
    if getattr(args, "samples", None) is not None:
        if not kw.get("ranges"):
            raise KernorchError("--samples times a range: give one with --shape NAME=LO..HI")
        from .dynamic import points
        points(kw["ranges"], kw.get("lengths", ()), args.samples)  # refuses a count below 3 now
        kw["samples"] = args.samples
    if getattr(args, "buckets", None):
        if not kw.get("ranges"):
            raise KernorchError("--buckets cuts a range: give one with --shape NAME=LO..HI")
        from .dynamic import buckets
        if len(kw["ranges"]) > 1 and args.buckets.strip() not in ("samples", "one"):
            raise KernorchError(f"--buckets cuts the range of one symbol; {len(kw['ranges'])} vary "
                                f"({', '.join(n for n, _, _ in kw['ranges'])}): give `samples` (a plan per "
                                "sample, one symbol dispatching) or `one`")
        if args.buckets.strip() == "samples":
            kw["sample_plans"] = True
        elif args.buckets.strip() == "one":
            kw["sample_gain"] = 0.0
        else:
            try:
                kw["bucket_edges"] = tuple(int(v) for v in args.buckets.split(",") if v.strip())
            except ValueError:
                raise KernorchError(f"--buckets {args.buckets!r}: expected lengths separated by commas, e.g. 8,64, "
                                    "or 'samples' or 'one'") from None
            buckets(kw["ranges"][0], kw["bucket_edges"])  # refuses bad edges now, with the range named
    if args.threads:
        kw["threads"] = args.threads
    if args.db:
        kw["db_path"] = args.db
    for name in ("max_kernel_size", "max_candidates", "max_partition"):
        v = getattr(args, name, None)
        if v:
            kw[name] = v
    if getattr(args, "max_pointwise", None) is not None:
        if args.max_pointwise < 0:
            raise KernorchError(f"--max-pointwise {args.max_pointwise}: expected 0 or more")
        kw["max_pointwise"] = args.max_pointwise
    if getattr(args, "allow_python_kernels", False):
        kw["python_kernels"] = True
    if getattr(args, "no_rewrites", False):
        kw["rewrites"] = False
    if getattr(args, "measure_all", False):
        kw["prune"] = False
    if getattr(args, "cost_model", None):
        kw["cost_model"] = args.cost_model
    if getattr(args, "remeasure", False):
        kw["remeasure"] = True
    if getattr(args, "time_limit", None):
        kw["solver_time_limit"] = args.time_limit
    if getattr(args, "budget", None):
        from .tune import parse_budget
        parse_budget(args.budget)  # a bad budget fails before any work
        kw["budget"] = args.budget
    if getattr(args, "tune_dir", None):
        kw["tune_dir"] = args.tune_dir
    return o.with_(**kw)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a `kill`, a job scheduler's stop): unwound as Ctrl-C is, so the run's temporary
    build directory is removed and its workers are closed (killed outright, a run left its
    directory of built kernels in the temporary directory: 4375 of them once)."""


def _terminate(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    installed = threading.current_thread() is threading.main_thread()  # (signals are for the main thread only)
    previous = signal.signal(signal.SIGTERM, _terminate) if installed else None
    try:
        from . import commands
        return getattr(commands, f"cmd_{args.cmd}")(args, options_from(args))
    except KernorchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        term = isinstance(e, Terminated)
        print(f"{'terminated' if term else 'interrupted'}: measurements so far are kept in the profile database",
              file=sys.stderr)
        return 128 + (signal.SIGTERM if term else signal.SIGINT)
    except Exception as e:  # never a bare traceback from deep inside a dependency
        if getattr(args, "debug", False):
            raise
        print(f"internal error: {type(e).__name__}: {e}\n(rerun with --debug for the traceback)", file=sys.stderr)
        return 3
    finally:
        if installed:  # (None: the previous handler was not set from Python, the default one)
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
