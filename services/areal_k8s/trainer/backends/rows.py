"""A micro-batch's rows as a model reads them, and where their scored tokens are, worked out on the host before the
micro-batch moves to the device: the step then picks the scored positions with index tensors, not boolean masks (a
boolean selection on a GPU waits for the GPU to count its elements: a host synchronisation in every forward).

`PaddedRows` are the micro-batch's right-padded rows as they are. `PackedRows` (`trainer.packing: packed`) lay the
rows' real tokens end to end in one row, with the positions and sequence bounds that variable-length attention
(attention.py) and rotary embeddings need, so no padding is computed. Either way the log-probabilities come back in
the micro-batch's own right-padded [rows, L − 1] layout (`scatter`), which is what the loss reads: packing changes
what the model computes, not what the step sees.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting for the device: to a GPU from pinned memory, asynchronously
    (a copy from pageable memory makes the host wait for the copy's stream, and so for all the work queued before)."""
    if device.type != "cuda" or tensor.is_cuda:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class _Rows:
    scored: torch.Tensor  # [S]: flat indices into the micro-batch's [rows × (L − 1)] next-token layout
    shape: tuple[int, int]  # (rows, L − 1)

    def to(self, device: torch.device):
        return replace(
            self,
            **{
                f.name: to_device(v, device)
                for f in fields(self)
                if isinstance(v := getattr(self, f.name), torch.Tensor)
            },
        )

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """`values` [S], one per scored position, put in place in a zero [rows, L − 1] tensor."""
        return values.new_zeros(self.shape[0] * self.shape[1]).index_copy(0, self.scored, values).view(self.shape)


@dataclass(frozen=True)
class PaddedRows(_Rows):
    input_ids: torch.Tensor  # [rows, L]
    attention_mask: torch.Tensor  # [rows, L]
    full: bool  # no row is padded

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PaddedRows:
        rows, length = input_ids.shape
        return cls(
            scored=attention_mask[:, 1:].reshape(-1).nonzero().squeeze(1),
            shape=(rows, length - 1),
            input_ids=input_ids,
            attention_mask=attention_mask,
            full=bool(attention_mask.all()),
        )

    def scored_hidden(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the model's hidden states [rows, L, H]: those that predict a scored token [S, H], and the tokens [S]."""
        flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        return flat.index_select(0, self.scored), self.input_ids[:, 1:].reshape(-1).index_select(0, self.scored)


@dataclass(frozen=True)
class PackedRows(_Rows):
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]: each sequence's own positions, from 0
    cu_seqlens: torch.Tensor  # [N + 1] int32: where each sequence starts, then T
    sources: torch.Tensor  # [S]: the packed positions whose next token is scored
    targets: torch.Tensor  # [S]: those next tokens
    max_length: int

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
        real = attention_mask.bool()
        rows, length = real.shape
        lengths = real.sum(1)
        starts = torch.cumsum(lengths, 0) - lengths
        positions = torch.arange(length).expand(rows, length)
        next_real = real[:, 1:]
        sources = (starts[:, None] + positions[:, :-1])[next_real]
        packed = input_ids[real]
        return cls(
            scored=(torch.arange(rows)[:, None] * (length - 1) + positions[:, :-1])[next_real],
            shape=(rows, length - 1),
            input_ids=packed[None],
            position_ids=positions[real][None],
            cu_seqlens=torch.cat([starts, lengths.sum().reshape(1)]).to(torch.int32),
            sources=sources,
            targets=packed[sources + 1],
            max_length=int(lengths.max()),
        )

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]

    def scored_hidden(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the model's hidden states [1, T, H]: those that predict a scored token [S, H], and the tokens [S]."""
        return hidden[0].index_select(0, self.sources), self.targets


def rows_of(input_ids: torch.Tensor, attention_mask: torch.Tensor, packing: str) -> PaddedRows | PackedRows:
    """A right-padded micro-batch's rows (on the host) as `trainer.packing` lays them out."""
    return (PackedRows if packing == "packed" else PaddedRows).of(input_ids, attention_mask)
