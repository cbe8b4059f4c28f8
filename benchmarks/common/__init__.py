"""What the benchmark scripts share: the workloads and their assets (tiny models,
tokenizers, prompt files, the real model), the FLOP model, timing and memory readings, and
`proxima train` runs read back from their metrics."""
