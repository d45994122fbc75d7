"""One simulated inference engine: its continuous batch, advanced in closed form from one completed sequence to
the next."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from areal_k8s.simulator.scenario import EngineCost


@dataclass
class Engine:
    name: str
    ready: bool = False
    version: int = 0
    steps: int = 0  # decode steps run so far: each advanced every sequence then in the batch by one token
    finishing: list[tuple[int, int, str, int]] = field(default_factory=list)  # heap: (last step, n, group, join step)
    joined: int = 0  # sum of the join steps of the sequences in the batch (for the context they attend to)
    groups: dict[str, list[int]] = field(default_factory=dict)  # group -> [sequences left, tokens, min version]
    hold: int | None = None  # a request for work the staleness bound is holding
    busy_until: float = 0.0  # when the decode steps under way end
    event_steps: int = 0  # how many they are
    generation: int = 0  # bumped to cancel a scheduled event (a push delays it, a removal drops it)
    fresh_prefill: int = 0  # prompt tokens of sequences that joined since the last event
    completing: int = 0  # groups generated, on their way to the stream (scored and written)

    def admit(self, group_id: str, lengths: list[int], prompt_tokens: int, order: Iterator[int]) -> None:
        """A group's sequences join the batch, each to finish after its length in decode steps (`order` breaks
        ties between sequences that finish at one step)."""
        self.groups[group_id] = [len(lengths), sum(lengths), self.version]
        for n in lengths:
            heapq.heappush(self.finishing, (self.steps + n, next(order), group_id, self.steps))
        self.joined += self.steps * len(lengths)
        self.fresh_prefill += prompt_tokens * len(lengths)

    def context_tokens(self, prompt_tokens: int) -> int:
        """The tokens the batch's sequences attend to now: their prompts and what each generated since it joined."""
        n = len(self.finishing)
        return n * prompt_tokens + n * self.steps - self.joined

    def next_steps(self, cost: EngineCost, prompt_tokens: int) -> tuple[int, float]:
        """The decode steps up to the batch's next completed sequence (at most `max_steps_per_event`) and their
        seconds, in closed form: with n sequences attending to C tokens at the first step, k steps cost
        k·(base + per_sequence·n) + per_context·(k·C + n·k(k−1)/2), plus the prefill of the sequences that joined."""
        n = len(self.finishing)
        k = min(cost.max_steps_per_event, self.finishing[0][0] - self.steps)
        context = self.context_tokens(prompt_tokens)
        seconds = (
            k * (cost.step_base_seconds + cost.step_per_sequence_seconds * n)
            + cost.step_per_context_token_seconds * (k * context + n * k * (k - 1) / 2)
            + cost.prefill_per_token_seconds * self.fresh_prefill
        )
        return k, seconds

    def advance(self, steps: int) -> Iterator[str]:
        """Run `steps` decode steps; yields each group as its last sequence finishes."""
        self.steps += steps
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, _, group_id, joined = heapq.heappop(self.finishing)
            self.joined -= joined
            group = self.groups[group_id]
            group[0] -= 1
            if group[0] == 0:
                yield group_id
