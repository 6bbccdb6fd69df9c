"""The lab's experiments, in the order `onecall lab` runs them (the seed's order).

Each is a module of this package with NAME, TITLE and `run(ctx: LabContext) -> ExperimentResult`
(see onecall/lab/base.py). Modules are imported only when an experiment is about to run, so one
that is missing or broken fails that experiment with a clear message, not `import onecall.lab`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from onecall import InvalidParameterError

# experiment NAME -> module in this package (a module cannot be called `json`: it would shadow the stdlib's)
EXPERIMENT_MODULES: dict[str, str] = {
    "memory": "memory",
    "prefix_cache": "prefix_cache",
    "template": "template",
    "prefill_decode": "prefill_decode",
    "sampling": "sampling",
    "json": "json_exp",
    "tools": "tools",
}
EXPERIMENT_NAMES: tuple[str, ...] = tuple(EXPERIMENT_MODULES)


class ExperimentUnavailableError(ImportError):
    """An experiment's module is missing or does not provide NAME, TITLE and run()."""


def select_experiments(only: str | None) -> list[str]:
    """`--only a,b` -> ["a", "b"] in the registry's order; None -> all. Unknown names are an error
    that lists the valid ones."""
    if only is None:
        return list(EXPERIMENT_NAMES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in EXPERIMENT_MODULES]
    if unknown or not names:
        what = f"unknown experiment {', '.join(map(repr, unknown))}" if unknown else "no experiment named"
        raise InvalidParameterError("only", f"{what}; valid names: {', '.join(EXPERIMENT_NAMES)}")
    return [n for n in EXPERIMENT_NAMES if n in names]


def load_experiment(name: str) -> ModuleType:
    """Import the experiment's module and check its contract."""
    if name not in EXPERIMENT_MODULES:
        raise InvalidParameterError(
            "only", f"unknown experiment {name!r}; valid names: {', '.join(EXPERIMENT_NAMES)}"
        )
    module_name = f"{__name__}.{EXPERIMENT_MODULES[name]}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the module exists but something it imports does not: that is a real bug
        raise ExperimentUnavailableError(
            f"experiment {name!r}: module {module_name} is not written yet"
        ) from e
    missing = [attr for attr in ("NAME", "TITLE", "run") if not hasattr(module, attr)]
    if missing:
        raise ExperimentUnavailableError(f"experiment {name!r}: {module_name} lacks {', '.join(missing)}")
    if name != module.NAME:
        raise ExperimentUnavailableError(f"experiment {name!r}: {module_name}.NAME is {module.NAME!r}")
    return module
