"""Qwen2 and Qwen2.5: Llama's decoder with biases on the query, key and value projections."""

from areal_k8s.trainer.backends.megatron.convert.common import Family

FAMILY = Family(model_types=("qwen2",), qkv_bias=True)
