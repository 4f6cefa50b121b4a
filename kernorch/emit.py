"""Plan → one deployable module → CompiledModel.

The emitted program is a Relax `main` that calls each chosen kernel in plan order: generated
kernels as `call_tir` of their scheduled PrimFuncs, library kernels as `call_dps_packed` of a
registered function. Weights are parameters (kept by the CompiledModel, saved as .npz);
intermediate buffers are planned by Relax's static memory planner (reused by lifetime).
"""
from __future__ import annotations

import json
import logging
import pickle
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from . import __version__
from .ir import Graph, KernorchError
from .options import Machine
from .plan import Plan

log = logging.getLogger(__name__)

FORMAT = 2


def _lib_name(i: int, impl: str, key: str) -> str:
    return f"kernorch.lib.k{i}_{impl}_{key}"  # one registered function per packed kernel of the plan


def _call_name(i: int, k) -> str:
    """The symbol the Relax VM calls for plan kernel `i`: a registered packed function or a PrimFunc."""
    from .backends import PACKED
    return _lib_name(i, k.impl, k.key) if k.impl in PACKED else f"k{i}"


def _kernel_graph(graph: Graph, k) -> Graph:
    from .measure import kernel_graph
    return kernel_graph(graph, k.members, k.inputs, k.outputs)


def register_library_kernels(graph: Graph, plan: Plan) -> dict[str, object]:
    """Make and register every library kernel of the plan (needed again in a loading process)."""
    from .backends import PACKED, packed_kernel
    from .backends import tvm as tb
    made = {}
    for i, k in enumerate(plan.kernels):
        if k.impl not in PACKED:
            continue
        kg = _kernel_graph(graph, k)
        lk = packed_kernel(k.impl, kg, kg.prims, k.inputs, k.outputs)
        name = _lib_name(i, k.impl, k.key)
        tb.register_packed(lk.run_dps, name)
        made[name] = lk
    return made


def weight_names(graph: Graph, plan: Plan) -> list[str]:
    seen: dict[str, None] = {}
    for k in plan.kernels:
        for t in k.inputs:
            if t in graph.constants:
                seen.setdefault(t)
    return list(seen)


def kernel_module(graph: Graph, plan: Plan, k, target):
    """The scheduled PrimFunc module of one generated kernel of the plan, as it was measured."""
    from .backends import tvm as tb
    if k.impl == "tvm-tuned":  # the best MetaSchedule record (kernorch.tune)
        from .tune import tuned_module
        return tuned_module(graph, k, target, plan.meta.get("tune_dir"))
    kg = _kernel_graph(graph, k)
    return tb.schedule(tb.lower(kg, kg.prims, k.inputs, k.outputs), target, "default")


def build_module(graph: Graph, plan: Plan, threads: int):
    """The Relax IRModule of the plan, compiled for this CPU."""
    import tvm
    from tvm import relax
    from .backends import PACKED
    from .backends import tvm as tb

    target = tb.make_target(threads)
    bb = relax.BlockBuilder()
    inputs = [relax.Var(n, relax.TensorType([int(d) for d in t.shape], t.dtype)) for n, t in graph.inputs]
    wnames = weight_names(graph, plan)
    weights = [relax.Var(f"w_{i}", relax.TensorType(list(graph.constants[w].shape), str(graph.constants[w].dtype)))
               for i, w in enumerate(wnames)]
    env = {n: v for (n, _), v in zip(graph.inputs, inputs)}
    env.update(dict(zip(wnames, weights)))

    def tty(t: str):
        ty = graph.type_of(t)
        return relax.TensorType([int(d) for d in ty.shape], ty.dtype)

    with bb.function("main", inputs + weights):
        with bb.dataflow():
            for i, k in enumerate(plan.kernels):
                args = relax.Tuple([env[t] for t in k.inputs])
                out_ty = [tty(t) for t in k.outputs]
                name = _call_name(i, k)
                if k.impl in PACKED:
                    call = relax.call_dps_packed(name, args, out_ty if len(out_ty) > 1 else out_ty[0])
                else:
                    mod = kernel_module(graph, plan, k, target)
                    tb.check_bounds(mod)
                    gv = bb.add_func(tb.relax_func(mod, name), name)
                    call = relax.call_tir(gv, args, out_ty if len(out_ty) > 1 else out_ty[0])
                res = bb.emit(call)
                if len(k.outputs) == 1:
                    env[k.outputs[0]] = res
                else:
                    for j, t in enumerate(k.outputs):
                        env[t] = bb.emit(relax.TupleGetItem(res, j))
            missing = [o for o in graph.outputs if o not in env]
            if missing:
                raise KernorchError(f"the plan does not produce graph outputs {missing}")
            out = bb.emit_output(relax.Tuple([env[o] for o in graph.outputs]))
        bb.emit_func_output(out)
    mod = bb.get()
    ex = tvm.compile(mod, target=target)
    return ex, wnames


