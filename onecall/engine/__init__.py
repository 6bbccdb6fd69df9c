"""The engine: scheduling and bookkeeping around one step() loop (engine.py); tensors only in model_runner.py."""
