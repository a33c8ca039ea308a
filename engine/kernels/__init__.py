"""The arithmetic: turns one planned tensor into output bytes, a chunk of elements at a time.
Compiled CPU kernels (numba: linear, ties, sparse, angle) and their torch counterparts
(torch_kernels with *_torch, top_k: CUDA, float64 and the references the compiled ones equal
bit for bit). Imports plan/ and io/, nothing of methods: a method hands its numbers down in
the plan."""
