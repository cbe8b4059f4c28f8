"""proxima's benchmarks, run from the repository root as modules:
`python -m benchmarks.bench_generation [--smoke]`. `benchmarks/README.md` has the current
figures and the command behind each."""
