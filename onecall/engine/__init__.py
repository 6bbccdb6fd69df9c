"""The engine: scheduling and bookkeeping around one step() loop (engine.py).

Pure Python (no tensors): engine, intake, scheduler, block_manager, radix_cache, sequence, outputs,
postprocess, trace. Tensors: model_runner (a batch -> the model -> logits), decode_graphs (static
buffers, CUDA graphs), engine_parts (loading), tp/ (tensor parallel).
"""
