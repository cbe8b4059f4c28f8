"""`python -m proxima ...`, the form torchrun launches: `torchrun --nproc_per_node N -m
proxima train CONFIG key=value ...`."""

from proxima.cli import run

run()
