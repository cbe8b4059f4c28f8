"""`python -m proxima.cli`: the `proxima` command."""

from proxima.cli import run

run()
