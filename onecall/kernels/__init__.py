"""How a matmul, an embedding lookup or attention runs on one kind of hardware; no model classes.

    cpu/    native C kernels (csrc/, built at first use by native_build.py, bound from the one header
            csrc/kernels.h by native_abi.py, called through native.py): 4-bit and int8 GEMMs,
            decode and prefill attention, the one-call decode step, embedding rows, argmax; fast_linear.py and
            fast_embedding.py are the torch modules over them (FastLinear, FastLMHead, StoredEmbedding)
    cuda/   Triton: paged attention (triton_attention.py)

The network (model/) calls these; what installs them into a model's layers (model/packing.py,
model/native_step.py, model/triton_ops.py) lives beside the network, not here.
"""
