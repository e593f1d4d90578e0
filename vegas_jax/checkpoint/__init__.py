"""Checkpoint readers and writers: Hugging Face safetensors, llama.cpp GGUF -> params;
params <-> orbax checkpoint directories (`load_model` calls the readers; the `convert`
command calls both, and depends on this package, never the reverse).

Every reader returns host (numpy) arrays in a `vegas_jax.model.Params` tree;
`vegas_jax.loading.load_model` moves them to the device. Nothing here imports torch.
Submodules are imported on use: reading a GGUF needs neither orbax nor safetensors code.
"""
