"""Our params back to Hugging Face names: the exact inverse of the loader."""

import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax.checkpoint.hf import load_hf_checkpoint, to_hf_config, to_hf_state_dict
from vegas_jax.loading import load_model


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mqa-tied", "qwen3-untied"])
def test_state_dict_round_trip(tiny_hf, kind):
    path, torch_model = tiny_hf(kind)
    m = load_model(checkpoint=path, dtype=jnp.float32)
    ours = to_hf_state_dict(m.config, load_hf_checkpoint(path, jnp.float32)[1])
    theirs = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()
              if not k.endswith("rotary_emb.inv_freq")}
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
    hf = to_hf_config(m.config)
    cfg = torch_model.config
    assert hf["num_key_value_heads"] == cfg.num_key_value_heads
    assert hf["tie_word_embeddings"] == cfg.tie_word_embeddings


def test_folded_params_give_the_same_hf_model(tiny_hf):
    """`load_model` folds the norm weights into the projections; written back to HF names
    (norms as ones) they compute what the original checkpoint computes."""
    import torch

    path, torch_model = tiny_hf("qwen3-untied")
    m = load_model(checkpoint=path, dtype=jnp.float32)
    assert m.params.layers.attn_norm is None
    sd = to_hf_state_dict(m.config, m.params)
    assert np.all(sd["model.layers.0.input_layernorm.weight"] == 1)
    folded = type(torch_model)(torch_model.config).eval()
    folded.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, strict=False)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        np.testing.assert_allclose(folded(ids).logits.numpy(), torch_model(ids).logits.numpy(),
                                   rtol=1e-4, atol=1e-4)
