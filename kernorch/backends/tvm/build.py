"""Build, run, time and export one scheduled kernel; the bounds check; packed functions."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import platform
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.script import tirx as T

from ...ir import KernorchError
from .lower import bounds_of, num_inputs, symbol_vars
from .objects import export_keeping
from .passes import PIPELINE
from .schedule import CACHE_LINE
from .tirwalk import is_load, operands
from .target import versions

log = logging.getLogger(__name__)


class BuiltKernel:
    """A compiled PrimFunc `main(*inputs, *outputs)` callable on numpy arrays."""

    def __init__(self, rt_mod, params: list[tuple[tuple[int, ...], str]], num_inputs: int, executable=None):
        self._rt_mod = rt_mod
        self.params = params
        self.num_inputs = num_inputs
        self._executable = executable
        self.dev = tvm.cpu()

    @functools.cached_property
    def rt_mod(self):
        """The runtime module: loaded from a file, or just-in-time compiled from the executable on
        first use (LLVM emits the machine code then; `export` emits it again for the file, so a
        kernel built to be exported and loaded elsewhere need not pay for both)."""
        return self._rt_mod if self._rt_mod is not None else self._executable.jit()

    @functools.cached_property
    def _fn(self):
        return self.rt_mod["main"]

    @property
    def input_types(self):
        return self.params[: self.num_inputs]

    @property
    def output_types(self):
        return self.params[self.num_inputs:]

    def _args(self, inputs: Sequence[np.ndarray], out_shapes: Sequence[tuple[int, ...]] | None = None):
        """Device tensors of `inputs` and fresh outputs. A symbolic dimension (a str in `params`:
        the kernel serves a range of lengths) takes any size; then `out_shapes` gives the outputs'."""
        if len(inputs) != self.num_inputs:
            raise KernorchError(f"kernel takes {self.num_inputs} inputs, got {len(inputs)}")
        args = []
        for x, (shape, dtype) in zip(inputs, self.input_types):
            x = np.asarray(x, dtype=dtype, order="C")  # (ascontiguousarray makes 0-d arrays 1-d)
            if len(x.shape) != len(shape) or any(isinstance(d, int) and d != n for d, n in zip(shape, x.shape)):
                raise KernorchError(f"input of shape {x.shape}, kernel expects {shape}")
            args.append(tvm.runtime.tensor(x, self.dev))
        if out_shapes is None:
            if any(isinstance(d, str) for shape, _ in self.output_types for d in shape):
                raise KernorchError("a kernel with symbolic output shapes needs out_shapes")
            out_shapes = [shape for shape, _ in self.output_types]
        outs = [tvm.runtime.empty(tuple(shape), dtype, self.dev) for shape, (_, dtype) in zip(out_shapes, self.output_types)]
        return args, outs

    def __call__(self, *inputs: np.ndarray, out_shapes=None) -> list[np.ndarray]:
        args, outs = self._args(inputs, out_shapes)
        self._fn(*args, *outs)
        return [o.numpy() for o in outs]

    def tensors(self, *inputs: np.ndarray, out_shapes=None) -> tuple[list, list]:
        """Device tensors of `inputs` and fresh outputs, for `time(tensors=...)` to time on again."""
        return self._args(inputs, out_shapes)

    def time(self, *inputs: np.ndarray, number: int = 10, repeat: int = 5, warmup: int = 1,
             min_repeat_ms: int = 0, out_shapes=None, cold: Sequence[int] = (), evict: int = 0,
             tensors: tuple[list, list] | None = None) -> list[float]:
        """Seconds per call, one value per repeat (each the mean of `number` calls), on
        preallocated tensors. Take the median yourself; never assert on it in tests.

        `cold`: the parameters (by position: the inputs, then the outputs) flushed from every cache
        level before each call, as the model finds its weights in memory and its large outputs.
        `evict`: bytes each of the pool's threads reads before each call, so that what the call
        touched last leaves the cores' own caches for the shared last level (as the model finds its
        weights when they all fit there). With either, each repeat is one call (`number` and
        `min_repeat_ms` ignored) and `repeat` calls are made. `tensors`: the device tensors of an
        earlier `tensors()` call, in place of `inputs` (the same memory timed again)."""
        args, outs = tensors if tensors is not None else self._args(inputs, out_shapes)
        for _ in range(max(warmup, 0)):
            self._fn(*args, *outs)
        if cold or evict:
            params = [*args, *outs]
            flush = _flusher([params[i] for i in cold], evict)
            fe = self.rt_mod.time_evaluator("main", self.dev, number=1, repeat=repeat, f_preproc=flush)
        else:
            fe = self.rt_mod.time_evaluator("main", self.dev, number=number, repeat=repeat, min_repeat_ms=min_repeat_ms)
        return [float(x) for x in fe(*args, *outs).results]

    def assembly(self) -> str:
        """The kernel's generated assembly (to check which vector registers the code uses)."""
        if self._executable is None:
            raise KernorchError("this kernel was loaded from a file; its assembly is not at hand")
        return self._executable.mod.inspect_source("asm")

    def export(self, path: str, keep_object: str | None = None) -> None:
        """Write a shared library (g++ needed) and `path + '.json'` with the signature; with
        `keep_object`, keep the kernel's object file there too (kernorch.backends.tvm.objects)."""
        if self._executable is None:
            raise KernorchError("this kernel was loaded from a file; export the original")
        export_keeping(self._executable, path, keep_object)
        with open(path + ".json", "w") as f:
            json.dump({"num_inputs": self.num_inputs, "params": [[list(s), d] for s, d in self.params],
                       "versions": versions()}, f)


