"""The lab's contract: what an experiment receives and what it returns.

    onecall lab -> runner: load the model once -> for each experiment: run(ctx) -> ExperimentResult
               -> results.json, report.md, report.html (plots inline), PNGs

An experiment is a module in onecall/lab/experiments/ with a `NAME`, a `TITLE`
and `run(ctx: LabContext) -> ExperimentResult`. It drives the engine only
through the public Python API (the names in `onecall.__all__`: LLM and its `info`,
SamplingParams, RequestOutput and its trace); it never reaches into the engine
(tests/lab/test_lab_public_api.py checks). It writes its
plots into `ctx.out_dir` and returns their paths; the report embeds them.

Every experiment sets `seed_rows`: the seed's figure beside ours (the seed
measured Qwen3-8B on one GPU; `ctx.setting` says what we ran on), so the
report explains each difference instead of hiding it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onecall import LLM


@dataclass
class SeedRow:
    """One line of the seed-against-ours table."""

    figure: str  # what is measured, e.g. "tokens prefilled over 10 turns (cache on / off)"
    seed: str  # the seed's value, as the seed states it, e.g. "999 / 5,549"
    ours: str  # our value, formatted the same way
    note: str = ""  # why they differ, when they do (model size, device, template)


@dataclass
class LabContext:
    """What every experiment gets. `llm` is loaded once and shared by all experiments;
    an experiment that needs another configuration (e.g. the prefix cache disabled) builds
    its own `LLM(**ctx.engine_kwargs, enable_prefix_caching=False)`."""

    llm: LLM
    engine_kwargs: dict[str, Any]  # model, dtype, device, ... as given to the first LLM
    out_dir: Path
    calls: int  # --calls: repetitions for the sampled experiments (json); seed used 80
    quick: bool = False  # reduced form for tests: fewer turns, shorter prompts, fewer calls
    progress: Callable[[str], None] = print  # one line per unit of work, shown while it runs

    @property
    def setting(self) -> str:
        """'<model> on <device>, <dtype>', for the report's headers."""
        info = self.llm.info
        return f"{info.model_name} on {info.device}, {info.dtype}"


@dataclass
class ExperimentResult:
    name: str  # the experiment's NAME; results.json key
    title: str
    results: dict[str, Any]  # JSON-serializable measurements: results.json[name]
    seed_rows: list[SeedRow] = field(default_factory=list)
    markdown: str = ""  # the section body: tables, the answers shown, explanations
    plots: list[Path] = field(default_factory=list)  # PNG files written under ctx.out_dir
