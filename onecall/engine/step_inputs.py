"""What one step hands the model runner, and the handle a tensor-parallel group offers the engine.

    StepInputs      one step's packed batch as plain ints: ModelRunner.pack makes it, ModelRunner.run
                    runs it; under tensor parallel rank 0 sends it to every other rank (engine/tp/)
    PromptLogitsFn  how run() hands back the raw logits of prompt positions (prompt logprobs)
    StepGroup       rank 0's handle on the other ranks (engine/tp/workers.py's TensorParallelGroup),
                    as the loader, the runner and the engine use it: nothing here imports engine/tp/

Kept apart so that the runner, the static decode buffers and the tensor-parallel transport all
import these types without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from onecall.model.parallel import TensorParallel

# on_prompt_logits(k, lo, logits): rows lo .. lo + len(logits) - 1 of StepInputs.prompt_rows[k]
PromptLogitsFn = Callable[[int, int, torch.Tensor], None]


@dataclass
class StepInputs:
    """One step's packed batch as plain ints: all a rank needs to run the forward and the logits."""

    copies: list[tuple[int, int]]  # (src_slot, dst_slot) copy-on-write, applied before the forward
    input_ids: list[int]  # (num_tokens,) decode rows first
    positions: list[int]  # (num_tokens,)
    block_tables: list[Seq[int]]  # per sequence (rank 0: live views, read-only within the step)
    seq_lens: list[int]  # per sequence: KV length after this step
    query_lens: list[int]  # per sequence: tokens fed now
    run_lengths: list[int]  # per sequence: leading consecutive blocks (BlockManager.first_run_length)
    sample_rows: list[int]  # packed rows whose logits are sampled, in batch order
    prompt_rows: list[tuple[int, int]]  # (first packed row, count) per sequence collecting prompt logprobs
    num_decode: int  # the first num_decode sequences decode one token each
    # a hybrid model (engine/state_slots.py): per sequence its state slot, and the (src, dst) slot
    # copies (snapshots taken or resumed) applied before the forward; empty otherwise
    state_slots: list[int] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # (packed sequence index, position p, slot): the forward also writes the state after p tokens
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)


class StepRunner(Protocol):
    """What a group runs on rank 0 once the step is sent (ModelRunner)."""

    def run(self, step: StepInputs, on_prompt_logits: PromptLogitsFn | None = None) -> torch.Tensor: ...


class StepGroup(Protocol):
    """Rank 0's handle on a tensor-parallel group (engine/tp/workers.py's TensorParallelGroup)."""

    tp: TensorParallel  # this rank's place in the group (rank 0 of N)
    device: torch.device
    dead_reason: str | None  # set once a rank died or a step failed: the group is unusable

    def run_step(
        self, runner: StepRunner, step: StepInputs, on_prompt_logits: PromptLogitsFn | None
    ) -> torch.Tensor:
        """Send `step` to the other ranks, then run it here; the sampling rows' logits."""
        ...

    def agree_num_blocks(self, num_blocks: int) -> int: ...

    def check_workers(self) -> None: ...

    def close(self) -> None: ...
