"""Model files -> tensors and a config. Knows nothing of kernels or of the network's modules.

    checkpoint.py         resolve a model (GGUF file, HF folder, the embedded default); iterate its
                          tensors under Hugging Face names; refuse unsafe formats (no pickle, ever)
    gguf.py               the GGUF reader: header, metadata, tensor directory, every read bounds-checked
    gguf_layout.py        llama.cpp's tensor names and metadata -> Hugging Face names and config.json
    gguf_rope_scaling.py  a GGUF's RoPE scaling keys and factor tensors -> the config's rope_scaling
    ggml_types.py         ggml type ids, block sizes, typed metadata reads
    quants.py             GGML blocks -> float tensors, or kept as stored groups (StoredGroups) for the
                          kernels to pack
    hf_config.py          a config.json dict -> ModelConfig (refusing what we would run wrong)
    hf_rope_config.py     Hugging Face rope_scaling variants -> RopeScaling
    fused.py              fused checkpoint projections (Phi-3's qkv_proj, gate_up_proj) split into parts

It imports model/config.py (the ModelConfig it builds) and nothing else of the model.
"""
