"""What rank 0 tells the tensor-parallel workers each step, and the group it travels on.

The step on the wire (two broadcasts of int64 tensors, nothing pickled): a header of HEADER_LEN
ints, [kind, num_copies, num_tokens, num_seqs, num_table_entries, num_sample_rows,
num_prompt_rows, num_decode], then, for a STEP, one payload tensor with the StepInputs lists laid
end to end in that order (copies as src, dst pairs; block tables as their lengths, then their ids;
prompt rows as row, count pairs). A SHUTDOWN is a header alone, its sizes all 0.

    rank 0 (engine/tp/workers.py)                       ranks 1 .. N-1 (engine/tp/worker_loop.py)
    encode_step(step) -> broadcast header, payload       receive_step(): header, then the payload
    close(): broadcast shutdown_header()                 receive_step() -> None

Backends: the model's collectives run on gloo on CPU, NCCL on CUDA (rank r on cuda:r). The step
messages (and the KV agreement) always go through a gloo group of CPU tensors (the default group
on CPU; a second group, control_group(), on CUDA), as vLLM sends its metadata: an idle worker then
waits on a socket, not in a spinning NCCL kernel, and a dead peer closes that socket. The groups'
timeout is long on purpose: a worker waits in the header broadcast as long as the server is idle.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from onecall.engine.step_inputs import StepInputs

SHUTDOWN, STEP = 0, 1
HEADER_LEN = 8
GROUP_TIMEOUT = datetime.timedelta(days=365)  # idle servers: workers wait in a broadcast meanwhile


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def control_group(device: torch.device) -> dist.ProcessGroup | None:
    """The group the step messages go through: gloo (None: the default group, already gloo on CPU).
    Every rank calls this once, at the same point, after the default group is up."""
    if backend_for(device) == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)


def shutdown_header() -> torch.Tensor:
    """The header that ends the workers' loop (no payload follows)."""
    return torch.tensor([SHUTDOWN] + [0] * (HEADER_LEN - 1), dtype=torch.int64)


def receive_step(control: dist.ProcessGroup | None) -> StepInputs | None:
    """The next step rank 0 broadcasts; None for SHUTDOWN."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0, group=control)
    kind, *sizes = header.tolist()
    if kind == SHUTDOWN:
        return None
    assert kind == STEP, f"unknown tensor-parallel message {kind}"
    payload = torch.empty(_payload_len(sizes), dtype=torch.int64)
    dist.broadcast(payload, src=0, group=control)
    return decode_step(sizes, payload.tolist())


def encode_step(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """StepInputs -> (header, payload) int64 CPU tensors (see the module docstring)."""
    assert not (step.state_slots or step.state_copies or step.state_snapshots), "a hybrid model's state stays on rank 0"
    tables = step.block_tables
    sizes = [
        len(step.copies),
        len(step.input_ids),
        len(step.seq_lens),
        sum(len(t) for t in tables),
        len(step.sample_rows),
        len(step.prompt_rows),
        step.num_decode,
    ]
    flat: list[int] = [x for pair in step.copies for x in pair]
    flat += step.input_ids
    flat += step.positions
    flat += step.seq_lens
    flat += step.query_lens
    flat += step.run_lengths
    flat += [len(t) for t in tables]
    for t in tables:
        flat += t
    flat += step.sample_rows
    flat += [x for pair in step.prompt_rows for x in pair]
    assert len(flat) == _payload_len(sizes), "the step's lists disagree with their counts"
    return torch.tensor([STEP, *sizes], dtype=torch.int64), torch.tensor(flat, dtype=torch.int64)


def decode_step(sizes: list[int], flat: list[int]) -> StepInputs:
    num_copies, num_tokens, num_seqs, _, num_sample, num_prompt, num_decode = sizes
    pos = 0

    def take(n: int) -> list[int]:
        nonlocal pos
        pos += n
        return flat[pos - n : pos]

    copies = take(2 * num_copies)
    input_ids, positions = take(num_tokens), take(num_tokens)
    seq_lens, query_lens, run_lengths = take(num_seqs), take(num_seqs), take(num_seqs)
    tables = [take(n) for n in take(num_seqs)]
    sample_rows = take(num_sample)
    prompt = take(2 * num_prompt)
    assert pos == len(flat), "the payload is longer than its header says"
    return StepInputs(
        copies=list(zip(copies[::2], copies[1::2], strict=True)),
        input_ids=input_ids,
        positions=positions,
        block_tables=list(tables),
        seq_lens=seq_lens,
        query_lens=query_lens,
        run_lengths=run_lengths,
        sample_rows=sample_rows,
        prompt_rows=list(zip(prompt[::2], prompt[1::2], strict=True)),
        num_decode=num_decode,
    )


def _payload_len(sizes: list[int]) -> int:
    num_copies, num_tokens, num_seqs, num_table_entries, num_sample, num_prompt, _ = sizes
    return 2 * num_copies + 2 * num_tokens + 4 * num_seqs + num_table_entries + num_sample + 2 * num_prompt
