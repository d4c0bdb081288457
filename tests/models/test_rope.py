"""YaRN's frequencies and attention factor against transformers' own, over the settings checkpoints
use: a factor alone (Qwen3), beta bounds, an explicit attention factor, DeepSeek's mscale pair, an
untruncated ramp, and a factor implied by the context lengths."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.models.rope import yarn_frequencies

pytest.importorskip("transformers")

SETTINGS = [
    {"factor": 4.0, "original_max_position_embeddings": 32768},
    {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
    {"factor": 4.0, "original_max_position_embeddings": 8192, "attention_factor": 1.3},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
    {"factor": 2.0, "original_max_position_embeddings": 2048, "truncate": False},
    {"factor": None, "original_max_position_embeddings": 32768},
]


@pytest.mark.parametrize("scaling", SETTINGS)
@pytest.mark.parametrize("head_dim,partial", [(128, 1.0), (128, 0.75)])
def test_yarn_matches_transformers(scaling, head_dim, partial):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.Qwen3Config(hidden_size=1024, num_attention_heads=8, head_dim=head_dim,
                                      max_position_embeddings=131072,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 1e6,
                                                       "partial_rotary_factor": partial} | scaling)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got, factor = yarn_frequencies(1e6, int(head_dim * partial), scaling, 131072)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert factor == pytest.approx(want_factor, rel=1e-7)


def test_a_gguf_s_yarn_keys_read_as_transformers_settings():
    """llama.cpp's converter writes HF's factor, original context, betas and attention factor as
    keys of their own, and DeepSeek-style mscale_all_dim as a log multiplier over an mscale of 1."""
    from kiln.models.gguf_loader import _yarn_scaling
    from kiln.runtime.errors import ModelLoadError

    def reader(values):
        return lambda k, default=None, required=False: values.get(k, default)

    keys = {"rope.scaling.factor": 40.0, "rope.scaling.original_context_length": 4096,
            "rope.scaling.yarn_beta_fast": 16.0, "rope.scaling.yarn_log_multiplier": 0.707}
    assert _yarn_scaling(reader(keys)) == {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                           "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16.0}
    with pytest.raises(ModelLoadError, match="extrapolation factor"):
        _yarn_scaling(reader(keys | {"rope.scaling.yarn_ext_factor": 0.5}))
