"""TVM's own compiler as a benchmark peer: Relax `from_onnx`, the default CPU fusion pipeline,
dlight's CPU rules, and MetaSchedule with a trial budget when asked."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm import relax

from .target import make_target

log = logging.getLogger(__name__)


def _tune(mod, target, budget_trials: int, work_dir: Path) -> dict:
    """MetaSchedule over the fused module's tasks; reuses a finished database in `work_dir`."""
    from tvm.s_tir import meta_schedule as ms
    from .metaschedule import fast_build, reap_workers
    done = work_dir / "done.json"
    if done.exists():
        return json.loads(done.read_text()) | {"from_cache": True}
    work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ms.relax_integration.tune_relax(
        mod, params={}, target=target, work_dir=str(work_dir), max_trials_global=budget_trials,
        num_trials_per_iter=min(16, budget_trials),
        builder=ms.builder.LocalBuilder(max_workers=2, timeout_sec=60.0, f_build=fast_build),
        runner=ms.runner.LocalRunner(timeout_sec=30, evaluator_config=ms.runner.EvaluatorConfig(
            number=3, repeat=1, min_repeat_ms=20)), seed=0)
    reap_workers()
    info = {"budget_trials": budget_trials, "tuning_seconds": time.perf_counter() - t0}
    done.write_text(json.dumps(info))
    return info | {"from_cache": False}


def prepare(proto, feeds: dict, input_names, threads: int, budget_trials: int = 0, tune_dir: Path | None = None):
    """(call, outputs, info): one inference on `feeds`, the outputs as numpy arrays, build facts."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm.relax.frontend.onnx import from_onnx
    from tvm.s_tir import dlight as dl

    target = make_target(threads)
    t0 = time.perf_counter()
    shapes = {n: list(np.shape(feeds[n])) for n in input_names}
    mod = from_onnx(proto, shape_dict=shapes, keep_params_in_input=False)
    info: dict[str, Any] = {"pipeline": "relax cpu_generic default (legalize, FuseOps, FuseTIR) + dlight cpu GEMV/Reduction",
                            "target": str(target.export().get("mcpu", "")), "tuned": False}
    with target:  # the default pipeline, split where schedules go: after fusion, before lowering to the VM
        mod = tvm.transform.Sequential(cpu.library_dispatch_passes(target) + cpu.legalize_passes(target))(mod)
    if budget_trials > 0 and tune_dir is not None:
        info["tuning"] = _tune(mod, target, budget_trials, tune_dir) | {"work_dir": str(tune_dir)}
        from tvm.s_tir import meta_schedule as ms
        db = ms.database.JSONDatabase(work_dir=str(tune_dir))
        with target, db, tvm.transform.PassContext(opt_level=3):
            mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
        info["tuned"] = True
    with target:
        mod = dl.ApplyDefaultSchedule(dl.cpu.GEMV(), dl.cpu.Reduction())(mod)
        mod = tvm.transform.Sequential(cpu.dataflow_lower_passes(target) + cpu.finalize_passes(target))(mod)
    ex = tvm.compile(mod, target=target, relax_pipeline=None)
    info["build_seconds"] = time.perf_counter() - t0
    dev = tvm.cpu()
    f = relax.VirtualMachine(ex, dev)["main"]
    args = [tvm.runtime.tensor(np.ascontiguousarray(feeds[n]), dev) for n in input_names]

    def outputs() -> list[np.ndarray]:
        res = f(*args)
        return [res.numpy()] if hasattr(res, "numpy") else [r.numpy() for r in res]

    return (lambda: f(*args)), outputs, info
