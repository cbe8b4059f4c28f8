"""`reward.sources` read and checked (`config.sources`): each mistake named, before any
work."""

from __future__ import annotations

import pytest

from proxima.config import ConfigError, load_config
from proxima.config.sources import reward_sources


@pytest.mark.parametrize(
    "sources, match",
    [
        ("[{name: a, function: f.py:g, model_path: m}]", "exactly one of"),
        ("[{name: a, function: f.py:g, batch_size: 4}]", "unknown keys \\['batch_size'\\]"),
        ("[{name: a, function: f.py:g}, {name: a, url: 'http://x'}]", "appear twice"),
        ("[{name: 'a b', function: f.py:g}]", "short name"),
        ("[{name: a, url: 'ftp://x'}]", "http://"),
        ("[{name: a, url: 'http://x', on_error: ignore}]", "on_error"),
        ("[{name: a, function: f.py:g, weight: heavy}]", "must be a number"),
        (
            "[{name: a, function: f.py:g, weight: 0}, {name: b, url: 'http://x', weight: 0.0}]",
            "has weight 0",
        ),
    ],
)
def test_source_mistakes_are_named(sources, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["task.name=arithmetic", f"reward.sources={sources}"])


def test_a_weight_in_exponent_notation_is_a_number():
    """YAML 1.1 reads `1e30` (no dot) as a string; a weight takes it as the number."""
    cfg = load_config(
        None, ["task.name=arithmetic", "reward.sources=[{name: a, function: f.py:g, weight: 1e30}]"]
    )
    assert [s.weight for s in reward_sources(cfg)] == [1e30]


def test_sources_and_the_single_keys_together_are_refused():
    with pytest.raises(ConfigError, match="not both"):
        load_config(
            None,
            [
                "task.name=arithmetic",
                "reward.function=f.py:g",
                "reward.sources=[{name: a, function: f.py:g}]",
            ],
        )
