"""The systems bench_vs_trl.py times on one workload: proxima, TRL and the eager floor, each
a function `cell(spec, workload, assets, iterations, workdir) -> [one record per
iteration]`, and the child process that runs one of them (`cell.run_cell`)."""
