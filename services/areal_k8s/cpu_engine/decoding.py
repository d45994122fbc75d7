"""Decoding: a request's state (`Sequence`), sampling and the decode step (`DecodeBatch`), shared by the engine's
scheduler (scheduler.py) and `generate_batch` on the trainer's own model.

- The running batch shares one HF `DynamicCache`, left-padded, with a 2D attention mask over the cached positions
  and explicit position ids that count only a row's real tokens, so a row's numerics do not depend on its neighbours.
- The running cache's layers are `SlackLayer`s: views into buffers with spare columns, so a decode step writes one
  column in place. New requests are prefilled in their own forward passes (grouped by length, so little padding is
  computed), then join in groups: the running rows and the new ones are copied, right-aligned, into fresh buffers.
  Finished rows stay as dead rows until the next join (or until a quarter of the batch is dead), then leave in one
  `batch_select_indices`; padding columns no remaining row needs are cut from the left, so the cache never grows far
  past the longest live row.
- Only attention-only models whose cache layers are plain `DynamicLayer`s are supported (checked at the first
  prefill): sliding-window caches with their own bookkeeping and linear-attention states cannot be merged like this.

Logprob convention: the logprob of a sampled token is `log_softmax(logits / temperature)[token]` (raw logits when
greedy, temperature 0), taken *before* top-k/top-p truncation: the behaviour-policy logprob the trainer recomputes
with the same temperature.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from areal_k8s.cpu_engine.requests import SamplingParams

UNIFORM_BLOCK = 32  # sampling uniforms drawn from a sequence's generator at a time


@dataclass(eq=False)
class Sequence:
    """One prompt's generation state: what it produced so far and why it stopped (`finish_reason`, SGLang's shape)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]  # EOS ids (unless ignore_eos) and the request's stop_token_ids
    max_total_tokens: int  # the model's context: prompt + output never exceed it
    generator: torch.Generator
    detokenize: Callable[[list[int]], str] | None = None  # needed only for stop strings
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)  # the weight version that sampled each output token
    retractions: int = 0  # times a pause sent it back to the queue (its KV recomputed under the new weights)
    finish_reason: dict[str, Any] | None = None

    _uniforms: list[float] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.params.max_new_tokens == 0:
            self.finish_reason = {"type": "length", "length": 0}

    def next_uniform(self) -> float:
        """The next number of this sequence's uniform [0, 1) stream (drawn from `generator` in blocks)."""
        if not self._uniforms:
            block = torch.rand(
                UNIFORM_BLOCK, generator=self.generator, dtype=torch.float64, device=self.generator.device
            )
            self._uniforms = block.tolist()[::-1]
        return self._uniforms.pop()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill computes the cache of: the prompt, and after a retraction the tokens generated so far."""
        return self.prompt_ids + self.output_ids

    def append(self, token_id: int, logprob: float, version: str) -> None:
        self.output_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.output_versions.append(version)
        if token_id in self.stop_token_ids:
            self.finish_reason = {"type": "stop", "matched": token_id}
        elif (matched := self._matched_stop_string()) is not None:
            self.finish_reason = {"type": "stop", "matched": matched}
        elif len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = {"type": "length", "length": self.params.max_new_tokens}
        elif len(self.prompt_ids) + len(self.output_ids) >= self.max_total_tokens:
            self.finish_reason = {"type": "length", "length": len(self.output_ids)}

    def abort(self, message: str) -> None:
        if not self.finished:
            self.finish_reason = {"type": "abort", "message": message}

    def _matched_stop_string(self) -> str | None:
        if not self.params.stop or self.detokenize is None:
            return None
        # A stop string can only end in the newest token, and spans at most 4 tokens per character (byte-level BPE).
        window = 4 * max(len(s) for s in self.params.stop) + 1
        tail = self.detokenize(self.output_ids[-window:])
        return next((s for s in self.params.stop if s in tail), None)


def sample_next_tokens(logits: torch.Tensor, sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose each row's next token from float32 `logits` [rows, vocab]; returns (tokens, logprobs).

    The logprob is under softmax(logits / T) (raw logits when greedy), before top-k/top-p truncation.
    Each sequence draws its uniforms from its own generator (on the logits' device), so a seeded request does not
    depend on its batch neighbours.
    """
    temperatures = torch.tensor([s.params.temperature for s in sequences], dtype=logits.dtype, device=logits.device)
    greedy = temperatures == 0
    logprobs = torch.log_softmax(logits / torch.where(greedy, 1.0, temperatures)[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled_rows = (~greedy).nonzero().flatten().tolist()
    if sampled_rows:
        probs = _truncate(logprobs[sampled_rows].exp(), [sequences[row].params for row in sampled_rows])
        # Inverse-CDF sampling, all rows in one pass: the first token whose cumulative mass exceeds u·total, for a
        # uniform u from the row's own stream. A zero-probability token never exceeds its predecessor's mass.
        cdf = probs.double().cumsum(dim=-1)
        total = cdf[:, -1:]
        uniforms = torch.tensor(
            [sequences[row].next_uniform() for row in sampled_rows], dtype=torch.float64, device=cdf.device
        )
        targets = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        choice = torch.searchsorted(cdf, targets, right=True).squeeze(1)
        tokens[sampled_rows] = choice.clamp_(max=probs.shape[-1] - 1).to(tokens.dtype)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _truncate(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the tokens outside each row's top-k and top-p nucleus (unnormalised; `multinomial` does not need it)."""
    vocab = probs.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=probs.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=probs.device)
    if bool((top_k >= vocab).all()) and bool((top_p >= 1.0).all()):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # The most likely token always stays: its rank is 0 < top_k and no mass comes before it.
    keep = (torch.arange(vocab, device=probs.device) < top_k[:, None]) & (mass_before < top_p[:, None])
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)


def joining_count(room: int, waiting: int, max_batch_size: int) -> int:
    """How many waiting requests to admit now: in groups of at least an eighth of the batch (one prefill pass each,
    and a cache rebuild when there are not enough finished rows to take over), unless everything waiting fits or
    nothing is running."""
    count = min(room, waiting)
    if count == waiting or room == max_batch_size or count >= max(1, max_batch_size // 8):
        return count
    return 0


PREFILL_PADDING_SLACK = 8  # padding positions a row may carry in a shared prefill pass before it gets its own pass


def prefill_chunks(joining: list[Sequence]) -> list[list[Sequence]]:
    """`joining` split into prefill passes of similar prompt lengths, longest first.

    A pass computes every row at the width of its longest prompt. Resubmitted requests (prompt plus the prefix
    generated before an interruption) differ in length by up to the whole generation budget, so one pass over all
    of them would mostly compute padding. A row joins the current pass while its padding stays within a quarter of
    the pass's width (or a few positions); a pass costs a fixed overhead of its own, so they are not split further.
    """
    ordered = sorted(joining, key=lambda s: len(s.prefill_ids), reverse=True)
    chunks: list[list[Sequence]] = []
    width = 0
    for sequence in ordered:
        length = len(sequence.prefill_ids)
        if chunks and width - length <= max(PREFILL_PADDING_SLACK, width // 4):
            chunks[-1].append(sequence)
        else:
            chunks.append([sequence])
            width = length
    return chunks


class SlackLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views into buffers with spare columns: a decode step writes its
    column in place instead of concatenating the whole cache (which made decoding quadratic in length)."""

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    @classmethod
    def right_aligned(cls, parts: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> SlackLayer:
        """One layer stacking `parts` (keys, values) along the batch, each left-padded with zeros to `width`."""
        layer = cls()
        keys, values = parts[0]
        layer.lazy_initialization(keys, values)
        rows = sum(k.shape[0] for k, _ in parts)
        layer._key_buffer, layer._value_buffer = (
            t.new_empty(rows, t.shape[1], 2 * width + 16, t.shape[3]) for t in (keys, values)
        )
        first = 0
        for k, v in parts:
            last, start = first + k.shape[0], width - k.shape[-2]
            for buffer, part in ((layer._key_buffer, k), (layer._value_buffer, v)):
                buffer[first:last, :, :start] = 0  # padding must be finite: masked scores are still computed
                buffer[first:last, :, start:width] = part
            first = last
        layer._expose(width)
        return layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._key_buffer is None:  # only layers built by `right_aligned` are used for decoding
            raise RuntimeError("SlackLayer must be created with right_aligned()")
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            self._grow(2 * end + 16)
        self._key_buffer[:, :, length:end] = key_states
        self._value_buffer[:, :, length:end] = value_states
        self._expose(end)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        length = self.get_seq_length()
        self._key_buffer, self._value_buffer = (
            self._copy(b[indices, :, :length], b.shape[-2]) for b in self._buffers()
        )
        self._expose(length)

    def write_rows(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace `rows` with `keys`/`values` right-aligned to the current length, zero padding before them."""
        length = self.get_seq_length()
        start = length - keys.shape[-2]
        for buffer, new in ((self._key_buffer, keys), (self._value_buffer, values)):
            buffer[rows, :, :start] = 0
            buffer[rows, :, start:length] = new

    def drop_leading(self, columns: int) -> None:
        """Forget the first `columns` positions (padding in every row); a view, no copy."""
        length = self.get_seq_length()
        self._key_buffer, self._value_buffer = self._key_buffer[:, :, columns:], self._value_buffer[:, :, columns:]
        self._expose(length - columns)

    def _grow(self, capacity: int) -> None:
        length = self.get_seq_length()
        self._key_buffer, self._value_buffer = (self._copy(b[:, :, :length], capacity) for b in self._buffers())

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._key_buffer, self._value_buffer

    @staticmethod
    def _copy(used: torch.Tensor, capacity: int) -> torch.Tensor:
        """`used` in a new buffer of `capacity` columns; the columns after it are written before they are read."""
        buffer = used.new_empty(used.shape[0], used.shape[1], capacity, used.shape[3])
        buffer[:, :, : used.shape[-2]] = used
        return buffer

    def _expose(self, length: int) -> None:
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]


class DecodeBatch:
    """Sequences decoding together: one forward pass per step over a shared, left-padded KV cache.

    Row i's cache holds its prompt and all its output tokens but the last; `_next_tokens[i]` is that last token,
    fed by the next step. A finished row stays in place (dead, its output ignored): joining requests take over dead
    rows in place (their prefilled cache written right-aligned into the row), so a busy engine never copies its
    cache; only when the batch drains (a quarter of the rows dead and nobody joining) or a joining prompt is longer
    than the cache are rows removed or the cache rebuilt, in one copy.
    """

    COUNTERS = (
        "prefill_seconds",
        "prefill_passes",
        "prefill_rows",
        "prefill_tokens",
        "decode_seconds",
        "decode_steps",
        "decode_rows",
        "decode_cache_positions",
        "decode_context_positions",
        "prefill_cpu_seconds",
        "decode_cpu_seconds",
    )

    def __init__(self, model: PreTrainedModel, counters: dict[str, float] | None = None, weight_version: str = "0"):
        self.model = model
        self.device = model.device
        self.weight_version = weight_version  # recorded with every sampled token
        self._rows: list[Sequence | None] = []  # None = dead row awaiting compaction
        self._cache: Cache | None = None
        self._mask: torch.Tensor | None = None  # [rows, cached positions], 1 = real token, 0 = left padding
        self._next_tokens: torch.Tensor | None = None  # [rows]
        self.tokens_generated = 0
        # Where the time goes (for /areal/load and benchmarks): prefill passes with the joins they feed, decode steps.
        self.prefill_seconds = 0.0
        self.prefill_passes = 0
        self.prefill_rows = 0
        self.prefill_tokens = 0  # padded positions computed by prefill passes (a prefix shared by rows counted once)
        self.decode_seconds = 0.0
        self.decode_steps = 0
        self.decode_rows = 0  # live rows summed over decode steps: / decode_steps = mean occupancy
        self.decode_cache_positions = 0  # cache positions (rows × width, padding included) decode steps attended over
        self.decode_context_positions = 0  # the live rows' real tokens among them
        # CPU time of the stepping thread in those passes: below the wall time when other processes share its core
        self.prefill_cpu_seconds = 0.0
        self.decode_cpu_seconds = 0.0
        for name, value in (counters or {}).items():
            setattr(self, name, value)

    def counters(self) -> dict[str, float]:
        """Cumulative prefill/decode time and work, carried over when the engine replaces a failed batch."""
        return {name: getattr(self, name) for name in self.COUNTERS}

    @property
    def sequences(self) -> list[Sequence]:
        return [s for s in self._rows if s is not None]

    def __len__(self) -> int:
        return len(self._live_rows())

    def _live_rows(self) -> list[int]:
        return [i for i, s in enumerate(self._rows) if s is not None]

    @torch.inference_mode()
    def advance(self, joining: list[Sequence]) -> list[Sequence]:
        """Prefill `joining` into the batch, then run one decode step over every row; returns the sequences that
        finished (they have left the batch)."""
        if joining:
            started, cpu_started = time.perf_counter(), time.thread_time()
            finished = self._admit(joining)
            self.prefill_seconds += time.perf_counter() - started
            self.prefill_cpu_seconds += time.thread_time() - cpu_started
            self.prefill_rows += len(joining)
        else:
            finished = []
            if 4 * (len(self._rows) - len(self)) >= len(self._rows):
                self._compact()
        if live := len(self):
            started, cpu_started = time.perf_counter(), time.thread_time()
            finished += self._step()
            self.decode_seconds += time.perf_counter() - started
            self.decode_cpu_seconds += time.thread_time() - cpu_started
            self.decode_steps += 1
            self.decode_rows += live
        return finished

    def remove(self, sequences: Iterable[Sequence]) -> None:
        leaving = {id(s) for s in sequences}
        self._kill([i for i, s in enumerate(self._rows) if s is not None and id(s) in leaving])

    def _admit(self, joining: list[Sequence]) -> list[Sequence]:
        chunks = [self._prefill(chunk) for chunk in prefill_chunks(joining)]
        self.prefill_passes += len(chunks)
        width = max(mask.shape[1] for _, _, mask, _ in chunks)
        dead = [i for i, s in enumerate(self._rows) if s is None]
        if self._rows and len(dead) >= len(joining) and width <= self._mask.shape[1]:
            for sequences, prefill, mask, tokens in chunks:
                self._take_over(dead[: len(sequences)], sequences, prefill, mask, tokens)
                dead = dead[len(sequences) :]
        else:
            self._compact()
            parts = [prefill.layers for _, prefill, _, _ in chunks]
            masks = [mask for _, _, mask, _ in chunks]
            tokens = [chosen for _, _, _, chosen in chunks]
            if self._rows:
                width = max(width, self._mask.shape[1])
                parts.insert(0, self._cache.layers)
                masks.insert(0, self._mask)
                tokens.insert(0, self._next_tokens)
            layers = [
                SlackLayer.right_aligned([(layer.keys, layer.values) for layer in per_layer], width)
                for per_layer in zip(*parts)
            ]
            self._cache = Cache(layers=layers)
            self._mask = torch.cat(_left_pad_to_common_length(masks, dim=-1))
            self._next_tokens = torch.cat(tokens)
            self._rows += [sequence for sequences, _, _, _ in chunks for sequence in sequences]
        return self._drop_finished()

    def _prefill(self, joining: list[Sequence]) -> tuple[list[Sequence], DynamicCache, torch.Tensor, torch.Tensor]:
        """One prefill pass over `joining` (left-padded to the longest): its cache, mask and first sampled tokens.

        Rows with the same input (a prompt group's samples) are computed once and their cache copied, as a prefix
        cache would share them; each row still samples from its own stream."""
        distinct: dict[tuple[int, ...], int] = {}
        owner = [distinct.setdefault(tuple(s.prefill_ids), len(distinct)) for s in joining]
        inputs = [list(ids) for ids in distinct]
        width = max(len(ids) for ids in inputs)
        rows = [([0] * (width - len(ids)) + ids, [0] * (width - len(ids)) + [1] * len(ids)) for ids in inputs]
        input_ids = torch.tensor([ids for ids, _ in rows], device=self.device)
        mask = torch.tensor([row_mask for _, row_mask in rows], device=self.device)
        prefill = DynamicCache()
        logits = self._forward(input_ids, mask, (mask.cumsum(dim=-1) - 1).clamp(min=0), prefill)
        _check_mergeable(prefill)
        self.prefill_tokens += len(inputs) * width
        if len(inputs) < len(joining):
            index = torch.tensor(owner, device=self.device)
            for layer in prefill.layers:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
            mask, logits = mask[index], logits[index]
        return joining, prefill, mask, self._choose(joining, logits)

    def _take_over(
        self, rows: list[int], joining: list[Sequence], prefill: DynamicCache, mask: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """Put prefilled `joining` into dead `rows`, right-aligned to the cache's current length."""
        index = torch.tensor(rows, device=self.device)
        self._mask[index] = torch.nn.functional.pad(mask, (self._mask.shape[1] - mask.shape[1], 0))
        self._next_tokens[index] = tokens
        for layer, new in zip(self._cache.layers, prefill.layers):
            layer.write_rows(index, new.keys, new.values)
        for row, sequence in zip(rows, joining):
            self._rows[row] = sequence

    def _step(self) -> list[Sequence]:
        mask = torch.cat([self._mask, self._mask.new_ones(len(self._rows), 1)], dim=1)
        positions = self._mask.sum(dim=1, keepdim=True)  # a row's real tokens so far = the new token's position
        live = self._live_rows()
        self.decode_cache_positions += mask.numel()
        self.decode_context_positions += int(positions[live].sum()) + len(live)
        logits = self._forward(self._next_tokens[:, None], mask, positions, self._cache)
        self._mask = mask
        if len(live) == len(self._rows):
            self._next_tokens = self._choose(self._rows, logits)
        else:
            index = torch.tensor(live, device=self.device)
            self._next_tokens[index] = self._choose([self._rows[i] for i in live], logits[index])
        return self._drop_finished()

    def _forward(self, input_ids, mask, positions, cache: Cache) -> torch.Tensor:
        output = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[:, -1, :].float()

    def _choose(self, sequences: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        tokens, logprobs = sample_next_tokens(logits, sequences)
        self.tokens_generated += len(sequences)
        for sequence, token, logprob in zip(sequences, tokens.tolist(), logprobs.tolist()):
            sequence.append(token, logprob, self.weight_version)
        return tokens

    def _drop_finished(self) -> list[Sequence]:
        rows = [i for i, s in enumerate(self._rows) if s is not None and s.finished]
        finished = [self._rows[i] for i in rows]
        self._kill(rows)
        return finished

    def _kill(self, rows: list[int]) -> None:
        for i in rows:
            self._rows[i] = None
        if rows:
            self._trim()

    def _trim(self) -> None:
        """Forget leading positions no live row uses (a view, no copy). A dead row still attends to the newest
        column, which stays, so no row's attention is ever fully masked."""
        live = self._live_rows()
        if not live:
            return
        first_used = int(self._mask[live].any(dim=0).int().argmax())
        if first_used:
            self._mask = self._mask[:, first_used:]
            for layer in self._cache.layers:
                layer.drop_leading(first_used)

    def _compact(self) -> None:
        """Drop dead rows (one copy of the cache) and the padding columns no live row needs."""
        alive = self._live_rows()
        if len(alive) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in alive]
        if not alive:
            self._cache = self._mask = self._next_tokens = None
            return
        index = torch.tensor(alive, device=self.device)
        self._mask, self._next_tokens = self._mask[index], self._next_tokens[index]
        for layer in self._cache.layers:
            layer.batch_select_indices(index)
        self._trim()


def _check_mergeable(cache: DynamicCache) -> None:
    unsupported = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if unsupported:
        raise NotImplementedError(f"the CPU engine can only batch plain DynamicLayer KV caches, got {unsupported}")


def _left_pad_to_common_length(tensors: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    length = max(t.shape[dim] for t in tensors)
    padded = []
    for tensor in tensors:
        shape = list(tensor.shape)
        shape[dim] = length - tensor.shape[dim]
        padded.append(torch.cat([tensor.new_zeros(shape), tensor], dim=dim) if shape[dim] else tensor)
    return padded


def context_length(model: PreTrainedModel) -> int:
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 2**31 - 1


def generate_batch(
    model: PreTrainedModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Iterable[int] = (),
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int = 0,
    max_batch_size: int = 64,
) -> list[Sequence]:
    """Generate for every prompt with `model` itself (the trainer's evaluation), using the engine's decode step.

    Rows are refilled continuously up to `max_batch_size`. Returns one `Sequence` per prompt, in order, with
    `output_ids`, `output_logprobs` (the engine's convention) and `finish_reason`. The model runs in eval mode
    and is put back in its previous mode afterwards; it may live on any device.
    """
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    stop_ids = frozenset(eos_token_ids)
    limit = context_length(model)
    sequences = [
        Sequence(
            rid=str(index),
            prompt_ids=list(prompt),
            params=params,
            stop_token_ids=stop_ids,
            max_total_tokens=limit,
            generator=torch.Generator(device=model.device).manual_seed(seed + index),
        )
        for index, prompt in enumerate(prompts)
    ]
    waiting = deque(s for s in sequences if not s.finished)
    batch = DecodeBatch(model)
    was_training = model.training
    model.eval()
    try:
        while waiting or len(batch):
            count = joining_count(max_batch_size - len(batch), len(waiting), max_batch_size)
            batch.advance([waiting.popleft() for _ in range(count)])
    finally:
        model.train(was_training)
    return sequences
