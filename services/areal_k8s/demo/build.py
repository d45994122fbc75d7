"""Build the demo's assets offline: a character tokenizer, a tiny Qwen2 warmed up by a short SFT, and the data.

The warm-up is deliberately short: it stops as soon as greedy accuracy on a probe set reaches
`sft_target_accuracy`, when the model writes the scratchpad format but still gets most sums wrong and its
sampled answers to one prompt often disagree, which is the signal GRPO learns from. Stopping on accuracy
rather than after a fixed step count keeps the base model equally weak across seeds (the warm-up's learning
curve is steep, and when it steepens varies by seed).

Float sums depend on the instruction set torch and MKL pick (AVX-512 kernels add in another order than AVX2 ones,
and a warm-up that stops on an accuracy threshold turns the last bit into a different model), so the build runs in a
process pinned to the AVX2 paths, on one thread: on one machine a seed builds the same weights whatever the CPU
offers beyond AVX2. Another machine may still differ in the last bits (a fresh clone elsewhere built another model
from the same seed); the manifest records the weights' digest.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from areal_k8s.cpu_engine.decoding import generate_batch
from areal_k8s.demo import task
from areal_k8s.reward.addition_verifier import addition_reward

BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
MANIFEST = "manifest.json"
# Long sums are rarely solved by a warm-up model; a shorter budget keeps the probe checks cheap.
PROBE_MAX_NEW_TOKENS = 64
BUCKET_BATCHES = 8  # batches drawn together and split by length
# torch's kernels, MKL's and oneDNN's, each told to use the AVX2 code paths whatever the CPU offers beyond them
PINNED_ISA = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
BUILD_FORMAT = 2  # 2: built pinned to AVX2; assets of an older format are rebuilt


@dataclass(frozen=True)
class ModelBuildConfig:
    """What every task's asset build has: the seed, the data sizes, the model's shape, the supervised warm-up and the
    base model's evaluation, at the demo's values (a task's build overrides what differs and adds its task's)."""

    seed: int = 0
    train_size: int = 4000
    eval_size: int = 256
    # model
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    # supervised warm-up: stops once greedy accuracy on a probe set reaches the target (or after max steps)
    sft_target_accuracy: float = 0.16
    sft_first_check: int = 150
    sft_check_every: int = 10
    sft_max_steps: int = 320
    sft_probe_size: int = 128
    sft_batch_size: int = 64
    sft_lr: float = 2e-3
    sft_warmup_steps: int = 20
    # base-model evaluation
    eval_max_new_tokens: int = 128
    eval_batch_size: int = 128


@dataclass(frozen=True)
class DemoBuildConfig(ModelBuildConfig):
    # task distribution
    min_digits: int = task.DEFAULT_DIGITS.min_digits
    max_digits: int = task.DEFAULT_DIGITS.max_digits
    tail_exponent: float = task.DEFAULT_DIGITS.tail_exponent

    @property
    def digits(self) -> task.DigitDistribution:
        return task.DigitDistribution(self.min_digits, self.max_digits, self.tail_exponent)


def build_tokenizer(
    alphabet: str = task.ALPHABET,
    *,
    markers: tuple[str, ...] = (),
    pieces: tuple[str, ...] = (),
    eos: str = EOS,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet` plus <bos>/<pad>/<unk>, the end-of-sequence token `eos` and one token
    per string of `markers` (special: dropped when decoding) and of `pieces` (kept: text the model writes as one
    token, as a learned vocabulary would); <bos> is prepended when encoding. The demo's is the defaults'."""
    specials = [PAD, BOS, eos, UNK, *markers]
    vocab = {token: index for index, token in enumerate(specials + list(pieces) + list(alphabet))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    backend.add_special_tokens(specials)
    backend.add_tokens(list(pieces))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=eos, pad_token=PAD, unk_token=UNK, padding_side="left"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_model(
    config: ModelBuildConfig, tokenizer: PreTrainedTokenizerFast, *, max_positions: int = 256
) -> Qwen2ForCausalLM:
    """A Qwen2 of `config`'s shape with random weights drawn from its seed."""
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(config.seed)
    return Qwen2ForCausalLM(model_config)


def encode_pair(tokenizer: PreTrainedTokenizerFast, prompt: str, solution: str) -> tuple[list[int], list[int]]:
    """(ids, labels) of a prompt (with <bos>) and its solution (ending in <eos>): labels are the solution's ids,
    -100 on the prompt's."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    solution_ids = [*tokenizer(solution, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return prompt_ids + solution_ids, [-100] * len(prompt_ids) + solution_ids


def supervised_batch(
    sequences: list[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 on padding) of (ids, labels) sequences."""
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), width), pad_id)
    labels = torch.full((len(sequences), width), -100)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, (ids, targets) in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(targets)
        mask[row, : len(ids)] = 1
    return input_ids, mask, labels


