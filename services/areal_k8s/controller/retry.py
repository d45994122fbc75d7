"""The prompts to admit again before the dataset cursor's next ones."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

RetryEntry = tuple[int, int]  # (dataset item index, failed attempts at it in a row)


class RetryQueue:
    """First in, first out: the prompts of groups that failed or were handed back join at the back, the prompt of a
    group the trainer dropped at the front. Each entry keeps its place number (places run without gaps from `head`
    to `tail`), so every change is one place written or cleared; the places changed since the last `take_changed`
    are remembered, for the shell to persist just those."""

    def __init__(self, head: int = 0, entries: Iterable[RetryEntry] = ()):
        self.head = self.tail = head
        self._places: dict[int, RetryEntry] = {}
        self._changed: set[int] = set()
        for entry in entries:
            self._places[self.tail] = entry
            self.tail += 1

    def __len__(self) -> int:
        return self.tail - self.head

    def __iter__(self) -> Iterator[RetryEntry]:
        return (self._places[place] for place in range(self.head, self.tail))

    def append(self, entry: RetryEntry) -> None:
        self._places[self.tail] = entry
        self._changed.add(self.tail)
        self.tail += 1

    def appendleft(self, entry: RetryEntry) -> None:
        self.head -= 1
        self._places[self.head] = entry
        self._changed.add(self.head)

    def popleft(self) -> RetryEntry:
        if not self:
            raise IndexError("pop from an empty retry queue")
        entry = self._places.pop(self.head)
        self._changed.add(self.head)
        self.head += 1
        return entry

    def take_changed(self) -> dict[int, RetryEntry | None]:
        """The places written or cleared since the last call: place -> its entry, None once cleared."""
        changed, self._changed = self._changed, set()
        return {place: self._places.get(place) for place in changed}
