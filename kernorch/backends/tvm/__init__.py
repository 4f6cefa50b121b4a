"""The TVM backend (TVM 0.27): the only package of kernorch that imports TVM.

One candidate kernel (a convex set of prims of a `Graph`):

    mod = lower(graph, members, inputs, outputs, "t14x32p")   # lower.py: one PrimFunc "main"(inputs..., outputs...)
    mod = schedule(mod, target, "t14x32p")                # schedule.py: a micro-kernel tile, or "default" rules
    k = build(mod, target)                                # build.py: BuiltKernel: k(*arrays), k.time(...), k.export(p)

A plan of kernels becomes one Relax VM executable in `relax.py`; MetaSchedule lives in
`metaschedule.py`, TVM's own compiler as a benchmark peer in `peer.py`, targets and the thread pool
in `target.py`, the TIR pipeline every kernel is compiled with (TVM's, register tiles kept on the
stack, repeated subexpressions bound once) in `passes.py`, and the walking and rebuilding of TIR
from Python that the schedules and the pipeline share in `tirwalk.py`.
"""
from .build import BuiltKernel, build, check_bounds, load, register_packed, relax_func
from .lower import T, lower
from .objects import object_path
from .objects import remember as remember_object
from .schedule import schedule, scheduled_for_lengths
from .target import make_target, set_threads, thread_env, vector_bits, versions

__all__ = ["BuiltKernel", "T", "build", "check_bounds", "load", "lower", "make_target", "register_packed",
           "object_path", "relax_func", "remember_object", "schedule", "scheduled_for_lengths", "set_threads",
           "thread_env", "vector_bits", "versions"]
