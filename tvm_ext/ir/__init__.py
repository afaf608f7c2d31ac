"""Reading Relax and TIR for planning: the DataflowGraph (`graph`, plain data, the planners'
input) and what builds it (`graph_builder`, `kernel_cost`), the kernel index analysis
(`kernel_dims`), one chunk of a kernel (`local_kernels`, used by partitioning in space), and
target kinds (`targets`).

Importing this package imports nothing else: `tvm_ext.ir.graph` stays free of TVM for the
planners that read it.
"""
