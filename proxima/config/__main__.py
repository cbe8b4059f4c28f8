"""`python -m proxima.config > docs/config.md`: the configuration reference, from the fields."""

from proxima.config.reference import reference_markdown

print(reference_markdown(), end="")
