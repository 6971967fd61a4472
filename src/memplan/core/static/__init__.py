"""The paper's static memory analysis: the training graph with Alg. 2's mirror nodes, mirror
plans, and the Fig. 2 allocator (in-place and buffer sharing)."""
