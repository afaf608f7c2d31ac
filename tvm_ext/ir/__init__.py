"""Reading Relax and TIR for planning: what builds the planners' `tvm_ext.graph.DataflowGraph`
(`graph_builder`, `kernel_cost`), the kernel index analysis (`kernel_dims`), one chunk of a
kernel (`local_kernels`, used by partitioning in space and by splitting in time), and target
kinds (`targets`).

Importing this package imports nothing else.
"""