def length_bucketed_batches(
    sequences: list[tuple[list[int], list[int]]], *, steps: int, batch_size: int, rng: random.Random
) -> Iterator[list[tuple[list[int], list[int]]]]:
    """`steps` random batches; each draw of BUCKET_BATCHES batches is sorted by length before splitting,
    so the rare long sample pads a batch of long samples rather than a batch of short ones."""
    emitted = 0
    while emitted < steps:
        count = min(BUCKET_BATCHES, steps - emitted)
        drawn = sorted(rng.sample(sequences, batch_size * count), key=lambda sequence: len(sequence[0]))
        batches = [drawn[i * batch_size : (i + 1) * batch_size] for i in range(count)]
        rng.shuffle(batches)
        yield from batches
        emitted += count


def supervised_warmup(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    sequences: list[tuple[list[int], list[int]]],
    *,
    max_steps: int,
    batch_size: int,
    lr: float,
    warmup_steps: int,
    seed: int,
    should_stop: Callable[[int], bool] = lambda step: False,
) -> list[float]:
    """AdamW on (ids, labels) sequences, the loss on the labelled tokens only; linear warm-up, then a constant rate.

    `should_stop(steps_done)` is asked after every step. Returns the per-step losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup_steps))
    model.train()
    losses = []
    for batch in length_bucketed_batches(sequences, steps=max_steps, batch_size=batch_size, rng=random.Random(seed)):
        input_ids, mask, labels = supervised_batch(batch, tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if should_stop(len(losses)):
            break
    model.eval()
    return losses


def greedy_accuracy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    items: list[tuple[str, str]],
    *,
    max_new_tokens: int,
    batch_size: int,
    reward: Callable = addition_reward,
) -> float:
    """Fraction of `items` (prompt, reference answer) whose greedy response `reward` scores 1.0."""
    correct = 0.0
    # Similar lengths together waste less decoding on padding.
    ordered = sorted(items, key=lambda item: len(item[0]))
    for start in range(0, len(ordered), batch_size):
        chunk = ordered[start : start + batch_size]
        prompts = [tokenizer(prompt)["input_ids"] for prompt, _ in chunk]
        responses = generate_batch(
            model,
            prompts,
            max_new_tokens=max_new_tokens,
            eos_token_ids=[tokenizer.eos_token_id],
            max_batch_size=batch_size,
        )
        correct += sum(
            reward(prompt, tokenizer.decode(r.output_ids, skip_special_tokens=True), answer, {}) == 1.0
            for r, (prompt, answer) in zip(responses, chunk)
        )
    return correct / len(items)


def build_demo_assets(out_dir: str | Path, *, seed: int = 0, **overrides) -> dict:
    """Build (or reuse) the demo's model, tokenizer and data under `out_dir` and return the manifest.

    `overrides` replace `DemoBuildConfig` defaults. An existing manifest with the same parameters is returned
    as is; the manifest is written last, so an interrupted build is redone.
    """
    config = DemoBuildConfig(seed=seed, **overrides)
    return build_assets(out_dir, config, overrides, module="areal_k8s.demo.build", build=_build)


def build_assets(out_dir: str | Path, config, overrides: dict, *, module: str, build: Callable) -> dict:
    """Reuse the assets under `out_dir` if their manifest has `config`'s parameters, else `build(config, out_dir)`
    (which returns the manifest) pinned to AVX2 on one thread: in `module`'s command line run anew with the
    pinned environment if this process is not pinned."""
    out_dir = Path(out_dir)
    manifest_path = out_dir / MANIFEST
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("params") == asdict(config) and manifest.get("format") == BUILD_FORMAT:
            return manifest
        manifest_path.unlink()  # the old manifest must not vouch for half-rewritten files
    if not isa_pinned():
        # the instruction set is chosen when torch loads: only a new process can be pinned
        params = [f"--param={key}={value}" for key, value in overrides.items()]
        subprocess.run(
            [sys.executable, "-m", module, "--out", str(out_dir), "--seed", str(config.seed), "--quiet", *params],
            env={**os.environ, **PINNED_ISA},
            check=True,
        )
        return json.loads(manifest_path.read_text())

    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float results, hence the built model, depend on the thread count
    try:
        manifest = build(config, out_dir)
    finally:
        torch.set_num_threads(threads)
    manifest["build_seconds"] = round(time.perf_counter() - started, 1)
    temporary = manifest_path.with_suffix(".tmp")
    temporary.write_text(json.dumps(manifest, indent=2) + "\n")
    temporary.replace(manifest_path)
    return manifest


def _build(config: DemoBuildConfig, out_dir: Path) -> dict:
    eval_problems = task.write_dataset(
        out_dir / "eval.jsonl", config.eval_size, seed=2 * config.seed + 1, digits=config.digits
    )
    held_out = frozenset(task.prompt_text(p) for p in eval_problems)
    train_problems = task.write_dataset(
        out_dir / "train.jsonl",
        config.train_size,
        seed=2 * config.seed,
        digits=config.digits,
        exclude=held_out,
    )
    # Fresh draws from the task distribution: the training file's de-duplication thins out short sums.
    probe = task.make_problems(config.sft_probe_size, seed=2 * config.seed + 2, digits=config.digits, exclude=held_out)
    return warm_up_and_save(
        config,
        out_dir,
        examples=[(task.prompt_text(p), task.solution_text(p)) for p in train_problems],
        probe=[(task.prompt_text(p), p.answer) for p in probe],
        held_out=[(task.prompt_text(p), p.answer) for p in eval_problems],
        reward=addition_reward,
        probe_max_new_tokens=PROBE_MAX_NEW_TOKENS,
    )


def warm_up_and_save(
    config,
    out_dir: Path,
    *,
    examples: list,
    probe: list[tuple[str, str]],
    held_out: list[tuple[str, str]],
    reward: Callable,
    probe_max_new_tokens: int,
    max_positions: int = 256,
    tokenizer: PreTrainedTokenizerFast | None = None,
    encode: Callable = lambda tokenizer, example: encode_pair(tokenizer, *example),
    accuracy: Callable = greedy_accuracy,
) -> dict:
    """A model of `config`'s shape warmed up on `examples` (by default (prompt, solution) texts; `encode(tokenizer,
    example)` makes each one's (ids, labels)) until its `accuracy` (greedy_accuracy's arguments) on `probe` (prompt,
    answer) reaches `config.sft_target_accuracy`, scored on `held_out`, saved with the tokenizer (the demo's by
    default) under `out_dir`/model; returns the manifest (the task's files, train.jsonl and eval.jsonl, are the
    caller's)."""
    tokenizer = tokenizer or build_tokenizer()
    model = build_model(config, tokenizer, max_positions=max_positions)
    probe_accuracy = 0.0

    def reached_target(step: int) -> bool:
        nonlocal probe_accuracy
        if step < config.sft_first_check or (step - config.sft_first_check) % config.sft_check_every:
            return False
        probe_accuracy = accuracy(
            model,
            tokenizer,
            probe,
            max_new_tokens=probe_max_new_tokens,
            batch_size=config.eval_batch_size,
            reward=reward,
        )
        return probe_accuracy >= config.sft_target_accuracy

    sft_started = time.perf_counter()
    losses = supervised_warmup(
        model,
        tokenizer,
        [encode(tokenizer, example) for example in examples],
        max_steps=config.sft_max_steps,
        batch_size=config.sft_batch_size,
        lr=config.sft_lr,
        warmup_steps=config.sft_warmup_steps,
        seed=config.seed,
        should_stop=reached_target,
    )
    sft_seconds = time.perf_counter() - sft_started

    eval_started = time.perf_counter()
    base_accuracy = accuracy(
        model,
        tokenizer,
        held_out,
        max_new_tokens=config.eval_max_new_tokens,
        batch_size=config.eval_batch_size,
        reward=reward,
    )
    eval_seconds = time.perf_counter() - eval_started

    model_dir = out_dir / "model"
    model.generation_config.update(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    return {
        "format": BUILD_FORMAT,
        "weights_sha256": weights_digest(model),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "params": asdict(config),
        "seed": config.seed,
        "model": "model",
        "train": "train.jsonl",
        "eval": "eval.jsonl",
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "sft_steps": len(losses),
        "sft_seconds": round(sft_seconds, 1),
        "sft_probe_accuracy": probe_accuracy,
        "sft_final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "base_greedy_accuracy": base_accuracy,
        "eval_seconds": round(eval_seconds, 1),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def isa_pinned() -> bool:
    return all(os.environ.get(key) == value for key, value in PINNED_ISA.items())


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the parameters' bytes in name order: equal digests, equal models."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def param_parser(config_class) -> Callable[[str], tuple[str, object]]:
    """A parser of `KEY=VALUE` for a field of `config_class` (a build config), the value converted to its type."""
    fields = {f.name: f.type for f in dataclasses.fields(config_class) if f.name != "seed"}

    def parse_param(text: str) -> tuple[str, object]:
        key, _, value = text.partition("=")
        if key not in fields:
            raise argparse.ArgumentTypeError(f"unknown build parameter {key!r}; known: {', '.join(sorted(fields))}")
        convert, kind = {"int": (int, "an integer"), "float": (float, "a number")}[fields[key]]
        try:
            return key, convert(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key} must be {kind}, got {value!r}") from None

    return parse_param


def build_command(argv: list[str] | None, *, module: str, doc: str, config_class, build: Callable, what: str) -> None:
    """The command line of an asset build: `python -m MODULE --out DIR [--seed N] [--param KEY=VALUE ...]`."""
    transformers.utils.logging.disable_progress_bar()
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--param",
        type=param_parser(config_class),
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a build parameter (e.g. sft_max_steps=40)",
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    args = parser.parse_args(argv)
    manifest = build(args.out, seed=args.seed, **dict(args.param))
    if args.quiet:
        return
    print(
        f"{what} assets in {args.out}: {manifest['num_parameters']:,}-parameter Qwen2, "
        f"{manifest['sft_steps']} SFT steps in {manifest['sft_seconds']}s, "
        f"base greedy accuracy {manifest['base_greedy_accuracy']:.1%} "
        f"on {manifest['params']['eval_size']} held-out prompts; weights sha256 {manifest['weights_sha256'][:16]}"
    )


def main(argv: list[str] | None = None) -> None:
    build_command(
        argv,
        module="areal_k8s.demo.build",
        doc=__doc__,
        config_class=DemoBuildConfig,
        build=build_demo_assets,
        what="demo",
    )


if __name__ == "__main__":
    main()
