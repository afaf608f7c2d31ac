"""The emitters SwapOffload (passes/swap_offload.py) writes a planned function with; helpers of
that pass, not passes. They write IR, so they live beside the pass rather than in
`tvm_ext.ir` (which only reads it):

- `emission`: what the emitters share (the graph, the plan, the block builder, each tensor's
  device value now and its host copy, the pools) and the placing of a tensor in its window;
- `whole_ops`: an op called whole at its position of the schedule, its outputs in their windows
  (a recomputed tensor is its kernel called again at its second position), an optimizer update
  written in place, and the swap-outs and swap-ins between ops;
- `chunked_ops`: an op run in chunks (`tvm_ext.swap.split`), its cut inputs and outputs copied
  chunk by chunk through its buffers while the chunk kernel runs, reductions added up over the
  chunks and an epilogue run once after them;
- `function`: the rewritten function around them (arguments on their devices, the pools, the
  schedule, the outputs).
"""
