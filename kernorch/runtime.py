"""CompiledModel: run, time, profile, save and load an optimized model.

The saved directory executes nothing but the compiled library:

    model.so        the Relax VM executable (every kernel compiled; Python kernels only if allowed)
    weights.npz     the weights as the executable takes them (packed layouts included), numpy
                    arrays loaded with allow_pickle=False
    graph.json      the primitive graph without weights (inputs, outputs, prims) and
    plan.json       the plan (kernels, schedules, costs)
    manifest.json   format version, kernorch version, tool versions, the target (CPU, ISA, threads),
                    the weights' names and layouts, and a SHA-256 of every file above
    report.json     what `optimize` measured (the report reads it; loading does not need it)

Loading checks the format version, the files' hashes (a changed weight or library is refused),
unknown files, and that this CPU has every ISA extension the library was compiled for.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping

import numpy as np

from . import __version__
from .dynamic import bucket_of, dispatch_symbol, plan_buckets, plan_ranges
from .ir import Graph, KernorchError, SymDim
from .options import Machine
from .plan import Plan

log = logging.getLogger(__name__)

FORMAT = 3
MANIFEST = "manifest.json"
HASHED = ("model.so", "weights.npz", "graph.json", "plan.json")
KNOWN = set(HASHED) | {MANIFEST, "report.json", "report.html", "bench.json"}


def _partial(d, binding: Mapping[str, int]):
    """A dimension with the symbols bound so far replaced by their values."""
    return d.partial(binding) if isinstance(d, SymDim) else d


class CompiledModel:
    """An optimized model: `run(inputs) -> outputs` like an ONNX Runtime session."""

    def __init__(self, graph: Graph, plan: Plan, executable, threads: int, machine: Machine,
                 report: dict | None = None):
        self.graph, self.plan, self.executable, self.threads = graph, plan, executable, threads
        self.machine = machine
        self.report = dict(report or {})
        self.input_names = [n for n, _ in graph.inputs]
        self.ranges = plan_ranges(plan.meta)  # the symbolic dimensions it serves: {"seq": (1, 512)}
        self.output_names = list(graph.outputs)

    # -- inputs --------------------------------------------------------------------------------
    def check_feeds(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Validate names, shapes and dtypes; a clear error naming the input otherwise."""
        return self._checked(inputs)[0]

    def plan_for(self, inputs: Mapping[str, np.ndarray]) -> Plan:
        """The kernels that run on `inputs`: with buckets, the plan of the bucket their length falls
        in (what the executable dispatches to); otherwise the whole plan."""
        buckets = plan_buckets(self.plan.meta)
        if not buckets:
            return self.plan
        value = self._checked(inputs)[1][dispatch_symbol(self.plan.meta)]
        return self.plan.bucket(bucket_of(buckets, value))

    def _checked(self, inputs: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        if not isinstance(inputs, Mapping):
            raise KernorchError(f"inputs must be a mapping of input name to array; the model takes {self.input_names}")
        unknown = sorted(set(inputs) - set(self.input_names))
        if unknown:
            raise KernorchError(f"unknown inputs {unknown}; the model takes {self.input_names}")
        feeds = {}
        binding: dict[str, int] = {}
        for n, t in self.graph.inputs:
            if n not in inputs:
                raise KernorchError(f"missing input {n!r} ({t})")
            x = inputs[n]
            if not isinstance(x, np.ndarray):
                x = np.asarray(x)
            want = self._shape(n, t, x.shape, binding)
            if x.shape != want:
                raise KernorchError(f"input {n!r} has shape {x.shape}, the model was optimized for {want}")
            if x.dtype != np.dtype(t.dtype):
                if not np.can_cast(x.dtype, t.dtype, casting="same_kind"):
                    raise KernorchError(f"input {n!r} has dtype {x.dtype}, the model takes {t.dtype}")
                x = x.astype(t.dtype)
            feeds[n] = x
        return feeds, binding

    def sample_graphs(self) -> list[Graph]:
        """The graph at the lengths a range is checked at (its ends and geometric middle, the
        middle first, then the lengths between those (`dynamic.probe_points`: seq=1..512 at 5 and
        109, and 2); with buckets, also each bucket's ends and middle); a static model's graph
        alone. (Checked at its ends and middle only, batch=1..6 ran right at 1, 2 and 6 and wrong at
        3 and 5.)"""
        if not self.ranges:
            return [self.graph]
        from .dynamic import bind, middle, points, probe_points
        rngs = tuple((n, lo, hi) for n, (lo, hi) in self.ranges.items())
        if len(rngs) > 1:  # several symbols: every combination of their ends and middles
            at = [middle(rngs), *points(rngs, count=3)]
        else:
            first, mid, last = points(rngs, count=3)
            at = [mid, first, last, *probe_points(rngs, count=3)]
        name = dispatch_symbol(self.plan.meta)  # (with buckets: the others at their middles)
        at += [{**middle(rngs), **b} for blo, bhi in plan_buckets(self.plan.meta)
               for b in points(((name, blo, bhi),), count=3)]
        return [bind(self.graph, b) for b in {tuple(sorted(b.items())): b for b in at}.values()]

    @property
    def example_graph(self) -> Graph:
        """The graph at one representative length (the middle of a range): what timing uses."""
        return self.sample_graphs()[0]

    def _shape(self, name: str, t, shape: tuple[int, ...], binding: dict[str, int]) -> tuple:
        """The shape input `name` must have; a symbolic dimension takes its value from the first
        input that has it, within its range (the same value in every input)."""
        if t.static:
            return tuple(t.shape)
        if len(shape) != len(t.shape):
            return tuple(str(d) for d in t.shape)
        out: list = [None] * len(shape)
        todo = list(range(len(shape)))
        while todo:  # a dimension over one symbol not yet bound first (batch*seq after batch and seq)
            ready = [i for i in todo if not isinstance(d := _partial(t.shape[i], binding), SymDim) or len(d.names) == 1]
            if not ready:
                d = _partial(t.shape[todo[0]], binding)
                raise KernorchError(f"input {name!r} has shape {shape}: its dimension {d} does not tell "
                                    f"{' and '.join(d.names)} apart (give an input with each on its own axis first)")
            for i in ready:
                d, got = _partial(t.shape[i], binding), shape[i]
                if isinstance(d, SymDim):
                    lo, hi = self.ranges[d.name]
                    value = d.solve(got, lo, hi)
                    if value is None:
                        raise KernorchError(f"input {name!r} has shape {shape}: {d.name} must be in {lo}..{hi} "
                                            f"(this executable serves {d.name}={lo}..{hi}; dimension {d} is {got})")
                    binding[d.name] = value
                    d = d(value)
                out[i] = d
            todo = [i for i in todo if i not in ready]
        return tuple(out)

    # -- running -------------------------------------------------------------------------------
    def run(self, inputs: Mapping[str, np.ndarray], check_finite: bool = True) -> dict[str, np.ndarray]:
        """Outputs by name. `check_finite`: refuse inputs holding NaN or Inf (the kernels were
        verified on finite values; some, like a maximum, do not propagate NaN as ONNX Runtime does)."""
        feeds = self.check_feeds(inputs)
        if check_finite:
            for n, x in feeds.items():
                if x.dtype.kind == "f" and not np.isfinite(x).all():
                    bad = np.argwhere(~np.isfinite(x))
                    raise KernorchError(f"input {n!r} holds {len(bad)} NaN/Inf value(s) (first at "
                                        f"{tuple(int(i) for i in bad[0])}); pass check_finite=False to run it anyway")
        return self.executable.run(feeds)

    def bind(self, inputs: Mapping[str, np.ndarray]):
        """A call without arguments that runs the model on `inputs` (validated and converted once)."""
        return self.executable.bind(self.check_feeds(inputs))

    def time(self, inputs: Mapping[str, np.ndarray], runs: int = 10, warmup: int = 2) -> list[float]:
        """Seconds per end-to-end call (inputs already on the device), one value per run."""
        return self.executable.time(self.check_feeds(inputs), runs, warmup)

    def profile(self, inputs: Mapping[str, np.ndarray], runs: int = 3) -> list[dict]:
        """Per-call latency inside the executable: [{"call", "kernel" (plan index or None), "ms"}]."""
        return self.executable.profile(self.check_feeds(inputs), runs)

    # -- persistence ---------------------------------------------------------------------------
    def save(self, outdir: str | Path, force: bool = False) -> Path:
        out = Path(outdir)
        if check_writable(out, force):
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        ex = self.executable
        ex.export(out / "model.so")
        np.savez(out / "weights.npz", **{f"w{i}": a for i, a in enumerate(ex.weight_arrays)})
        self.plan.save(out / "plan.json")
        (out / "graph.json").write_text(json.dumps(replace(self.graph, constants={}).to_json()))
        manifest = {
            "format": FORMAT, "kernorch": __version__, "versions": _tool_versions(),
            "target": self.machine.fingerprint(self.threads), "machine": self.machine.to_json(),
            "threads": self.threads, "weights": [list(w) for w in ex.weight_names],
            "inputs": {n: t.to_json() for n, t in self.graph.inputs}, "outputs": self.output_names,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "sha256": {f: _sha256(out / f) for f in HASHED},
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
        (out / "report.json").write_text(json.dumps(self.report, indent=2, default=str))
        return out


def check_writable(out: Path, force: bool) -> bool:
    """May a model be saved to `out`? True when an earlier kernorch output must be removed first.
    A non-empty directory needs `force`, and even then only a kernorch output is overwritten."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    if not out.is_dir():
        raise KernorchError(f"{out} is a file, not a directory")
    if not force:
        raise KernorchError(f"{out} exists and is not empty; pass --force (force=True) to overwrite it")
    if not (out / MANIFEST).exists():
        raise KernorchError(f"{out} is not a kernorch output (no {MANIFEST}); refusing to overwrite it")
    extra = sorted(p.name for p in out.iterdir() if p.name not in KNOWN)
    if extra:
        raise KernorchError(f"{out} holds files kernorch did not write ({', '.join(extra[:5])}); "
                            "refusing to overwrite it")
    return True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tool_versions() -> dict[str, str]:
    import importlib.metadata as md
    return {p: md.version(p) for p in ("apache-tvm", "apache-tvm-ffi", "numpy")}


def read_manifest(d: Path) -> dict:
    mf = d / MANIFEST
    if not mf.exists():
        raise KernorchError(f"{d}: not a saved kernorch model (no {MANIFEST})")
    try:
        manifest = json.loads(mf.read_text())
    except ValueError as e:
        raise KernorchError(f"{d}: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise KernorchError(f"{d}: saved in format {manifest.get('format') if isinstance(manifest, dict) else '?'} "
                            f"(kernorch {manifest.get('kernorch') if isinstance(manifest, dict) else '?'}); this "
                            f"kernorch ({__version__}) reads format {FORMAT}: optimize the model again")
    return manifest


def check_integrity(d: Path, manifest: dict) -> None:
    """Every hashed file present and unchanged, and no file kernorch does not know."""
    sums = manifest.get("sha256") or {}
    for f in HASHED:
        p = d / f
        if not p.exists():
            raise KernorchError(f"{d}: {f} is missing")
        if sums.get(f) != _sha256(p):
            raise KernorchError(f"{d}: {f} does not match the hash in {MANIFEST} (changed after saving); "
                                "optimize the model again")
    extra = sorted(p.name for p in d.iterdir() if p.name not in KNOWN)
    if extra:
        raise KernorchError(f"{d}: unknown files {', '.join(extra[:5])} beside the saved model; remove them")


def check_machine(d: Path, manifest: dict, machine: Machine) -> None:
    """The library runs only where every ISA extension it was compiled for exists."""
    saved = Machine.from_json(manifest["machine"])
    missing = sorted(set(saved.isa) - set(machine.isa))
    if missing:
        raise KernorchError(f"{d}: compiled for {saved.name} with {', '.join(missing[:6])}, which this CPU "
                            f"({machine.name}) lacks; optimize the model on this machine")
    if saved.name != machine.name or saved.cores != machine.cores:
        log.warning("%s was optimized on %s (%d cores); this is %s (%d cores): it runs, but its kernels were "
                    "measured elsewhere", d, saved.name, saved.cores, machine.name, machine.cores)


def load(outdir: str | Path, threads: int | None = None) -> CompiledModel:
    """Load a model saved by `CompiledModel.save` (in a fresh process, without re-optimizing)."""
    from .backends.tvm import relax as rx
    d = Path(outdir)
    manifest = read_manifest(d)
    if manifest.get("versions") != _tool_versions():
        raise KernorchError(f"{d}: built with {manifest.get('versions')}, this environment has {_tool_versions()}")
    check_integrity(d, manifest)
    machine = Machine.host()
    check_machine(d, manifest, machine)
    try:
        graph = Graph.from_json(json.loads((d / "graph.json").read_text()))
        plan = Plan.load(d / "plan.json")
        with np.load(d / "weights.npz", allow_pickle=False) as w:
            arrays = [w[f"w{i}"] for i in range(len(manifest["weights"]))]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise KernorchError(f"{d}: cannot read the saved model: {type(e).__name__}: {e}") from None
    names = [tuple(x) for x in manifest["weights"]]
    n = int(threads or manifest["threads"])
    ex = rx.load_executable(d / "model.so", names, arrays, graph, plan, n)
    report = json.loads((d / "report.json").read_text()) if (d / "report.json").exists() else {}
    return CompiledModel(graph, plan, ex, n, Machine.from_json(manifest["machine"]), report)
