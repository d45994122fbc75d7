"""Our CPU inference engine: any Hugging Face decoder LM, continuous batching over one KV cache, SGLang's RL semantics.

Decoding (`DecodeBatch`, also used by `generate_batch` on the trainer's own model):
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

Threading: one scheduler thread owns the model. It alternates "run queued control commands" with "admit waiting
requests, run one decode step". Everything that touches the model (weight loading, checksums, reading weights) is a
command, so it can never race a forward pass. Async callers talk to it through `concurrent.futures.Future`s, which
keeps the engine usable from any event loop. Blocking collectives (rendezvous, broadcasts) run in worker threads:
generation goes on while a broadcast is received, and only the final copy into the model is a command.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.utils import logging as hf_logging

from areal_k8s.common.distributed import broadcast_within, destroy_side_group, in_daemon_thread, init_side_group
from areal_k8s.common.weights import bucket_nbytes, unflatten_bucket, weights_checksum
from areal_k8s.common.weights import parse_dtype as parse_weight_dtype

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
ABORT_BEFORE_PREFILL = "Abort before prefill"  # SGLang's message for a request aborted with no tokens produced


class InvalidRequest(ValueError):
    """A request that can never succeed as sent (the server answers 400)."""


class WeightUpdateError(RuntimeError):
    """A weight-group or weight-update operation failed; nothing was loaded from the failed update."""


# ----------------------------------------------------------------------------------------------------------------
# Sampling parameters and per-request state


# Accepted only at their neutral value: the CPU engine does not implement them, and silently ignoring a
# non-neutral value would change the sampling distribution behind the caller's back.
_NEUTRAL_SAMPLING_PARAMS: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "logit_bias": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
}
# Presentation-only knobs of SGLang that do not apply to a non-streaming, tokens-first engine.
_IGNORED_SAMPLING_PARAMS = {"spaces_between_special_tokens", "stream_interval"}


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling parameters that this engine implements (defaults as in SGLang)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # affects `text` only; `output_ids` always keep the matched stop token
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise InvalidRequest(f"sampling_params must be an object, got {type(raw).__name__}")
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key in _IGNORED_SAMPLING_PARAMS:
                continue
            if key in _NEUTRAL_SAMPLING_PARAMS:
                if value != _NEUTRAL_SAMPLING_PARAMS[key]:
                    raise InvalidRequest(f"sampling param {key}={value!r} is not supported by the CPU engine")
                continue
            if key not in cls.__dataclass_fields__:
                raise InvalidRequest(f"unknown sampling param {key!r}")
            if value is not None:
                values[key] = value
        params = cls(
            max_new_tokens=_require_int("max_new_tokens", values.get("max_new_tokens", cls.max_new_tokens), low=0),
            temperature=_require_float("temperature", values.get("temperature", cls.temperature), low=0.0),
            top_p=_require_float("top_p", values.get("top_p", cls.top_p), low=0.0, high=1.0),
            top_k=_require_int("top_k", values.get("top_k", cls.top_k), low=-1),
            stop_token_ids=_require_token_ids("stop_token_ids", values.get("stop_token_ids", [])),
            stop=_require_strings("stop", values.get("stop", ())),
            ignore_eos=_require_bool("ignore_eos", values.get("ignore_eos", cls.ignore_eos)),
            skip_special_tokens=_require_bool(
                "skip_special_tokens", values.get("skip_special_tokens", cls.skip_special_tokens)
            ),
            no_stop_trim=_require_bool("no_stop_trim", values.get("no_stop_trim", cls.no_stop_trim)),
            sampling_seed=_require_int("sampling_seed", values["sampling_seed"]) if "sampling_seed" in values else None,
        )
        if params.top_p == 0.0:
            raise InvalidRequest("top_p must be in (0, 1]")
        return params


def _require_int(name: str, value: Any, *, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidRequest(f"{name} must be >= {low}, got {value}")
    return value


def _require_token_ids(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise InvalidRequest(f"{name} must be a list of token ids, got {value!r}")
    return tuple(_require_int(f"{name}[]", token, low=0) for token in value)


def _require_float(name: str, value: Any, *, low: float, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    if value < low or (high is not None and value > high):
        raise InvalidRequest(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return float(value)


def _require_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}")
    return value


def _require_str(name: str, value: Any) -> str:
    if not (isinstance(value, str) and value):
        raise InvalidRequest(f"{name} must be a non-empty string, got {value!r}")
    return value


def _require_strings(name: str, value: Any) -> tuple[str, ...]:
    strings = (value,) if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) and s for s in strings):
        raise InvalidRequest(f"{name} must be a non-empty string or a list of them, got {value!r}")
    return tuple(strings)


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


def weight_version_spans(token_versions: list[str], current: str) -> dict[str, Any]:
    """SGLang's `weight_versions` (runs of output tokens sampled by one version, `{version, start, end}`) and its
    `weight_version` (the last run's; the current one when nothing was generated)."""
    spans: list[dict[str, Any]] = []
    for index, version in enumerate(token_versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": version, "start": index, "end": index + 1})
    spans = spans or [{"version": current, "start": 0, "end": 0}]
    return {"weight_version": spans[-1]["version"], "weight_versions": spans}


# ----------------------------------------------------------------------------------------------------------------
# Sampling and the decode step, shared by the engine and `generate_batch`


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


# ----------------------------------------------------------------------------------------------------------------
# The engine


class CpuEngine:
    """An SGLang-compatible engine for CPU: same operations, same JSON shapes (see server.py for the HTTP face).

    `generate` answers like SGLang's /generate. Pausing: "abort" returns every queued and running request at once
    with finish_reason abort and its tokens so far; "retract" puts running requests back at the head of the queue,
    dropping their KV cache, so that after `continue_generation` they are prefilled again (prompt and tokens so far)
    under whatever weights are loaded by then and go on generating; "in_place" freezes running requests with their
    KV cache. Every answer carries SGLang's `weight_versions`: spans of output tokens sampled by one weight version,
    so a retracted request reports where the policy changed. In every mode, requests arriving while paused are held
    apart (as SGLang holds them before its scheduler) until `continue_generation`. `flush_cache` is a no-op when idle
    (there is no cross-request prefix cache) and fails while requests are queued or running, like SGLang's.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_batch_size: int = 64,
        num_threads: int = 1,
        seed: int = 0,
        weight_version: str = "default",
        weight_update_timeout: float = 600.0,
        device: str = "cpu",
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        torch.set_num_threads(num_threads)
        hf_logging.disable_progress_bar()
        self.model_path = str(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=parse_dtype(dtype)).to(device).eval()
        self.max_batch_size = max_batch_size
        self.weight_update_timeout = weight_update_timeout
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.context_length = context_length(self.model)
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self._rng = random.Random(seed)
        self._batch = DecodeBatch(self.model, weight_version=weight_version)
        self._pause_mode: str | None = None
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._group_lock = threading.Lock()  # one rendezvous/broadcast sequence at a time
        # Shared with the callers' threads, guarded by `_wakeup`:
        self._wakeup = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        # Requests that arrive while paused: SGLang holds them before its scheduler (so a flush finds it idle and a
        # weight update sees no new request), and they join the queue on continue.
        self._held: deque[Sequence] = deque()
        self._replies: dict[str, concurrent.futures.Future] = {}  # rid -> answered when the request finishes
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._stopping = False
        # Written by the scheduler thread only: what the engine did, for /areal/load and benchmarks.
        self.started_at = time.monotonic()
        self.busy_seconds = 0.0  # inside prefill/decode steps
        self.generated_tokens = 0
        self._scheduler = threading.Thread(target=self._schedule, name="cpu-engine-scheduler", daemon=True)
        self._scheduler.start()
        log.info(
            "loaded %s (%s, %d parameters), eos %s, context %d",
            self.model_path,
            dtype,
            sum(p.numel() for p in self.model.parameters()),
            sorted(self.eos_token_ids),
            self.context_length,
        )

    # --- generation -------------------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        rid: str | list[str] | None = None,
        *,
        return_logprob: bool = True,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's /generate: one prompt gives one answer, a list of prompts a list of answers."""
        if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
            count = len(input_ids)
            if rid is not None and not isinstance(rid, list):
                raise InvalidRequest("for a batch of prompts, rid must be a list (one per prompt) or null")
            rids = [None] * count if rid is None else rid
            params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * count
            if len(rids) != count or len(params) != count:
                raise InvalidRequest("for a batch, rid and sampling_params lists must be as long as input_ids")
            named = [r for r in rids if r is not None]
            if len(set(map(repr, named))) != len(named):
                raise InvalidRequest("the rids of a batch must be distinct")
            sequences = [self._new_sequence(*request) for request in zip(input_ids, params, rids)]
            return list(await asyncio.gather(*(self._run(s, return_logprob) for s in sequences)))
        if isinstance(rid, list) or isinstance(sampling_params, list):
            raise InvalidRequest("rid and sampling_params may be lists only when input_ids is a list of prompts")
        return await self._run(self._new_sequence(input_ids, sampling_params, rid), return_logprob)

    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")

        def pause() -> None:
            with self._wakeup:
                self._pause_mode = mode
            if mode == "abort":
                log.info(
                    "generation paused: %d requests aborted", self._abort(lambda s: True, "Abort by pause_generation")
                )
            elif mode == "retract":
                log.info("generation paused: %d running requests retracted", self._retract())
            else:
                log.info("generation paused in place")

        await self._in_scheduler(pause)

    @property
    def weight_version(self) -> str:
        return self._batch.weight_version

    async def continue_generation(self) -> None:
        def resume() -> None:
            with self._wakeup:
                self._pause_mode = None
                self._waiting.extend(self._held)
                self._held.clear()
            log.info("generation continued")

        await self._in_scheduler(resume)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort one request (or all); returns how many were aborted. Unknown rids are not an error (as SGLang)."""
        if not _require_bool("abort_all", abort_all) and not isinstance(rid, str):
            raise InvalidRequest("give a rid (string) or abort_all=true")
        return await self._in_scheduler(
            lambda: self._abort(lambda s: abort_all or s.rid == rid, "Abort by abort_request")
        )

    async def flush_cache(self) -> bool:
        """True when flushed; False while requests are queued or running (the caller may retry)."""
        return await self._in_scheduler(lambda: not (self._waiting or self._batch.sequences))

    # --- weights ----------------------------------------------------------------------------------------------

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> str:
        """Join the trainer's weight group as rank `rank_offset` (TP=1); returns once every rank has joined."""
        _require_int("master_port", master_port, low=1)
        _require_int("world_size", world_size, low=2)
        _require_int("rank_offset", rank_offset, low=1)
        if rank_offset >= world_size:
            raise InvalidRequest(f"rank_offset {rank_offset} must be < world_size {world_size}")
        for name, value in (("master_address", master_address), ("group_name", group_name), ("backend", backend)):
            _require_str(name, value)

        def join() -> None:
            with self._group_lock:
                # Only the trainer (rank 0) creates groups: a second init under the same name means the trainer that
                # made the first one restarted, and that group is dead (its receive, if any, has already timed out).
                if (stale := self._groups.pop(group_name, None)) is not None:
                    log.warning("replacing weight update group %r left by a previous trainer", group_name)
                    destroy_side_group(stale)
                self._groups[group_name] = init_side_group(
                    backend,
                    master_address,
                    master_port,
                    world_size,
                    rank_offset,
                    group_name,
                    self.weight_update_timeout,
                )

        await in_daemon_thread(_as_weight_update_error, join)
        return f"joined weight update group {group_name!r} as rank {rank_offset} of {world_size}"

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> str:
        def destroy() -> None:
            with self._group_lock:
                group = self._groups.pop(group_name, None)
                if group is None:
                    raise WeightUpdateError(f"no weight update group named {group_name!r}")
                destroy_side_group(group)

        await in_daemon_thread(_as_weight_update_error, destroy)
        return f"destroyed weight update group {group_name!r}"

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        *,
        weight_version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> str:
        """Receive tensors broadcast by group rank 0 and load them by HF parameter name.

        Names and shapes are checked against the model only after the broadcast was received in full, so a
        mismatch leaves the group usable, and nothing is copied unless every tensor fits: a failing update loads
        nothing. Metadata this engine cannot receive at all (a bad dtype, an unknown group) is refused before the
        broadcast, which then has no receiver: the trainer must rebuild the group. `flush_cache` is accepted for
        compatibility; there is no cross-request cache to flush. Running requests, if any, go on with the new
        weights (pause first, as the trainer does, to avoid mixing).
        """
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names) and names):
            raise InvalidRequest("names must be a non-empty list of strings")
        if not (isinstance(dtypes, list) and isinstance(shapes, list) and len(dtypes) == len(shapes) == len(names)):
            raise InvalidRequest("names, dtypes and shapes must be lists of the same length")
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        shapes = [_require_shape(s) for s in shapes]
        if load_format not in (None, "flattened_bucket"):
            raise InvalidRequest(f"load_format must be null or 'flattened_bucket', got {load_format!r}")
        if weight_version is not None and not isinstance(weight_version, str):
            raise InvalidRequest(f"weight_version must be a string, got {weight_version!r}")
        _require_bool("flush_cache", flush_cache)
        if _require_bool("abort_all_requests", abort_all_requests):
            await self.abort_request(abort_all=True)

        def receive_and_load() -> None:
            with self._group_lock:
                group = self._groups.get(group_name)
                if group is None:
                    raise WeightUpdateError(f"no weight update group named {group_name!r}")
                tensors = _receive_broadcast(
                    group,
                    torch_dtypes,
                    shapes,
                    flattened=load_format is not None,
                    timeout=self.weight_update_timeout,
                    device=self.model.device,
                )
                load = functools.partial(self._load_weights, list(zip(names, tensors)), weight_version)
                self._submit_command(load).result()

        await in_daemon_thread(_as_weight_update_error, receive_and_load)
        return f"updated {len(names)} tensors, weight version {self.weight_version}"

    async def weights_checksum(self, names: list[str] | None = None) -> dict[str, Any]:
        """Our extension: `weights_checksum` over the named parameters (all of them by default)."""
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise InvalidRequest("names must be a list of strings")

        def checksum() -> dict[str, Any]:
            per_tensor, combined = weights_checksum(self._parameters(names))
            return {"per_tensor": per_tensor, "combined": combined, "weight_version": self.weight_version}

        return await self._in_scheduler(checksum)

    def model_info(self) -> dict[str, Any]:
        """SGLang's /model_info (the fields that apply to a text-only engine)."""
        config = self.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "model_type": config.model_type,
            "architectures": config.architectures,
        }

    def server_info(self) -> dict[str, Any]:
        """SGLang's /server_info, as far as it describes this engine: one process, no parallelism."""
        return {
            "model_path": self.model_path,
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": 1,
            "device": self.model.device.type,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "max_running_requests": self.max_batch_size,
            "weight_version": self.weight_version,
            "disable_radix_cache": True,
        }  # no KV outlives its request

    # --- health and lifecycle ---------------------------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        """Our /areal/load: requests queued and running, and how busy the engine has been since it started."""
        with self._wakeup:
            waiting = len(self._waiting) + len(self._held)
        running = len(self._batch)
        return {
            "dp_rank": 0,
            "num_reqs": running + waiting,
            "num_waiting_reqs": waiting,
            "num_running_reqs": running,
            "busy_seconds": self.busy_seconds,
            "uptime_seconds": time.monotonic() - self.started_at,
            "generated_tokens": self.generated_tokens,
            **self._batch.counters(),
        }

    def is_alive(self) -> bool:
        return self._scheduler.is_alive()

    def is_idle(self) -> bool:
        """No queued or running requests, and not paused: a probe generate would be served at once."""
        with self._wakeup:
            return not (self._waiting or self._replies or self._pause_mode)

    def shutdown(self) -> None:
        """Stop the scheduler; requests still open are answered as aborted. Idempotent."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._scheduler.join()
        with self._group_lock:
            for group in self._groups.values():
                destroy_side_group(group)
            self._groups.clear()

    # --- internals: requests ----------------------------------------------------------------------------------

    def _new_sequence(self, input_ids: Any, sampling_params: Any, rid: Any) -> Sequence:
        if not (isinstance(input_ids, list) and input_ids):
            raise InvalidRequest("input_ids must be a non-empty list of token ids")
        for token in input_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise InvalidRequest(f"input_ids must be token ids in [0, {self.vocab_size}), got {token!r}")
        if len(input_ids) >= self.context_length:
            raise InvalidRequest(
                f"prompt of {len(input_ids)} tokens leaves no room in the model's context of {self.context_length}"
            )
        if rid is not None and not (isinstance(rid, str) and rid):
            raise InvalidRequest(f"rid must be a non-empty string, got {rid!r}")
        params = SamplingParams.from_dict(sampling_params)
        seed = params.sampling_seed if params.sampling_seed is not None else self._rng.getrandbits(63)
        return Sequence(
            rid=rid or f"cpu-{self._rng.getrandbits(64):016x}",
            prompt_ids=list(input_ids),
            params=params,
            stop_token_ids=frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.eos_token_ids),
            max_total_tokens=self.context_length,
            generator=torch.Generator().manual_seed(seed),
            detokenize=functools.partial(self.tokenizer.decode, skip_special_tokens=params.skip_special_tokens),
        )

    async def _run(self, sequence: Sequence, return_logprob: bool) -> dict[str, Any]:
        if not sequence.finished:
            reply = concurrent.futures.Future()
            with self._wakeup:
                if self._stopping:
                    raise RuntimeError("the engine is shutting down")
                if sequence.rid in self._replies:
                    raise InvalidRequest(f"a request with rid {sequence.rid!r} is already running")
                self._replies[sequence.rid] = reply
                (self._waiting if self._pause_mode is None else self._held).append(sequence)
                self._wakeup.notify()
            try:
                # Shielded: a cancelled caller must not cancel the future the scheduler is about to answer.
                await asyncio.shield(asyncio.wrap_future(reply))
            except asyncio.CancelledError:
                self._submit_command(lambda: self._abort(lambda s: s is sequence, "Abort: the caller went away"))
                raise
        return self._response(sequence, return_logprob)

    def _response(self, sequence: Sequence, return_logprob: bool) -> dict[str, Any]:
        """SGLang's /generate answer for a finished sequence."""
        text_ids = sequence.output_ids
        matched = (sequence.finish_reason or {}).get("matched")
        if isinstance(matched, int) and not sequence.params.no_stop_trim:
            text_ids = text_ids[:-1]
        text = self.tokenizer.decode(text_ids, skip_special_tokens=sequence.params.skip_special_tokens)
        if isinstance(matched, str) and not sequence.params.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        meta_info: dict[str, Any] = {
            "id": sequence.rid,
            "finish_reason": sequence.finish_reason,
            "prompt_tokens": len(sequence.prompt_ids),
            "completion_tokens": len(sequence.output_ids),
            "cached_tokens": 0,
            "num_retractions": sequence.retractions,
            **weight_version_spans(sequence.output_versions, self.weight_version),
        }
        if return_logprob:
            meta_info["output_token_logprobs"] = [
                [logprob, token, None] for logprob, token in zip(sequence.output_logprobs, sequence.output_ids)
            ]
        return {"text": text, "output_ids": list(sequence.output_ids), "meta_info": meta_info}

    # --- internals: the scheduler thread ----------------------------------------------------------------------

    def _submit_command(self, command: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `command` on the scheduler thread between two model steps."""
        result = concurrent.futures.Future()
        with self._wakeup:
            if self._stopping:
                result.set_exception(RuntimeError("the engine is shutting down"))
                return result
            self._commands.append((command, result))
            self._wakeup.notify()
        return result

    async def _in_scheduler(self, command: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit_command(command))

    def _schedule(self) -> None:
        while True:
            with self._wakeup:
                while not (self._stopping or self._commands or self._has_work()):
                    self._wakeup.wait()
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            for command, result in commands:
                try:
                    result.set_result(command())
                except Exception as exc:
                    result.set_exception(exc)
            if self._pause_mode is not None:
                continue
            with self._wakeup:
                count = joining_count(self.max_batch_size - len(self._batch), len(self._waiting), self.max_batch_size)
                joining = [self._waiting.popleft() for _ in range(count)]
            if not (joining or self._batch.sequences):
                continue
            try:
                stepped, tokens = time.monotonic(), self._batch.tokens_generated
                finished = self._batch.advance(joining)
                self.busy_seconds += time.monotonic() - stepped
                self.generated_tokens += self._batch.tokens_generated - tokens
            except Exception as exc:  # a model failure fails this batch's requests, never the engine
                log.exception("decode step failed; failing %d requests", len(self._batch) + len(joining))
                failed = list({id(s): s for s in [*self._batch.sequences, *joining]}.values())
                self._batch = DecodeBatch(
                    self.model, counters=self._batch.counters(), weight_version=self.weight_version
                )
                self._reply(failed, exc)
                continue
            self._reply(finished)
        self._abort(lambda s: True, "Abort: engine shutting down")
        with self._wakeup:
            for _, result in self._commands:
                result.set_exception(RuntimeError("the engine is shutting down"))
            self._commands.clear()

    def _has_work(self) -> bool:
        return self._pause_mode is None and bool(self._waiting or self._batch.sequences)

    def _retract(self) -> int:
        """Send the running requests back to the head of the queue, in their order; their cache is dropped."""
        running = self._batch.sequences
        self._batch.remove(running)
        for sequence in running:
            sequence.retractions += 1
        with self._wakeup:
            self._waiting.extendleft(reversed(running))
        return len(running)

    def _abort(self, selected: Callable[[Sequence], bool], message: str) -> int:
        with self._wakeup:
            queued = [s for s in (*self._waiting, *self._held) if selected(s)]
            self._waiting = deque(s for s in self._waiting if not selected(s))
            self._held = deque(s for s in self._held if not selected(s))
        running = [s for s in self._batch.sequences if selected(s)]
        for sequence in queued:  # a retracted request in the queue has tokens already
            sequence.abort(message if sequence.output_ids else ABORT_BEFORE_PREFILL)
        for sequence in running:
            sequence.abort(message)
        self._batch.remove(running)
        self._reply(queued + running)
        return len(queued) + len(running)

    def _reply(self, sequences: list[Sequence], error: Exception | None = None) -> None:
        with self._wakeup:
            replies = [self._replies.pop(s.rid) for s in sequences if s.rid in self._replies]
        for reply in replies:
            if error is None:
                reply.set_result(None)
            else:
                reply.set_exception(error)

    def _parameters(self, names: list[str] | None) -> list[tuple[str, torch.Tensor]]:
        if names is None:
            return list(self.model.named_parameters())
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        unknown = [name for name in names if name not in parameters]
        if unknown:
            raise InvalidRequest(f"unknown parameter names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        return [(name, parameters[name]) for name in names]

    def _load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        problems = []
        for name, tensor in named_tensors:
            if name not in parameters:
                problems.append(f"unknown parameter {name!r}")
            elif parameters[name].shape != tensor.shape:
                problems.append(
                    f"shape mismatch for {name!r}: model has {list(parameters[name].shape)}, got {list(tensor.shape)}"
                )
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise WeightUpdateError("; ".join(problems[:5]) + more + "; nothing was loaded from this update")
        with torch.no_grad():
            for name, tensor in named_tensors:
                parameters[name].copy_(tensor)
        if weight_version is not None:
            self._batch.weight_version = weight_version


def _receive_broadcast(
    group: dist.ProcessGroup,
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    *,
    flattened: bool,
    timeout: float,
    device: torch.device,
) -> list[torch.Tensor]:
    """Receive what group rank 0 broadcasts: one tensor per name, or one flattened bucket of bytes in `names` order
    (common/weights.py, SGLang's layout), onto the model's device (NCCL receives on a GPU)."""
    if not flattened:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes)]
        for tensor in tensors:
            broadcast_within(tensor, group, timeout)
        return tensors
    bucket = torch.empty(bucket_nbytes(dtypes, shapes), dtype=torch.uint8, device=device)
    broadcast_within(bucket, group, timeout)
    return unflatten_bucket(bucket, dtypes, shapes)


def _as_weight_update_error(action: Callable[[], None]) -> None:
    """Run a blocking group operation, reporting torch/gloo failures as WeightUpdateError (answered 400)."""
    try:
        action()
    except (WeightUpdateError, InvalidRequest):
        raise
    except Exception as exc:
        raise WeightUpdateError(f"{type(exc).__name__}: {exc}") from exc


def _require_shape(shape: Any) -> list[int]:
    if not isinstance(shape, list):
        raise InvalidRequest(f"each shape must be a list of sizes, got {shape!r}")
    return [_require_int("shape size", size, low=0) for size in shape]


def parse_dtype(name: Any) -> torch.dtype:
    try:
        return parse_weight_dtype(name)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _eos_token_ids(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = set(configured if isinstance(configured, list) else [] if configured is None else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
