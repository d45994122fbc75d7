"""The model a run hands over: the trainer writes RUN_DIR/final when its last step is checkpointed, `arealctl export`
writes the same from any checkpoint, Hugging Face loads either and generates with it, and the pinned SGLang serves
it (one server of its own: the session's `sglang_server` serves another model)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from areal_k8s_testing.sglang_server import SGLangServer
from areal_k8s_testing.synthetic import GROUP_SIZE, make_groups
from support.jobs import job_config, tiny_qwen2_fixture
from support.sglang_server import skip_or_fail_without_env
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from areal_k8s.common.config import load_job_file
from areal_k8s.common.final_model import refresh_model_card
from areal_k8s.trainer.checkpoint import checkpoint_dir, save_checkpoint
from areal_k8s.trainer.loop.trainer import Trainer
from areal_k8s.trainer.world import World

model_path = tiny_qwen2_fixture("final-model", seed=3)


@pytest.fixture(scope="module")
def trained_run(model_path, tmp_path_factory):
    """A run directory as a finished run leaves it: two steps trained by the real torch backend, each checkpointed
    and logged to steps.jsonl, the job file `arealctl run` writes, and final/ written by the trainer."""
    run_dir = tmp_path_factory.mktemp("run")
    job = job_config(
        "take-home",
        str(model_path),
        run_dir=str(run_dir),
        sampling={"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 14},
        algorithm={"batch_size": 2, "group_size": GROUP_SIZE, "total_steps": 2, "lr": 1e-2},
    ).resolve_paths(run_dir)  # as `arealctl run` writes it into job.yaml
    (run_dir / "job.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json")))
    trainer = Trainer(
        job=job,
        store=None,
        controller=None,
        tokenizer=AutoTokenizer.from_pretrained(model_path),
        eval_items=[],
        consumer="trainer-0",
        world=World(),
    )
    trainer.backend.load(job.model)
    trainer.state.base_accuracy = 0.25
    for version in (1, 2):
        record = trainer.train_step(make_groups(model_path, 2, seed=version))
        record.eval_accuracy = 0.5 if version == 2 else -1.0
        trainer.state.version = version
        assert trainer.steps_log.append(record)
        save_checkpoint(trainer.checkpoints, trainer.backend, trainer.state, keep=5)
    trainer.write_final_model()
    weights = {name: p.detach().clone() for name, p in trainer.backend.model.named_parameters()}
    return run_dir, weights


def arealctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_k8s.cli.main", *args], capture_output=True, text=True)


def test_final_holds_the_trained_weights_tokenizer_generation_config_and_model_card(trained_run, model_path):
    run_dir, weights = trained_run
    final = run_dir / "final"
    assert {p.name for p in final.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "README.md",
    }
    assert not any(p.name in ("optimizer.pt", "rng.pt", "trainer_state.json") for p in final.iterdir())
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.detach(), weights[name]), name
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    assert not torch.equal(base.lm_head.weight, model.lm_head.weight)  # training moved them

    generation = GenerationConfig.from_pretrained(final)
    assert (generation.do_sample, generation.temperature, generation.top_p) == (True, 0.7, 0.9)
    assert generation.max_new_tokens == 14
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert generation.eos_token_id == tokenizer.eos_token_id
    prompt = tokenizer("12+34=", return_tensors="pt")
    out = model.generate(**prompt, do_sample=False, max_new_tokens=5)
    assert out.shape[1] > prompt["input_ids"].shape[1]

    card = (final / "README.md").read_text()
    assert "# take-home" in card and "library_name: transformers" in card
    assert "| policy version (trainer steps) | 2 of 2 |" in card
    assert "| held-out accuracy of the base model | 25.0% |" in card
    assert "| held-out accuracy of this model | 50.0% |" in card


def test_export_writes_any_checkpoint_as_the_run_writes_final(trained_run, tmp_path):
    run_dir, _ = trained_run
    result = arealctl("export", str(run_dir), str(tmp_path / "newest"))
    assert result.returncode == 0, result.stderr
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"):
        assert (tmp_path / "newest" / name).read_bytes() == (run_dir / "final" / name).read_bytes(), name

    first = checkpoint_dir(run_dir / "checkpoints", 1)
    result = arealctl("export", str(first), str(tmp_path / "v1"), "--job", str(run_dir / "job.yaml"))
    assert result.returncode == 0, result.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32)
    step1 = AutoModelForCausalLM.from_pretrained(first, dtype=torch.float32)
    for (name, exported), (_, saved) in zip(model.named_parameters(), step1.named_parameters(), strict=True):
        assert torch.equal(exported, saved), name
    assert "| policy version (trainer steps) | 1 of 2 |" in (tmp_path / "v1" / "README.md").read_text()


def test_export_of_what_is_not_a_checkpoint_fails_with_one_line(trained_run, tmp_path):
    run_dir, _ = trained_run
    result = arealctl("export", str(tmp_path / "nowhere"), str(tmp_path / "out"), "--job", str(run_dir / "job.yaml"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"arealctl: error: checkpoint not found: {tmp_path / 'nowhere'}"]
    copied = tmp_path / "copied" / "v000002"  # copied out of its run: no job.yaml beside it
    copied.parent.mkdir()
    subprocess.run(["cp", "-r", str(checkpoint_dir(run_dir / "checkpoints", 2)), str(copied)], check=True)
    result = arealctl("export", str(copied), str(tmp_path / "out"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "pass --job FILE" in result.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "a-file").write_text("")
    result = arealctl("export", str(run_dir), str(tmp_path / "a-file" / "model"))
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"arealctl: error: {tmp_path / 'a-file' / 'model'}: cannot write the model (")


def test_the_model_card_takes_the_runs_summary_once_arealctl_run_writes_it(trained_run, tmp_path):
    run_dir = Path(shutil.copytree(trained_run[0], tmp_path / "run"))
    job = load_job_file(run_dir / "job.yaml")
    assert "| wall time (s) · trained samples/s | None · None |" in (run_dir / "final" / "README.md").read_text()
    (run_dir / "summary.json").write_text(json.dumps({"steps": 2, "wall_seconds": 61.5, "samples_per_second": 3.2}))
    card = refresh_model_card(run_dir, job)
    assert card == run_dir / "final" / "README.md"
    assert "| wall time (s) · trained samples/s | 61.5 · 3.2 |" in card.read_text()
    assert "| held-out accuracy of this model | 50.0% |" in card.read_text()
    shutil.rmtree(run_dir / "final")  # a run that wrote no final model (interrupted): nothing to refresh
    assert refresh_model_card(run_dir, job) is None


def test_sglang_serves_final_with_its_tokenizer_and_generates_what_the_trained_weights_predict(trained_run, tmp_path):
    skip_or_fail_without_env()
    run_dir, _ = trained_run
    final = run_dir / "final"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    with SGLangServer(final, tmp_path / "sglang.log") as server:
        status, answer = server.request(
            "POST",
            "/generate",
            {
                "text": "12+34=",  # tokenized by the server, with final/'s tokenizer
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
                "return_logprob": True,
            },
        )
    assert status == 200, answer
    prompt, output = tokenizer("12+34=")["input_ids"], answer["output_ids"]
    assert answer["meta_info"]["prompt_tokens"] == len(prompt) and len(output) == 8
    assert answer["text"] == tokenizer.decode(output)
    # each greedy token is a most likely one under the trained weights as transformers computes them (both float32;
    # they differ by the order of float operations only)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    reference = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    chosen = reference[torch.arange(len(output)), torch.tensor(output)]
    served = torch.tensor([logprob for logprob, _token, _text in answer["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(served, chosen, atol=1e-3, rtol=0)
    assert torch.all(chosen >= reference.max(dim=-1).values - 1e-3)
