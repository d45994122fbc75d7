"""The step itself: one batch of groups turned into the policy's updates, and the record of what it did.

Advantages per group, the batch collated and split into `algorithm.minibatches` minibatches of whole groups, each
rank's share of every minibatch packed into token-budgeted micro-batches, the proximal and reference log-probabilities
where the objective needs them, then one update of the backend per minibatch under the loss of loss.py. Every rank of
the trainer world runs the same step on the same batch: each trains its share, and the gradients add up over the
ranks.
"""

from __future__ import annotations

import time

import torch

from areal_k8s.common.config import JobConfig
from areal_k8s.common.rewards import is_informative
from areal_k8s.trainer.algorithm import compute_advantages, learning_rate, loss_normaliser, merge_loss_stats
from areal_k8s.trainer.backends.backend import MicroBatch, PhaseClock, TrainBackend
from areal_k8s.trainer.step.batching import Group, staleness_of
from areal_k8s.trainer.step.collation import collate, share_of_rank, split_minibatches
from areal_k8s.trainer.step.loss import loss_fn
from areal_k8s.trainer.step.packing import first_fit_decreasing, take_rows
from areal_k8s.trainer.step.record import StepRecord


def token_staleness_counts(batch: dict[str, torch.Tensor], version: int) -> list[int]:
    """The batch's trained (loss-mask) tokens by staleness at `version`: index s counts those generated s versions
    before it."""
    lags = version - batch["versions"][batch["loss_mask"]]
    return torch.bincount(lags.clamp(min=0)).tolist() if lags.numel() else []


