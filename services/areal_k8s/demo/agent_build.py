"""Build the agent example's assets offline: the task's tokenizer and chat template, a tiny Qwen2 warmed up on solved
episodes until it solves some of them, and the data.

`python -m areal_k8s.demo.agent_build --out .cache/agent` (what `make agent-assets` runs). The build is the demo's
(services/areal_k8s/demo/build.py: pinned to AVX2 on one thread, stopped on a probe's greedy accuracy, the manifest
written last) on agent_task.py's episodes: the warm-up's loss is on the model's two replies only, and its accuracy is
the episode's, the calculator's result put between the two replies as the gateway would.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from areal_k8s.common.prompts import ConversationFormat
from areal_k8s.cpu_engine.decoding import generate_batch
from areal_k8s.demo import agent_task
from areal_k8s.demo.build import ModelBuildConfig, build_assets, build_command, build_tokenizer, warm_up_and_save
from areal_k8s.reward.verifiers import exact_reward


@dataclass(frozen=True)
class AgentBuildConfig(ModelBuildConfig):
    train_size: int = 3000
    eval_size: int = 128  # each held-out episode is a run of the user's program: a process start
    max_positions: int = 128  # an episode is about 50 tokens
    # the warm-up stops once half of a probe's episodes are solved greedily, when sampling at the job's temperature
    # (0.5) solves about a quarter: groups of four mostly mix solved and unsolved episodes, the signal GRPO learns
    # from. Copying the operands and the result is learnt within a few steps once it starts (from about 25 % to 65 %
    # in 5 at a rate of 1e-3), so the rate is lower and the accuracy checked every other step.
    sft_target_accuracy: float = 0.5
    sft_first_check: int = 40
    sft_check_every: int = 2
    sft_max_steps: int = 400
    sft_lr: float = 5e-4
    probe_max_new_tokens: int = 24  # a tool call is 16 tokens
    eval_max_new_tokens: int = 24


def agent_tokenizer():
    return build_tokenizer(
        agent_task.ALPHABET,
        markers=agent_task.MARKERS,
        pieces=agent_task.PIECES,
        eos=agent_task.END,
        chat_template=agent_task.CHAT_TEMPLATE,
    )


def episode_accuracy(model, tokenizer, items, *, max_new_tokens: int, batch_size: int, reward=exact_reward) -> float:
    """Fraction of `items` (prompt, answer) whose greedy episode ends on a reply `reward` scores 1.0: the first reply,
    and where it calls the calculator, the reply to its result."""
    conversation = ConversationFormat(tokenizer, "chat")
    stops = [tokenizer.eos_token_id]

    def replies(prompts: list[list[int]]):
        return generate_batch(
            model, prompts, max_new_tokens=max_new_tokens, eos_token_ids=stops, max_batch_size=batch_size
        )

    prompts = [agent_task.first_prompt(conversation, prompt) for prompt, _ in items]
    finals = {}
    followups: list[tuple[int, list[int]]] = []
    for index, (prompt, first) in enumerate(zip(prompts, replies(prompts))):
        text = tokenizer.decode(first.output_ids, skip_special_tokens=True)
        result = agent_task.calculator(text)
        if result is None:
            finals[index] = text
        else:
            tool = conversation.tool_turn([result], first.output_ids)
            followups.append((index, prompt + first.output_ids + tool))
    for (index, _), second in zip(followups, replies([ids for _, ids in followups])):
        finals[index] = tokenizer.decode(second.output_ids, skip_special_tokens=True)
    solved = sum(reward(prompt, finals[i], answer, {}) == 1.0 for i, (prompt, answer) in enumerate(items))
    return solved / len(items)


def build_agent_assets(out_dir: str | Path, *, seed: int = 0, **overrides) -> dict:
    """Build (or reuse) the agent example's model, tokenizer and data under `out_dir` and return the manifest;
    `overrides` replace `AgentBuildConfig` defaults."""
    config = AgentBuildConfig(seed=seed, **overrides)
    return build_assets(out_dir, config, overrides, module="areal_k8s.demo.agent_build", build=_build)


def _build(config: AgentBuildConfig, out_dir: Path) -> dict:
    held_out = agent_task.make_problems(config.eval_size, seed=2 * config.seed + 1)
    seen = frozenset(p.expression for p in held_out)
    train = agent_task.make_problems(config.train_size, seed=2 * config.seed, exclude=seen)
    probe = agent_task.make_problems(config.sft_probe_size, seed=2 * config.seed + 2, exclude=seen)
    agent_task.write_dataset(out_dir / "eval.jsonl", held_out)
    agent_task.write_dataset(out_dir / "train.jsonl", train)
    return warm_up_and_save(
        config,
        out_dir,
        examples=train,
        probe=[(p.expression, p.answer) for p in probe],
        held_out=[(p.expression, p.answer) for p in held_out],
        reward=exact_reward,
        probe_max_new_tokens=config.probe_max_new_tokens,
        max_positions=config.max_positions,
        tokenizer=agent_tokenizer(),
        encode=agent_task.encode_episode,
        accuracy=episode_accuracy,
    )


def main(argv: list[str] | None = None) -> None:
    build_command(
        argv,
        module="areal_k8s.demo.agent_build",
        doc=__doc__,
        config_class=AgentBuildConfig,
        build=build_agent_assets,
        what="agent example",
    )


if __name__ == "__main__":
    main()
