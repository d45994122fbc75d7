"""The trainer's step on a real (tiny) model: the micro-batching, collation and loss wiring give one update,
whatever the token budget, and every objective variant trains."""

from collections import Counter

import pytest
import torch
from areal_k8s_testing.synthetic import GROUP_SIZE, make_groups
from support.jobs import job_config, tiny_qwen2_fixture
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_k8s.common.trajectory import Trajectory
from areal_k8s.trainer.loop.trainer import Trainer
from areal_k8s.trainer.step.batching import Group
from areal_k8s.trainer.step.collation import collate, split_minibatches

GROUPS, SAMPLES = 3, GROUP_SIZE
TRAINER_OPTIONS = (
    "micro_batch_tokens",
    "logprob_chunk_tokens",
    "precision",
    "gradient_checkpointing",
    "packing",
    "compile",
)


model_path = tiny_qwen2_fixture("trainer-step", seed=3)


def step_groups(model_path, silent_last: bool = True) -> list[Group]:
    """The step tests' batch: its tokens from two policy versions, the rewards alternating within each group."""
    return make_groups(
        model_path,
        GROUPS,
        seed=0,
        longest_response=12,
        versions=(0, 1),
        reward=lambda group, sample: float(sample % 2),
        silent_last=silent_last,
    )


def trained_parameters(model_path, groups, version: int = 0, **algorithm) -> tuple[dict[str, torch.Tensor], object]:
    options = {"micro_batch_tokens": 4096} | {key: algorithm.pop(key) for key in TRAINER_OPTIONS if key in algorithm}
    job = job_config(
        "step",
        str(model_path),
        run_dir=str(model_path.parent / "run"),
        sampling={"temperature": 1.0, "max_new_tokens": 12},
        algorithm={"batch_size": GROUPS, "group_size": SAMPLES, "lr": 1.0, **algorithm},
        trainer=options,
    )
    trainer = Trainer(
        job=job,
        store=None,
        controller=None,
        tokenizer=AutoTokenizer.from_pretrained(model_path),
        eval_items=[],
        consumer="test",
    )
    trainer.backend.load(model_path)
    # plain SGD at lr 1: the parameter change is the gradient itself (AdamW's first step would amplify float noise)
    trainer.backend.optimizer = torch.optim.SGD(trainer.backend.model.parameters(), lr=job.algorithm.lr)
    if trainer.reference:
        trainer.reference.load(model_path)
    trainer.state.version = version
    record = trainer.train_step(groups)
    return {name: p.detach().clone() for name, p in trainer.backend.model.named_parameters()}, record


def test_collate_lines_up_next_token_arrays():
    trajectory = Trajectory(
        token_ids=[5, 6, 7, 8],
        logprobs=[0, 0, -0.5, -0.25],
        versions=[-1, -1, 3, 4],
        loss_mask=[False, False, True, True],
        prompt_length=2,
    )
    short = Trajectory(token_ids=[5, 9], logprobs=[0, -1.0], versions=[-1, 2], loss_mask=[False, True], prompt_length=1)
    batch = collate([trajectory, short], torch.tensor([2.0, -1.0]), pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # position t holds what predicts token t+1
    assert batch["behaviour_logprobs"].tolist() == [[0.0, -0.5, -0.25], [-1.0, 0.0, 0.0]]
    assert batch["versions"].tolist() == [[-1, 3, 4], [2, -1, -1]]
    assert batch["loss_mask"].tolist() == [[False, True, True], [True, False, False]]
    assert batch["advantages"].tolist() == [[2.0] * 3, [-1.0] * 3]


def test_split_minibatches_keeps_groups_whole():
    assert split_minibatches(3, 4, 2) == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]
    assert split_minibatches(2, 2, 5) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("objective", [{}, {"name": "gspo"}, {"decoupled": False, "dual_clip": 3.0}, {"kl_coef": 0.1}])
def test_the_update_does_not_depend_on_the_micro_batch_budget_or_the_logprob_chunk(model_path, objective):
    groups = step_groups(model_path)
    whole, record = trained_parameters(model_path, groups, micro_batch_tokens=4096, **objective)
    # a few sequences per micro-batch, a few tokens per chunk of logits
    packed, _ = trained_parameters(model_path, groups, micro_batch_tokens=24, logprob_chunk_tokens=7, **objective)
    initial = dict(AutoModelForCausalLM.from_pretrained(model_path).named_parameters())
    assert any(not torch.equal(whole[n], initial[n]) for n in whole)  # it trained
    for name in whole:
        assert torch.allclose(whole[name], packed[name], atol=1e-5), name
    assert record.samples == GROUPS * SAMPLES and record.groups_without_signal == 1


def test_a_bf16_step_with_activation_checkpointing_moves_the_weights_as_the_fp32_one(model_path):
    groups = step_groups(model_path)
    initial = dict(AutoModelForCausalLM.from_pretrained(model_path).named_parameters())
    fp32, _ = trained_parameters(model_path, groups)
    bf16, record = trained_parameters(
        model_path, groups, precision="bf16", gradient_checkpointing=True, logprob_chunk_tokens=7
    )
    fp32_step = torch.cat([(fp32[n] - initial[n]).flatten() for n in initial])
    bf16_step = torch.cat([(bf16[n] - initial[n]).flatten() for n in initial])
    assert torch.nn.functional.cosine_similarity(fp32_step, bf16_step, dim=0) > 0.99
    assert all(p.dtype == torch.float32 for p in bf16.values()) and record.loss != 0


