"""Tensor parallel: rank 0 sends each step's StepInputs (engine/step_inputs.py) to ranks 1 .. N-1.

    workers.py      rank 0's side: start_group() (or join torchrun's), run_step(), deaths, close
    worker_loop.py  ranks 1 .. N-1: join, load 1/N of the weights, run each step received
    messages.py     the gloo control group and the step's wire encoding

The engine uses it only through the StepGroup protocol (engine/step_inputs.py); nothing in
engine/ outside this folder imports it, except Engine starting a group when asked for N > 1.
"""
