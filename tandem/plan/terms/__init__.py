"""The cost terms of one strategy, each a pure function of the inputs returning numbers (and the facts an
explanation needs), never sentences: memory, compute (efficiency, attention kernels, GEMM shapes,
bandwidth-bound kernels), pipeline stages, and each communication term (data-parallel, tensor, pipeline,
context, expert) over the collective and NCCL-algorithm models. cost.py composes them."""
