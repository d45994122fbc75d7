"""The `megatron` backend: a megatron-core GPTModel built from a Hugging Face config, tensor- and data-parallel over
the trainer world, its weights converted to and from Hugging Face names (convert/, one file per model family)."""