class TrainStep:
    def __init__(
        self, job: JobConfig, backend: TrainBackend, reference: TrainBackend | None, tokenizer, world_size: int
    ):
        """`reference`: the frozen initial policy of the KL penalty (None without one)."""
        self.job = job
        self.backend = backend
        self.reference = reference
        self.tokenizer = tokenizer
        self.world_size = world_size

    def train(self, groups: list[Group], version: int) -> StepRecord:
        """Advantages, then `minibatches` AdamW updates of the decoupled PPO loss over token-budgeted micro-batches:
        the step from `version` to the next."""
        started = time.monotonic()
        algorithm, sampling = self.job.algorithm, self.job.sampling
        trajectories = [e.trajectory for g in groups for e in g.entries]
        rewards = torch.tensor([[e.trajectory.reward for e in g.entries] for g in groups], dtype=torch.float32)
        generated = torch.tensor(
            [[len(e.trajectory.token_ids) - e.trajectory.prompt_length for e in g.entries] for g in groups]
        )
        advantages = compute_advantages(
            algorithm.name,
            rewards,
            generated,
            eps=algorithm.adv_eps,
            max_new_tokens=sampling.max_new_tokens,
            overlong_buffer=algorithm.overlong_buffer,
            overlong_factor=algorithm.overlong_factor,
        ).flatten()
        batch = collate(trajectories, advantages, self.tokenizer.pad_token_id)
        lengths = [len(t.token_ids) for t in trajectories]
        minibatches = split_minibatches(len(groups), algorithm.group_size, algorithm.minibatches)
        shares = [self.rows_to_train(batch, rows, lengths) for rows in minibatches]  # this rank's, per minibatch
        mine = sorted({row for rows, _ in shares for row in rows})
        clock = PhaseClock()
        # The proximal policy is the one before this step's first update: with one update it is the current policy.
        if len(minibatches) > 1 and algorithm.decoupled and algorithm.proximal == "recompute":
            with clock("recompute"):
                batch["proximal_logprobs"] = self.batch_logprobs(self.backend, batch, lengths, mine)
        if self.reference:
            with clock("recompute"):
                batch["reference_logprobs"] = self.batch_logprobs(self.reference, batch, lengths, mine)

        lr = learning_rate(
            version,
            algorithm.total_steps,
            algorithm.lr,
            schedule=algorithm.lr_schedule,
            warmup_steps=algorithm.lr_warmup_steps,
            min_ratio=algorithm.lr_min_ratio,
        )
        results = []
        for rows, (share, masked) in zip(minibatches, shares):
            # the whole minibatch's, on every rank (each holds the whole batch): the ranks' losses add up to its loss
            normaliser = loss_normaliser(algorithm.normaliser, batch["loss_mask"][rows], sampling.max_new_tokens)
            micro_batches = self.micro_batches(batch, share, lengths, masked)
            results.append(self.backend.train_minibatch(micro_batches, loss_fn(algorithm, normaliser, version), lr=lr))
            clock.add(results[-1].seconds)
        self.backend.gather_for_push()  # (every rank) the weights rank 0 pushes next
        stats = merge_loss_stats([stats for result in results for stats in result.stats])
        return StepRecord(
            version=version + 1,
            groups=[g.group_id for g in groups],
            entries=[e.entry_id for g in groups for e in g.entries],
            staleness=[staleness_of(version, g) for g in groups for _ in g.entries],
            reward_mean=float(rewards.mean()),
            loss=sum(result.loss for result in results),
            clip_fraction=stats.clip_fraction,
            approx_kl=stats.approx_kl,
            grad_norm=max(result.grad_norm for result in results),
            samples=len(trajectories),
            tokens=int(batch["loss_mask"].sum()),
            seconds={"train": (train := time.monotonic() - started)},
            train_seconds={"prepare": train - sum(clock.seconds.values()), **clock.seconds},
            learning_rate=lr,
            behaviour_weight_mean=stats.behaviour_weight_mean,
            capped_fraction=stats.capped_fraction,
            groups_without_signal=sum(not is_informative(r) for r in rewards),
            world_size=self.world_size,
            token_staleness_counts=token_staleness_counts(batch, version),
            response_tokens=generated.flatten().tolist(),
        )

    def rows_to_train(
        self, batch: dict[str, torch.Tensor], rows: list[int], lengths: list[int]
    ) -> tuple[list[int], bool]:
        """This rank's rows of one minibatch, and whether they only stand in (their loss masked out)."""
        if self.job.algorithm.kl_coef == 0:
            # A zero-advantage sample (its group's rewards all equal) adds nothing to the loss or its gradient; it
            # still counts in the normaliser, as in the full-batch loss.
            rows = [i for i in rows if batch["advantages"][i, 0] != 0]
        if not rows:  # nothing to learn, on any rank: no rank runs a backward, so none waits for an all-reduce
            return [], False
        # every rank of a data-parallel replica (a model split over ranks) trains the same rows
        share = share_of_rank(
            rows, lengths, self.job.algorithm.group_size, self.backend.data_rank, self.backend.data_size
        )
        if share:
            return share, False
        # A rank without a share still joins the gradient all-reduce: one row whose loss is masked out adds zero.
        return [min(rows, key=lengths.__getitem__)], True

    def micro_batches(
        self, batch: dict[str, torch.Tensor], rows: list[int], lengths: list[int], masked: bool = False
    ) -> list[MicroBatch]:
        """`rows` packed first-fit-decreasing into token-budgeted micro-batches (`masked`: with no loss token)."""
        packed = self.budgeted([lengths[i] for i in rows])
        micro_batches = [take_rows(batch, [rows[i] for i in micro], lengths) for micro in packed]
        for micro_batch in micro_batches if masked else []:
            micro_batch["loss_mask"] = torch.zeros_like(micro_batch["loss_mask"])
        return micro_batches

    def budgeted(self, lengths: list[int]) -> list[list[int]]:
        """Micro-batches of sequences with these lengths within `micro_batch_tokens`: counted with their padding, or
        (`packing: packed`, where a backend computes none) without."""
        trainer = self.job.trainer
        return first_fit_decreasing(lengths, trainer.micro_batch_tokens, padded=trainer.packing == "padded")

    def batch_logprobs(
        self, backend: TrainBackend, batch: dict[str, torch.Tensor], lengths: list[int], rows: list[int]
    ) -> torch.Tensor:
        """Token logprobs of `rows` under `backend`'s policy (no gradient), computed in micro-batches:
        [batch rows, L − 1], zero on the other rows."""
        result = torch.zeros_like(batch["behaviour_logprobs"])
        for micro in self.budgeted([lengths[i] for i in rows]):
            selected = [rows[i] for i in micro]
            logprobs = backend.token_logprobs(take_rows(batch, selected, lengths))
            result[selected, : logprobs.shape[1]] = logprobs
        return result