# -- flushing arguments from the caches (timing a kernel as a model runs it) ---------------------

FLUSH_FUNC = "kernorch.flush_cold_args"


@functools.lru_cache(maxsize=1)
def _clflush_kernel():
    """A compiled kernel that clflushes every cache line of a byte buffer (built on first use, not
    at import)."""
    @T.prim_func
    def clflush(a: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n,), "uint8")
        for i in range((n + CACHE_LINE - 1) // CACHE_LINE):
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.sse2.clflush", T.address_of(A[i * CACHE_LINE])))
    return tvm.compile(tvm.IRModule({"main": clflush}), target="llvm")["main"]


@functools.lru_cache(maxsize=1)
def _evict_kernel():
    """A compiled kernel that reads one word of every cache line of its (threads, n) buffer, row t
    on the pool's thread t, into out[t]: each thread's core then holds that row in its own caches,
    and what it held before went to the shared level (a victim cache on the parts seen here)."""
    step = CACHE_LINE // 4

    @T.prim_func
    def evict(a: T.handle, o: T.handle):
        t = T.int64()
        n = T.int64()
        A = T.match_buffer(a, (t, n), "float32")
        O = T.match_buffer(o, (t,), "float32")
        for i in T.parallel(t):
            O[i] = T.float32(0)
            for j in range(n // step):
                O[i] = O[i] + A[i, j * step]
    return tvm.compile(tvm.IRModule({"main": evict}), target="llvm")["main"]


@functools.lru_cache(maxsize=2)
def _evict_buffers(threads: int, nbytes: int):
    dev = tvm.cpu()
    return (tvm.runtime.tensor(np.ones((threads, max(nbytes // 4, CACHE_LINE)), "float32"), dev),
            tvm.runtime.tensor(np.zeros(threads, "float32"), dev))


def _flusher(tensors: Sequence, evict: int = 0) -> str:
    """The name of a registered function that flushes the cache lines of `tensors` (byte views of
    them) from every cache level, then has each of the pool's threads read `evict` bytes of its own
    (`BuiltKernel.time`); `time_evaluator` calls it before each repeat (`f_preproc`). Why kernels
    are timed so: kernorch.measure._timed. Not x86 (no clflush): nothing is flushed."""
    views = [t._create_view((int(np.prod(t.shape)) * tvm.DataType(t.dtype).bits // 8,), "uint8")
             for t in tensors]
    views = [v for v in views if v.shape[0] > 0]
    kernel = _clflush_kernel() if platform.machine().lower() in ("x86_64", "amd64", "i686") else None
    reader = _evict_kernel() if evict else None
    own = _evict_buffers(int(tvm.runtime.num_threads()), evict) if evict else None

    def flush(*_):
        for v in views if kernel is not None else ():
            kernel(v)
        if reader is not None:
            reader(*own)
    tvm_ffi.register_global_func(FLUSH_FUNC, flush, override=True)
    return FLUSH_FUNC


def load(path: str) -> BuiltKernel:
    """Load a kernel written by `BuiltKernel.export`."""
    with open(path + ".json") as f:
        meta = json.load(f)
    if meta.get("versions") != versions():
        log.warning("kernel %s was built with %s, running %s", path, meta.get("versions"), versions())
    params = [(tuple(s), d) for s, d in meta["params"]]
    return BuiltKernel(tvm.runtime.load_module(path), params, int(meta["num_inputs"]))


def build(mod: tvm.IRModule, target: tvm.target.Target) -> BuiltKernel:
    """tvm.compile the PrimFunc module (about 0.05-0.5 s per kernel)."""
    func = mod["main"]
    params = []
    for buf in func.params:  # 0.27: params are Buffers (no buffer_map)
        params.append((tuple(int(s) if isinstance(s, tirx.IntImm) else str(s) for s in buf.shape), str(buf.dtype)))
    check_bounds(mod)
    return BuiltKernel(None, params, num_inputs(func), compile_kernel(mod, target))


def compile_kernel(mod: tvm.IRModule, target):
    """A scheduled kernel module compiled through kernorch's TIR pipeline (unchecked: `build` checks)."""
    return tvm.compile(mod, target=target, tir_pipeline=PIPELINE)


def compile_objects(modules: Mapping[str, tvm.IRModule], files: Mapping[str, Path], target, workers: int) -> None:
    """Compile each scheduled, bounds-checked kernel module of `modules` ({call name: module}) and
    keep its object at `files[name]`, as a builder's export does (`export_keeping`), `workers`
    kernels at a time: tvm.compile releases the GIL, so threads of this process compile side by
    side (8 GEMM kernels over a symbolic row count: 1.11 s in one thread, 0.59 in two, Xeon SPR class)."""
    once = {str(files[name]): name for name in modules}  # kernels sharing an object (one kernel in two buckets)
    if not once:
        return
    log.info("compiling %d kernels into their object files, %d at a time", len(once), workers)

    def one(name: str) -> None:
        with tempfile.TemporaryDirectory(prefix="kernorch-kernel-") as ws:
            export_keeping(compile_kernel(modules[name], target), f"{ws}/k.so", files[name])
        if not Path(files[name]).exists():
            raise RuntimeError(f"compiling kernel {name} left no object file at {files[name]}")
    with ThreadPoolExecutor(max(1, min(workers, len(once)))) as pool:
        list(pool.map(one, once.values()))


SYMBOLIC_PROBES = (1, 2, 7, 64)  # lengths a kernel over a symbolic dimension is bounds-checked at (and its end)


def check_bounds(mod: tvm.IRModule) -> None:
    """`_check_bounds`; a kernel over a symbolic dimension (kernorch.dynamic) is checked at a few
    concrete lengths and the largest it serves (its `kernorch.bounds`), since the interval
    analysis cannot relate a fused index to a symbolic extent (`f // 4 < seq` from `f < 4 * seq`).
    The lengths are judged in one walk of the kernel, an analyzer per length with the dimension
    bound to it (a walk of the kernel specialized at each length: 25 ms against 13 per kernel, over
    182 kernels of the transformer block over seq=1..512, Zen 4)."""
    func = mod["main"]
    syms = symbol_vars(func)
    if not syms:
        return _check_bounds(mod)
    if not _loads_under_select(mod, None):  # nothing a length could push out of bounds
        return
    from tvm.sym.analyzer import Analyzer
    analyzers = []
    for value in SYMBOLIC_PROBES + tuple(int(v) for v in bounds_of(func).values()):
        ana = Analyzer()
        for v in syms.values():
            ana.bind(v, tirx.IntImm("int64", value))  # (kernorch.backends.tvm.lower: int64 symbols)
        analyzers.append(ana)
    _refuse(_loads_under_select(tvm.IRModule({"main": func}), analyzers))


def _check_bounds(mod: tvm.IRModule) -> None:
    """Refuse a kernel with a load under a `Select` that may fall outside its buffer.

    `Select` evaluates both sides, and the simplifier uses its condition to drop index clamps, so
    such a load reads far outside the buffer (the concat segfaults of the first session). Guarded
    loads belong under `if_then_else`, which is lazy. TVM's OOBChecker is not used: it flags
    guarded loads as well (pool, pad, conv padding).
    """
    from tvm.sym.analyzer import Analyzer

    _refuse(_loads_under_select(mod, [Analyzer()]))


def _refuse(bad: list[str]) -> None:
    if bad:
        raise KernorchError(f"kernel may read out of bounds under a Select: {', '.join(bad[:3])}")


def _loads_under_select(mod: tvm.IRModule, analyzers) -> list[str]:
    """The loads under a `Select` that some analyzer of `analyzers` cannot prove inside their
    buffers (each analyzer holds its own facts: one per length a symbolic kernel is checked at);
    with None, every load under a `Select` whose indices are not opaque (a quick first look: a
    kernel without any needs no bounds check at any length)."""
    low = tvm.ir.transform.Sequential([s_tir.transform.LowerInitBlock(), s_tir.transform.ConvertBlocksToOpaque(),
                                       s_tir.transform.LowerOpaqueBlock()])(mod)
    bad: list[str] = []
    anas = analyzers or []

    def opaque(e) -> bool:
        """An index built from selects, loads or calls (reflect padding, gathered positions): its
        range is by construction, which interval analysis cannot follow; such loads are not judged."""
        if isinstance(e, (tirx.Select, tvm.ir.expr.TensorLoad)) or getattr(e, "args", None):
            return True
        return any(opaque(sub) for sub in operands(e))

    def inside(ana, idx, n) -> bool:
        b = ana.const_int_bound(idx)
        return b.min_value >= 0 and (b.max_value < int(n) if isinstance(n, tirx.IntImm) else ana.can_prove(idx < n))

    def load_ok(e) -> bool:
        if analyzers is None:
            return all(opaque(idx) for idx in e.indices)
        return all(opaque(idx) or all(inside(ana, idx, n) for ana in anas)
                   for idx, n in zip(e.indices, e.source.shape))

    def expr(e, in_select: bool) -> None:
        if is_load(e) and in_select and not load_ok(e):
            bad.append(f"{e.source.name}[{', '.join(str(i) for i in e.indices)}]")
        if isinstance(e, tirx.Select):
            expr(e.condition, in_select)
            expr(e.true_value, True)
            expr(e.false_value, True)
            return
        for sub in operands(e):
            expr(sub, in_select)

    def scope(condition):
        stack = contextlib.ExitStack()
        for ana in anas:
            stack.enter_context(ana.constraint_scope(condition))
        return stack

    def stmt(st) -> None:
        if isinstance(st, tirx.For):
            for ana in anas:
                ana.bind(st.loop_var, tvm.ir.Range.from_min_extent(st.min, st.extent))
            stmt(st.body)
        elif isinstance(st, tirx.SeqStmt):
            for x in st.seq:
                stmt(x)
        elif isinstance(st, tirx.BufferStore):
            expr(st.value, False)
        elif isinstance(st, tirx.IfThenElse):  # e.g. the tail guard of a non-dividing split
            with scope(st.condition):
                stmt(st.then_case)
            if st.else_case is not None:
                with scope(tirx.Not(st.condition)):
                    stmt(st.else_case)
        elif isinstance(st, (tirx.LetStmt, tirx.Bind)):
            for ana in anas:
                ana.bind(st.var, st.value)
            expr(st.value, False)
            if hasattr(st, "body"):
                stmt(st.body)
        elif isinstance(st, tirx.Evaluate):
            expr(st.value, False)
        elif hasattr(st, "body"):
            stmt(st.body)

    for _, func in low.functions.items():
        if isinstance(func, tirx.PrimFunc):
            stmt(func.body)
    return bad


def relax_func(mod: tvm.IRModule, name: str) -> tirx.PrimFunc:
    """The kernel's PrimFunc renamed for `bb.add_func(relax_func(mod, name), name)`.

    Every kernel is called "main" with global_symbol "main"; two of them (or one beside Relax's
    own main) in one Relax module fail with "IRModule contains duplicate global symbol: main".
    """
    return mod["main"].with_attr("global_symbol", name)


# ------------------------------------------------------------------------------------------------
# packed functions (library kernels callable from Relax)
# ------------------------------------------------------------------------------------------------


def register_packed(fn_dps: Callable[..., None], name: str) -> None:
    """Register `fn_dps(*inputs, *outputs)` (numpy arrays, outputs written in place) as the global
    packed function `name`, for `relax.call_dps_packed(name, args, out_ty=...)`.

    The arguments arrive as tvm tensors and are viewed zero-copy with np.from_dlpack. That is safe
    from Relax call_dps_packed; do NOT call it through TIR `call_packed` (borrowed DLTensor views
    segfault in from_dlpack). A process that loads an exported Relax library must register
    the same names again before running it.
    """

    def _call(*args):
        fn_dps(*[np.from_dlpack(a) for a in args])

    tvm_ffi.register_global_func(name, _call, override=True)