class CompiledModel:
    """An optimized model: `run(inputs) -> outputs` like an ONNX Runtime session."""

    def __init__(self, graph: Graph, plan: Plan, executable, weight_names: Sequence[str], threads: int,
                 machine: Machine | None = None, report: dict | None = None):
        import tvm
        from tvm import relax
        from .backends import tvm as tb
        tb.set_threads(threads)
        self.graph, self.plan, self.executable, self.threads = graph, plan, executable, threads
        self.machine = machine or Machine.host()
        self.report = dict(report or {})
        self._libs = register_library_kernels(graph, plan)
        self.dev = tvm.cpu()
        self.vm = relax.VirtualMachine(executable, self.dev)
        self.weight_names = list(weight_names)
        self._weights = [tvm.runtime.tensor(np.asarray(graph.constants[w], order="C"), self.dev) for w in weight_names]
        self.input_names = [n for n, _ in graph.inputs]
        self.output_names = list(graph.outputs)

    def _args(self, inputs: Mapping[str, np.ndarray]):
        import tvm
        unknown = set(inputs) - set(self.input_names)
        if unknown:
            raise KernorchError(f"unknown inputs {sorted(unknown)}; the model takes {self.input_names}")
        args = []
        for n, t in self.graph.inputs:
            if n not in inputs:
                raise KernorchError(f"missing input {n!r} ({t})")
            x = np.asarray(inputs[n])
            want = tuple(int(d) for d in t.shape)
            if x.shape != want:
                raise KernorchError(f"input {n!r} has shape {x.shape}, the model was optimized for {want}")
            args.append(tvm.runtime.tensor(np.asarray(x, dtype=t.dtype, order="C"), self.dev))
        return args + self._weights

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        res = self.vm["main"](*self._args(inputs))
        return {n: res[i].numpy() for i, n in enumerate(self.output_names)}

    def time(self, inputs: Mapping[str, np.ndarray], runs: int = 10, warmup: int = 2) -> list[float]:
        """Seconds per end-to-end call (inputs already on the device), one value per run."""
        args = self._args(inputs)
        f = self.vm["main"]
        for _ in range(warmup):
            f(*args)
        out = []
        for _ in range(runs):
            t0 = time.perf_counter()
            f(*args)
            out.append(time.perf_counter() - t0)
        return out

    def profile(self, inputs: Mapping[str, np.ndarray], runs: int = 3) -> list[dict]:
        """Per-call latency inside the real executable (VM instrumentation), median over `runs`.

        Each entry: the called symbol, the plan kernel's index (None for VM builtins), the median ms.
        Compared with each kernel's isolated measurement this shows where the end-to-end time goes
        that the additive cost model does not see (cold caches, thread-pool wake-ups, VM calls).
        """
        import time as _t
        import tvm_ffi
        times: dict[str, list[float]] = {}
        order: list[str] = []
        state = {"t": 0.0, "i": 0}

        def instrument(func, symbol, before, ret, *args):
            if before:
                state["t"] = _t.perf_counter()
            else:
                key = f"{state['i']}:{symbol}"
                state["i"] += 1
                if key not in times:
                    times[key] = []
                    order.append(key)
                times[key].append(_t.perf_counter() - state["t"])
            return 0

        from tvm import relax
        vm = relax.VirtualMachine(self.executable, self.dev)
        vm.set_instrument(tvm_ffi.convert(instrument))
        args = self._args(inputs)
        for _ in range(runs):
            state["i"] = 0
            vm["main"](*args)
        index = {_call_name(i, k): i for i, k in enumerate(self.plan.kernels)}
        out = []
        for k in order:
            sym = k.split(":", 1)[1]
            out.append({"call": sym, "kernel": index.get(sym), "ms": float(np.median(times[k])) * 1e3})
        return out

    # -- persistence -------------------------------------------------------------------------
    def save(self, outdir: str | Path, force: bool = False) -> Path:
        out = Path(outdir)
        if out.exists() and any(out.iterdir()):
            if not force:
                raise KernorchError(f"{out} exists and is not empty; pass --force (force=True) to overwrite it")
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        self.executable.export_library(str(out / "model.so"))
        np.savez(out / "weights.npz", **{f"w{i}": self.graph.constants[w] for i, w in enumerate(self.weight_names)})
        self.plan.save(out / "plan.json")
        bare = replace(self.graph, constants={})
        with open(out / "graph.pkl", "wb") as f:
            pickle.dump(bare, f)
        manifest = {
            "format": FORMAT, "kernorch": __version__, "versions": _tool_versions(),
            "target": self.machine.fingerprint(self.threads), "machine": self.machine.to_json(),
            "threads": self.threads, "weights": self.weight_names,
            "inputs": {n: t.to_json() for n, t in self.graph.inputs}, "outputs": self.output_names,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
        (out / "report.json").write_text(json.dumps(self.report, indent=2, default=str))
        return out


def _tool_versions() -> dict[str, str]:
    import importlib.metadata as md
    return {p: md.version(p) for p in ("apache-tvm", "apache-tvm-ffi", "numpy")}


def load(outdir: str | Path, threads: int | None = None) -> CompiledModel:
    """Load a saved model in a fresh process, without re-optimizing."""
    import tvm
    d = Path(outdir)
    mf = d / "manifest.json"
    if not mf.exists():
        raise KernorchError(f"{d}: not a saved kernorch model (no manifest.json)")
    manifest = json.loads(mf.read_text())
    if manifest.get("format") != FORMAT or manifest.get("kernorch") != __version__:
        raise KernorchError(f"{d}: saved by kernorch {manifest.get('kernorch')} (format {manifest.get('format')}); "
                            f"this is kernorch {__version__}: optimize the model again")
    if manifest.get("versions") != _tool_versions():
        raise KernorchError(f"{d}: built with {manifest.get('versions')}, this environment has {_tool_versions()}")
    machine = Machine.host()
    saved_threads = int(manifest["threads"])
    if manifest["target"] != machine.fingerprint(saved_threads):
        raise KernorchError(f"{d}: optimized for another target ({manifest['machine'].get('name')}, "
                            f"{manifest['machine'].get('cores')} cores, {saved_threads} threads); "
                            f"this machine is {machine.name} with {machine.cores} cores: optimize it here")
    with open(d / "graph.pkl", "rb") as f:
        graph = pickle.load(f)
    w = np.load(d / "weights.npz")
    consts = {name: w[f"w{i}"] for i, name in enumerate(manifest["weights"])}
    graph = replace(graph, constants=consts)
    plan = Plan.load(d / "plan.json")
    ex = tvm.runtime.load_module(str(d / "model.so"))
    report = json.loads((d / "report.json").read_text()) if (d / "report.json").exists() else {}
    return CompiledModel(graph, plan, ex, manifest["weights"], threads or saved_threads, machine, report)
