"""Interruptible generation: one engine request per batch of prompts, resumed after every weight push.

When the trainer pauses the engine to push weights, in-flight requests come back with finish_reason "abort" and
the tokens so far; they are resubmitted as prompt + generated prefix, the engine recomputes the KV cache under the
new weights, and every token keeps the policy version that produced it (AReaL's interruptible
generation, arXiv 2505.24298). With `rollout.interrupt: retract` the engine does the same inside: it re-queues the
request, recomputes its cache after the update and answers once, its `weight_versions` spans naming each token's
version. An engine also retracts on its own under KV-cache pressure, with unchanged weights: the spans show that
too, and the request simply goes on. A workflow's every model turn is one such generation, so the versions stay
right per token across turns.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from areal_k8s.common.sglang import parse_weight_version, token_versions

MAX_INTERRUPTIONS = 64  # a request aborted this often is not being interrupted by weight pushes: give up on it


@dataclass
class Sample:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    interruptions: int = 0


def request_seed(seed: int, rid: str) -> int:
    """A request's `sampling_seed`, from the job's seed and the request's id: a rerun of the job samples the same
    tokens however its requests were batched (our CPU engine always; SGLang with --enable-deterministic-inference,
    and it ignores the field otherwise). Non-negative and 31 bits, which every engine accepts."""
    digest = hashlib.blake2b(f"{seed}/{rid}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


async def generate_interruptible(engine, prompt_ids: list[int], sampling: dict, rids: list[str]) -> list[Sample]:
    """Generate one response per rid to the same prompt (the engine shares its prefill)."""
    return await generate_each(engine, [prompt_ids] * len(rids), sampling, rids)


async def generate_each(
    engine, prompts: list[list[int]], sampling: dict, rids: list[str], *, seed: int | None = None
) -> list[Sample]:
    """Generate one response per (prompt, rid), in one batched request; after every abort, the aborted ones are
    resubmitted together from their generated prefixes. With a `seed`, every request carries its `request_seed`.

    A resubmission is a new request with a rid of its own: SGLang 0.5.20 answers 500 (its request state lost) when
    a rid comes back while the aborted request of that name is still being cleaned up."""
    prompt_of = dict(zip(rids, prompts, strict=True))
    samples = {rid: Sample() for rid in rids}
    budget = sampling["max_new_tokens"]
    pending, attempt = list(rids), 0
    while pending:
        request_ids = [rid if attempt == 0 else f"{rid}@{attempt}" for rid in pending]
        params = [dict(sampling, max_new_tokens=budget - len(samples[rid].output_ids)) for rid in pending]
        if seed is not None:
            for request, request_id in zip(params, request_ids):
                request["sampling_seed"] = request_seed(seed, request_id)
        results = await engine.generate(
            [prompt_of[rid] + samples[rid].output_ids for rid in pending], params, rid=request_ids
        )
        pending = [
            rid for rid, result in zip(pending, results, strict=True) if not record_answer(samples[rid], result, budget)
        ]
        attempt += 1
    return [samples[rid] for rid in rids]


def record_answer(sample: Sample, result: dict, budget: int) -> bool:
    """Append an engine answer's tokens, logprobs and versions to `sample`; False if it must be resubmitted."""
    meta = result["meta_info"]
    tokens = meta["output_token_logprobs"]
    for (logprob, token_id, _text), version in zip(tokens, token_versions(meta), strict=True):
        sample.output_ids.append(token_id)
        sample.logprobs.append(logprob)
        sample.versions.append(parse_weight_version(version))
    sample.interruptions += meta.get("num_retractions", 0)
    reason = meta["finish_reason"]["type"]
    if reason != "abort":
        sample.finish_reason = reason
        return True
    sample.interruptions += 1
    if len(sample.output_ids) >= budget:
        sample.finish_reason = "length"
        return True
    if sample.interruptions > MAX_INTERRUPTIONS:
        raise RuntimeError(f"request {meta.get('id')} was aborted {sample.interruptions} times")
    return False
