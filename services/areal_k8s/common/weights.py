"""What the trainer and the engines share about weights in transit: bucket layout, the flattened-bucket wire format
and the checksum both sides compute.

The wire format is SGLang's `load_format: "flattened_bucket"` as v0.5.20 receives it (`FlattenedTensorBucket` in
sglang/srt/weight_sync/tensor_bucket.py): every tensor of a bucket, flattened and viewed as bytes, concatenated in
`names` order into one uint8 tensor that is broadcast once. The receiver allocates the same byte count from the
announced names/dtypes/shapes and views each slice back as its dtype and shape. That view needs every slice to
start at a multiple of its element size, which one dtype per bucket guarantees (`plan_buckets`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def plan_buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split tensors into consecutive buckets of at most `bucket_bytes`, keeping their order and one dtype per
    bucket (the receiver views byte slices as the dtype: a bfloat16 tensor of odd length would misalign a float32
    one after it). A tensor larger than the budget gets a bucket of its own.

    Lazily: a bucket is yielded as soon as the tensor after it is known not to fit, so a producer that makes each
    tensor on demand (a trainer converting its weights to the push dtype) never holds more than about a bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return _buckets(named_tensors, bucket_bytes)


def _buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    current: list[tuple[str, torch.Tensor]] = []
    current_bytes = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if current and (tensor.dtype != current[0][1].dtype or current_bytes + size > bucket_bytes):
            yield current
            current, current_bytes = [], 0
        current.append((name, tensor))
        current_bytes += size
    if current:
        yield current


def flatten_bucket(tensors: Iterable[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """One uint8 tensor holding every tensor's bytes, in order: what rank 0 broadcasts for a flattened bucket."""
    return torch.cat([t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def bucket_nbytes(dtypes: list[torch.dtype], shapes: list[list[int]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in zip(dtypes, shapes, strict=True))


def unflatten_bucket(flat: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views of a received flattened bucket as the announced tensors (no copy)."""
    if flat.dtype != torch.uint8 or flat.numel() != bucket_nbytes(dtypes, shapes):
        raise ValueError(
            f"a bucket of {bucket_nbytes(dtypes, shapes)} bytes was announced, got {flat.numel()} {flat.dtype}"
        )
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in zip(dtypes, shapes)]
    return [piece.view(dtype).view(shape) for piece, dtype, shape in zip(flat.split(sizes), dtypes, shapes)]


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype spelling SGLang's update API expects ("bfloat16", not "torch.bfloat16")."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: object) -> torch.dtype:
    """ "bfloat16" (or "torch.bfloat16") -> torch.bfloat16; only floating dtypes are weights."""
    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unsupported dtype {name!r}")
    return dtype


def weights_checksum(named_tensors: NamedTensors) -> tuple[dict[str, str], str]:
    """sha256 of each tensor's contiguous float32 CPU bytes, and one digest over all of them in sorted name order.

    Engine and trainer both call this, so equal digests mean the engine holds exactly the trainer's values (as
    float32: a bfloat16 engine matches a trainer that hashes the bfloat16-rounded tensors).
    """
    per_tensor = {
        name: hashlib.sha256(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()
        for name, tensor in named_tensors
    }
    combined = hashlib.sha256()
    for name in sorted(per_tensor):
        combined.update(f"{name}\0{per_tensor[name]}\n".encode())
    return per_tensor, combined.hexdigest()
