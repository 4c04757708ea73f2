"""``--speculative-config``: vLLM's JSON shape, checked once, errors naming the field."""

from __future__ import annotations

import pytest

from vmkv.config import EngineConfig
from vmkv.spec_decode.config import SpeculativeConfig


def test_vllm_json_and_defaults() -> None:
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4,'
                          ' "prompt_lookup_max": 3}')
    spec = config.speculative_config
    assert isinstance(spec, SpeculativeConfig)
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 4)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)  # vLLM's rule
    both = EngineConfig(speculative_config={"method": "[ngram]", "num_speculative_tokens": 2})
    assert both.speculative_config.prompt_lookup_min == 5  # type: ignore[union-attr]
    assert EngineConfig().speculative_config is None
    assert EngineConfig(speculative_config=spec).speculative_config is spec


@pytest.mark.parametrize("value, field", [
    ("{", "JSON object"),
    ("[1]", "JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "speculative_config.method"),
    ('{"method": "ngram"}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}',
     "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "speculative_config.prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}',
     "speculative_config.lookahead"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": 1}',
     "speculative_config.adaptive"),
])
def test_bad_values_name_the_field(value: str, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineConfig(speculative_config=value)


def test_the_command_line_takes_the_json() -> None:
    import argparse

    from vmkv.config_args import add_engine_args, config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config",
                              '{"method": "suffix", "num_speculative_tokens": 6}'])
    config = config_from_args(EngineConfig, args)
    assert config.speculative_config.method == "suffix"  # type: ignore[union-attr]
