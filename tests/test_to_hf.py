"""Our params back to Hugging Face names: the exact inverse of the loader."""

import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax.checkpoint.hf import to_hf_config, to_hf_state_dict
from vegas_jax.loading import load_model


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mqa-tied", "qwen3-untied"])
def test_state_dict_round_trip(tiny_hf, kind):
    path, torch_model = tiny_hf(kind)
    m = load_model(checkpoint=path, dtype=jnp.float32)
    ours = to_hf_state_dict(m.config, m.params)
    theirs = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()
              if not k.endswith("rotary_emb.inv_freq")}
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
    hf = to_hf_config(m.config)
    cfg = torch_model.config
    assert hf["num_key_value_heads"] == cfg.num_key_value_heads
    assert hf["tie_word_embeddings"] == cfg.tie_word_embeddings
