"""A plan → one Relax VM executable; the executable's run, time, profile and export.

The program is a Relax `main(*inputs, *weights)` that calls each chosen kernel in plan order:
generated kernels as `call_tir` of their scheduled PrimFuncs (packed weights enter in their packed
layout), Python kernels (only when allowed, see backends.registry) as `call_dps_packed` of a
registered function. Relax's static memory planner reuses intermediate buffers by lifetime.
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ...ir import Graph, KernorchError
from ...kernels import variant_out_packs, variant_packs
from ...layouts import kernel_io
from ...timing import time_calls
from .. import registry
from .build import check_bounds, compile_objects, register_packed, relax_func
from ...dynamic import BUCKET_BOUNDS, dispatch_symbol, plan_buckets, plan_ranges
from .lower import Symbols, lower
from . import objects, passes
from .objects import object_path
from .schedule import schedule, scheduled_for_lengths
from .target import make_target, set_threads

log = logging.getLogger(__name__)

ALIGN = 64  # bytes: TVM's buffers are allocated (and its kernels compiled) for this alignment


def call_name(i: int, k) -> str:
    """The symbol of plan kernel `i`: a PrimFunc, or a registered Python kernel."""
    return f"k{i}" if registry.native(k.impl) else f"kernorch.py.k{i}_{k.impl}_{k.key}"


def kernel_symbols(plan) -> list[str]:
    """The symbol the Relax VM calls for each plan kernel: a generated kernel that repeats one
    before it (the same key, implementation and schedule in the same bucket: the same PrimFunc, its
    operands numbered alike) calls that one's PrimFunc, compiled once. gpt_like's four layers repeat
    each kernel four times: its range executable compiled 61 PrimFuncs, 30 s of a 140 s optimize."""
    first: dict[tuple, str] = {}
    out = []
    for i, k in enumerate(plan.kernels):
        name = call_name(i, k)
        out.append(first.setdefault((k.key, k.impl, k.schedule, k.bucket), name) if registry.native(k.impl) else name)
    return out


def _lowered(graph: Graph, k) -> tvm.IRModule:
    """Plan kernel `k` lowered for its schedule (its layouts), before scheduling."""
    io = kernel_io(graph, k)
    return lower(io.graph, io.graph.prims, io.inputs, io.outputs, k.schedule)


def kernel_module(graph: Graph, k, target, tune_dir: str | None = None,
                  bounds: dict[str, int] | None = None) -> tvm.IRModule:
    """The scheduled PrimFunc module of one generated plan kernel, exactly as it was measured
    (`bounds`: over a range, the largest value of each symbol, as kernorch.measure gave it)."""
    if k.impl == "tvm-tuned":  # the best MetaSchedule record
        from .metaschedule import best_module, open_db
        io = kernel_io(graph, k)
        kg = io.graph
        mod = lower(kg, kg.prims, io.inputs, io.outputs)
        best = best_module(open_db(tune_dir), mod, target) if tune_dir else None
        if best is None:
            raise KernorchError(f"kernel {k.id} ({'+'.join(p.op for p in kg.prims)}) was chosen tuned, but its "
                                f"tuning record is gone from {tune_dir}; optimize again")
        return best
    return schedule(_lowered(graph, k), target, k.schedule, bounds)


def kernel_object(graph: Graph, k, target, objects_dir: str | Path | None, tune_dir: str | None = None,
                  bounds: dict[str, int] | None = None, at: Sequence[int] | None = None
                  ) -> tuple[tvm.IRModule | None, Path | None]:
    """A generated plan kernel as the executable takes it: (its scheduled, bounds-checked module,
    its object file in `objects_dir`), or (None, the object) where a build already named that
    object by the kernel's lowered module (kernorch.backends.tvm.objects.known: nothing scheduled).
    `at`: the only lengths it will run at (`build_executable`)."""
    lowered = None
    if objects_dir is not None and k.impl == "tvm":
        lowered = _lowered(graph, k)
        obj = objects.known(objects_dir, lowered, k.schedule, bounds, target, at)
        if obj is not None:
            return None, obj
    mod = schedule(lowered, target, k.schedule, bounds, at) if lowered is not None else \
        kernel_module(graph, k, target, tune_dir, bounds)
    check_bounds(mod)
    if objects_dir is None:
        return mod, None
    obj = object_path(objects_dir, mod, target)
    if lowered is not None:
        objects.remember(objects_dir, lowered, k.schedule, bounds, target, obj,
                         at if at and scheduled_for_lengths(k.schedule) else None)
    return mod, obj


def weights(graph: Graph, plan) -> list[tuple[str, str, np.ndarray]]:
    """The executable's weight parameters: (tensor, layout, array) in parameter order. A weight a
    kernel variant packs is passed packed ("KN>N32"); the same tensor in two layouts is two weights."""
    seen: dict[tuple[str, str], np.ndarray] = {}
    for k in plan.kernels:
        if not any(t in graph.constants for t in k.inputs):
            continue
        io = kernel_io(graph, k)
        packs = variant_packs(io.graph, io.inputs, k.schedule) if registry.native(k.impl) else {}
        for i, t in enumerate(io.inputs):
            if t not in graph.constants:
                continue
            p = packs.get(i)
            layout = p.layout if p else "plain"
            if (t, layout) not in seen:
                arr = np.asarray(graph.constants[t])
                seen[(t, layout)] = p.pack(arr) if p else np.asarray(arr, order="C")  # (ascontiguousarray makes 0-d 1-d)
    return [(t, layout, a) for (t, layout), a in seen.items()]


def register_python_kernels(graph: Graph, plan) -> None:
    """Register every Python kernel of the plan (again in a process that loads the saved model)."""
    for i, k in enumerate(plan.kernels):
        if not registry.native(k.impl):
            io = kernel_io(graph, k)
            register_packed(registry.python_kernel(k.impl, io.graph, io.graph.prims, io.inputs, io.outputs).run_dps,
                            call_name(i, k))


def build_module(graph: Graph, plan, target, weight_params: Sequence[tuple[str, str, np.ndarray]],
                 objects_dir: str | Path | None = None, linked: dict | None = None,
                 unbuilt: dict | None = None, at: Sequence[int] | None = None) -> tvm.IRModule:
    """The Relax IRModule of the plan. Over a symbolic dimension (plan.meta["ranges"]: "seq=1..512")
    the function's shapes use one int64 variable per symbol, bounded by the range's upper end (the
    VM plans its buffers for it); the kernels bind their own variables from their arguments. A plan
    with buckets (plan.meta["buckets"]) dispatches on the value of its symbol (over several, the
    one named: dynamic.dispatch_symbol) in `main`: `if seq <= 8:
    <the first bucket's kernels> elif seq <= 64: bucket1(...) else: bucket2(...)`. A bucket called
    as a function checks every parameter again (its weights too: 22 more tensor checks and 17 more
    shape matches per call for the transformer block), which cost the shortest lengths about 7 %
    (the one plan dispatched to itself in two buckets: 1.07x the plan's time at seq=1 and 7, 9
    rounds alternated, Zen 4); so the first bucket, the shortest lengths, runs inline, and a bucket
    function checks its inputs alone (its "num_input": the weights are main's, checked there; 60
    weights checked again took 10 us a call, Xeon model 167). The others
    stay functions: inline in nested branches, TVM 0.27's memory planning allocated a storage in
    the first branch only and reused it in the others (a crash at the second bucket's lengths); a
    branch that only calls allocates nothing. (The inline branch is built with BlockBuilder's
    `_begin_binding_block`/`_end_block`: TVM has no public scope for an `If` branch.)

    Each bucket's kernels are scheduled for the largest length they were measured for: the
    bucket's end where each bucket was planned over its own lengths (`--buckets 8,64`), the
    range's where the plans were chosen among kernels measured over the whole range
    (plan.meta[BUCKET_BOUNDS] "range": `pipeline.sample_plans`), so that they are the code timed
    and link the objects their builders kept.

    `objects_dir`: where the builders kept the kernels' object files (kernorch.backends.tvm.objects).
    Every native kernel is then called as an external function, its object recorded in `linked`
    ({call name: file}) for the library to link; one whose file is not there yet (over a range, a
    kernel with row copies: measured built for its sample lengths only) is recorded in `unbuilt`
    too ({call name: its scheduled module}), for `build.compile_objects` to write the file first.
    Without `objects_dir` every kernel is compiled in the module. `at`: as `build_executable` takes it."""
    found = {} if linked is None else linked
    pending = {} if unbuilt is None else unbuilt
    scheduled: dict = {}  # a kernel in several buckets, built for the same bounds: scheduled once
    bb = relax.BlockBuilder()
    sym = Symbols()
    bounds = bucket_bounds(plan, None)
    # "num_input": VMShapeLower checks the inputs alone at every call, not the weights: they are the
    # executable's own (`Executable.args`), from files `runtime.load` checked against their digests.
    # Checked at every call, they cost the transformer block's range executable 4-9 us a run (2-4 % at
    # seq=1-8, 1-1.5 % at 32), its static one at 32 3-7 us, gpt_like's at seq=1 13-19 (Xeon model 167)
    attrs = {"num_input": len(graph.inputs), **({"tir_var_upper_bound": bounds} if bounds else {})}

    def emit(indices, inputs, wvars, upper: dict[str, int], dataflow: bool = True) -> relax.Expr:
        return _emit_kernels(bb, graph, plan, indices, target, inputs, wvars, weight_params, sym, upper,
                             dataflow=dataflow, objects_dir=objects_dir, linked=found, unbuilt=pending,
                             scheduled=scheduled, at=at)

    def params():
        inputs = [relax.Var(n, _tensor_type(t, sym)) for n, t in graph.inputs]
        return inputs, [relax.Var(f"w_{i}", relax.TensorType(list(a.shape), str(a.dtype)))
                        for i, (_, _, a) in enumerate(weight_params)]

    parts = plan_buckets(plan.meta)
    if not parts:
        inputs, wvars = params()
        with bb.function("main", inputs + wvars, attrs=attrs):
            bb.emit_func_output(emit(range(len(plan.kernels)), inputs, wvars, bounds))
        return bb.get()
    def in_bucket(b: int) -> list[int]:
        return [i for i, k in enumerate(plan.kernels) if k.bucket == b]

    funcs = []
    for b in range(1, len(parts)):
        inputs, wvars = params()
        with bb.function(f"bucket{b}", inputs + wvars, attrs=attrs, private=True):
            funcs.append(bb.emit_func_output(emit(in_bucket(b), inputs, wvars, bucket_bounds(plan, b))))
    inputs, wvars = params()
    name = dispatch_symbol(plan.meta)
    with bb.function("main", inputs + wvars, attrs=attrs):
        call = relax.Call(funcs[-1], inputs + wvars)
        for b in reversed(range(1, len(parts) - 1)):  # built inside out: the last bucket is the innermost else
            call = relax.If(relax.prim_value(sym.vars[name] <= parts[b][1]),
                            relax.SeqExpr([], relax.Call(funcs[b - 1], inputs + wvars)), relax.SeqExpr([], call))
        bb._begin_binding_block()  # the first bucket's kernels in main itself, the others' functions called
        first = emit(in_bucket(0), inputs, wvars, bucket_bounds(plan, 0), dataflow=False)
        first = relax.SeqExpr([bb._end_block()], first)
        bb._begin_binding_block()
        bb.emit_func_output(bb.emit(relax.If(relax.prim_value(sym.vars[name] <= parts[0][1]), first,
                                             relax.SeqExpr([], call))))
    return bb.get()


def bucket_bounds(plan, bucket: int | None) -> dict[str, int]:
    """The largest value of each symbol the kernels of `bucket` are scheduled for (None: the
    plan's range): what they were measured for, the bucket's end, or the range's where the
    buckets' plans were chosen among kernels measured over the whole range (BUCKET_BOUNDS)."""
    bounds = {name: hi for name, (_, hi) in plan_ranges(plan.meta).items()}
    parts = plan_buckets(plan.meta)
    if bucket is None or not parts or plan.meta.get(BUCKET_BOUNDS) == "range":
        return bounds
    return {**bounds, dispatch_symbol(plan.meta): parts[bucket][1]}


def unnamed_kernels(graph: Graph, plan, threads: int, objects_dir: str | Path, machine=None) -> list[tuple]:
    """The plan's generated kernels (one per key, schedule and bounds) whose object no build has
    named by their lowered module yet (`objects.known`): (kernel, the bounds the executable
    schedules it for). Over a range, the tiles measured for their sample lengths only."""
    target = make_target(threads, machine)
    out: dict[tuple, tuple] = {}
    for k in plan.kernels:
        bounds = bucket_bounds(plan, k.bucket)
        ident = (k.key, k.impl, k.schedule, tuple(sorted(bounds.items())))
        if k.impl != "tvm" or ident in out:
            continue
        if objects.known(objects_dir, _lowered(graph, k), k.schedule, bounds, target) is None:
            out[ident] = (k, bounds)
    return list(out.values())


def _tensor_type(t, sym: Symbols) -> relax.TensorType:
    return relax.TensorType([sym.expr(d) for d in t.shape], t.dtype)


def _emit_kernels(bb, graph: Graph, plan, indices, target, inputs, wvars, weight_params, sym,
                  bounds: dict[str, int], dataflow: bool = True, objects_dir: str | Path | None = None,
                  linked: dict | None = None, unbuilt: dict | None = None,
                  scheduled: dict | None = None, at: Sequence[int] | None = None) -> relax.Expr:
    """The plan kernels `indices` (global plan indices: kernel i calls PrimFunc `kernel_symbols(plan)[i]`,
    added to the module once) called in order inside one dataflow block of the function being
    built (`dataflow=False`: in the binding block the caller began, a branch of an `If`); returns
    its output tuple. `bounds`: the largest value of each symbol these kernels serve (their
    bucket's or the range's end), with which they were measured. `objects_dir`, `linked`: as
    `build_module` takes them. `scheduled`: the scheduled module and object file of each (key,
    implementation, schedule, bounds) met so far, in this bucket or another."""
    wvar = {(t, layout): v for (t, layout, _), v in zip(weight_params, wvars)}
    symbols = kernel_symbols(plan)
    funcs: dict = {}  # (a symbol serves one bucket: every call of it is in this block)
    scheduled = {} if scheduled is None else scheduled
    env = {n: v for (n, _), v in zip(graph.inputs, inputs)}
    tune_dir = plan.meta.get("tune_dir")
    with bb.dataflow() if dataflow else contextlib.nullcontext():
        for i in indices:
            k = plan.kernels[i]
            native = registry.native(k.impl)
            io = kernel_io(graph, k)
            packs = variant_packs(io.graph, io.inputs, k.schedule) if native else {}
            out_packs = variant_out_packs(io.graph, io.outputs, k.schedule) if native else {}
            args = []
            for j, (t, q) in enumerate(zip(io.inputs, io.reads)):
                if t in graph.constants:
                    args.append(wvar[(t, packs[j].layout if j in packs else "plain")])
                elif q not in env:
                    raise KernorchError(f"kernel {k.id} reads {q} before any kernel writes it")
                else:
                    args.append(env[q])
            out_ty = [relax.TensorType([sym.expr(d) for d in out_packs[j].packed_shape], "float32") if j in out_packs
                      else _tensor_type(io.graph.type_of(t), sym) for j, t in enumerate(io.outputs)]
            ty = out_ty if len(out_ty) > 1 else out_ty[0]
            name = symbols[i]
            if native:
                if name not in funcs:
                    ident = (k.key, k.impl, k.schedule, tuple(sorted(bounds.items())))
                    if ident not in scheduled:
                        scheduled[ident] = kernel_object(graph, k, target, objects_dir, tune_dir, bounds, at)
                    mod, obj = scheduled[ident]
                    if obj is not None:
                        linked[name] = obj
                        funcs[name] = None
                        if not obj.exists():
                            unbuilt[name] = mod
                    else:
                        funcs[name] = bb.add_func(relax_func(mod, name), name)
                call = relax.call_tir(funcs[name], relax.Tuple(args), ty) if funcs[name] is not None \
                    else relax.call_dps_packed(name, relax.Tuple(args), ty)
            else:
                call = relax.call_dps_packed(name, relax.Tuple(args), ty)
            res = bb.emit(call)
            if len(io.writes) == 1:
                env[io.writes[0]] = res
            else:
                for j, q in enumerate(io.writes):
                    env[q] = bb.emit(relax.TupleGetItem(res, j))
        missing = [o for o in graph.outputs if o not in env]
        if missing:
            raise KernorchError(f"the plan does not produce graph outputs {missing}")
        out = relax.Tuple([env[o] for o in graph.outputs])
        return bb.emit_output(out) if dataflow else bb.emit(out)


@tvm.transform.module_pass(opt_level=0, name="kernorch.NoaliasHostFuncs")
def _noalias_host_funcs(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Mark the PrimFuncs Relax generates itself (`shape_func`, over a symbolic dimension) noalias.

    TVM 0.27's LLVM code generator drops `noalias` from every kernel of a module as soon as one
    PrimFunc in it lacks the attribute; the accumulators of a micro-kernel are then stored to memory
    on every step of the reduction (the 512-row 384x1536 GEMM of a dynamic executable took 4.1 ms
    instead of 2.0). `shape_func` reads and writes one buffer, the VM's shape heap: noalias holds.
    """
    for gv, func in list(mod.functions.items()):
        if isinstance(func, tvm.tirx.PrimFunc) and not (func.attrs and "tirx.noalias" in func.attrs):
            mod[gv] = func.with_attr("tirx.noalias", True)
    return mod


_ALLOC_TENSOR = tvm.ir.Op.get("relax.vm.alloc_tensor")


def _shapes_in(seq: relax.SeqExpr) -> relax.SeqExpr:
    """`seq` with each symbolic shape its blocks allocate tensors of bound once per block (at its
    first allocation) and passed by that variable after (the branches of an `If` alike)."""
    blocks = []
    for block in seq.blocks:
        bound: dict[int, relax.Var] = {}
        out = []
        for b in block.bindings:
            value = b.value if isinstance(b, relax.VarBinding) else None
            if isinstance(value, relax.If):
                b = relax.VarBinding(b.var, relax.If(value.cond, _shapes_in(value.true_branch),
                                                     _shapes_in(value.false_branch)))
            elif (isinstance(value, relax.Call) and value.op.same_as(_ALLOC_TENSOR)
                  and isinstance(shape := value.args[2], relax.ShapeExpr)
                  and any(not isinstance(v, tvm.tirx.IntImm) for v in shape.values)):
                key = tvm_ffi.structural_hash(shape)
                if key not in bound:
                    bound[key] = relax.Var(f"shape{len(bound)}", shape.ty)
                    out.append(relax.VarBinding(bound[key], shape))
                args = [*value.args[:2], bound[key], *value.args[3:]]
                b = relax.VarBinding(b.var, relax.Call(value.op, args, value.attrs, value.ty_args))
            out.append(b)
        blocks.append(relax.BindingBlock(out))
    return relax.SeqExpr(blocks, seq.body)


@tvm.transform.module_pass(opt_level=0, name="kernorch.ShapesOnce")
def _shapes_once(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Over a symbolic dimension, build each shape the executable allocates tensors of once a call.

    Relax passes every allocation its shape as an expression of the symbol, and the VM builds each
    one at every call (`vm.builtin.make_shape`): gpt_like over seq=1..512 made 55 a call for 8
    distinct shapes. Bound once (before `VMShapeLower`), it makes 9; the same executable ran 0.96x
    the time at seq=1 and 7, 0.99x at 32, 1.00x at 512 (in turns in one process, Xeon model 167),
    its outputs the same bit for bit."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
            mod[gv] = relax.Function(func.params, _shapes_in(func.body), func.ret_ty, func.is_pure, func.attrs,
                                     func.span)
    return mod


def _relax_pipeline() -> tvm.transform.Pass:
    """TVM 0.27's default Relax build pipeline (`relax.get_pipeline("default")`, its passes listed
    here) with `_shapes_once` before the VM's shapes are lowered, then `_noalias_host_funcs`."""
    t = relax.transform
    return tvm.transform.Sequential([
        relax.backend.DispatchSampling(), relax.backend.DispatchSortScan(), t.LegalizeOps(),
        t.RewriteDataflowReshape(), t.ToNonDataflow(), t.RemovePurityChecking(), t.CallTIRRewrite(),
        t.StaticPlanBlockMemory(), t.RewriteCUDAGraph(), t.LowerAllocTensor(), t.KillAfterLastUse(),
        t.LowerRuntimeBuiltin(), t.ComputePrimValue(), _shapes_once, t.VMShapeLower(), t.AttachGlobalSymbol(),
        _noalias_host_funcs])


def build_executable(graph: Graph, plan, threads: int, machine=None, cache_dir: str | Path | None = None,
                     objects_dir: str | Path | None = None, workers: int = 1,
                     at: Sequence[int] | None = None) -> "Executable":
    """Compile the plan for this CPU: the executable with its (packed) weights. With `cache_dir`,
    a library compiled before from the same module, weights and tools is loaded instead of compiled
    again (`_compiled`), and the kernels whose object files the builders kept in `objects_dir` are
    linked instead of compiled again (kernorch.backends.tvm.objects); those without one are
    compiled into that directory first, `workers` at a time, and linked too. `at` (one symbol): the
    only lengths the executable will run at; its kernels may link objects built for those lengths
    alone (a measurement's, for its samples) and are compiled so where none is kept. It is wrong at
    other lengths: for a run at them, never to be saved."""
    target = make_target(threads, machine)
    params = weights(graph, plan)
    use = objects_dir if cache_dir is not None and objects_dir is not None and objects.available() else None
    linked: dict[str, Path] = {}
    unbuilt: dict[str, tvm.IRModule] = {}
    mod = build_module(graph, plan, target, params, use, linked, unbuilt, at)
    if use is not None:
        log.info("executable: %d kernels link their builds' objects, %d with no object yet",
                 len(set(linked.values()) - {linked[n] for n in unbuilt}), len({linked[n] for n in unbuilt}))
    try:
        ex, library = _compiled(mod, target, graph, params, cache_dir, linked, unbuilt, workers)
    except (KernorchError, RuntimeError, OSError) as e:
        if not linked:
            raise
        log.warning("%s; compiling every kernel instead", e)
        linked = {}
        mod = build_module(graph, plan, target, params, at=at)
        ex, library = _compiled(mod, target, graph, params, cache_dir)
    if linked:
        objects.prune(use)
    return Executable(ex, [(t, layout) for t, layout, _ in params], [a for _, _, a in params],
                      [(n, t) for n, t in graph.inputs], list(graph.outputs), threads, graph, plan, library,
                      linked)


EXECUTABLES_KEPT = 16  # libraries a cache directory keeps, the least recently used dropped beyond


def executable_key(mod: tvm.IRModule, target, graph: Graph, params, linked: Mapping[str, Path] | None = None) -> str:
    """What a compiled library depends on: the Relax module (its structural hash: every kernel as
    scheduled), the target, TVM, the code of this module (the Relax passes it compiles with) and of
    passes.py and tirwalk.py (the TIR pipeline), every constant of the graph by content and the layout of every
    weight the kernels take (its packed content follows from the constant and the layout), and the
    object file linked for each kernel called as an external function (`linked`: named by its
    content's key)."""
    import hashlib
    h = hashlib.sha256()
    for part in (str(tvm_ffi.structural_hash(mod)), str(target), Path(__file__).read_text(), *objects.code_parts(),
                 *(f"{name}:{layout}:{np.shape(a)}" for name, layout, a in params),
                 *(f"{name}:{Path(obj).stem}" for name, obj in sorted((linked or {}).items()))):
        h.update(part.encode() + b"\0")
    for name in sorted(graph.constants):
        a = np.ascontiguousarray(graph.constants[name])
        h.update(f"{name}:{a.dtype}:{a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()[:32]


def compile_module(mod: tvm.IRModule, target):
    """The plan's Relax module compiled in memory (its kernels as LLVM IR, `.mod.imports[0]`)."""
    return tvm.compile(mod, target=target, relax_pipeline=_relax_pipeline(), tir_pipeline=passes.PIPELINE)


def _compiled(mod: tvm.IRModule, target, graph: Graph, params, cache_dir,
              linked: Mapping[str, Path] | None = None, unbuilt: Mapping[str, tvm.IRModule] | None = None,
              workers: int = 1) -> tuple[object, Path | None]:
    """`mod` compiled (LLVM: most of an emit, 45 of yolox_tiny's 79 s on a Zen 4), or the library
    `cache_dir` holds for its `executable_key`; with the file it is kept in (None: not kept). A
    library that does not load is compiled again; one that cannot be stored is only logged.

    A library just stored is loaded from its file: the module `tvm.compile` returns holds LLVM IR,
    which the first VM made of it compiles to machine code again, as exporting it did (the
    transformer block over seq=1..512, Zen 4: 1.6 s of a 7.7 s emit; loading the file: 3 ms).
    `linked`: the kernels the module calls as external functions, with their object files (it then
    runs only from the library, which links them); `unbuilt`: those of them whose object file is
    compiled first (only when the library is, `workers` at a time)."""
    def compile_():
        return compile_module(mod, target)
    if cache_dir is None:  # (build_executable links objects only into a library it keeps)
        return compile_(), None
    import os
    import tempfile
    cache = Path(cache_dir)
    path = cache / f"{executable_key(mod, target, graph, params, linked)}.so"
    if path.exists():
        try:
            ex = tvm.runtime.load_module(str(path))
            path.touch()
            log.info("executable loaded from %s", path)
            return ex, path
        except Exception as e:  # noqa: BLE001 - a damaged or foreign file: compile again
            log.warning("cached executable %s did not load (%s); compiling again", path, str(e).splitlines()[0])
    compile_objects(unbuilt or {}, linked or {}, target, workers)
    ex = compile_()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{path.stem}.{os.getpid()}.so"
        with tempfile.TemporaryDirectory(prefix="kernorch-link-") as ws:
            ex.export_library(str(tmp), addons=objects.renamed(linked or {}, ws))
        os.replace(tmp, path)
        kept = [q for q in cache.glob("*.so") if not q.name.startswith(".")]  # (not another run's export)
        for old in sorted(kept, key=lambda q: q.stat().st_mtime, reverse=True)[EXECUTABLES_KEPT:]:
            old.unlink(missing_ok=True)
    except (OSError, RuntimeError) as e:
        if linked:  # (the module alone lacks the linked kernels)
            raise KernorchError(f"could not link the executable in {cache}: {e}") from e
        log.warning("could not keep the executable in %s: %s", cache, e)
        return ex, None
    try:
        return tvm.runtime.load_module(str(path)), path
    except Exception as e:  # noqa: BLE001 - run the module compiled in memory instead
        if linked:
            raise KernorchError(f"the executable just linked in {path} did not load: {e}") from e
        log.warning("the executable just kept in %s did not load (%s)", path, str(e).splitlines()[0])
        return ex, path


def _aligned(x: np.ndarray) -> bool:
    return x.ctypes.data % ALIGN == 0


class Executable:
    """The compiled plan: `run(feeds)` on numpy arrays, `time`, `profile`, `export`.

    Inputs that are already C-contiguous, of the right dtype and 64-byte aligned are handed to the
    VM without a copy (DLPack); others are copied once into a TVM tensor.
    """

    def __init__(self, ex, weight_names: Sequence[tuple[str, str]], weight_arrays: Sequence[np.ndarray],
                 inputs: Sequence[tuple[str, object]], outputs: Sequence[str], threads: int, graph: Graph, plan,
                 library: Path | None = None, linked: Mapping[str, Path] | None = None):
        set_threads(threads)
        register_python_kernels(graph, plan)
        self.ex, self.threads, self.library = ex, threads, library
        self.linked = dict(linked or {})  # the kernels linked from their builds' object files: call name -> file
        self.weight_names = list(weight_names)
        self.inputs, self.outputs = list(inputs), list(outputs)
        self.plan = plan
        self.dev = tvm.cpu()
        self.vm = relax.VirtualMachine(ex, self.dev)
        self._main = self.vm["main"]
        self._weights = [tvm.runtime.tensor(np.asarray(a, order="C"), self.dev) for a in weight_arrays]

    @property
    def weight_arrays(self) -> list[np.ndarray]:
        """The weights as the kernels take them (packed layouts included), as numpy arrays."""
        return [w.numpy() for w in self._weights]

    def args(self, feeds: Mapping[str, np.ndarray]) -> list:
        """VM arguments for already-validated feeds (see runtime.CompiledModel.run)."""
        out = []
        for n, t in self.inputs:
            x = feeds[n]
            if x.dtype == np.dtype(t.dtype) and x.flags.c_contiguous and _aligned(x) and x.size:
                out.append(tvm_ffi.from_dlpack(x))
            else:
                out.append(tvm.runtime.tensor(np.asarray(x, dtype=t.dtype, order="C"), self.dev))
        return out + self._weights

    def bind(self, feeds: Mapping[str, np.ndarray]):
        """A call without arguments that runs the model on `feeds` (converted once): for timing."""
        args, f = self.args(feeds), self._main
        return lambda: f(*args)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        res = self._main(*self.args(feeds))
        return {n: res[i].numpy() for i, n in enumerate(self.outputs)}

    def time(self, feeds: Mapping[str, np.ndarray], runs: int = 10, warmup: int = 2) -> list[float]:
        """Seconds per end-to-end call (inputs already on the device), one value per run."""
        return time_calls(self.bind(feeds), runs, warmup)

    def profile(self, feeds: Mapping[str, np.ndarray], runs: int = 3) -> list[dict]:
        """Per-call latency inside the real executable (VM instrumentation), median over `runs`.

        Each entry: the called symbol, the plan kernel's index (None for VM builtins), the median ms.
        """
        times: dict[str, list[float]] = {}
        order: list[str] = []
        state = {"t": 0.0, "i": 0}

        def instrument(func, symbol, before, ret, *args):
            if before:
                state["t"] = time.perf_counter()
            else:
                key = f"{state['i']}:{symbol}"
                state["i"] += 1
                if key not in times:
                    times[key] = []
                    order.append(key)
                times[key].append(time.perf_counter() - state["t"])
            return 0

        vm = relax.VirtualMachine(self.ex, self.dev)
        vm.set_instrument(tvm_ffi.convert(instrument))
        args = self.args(feeds)
        for _ in range(runs):
            state["i"] = 0
            vm["main"](*args)
        users: dict[str, list[int]] = {}  # each symbol's plan kernels, in the order they call it
        for i, sym in enumerate(kernel_symbols(self.plan)):
            users.setdefault(sym, []).append(i)
        calls: dict[str, int] = {}
        out = []
        for key in order:
            sym = key.split(":", 1)[1]
            n = calls[sym] = calls.get(sym, -1) + 1
            index = users[sym][n] if n < len(users.get(sym, ())) else None
            out.append({"call": sym, "kernel": index, "ms": float(np.median(times[key])) * 1e3})
        return out

    def export(self, path: str | Path) -> None:
        """The compiled library: a copy of the file it was loaded from or kept in (a loaded library
        cannot be exported again), else linked now (g++)."""
        if self.library is not None and self.library.exists():
            import shutil
            shutil.copyfile(self.library, path)
        else:
            self.ex.export_library(str(path))


def load_executable(path: str | Path, weight_names, weight_arrays, graph: Graph, plan, threads: int) -> Executable:
    """An executable exported by `Executable.export`, with the weights saved beside it."""
    ex = tvm.runtime.load_module(str(path))
    return Executable(ex, weight_names, weight_arrays, [(n, t) for n, t in graph.inputs], list(graph.outputs),
                      threads, graph, plan, Path(path))
