"""Attention ops for vegas_jax: each file holds the Pallas kernel, its `pallas_call`
wrapper, the public op and the `jnp` reference it is tested against."""
