"""`composer_diloco.policy.context_length`: the run's max_seq_len against the positions a model config declares."""

import pytest
from transformers import GPT2Config, LlamaConfig

from composer_diloco.config import ConfigError
from composer_diloco.policy import load_default_tokenizer, tiny_model_config
from composer_diloco.policy.context_length import check_context_length, model_positions


def test_the_positions_of_each_config_family():
    assert model_positions(tiny_model_config(load_default_tokenizer(), 0)) == 2048  # coding episodes reach ~1,150
    assert model_positions(LlamaConfig(max_position_embeddings=8192)) == 8192
    assert model_positions(GPT2Config(n_positions=1024)) == 1024
    assert model_positions(object()) is None  # declares none: not checked
    check_context_length(10**6, object(), "some/model")


def test_a_longer_max_seq_len_is_one_line_naming_both():
    llama = LlamaConfig(max_position_embeddings=8192)
    check_context_length(8192, llama, "meta-llama/Llama-3.1-8B-Instruct")  # equal fits
    with pytest.raises(ConfigError, match=r"^max_seq_len = 8193 tokens is longer than the 8192 positions of "
                                          r"'meta-llama/Llama-3\.1-8B-Instruct' .*set max_seq_len <= 8192$"):
        check_context_length(8193, llama, "meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(ConfigError, match="the embedded default"):
        check_context_length(4096, tiny_model_config(load_default_tokenizer(), 0), None)
