"""Code-generation backends.

`kernorch.backends.tvm` is the only module of the project that imports TVM: it lowers a candidate
kernel (a convex set of prims) to one TIR PrimFunc, applies a default CPU schedule, builds and
times it. `kernorch.backends.library` implements linear kernels (matmul/conv + elementwise
epilogue) with numpy/OpenBLAS, callable from a Relax VM through a registered packed function.
"""
