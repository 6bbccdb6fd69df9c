"""How a matmul, an embedding lookup or attention runs on one kind of hardware; no model classes.

    cpu/    native C kernels (csrc/, built at first use by native_build.py, bound from the one header
            csrc/kernels.h by native_abi.py, called through native.py): 4-bit and int8 GEMMs,
            decode and prefill attention, the one-call decode step, embedding rows, argmax; fast_linear.py and
            fast_embedding.py are the torch modules over them (FastLinear, FastLMHead, StoredEmbedding)
            experts.py: a MoE layer's experts on their groups; ops.py: the C kernels behind ops.py
    cuda/   Triton: paged attention (triton_attention.py), the fused small ops (fused_ops.py)
    ops.py  the interface the network (model/) calls: LayerOps, AttentionKernels, ExpertKernels
    select.py  which implementation a model is built on and a step's attention runs on

model/ imports ops.py and select.py only; packing weights into the kernels' layouts happens in loading/.
"""