def test_several_minibatches_with_recomputed_or_loglinear_proximal_policy(model_path):
    groups = step_groups(model_path, silent_last=False)
    unclipped = {"max_grad_norm": 1e6}
    recomputed, record = trained_parameters(model_path, groups, minibatches=2, proximal="recompute", **unclipped)
    loglinear, _ = trained_parameters(model_path, groups, minibatches=2, proximal="loglinear", **unclipped)
    single, _ = trained_parameters(model_path, groups, **unclipped)
    # two updates move the weights differently from one, and the proximal estimate matters
    assert any(not torch.allclose(recomputed[n], single[n], atol=1e-6) for n in single)
    assert any(not torch.allclose(recomputed[n], loglinear[n], atol=1e-6) for n in single)
    assert all(torch.isfinite(p).all() for p in loglinear.values())
    assert record.behaviour_weight_mean > 1.0  # behaviour logprobs were shifted down: π_prox / π_behav > 1


def test_a_step_splits_its_time_and_exports_its_figures(model_path):
    groups = step_groups(model_path, silent_last=False)
    _, record = trained_parameters(model_path, groups, minibatches=2, proximal="recompute")
    split = record.train_seconds
    assert set(split) == {"prepare", "recompute", "forward_backward", "optimizer"}
    assert min(split["recompute"], split["forward_backward"], split["optimizer"]) > 0 and split["prepare"] >= 0
    assert sum(split.values()) == pytest.approx(record.seconds["train"])

    record.seconds["wait"] = 0.25
    job = job_config("step", str(model_path), run_dir=str(model_path.parent / "run"))
    trainer = Trainer(job=job, store=None, controller=None, tokenizer=None, eval_items=[], consumer="test")
    trainer.observe(record, step_seconds=2.0)
    m = trainer.metrics

    def phase(name: str) -> float:
        return m.value("areal_trainer_phase_seconds_total", phase=name)

    assert phase("wait") == 0.25 and phase("forward_backward") == split["forward_backward"] and phase("eval") == 0
    assert m.value("areal_trainer_trained_samples_total") == GROUPS * SAMPLES == record.samples
    assert m.value("areal_trainer_sample_staleness_count") == GROUPS * SAMPLES
    assert (
        m.value("areal_trainer_loss") == record.loss
        and m.value("areal_trainer_learning_rate") == record.learning_rate > 0
    )
    assert m.value("areal_trainer_step_duration_seconds_sum") == 2.0


def expected_token_staleness(groups: list[Group], version: int) -> list[int]:
    """The trained tokens by staleness at `version`, from the trajectories themselves."""
    lags = Counter(
        version - generated_by
        for g in groups
        for e in g.entries
        for generated_by, trained in zip(e.trajectory.versions, e.trajectory.loss_mask)
        if trained
    )
    return [lags[s] for s in range(max(lags) + 1)]


def test_a_step_counts_its_trained_tokens_by_staleness_and_exports_them(model_path):
    """Each trained token's staleness is its trainer version minus its own policy's: tokens of one response can
    differ (here from versions 0 and 1, trained at 2)."""
    groups = step_groups(model_path, silent_last=False)
    _, record = trained_parameters(model_path, groups, version=2)
    counts = expected_token_staleness(groups, 2)
    assert record.token_staleness_counts == counts and counts[0] == 0 and min(counts[1:]) > 0
    assert sum(counts) == record.tokens
    assert record.report().token_staleness_counts == counts

    job = job_config("step", str(model_path), run_dir=str(model_path.parent / "run"))
    trainer = Trainer(job=job, store=None, controller=None, tokenizer=None, eval_items=[], consumer="test")
    trainer.observe(record, step_seconds=1.0)
    trainer.observe(record, step_seconds=1.0)
    m = trainer.metrics
    assert m.value("areal_trainer_token_staleness_count") == 2 * record.tokens
    assert m.value("areal_trainer_token_staleness_sum") == 2 * sum(s * n for s, n in enumerate(counts))
    assert m.value("areal_trainer_token_staleness_bucket", le="1.0") == 2 * counts[1]


def test_capped_truncates_the_behaviour_weight_of_tokens_older_than_eta_only(model_path):
    """The synthetic behaviour policy is a little stale: every token's w = π_prox/π_behav is e^0.05. At version 2
    with η = 1 the tokens of version 0 are past η: `capped` truncates their w at `stale_weight_cap` (1.0 here),
    the others keep theirs; `strict` and `admission` truncate nothing (w is under the behaviour-weight cap)."""
    groups = step_groups(model_path, silent_last=False)
    counts = expected_token_staleness(groups, 2)
    options = {"max_staleness": 1, "behaviour_cap_mode": "clamp"}
    _, capped = trained_parameters(
        model_path, groups, version=2, staleness_policy="capped", stale_weight_cap=1.0, **options
    )
    _, admission = trained_parameters(model_path, groups, version=2, staleness_policy="admission", **options)
    assert capped.capped_fraction == pytest.approx(counts[2] / sum(counts))
    assert admission.capped_fraction == 0
    assert capped.loss != admission.loss
