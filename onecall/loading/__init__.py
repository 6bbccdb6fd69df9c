"""A runnable model from a checkpoint: where formats/, model/ and kernels/ meet.

    weights.py      checkpoint tensors (Hugging Face names, from formats/) -> a DecoderLM's parameters,
                    fused projections stacked, MoE experts handed to their kernels
    packing.py      the CPU fast path: every projection packed into a FastLinear as it streams in
                    (the file's own 4-bit / int8 groups where the kernels run them), the logits head,
                    the embedding kept as the file's groups
    native_step.py  the one-call decode step, assembled from a packed model's layers
    pack_cache.py   a GGUF's packed projections, head and embedding kept on disk after a first load and
                    memory-mapped back on the next (neither decoded nor packed again)

Nothing here runs at step time except what it built; engine/engine_parts.py calls it.
"""
