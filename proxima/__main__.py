"""`python -m proxima ...`, the form torchrun launches: `torchrun --nproc_per_node N -m
proxima train CONFIG key=value ...`."""

import sys

from proxima.cli import main

sys.exit(main())
