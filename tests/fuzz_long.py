"""The long fuzz run: random graphs (tests/fuzzgraphs.py) one seed after another, each optimized
and compared with ONNX Runtime, going on after a failure; prints and writes the figures.

    .venv/bin/python tests/fuzz_long.py --minutes 60 --log fuzz.jsonl

A failing seed is reproduced with `check(seed, ...)` or `random_model(seed)`; a fixed mismatch
becomes a regression test (see tests/test_pipeline.py).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fuzzgraphs import Discard, check, fuzz_options  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start", type=int, default=10_000, help="first seed")
    ap.add_argument("--count", type=int, default=3000, help="seeds to try at most")
    ap.add_argument("--minutes", type=float, default=60.0, help="stop starting new graphs after this")
    ap.add_argument("--log", default="fuzz.jsonl", help="one JSON line per graph")
    args = ap.parse_args(argv)
    options = fuzz_options(str(Path(tempfile.mkdtemp(prefix="kernorch-fuzz-")) / "db.sqlite"))
    counts, ops, failures = collections.Counter(), collections.Counter(), []
    t0 = time.time()
    with open(args.log, "a") as log:
        for seed in range(args.start, args.start + args.count):
            if time.time() - t0 > args.minutes * 60:
                break
            try:
                entry = check(seed, options)
                ops.update(entry["ops"])
                counts["ok"] += 1
            except Discard as d:
                entry = {"seed": seed, "outcome": str(d)}
                counts["discarded"] += 1
            except Exception as e:  # noqa: BLE001 - a mismatch or an error: recorded, the run goes on
                entry = {"seed": seed, "outcome": "mismatch or error", "error": f"{type(e).__name__}: {e}"[:500]}
                counts["failed"] += 1
                failures.append(seed)
            log.write(json.dumps(entry) + "\n")
            log.flush()
            done = sum(counts.values())
            print(f"\r{done} graphs, {counts['ok']} ok, {counts['discarded']} discarded, {counts['failed']} failed, "
                  f"{time.time() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    summary = {"graphs": sum(counts.values()), **counts, "failed_seeds": failures, "seconds": round(time.time() - t0),
               "ops": dict(ops.most_common())}
    print(json.dumps(summary, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
