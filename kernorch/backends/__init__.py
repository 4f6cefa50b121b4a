"""Code-generation backends and the registry of implementations.

`registry` declares every implementation a kernel can have (generated TIR, MetaSchedule-tuned TIR,
the reference evaluator for operators kept whole). `tvm` is the only package of kernorch that
imports TVM: lowering, schedules and micro-kernel tiles, builds, the Relax executable, MetaSchedule.
`reference` runs an operator kept whole through onnx's reference evaluator (a Python callback,
only when the user allows it).
"""
