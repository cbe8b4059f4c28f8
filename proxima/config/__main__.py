"""`python -m proxima.config`: the README's config table, generated from the fields."""

from proxima.config.plans import keys_markdown

print(keys_markdown())
