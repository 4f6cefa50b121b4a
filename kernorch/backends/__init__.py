"""Code-generation backends.

`kernorch.backends.tvm` is the only module of the project that imports TVM: it lowers a candidate
kernel (a convex set of prims) to one TIR PrimFunc, applies a default CPU schedule, builds and
times it. `kernorch.backends.library` implements linear kernels (matmul/conv + elementwise
epilogue) with numpy/OpenBLAS, callable from a Relax VM through a registered packed function.
"""

#: implementations that run as Python-registered packed functions (Relax `call_dps_packed`)
PACKED = ("library", "ort")


def _module(impl: str):
    if impl == "library":
        from . import library
        return library
    if impl == "ort":
        from . import ort_kernels
        return ort_kernels
    raise ValueError(f"{impl!r} is not a packed implementation")


def packed_supports(impl, graph, members, inputs, outputs):
    """None if `impl` can implement the kernel, else the reason."""
    return _module(impl).supports(graph, members, inputs, outputs)


def packed_kernel(impl, graph, members, inputs, outputs):
    """A callable kernel (`k(*arrays) -> outputs`, `k.run_dps(*inputs, *outputs)`)."""
    return _module(impl).make(graph, members, inputs, outputs)
