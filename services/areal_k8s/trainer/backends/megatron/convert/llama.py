"""Llama (2, 3 and 3.x without rope scaling): the reference decoder, no biases, no query/key norms."""

from areal_k8s.trainer.backends.megatron.convert.common import Family

FAMILY = Family(model_types=("llama",))
