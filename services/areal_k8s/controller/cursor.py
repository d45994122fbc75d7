"""The dataset cursor: which prompt the controller admits next when no failed one waits."""

from __future__ import annotations

import random


class DataCursor:
    """Walks the dataset epoch after epoch, in a fresh deterministic order each epoch."""

    def __init__(self, size: int, *, seed: int, shuffle: bool, epoch: int = 0, position: int = 0):
        if size == 0:
            raise ValueError("the training dataset is empty")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = epoch, position
        self._order = self._order_for(epoch)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> int:
        if self.position == self.size:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._order_for(self.epoch)
        index = self._order[self.position]
        self.position += 1
        return index
