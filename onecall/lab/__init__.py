"""The lab: `onecall lab` reproduces the seed's measurements of one call on whatever model is loaded.

    onecall/lab/
      base.py         the contract: LabContext in, ExperimentResult (+ SeedRows) out
      experiments/    one module per experiment, the registry in __init__ (run order)
      runner.py       load once, run each, catch failures, write results.json + reports
      report.py       report.md and report.html (plots inline), markdown helpers
      plots.py        line_plot / bar_plot: every PNG the same size and dpi
      cli.py          the `onecall lab` flags and command (also `python -m onecall.lab`)

Importing this package is cheap: torch, matplotlib and the experiments load only when a run starts.
"""
