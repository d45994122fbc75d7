"""Qwen3 (dense): Llama's decoder with an RMSNorm on each head's queries and keys, no projection biases."""

from areal_k8s.trainer.backends.megatron.convert.common import Family

FAMILY = Family(model_types=("qwen3",), qk_norm=True)
