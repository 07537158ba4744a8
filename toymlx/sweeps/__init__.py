"""Many runs of one recipe (`toymlx-sweep`): a plan of runs from a grid or random draws, run as
`toymlx-train` children by a supervisor, watched live, summarised.

    specs = grid(["--steps", "200"], {"lr": [1e-3, 3e-3], "model.d_model": [64, 128]})
    result = run_sweep("from-scratch", specs, root="runs", workers=2)

The sweep's public names, each from the module that holds its idea: `spec` (the plan and its
record), `draws` (random-search distributions), `supervisor` (the children), `live` (the live
view), `summary` (summary.csv, report.png)."""

from toymlx.sweeps.draws import IntUniform, LogUniform, Uniform
from toymlx.sweeps.spec import (
    MAX_RUNS,
    RunSpec,
    changed_options,
    default_sweep_id,
    file_axis,
    grid,
    parse_axis,
    random,
    run_name,
    shard_specs,
    value_args,
)
from toymlx.sweeps.summary import SweepResult, summarize_sweep
from toymlx.sweeps.supervisor import run_state, run_sweep

__all__ = ["MAX_RUNS", "IntUniform", "LogUniform", "RunSpec", "SweepResult", "Uniform",
           "changed_options", "default_sweep_id", "file_axis", "grid", "parse_axis", "random",
           "run_name", "run_state", "run_sweep", "shard_specs",
           "summarize_sweep", "value_args"]
