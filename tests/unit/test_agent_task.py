"""The agent example's task (services/areal_k8s/demo/agent_task.py), its asset build and its program
(examples/agents/calculator.py)."""

import importlib.util
import json
import random

import pytest
from support.imports import ROOT
from transformers import AutoTokenizer

from areal_k8s.common.prompts import ConversationFormat
from areal_k8s.data.dataset import load_dataset
from areal_k8s.demo import agent_task
from areal_k8s.demo.agent_build import agent_tokenizer, build_agent_assets

TINY_BUILD = {
    "train_size": 64,
    "eval_size": 8,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "sft_target_accuracy": 1.0,  # never reached by a 3-step warm-up: it runs to sft_max_steps
    "sft_first_check": 2,
    "sft_check_every": 1,
    "sft_max_steps": 3,
    "sft_probe_size": 8,
    "sft_batch_size": 8,
    "sft_warmup_steps": 1,
    "eval_batch_size": 8,
}


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    out = tmp_path_factory.mktemp("agent")
    return out, build_agent_assets(out, seed=2, **TINY_BUILD)


def load_program():
    spec = importlib.util.spec_from_file_location("calculator_agent", ROOT / "examples" / "agents" / "calculator.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    return program


def test_problems_are_distinct_seeded_and_keep_out_what_is_excluded():
    held_out = agent_task.make_problems(50, seed=1)
    train = agent_task.make_problems(500, seed=0, exclude=frozenset(p.expression for p in held_out))
    assert train == agent_task.make_problems(500, seed=0, exclude=frozenset(p.expression for p in held_out))
    assert len({p.expression for p in train}) == 500
    assert not {p.expression for p in train} & {p.expression for p in held_out}
    assert all(10 <= p.left <= 99 and 10 <= p.right <= 99 and p.answer == str(p.left * p.right) for p in train)
    with pytest.raises(ValueError, match="two-digit products left"):
        agent_task.make_problems(90 * 90 + 1, seed=0)


def test_a_solved_episode_is_the_templates_conversation_with_only_the_models_replies_labelled():
    tokenizer = agent_tokenizer()
    problem = agent_task.Problem(37, 48)
    ids, labels = agent_task.encode_episode(tokenizer, problem)
    assert tokenizer.unk_token_id not in ids
    # the gateway's path: the call the model writes, parsed into the assistant message the program sends back,
    # rendered by the template, must be the same tokens as the trajectory's
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*48"}}}
    conversation = [
        {"role": "user", "content": "37*48"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1776"},
        {"role": "assistant", "content": "1776"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tools=[agent_task.CALCULATOR], tokenize=False)
    assert tokenizer.decode(ids) == rendered
    labelled = [i for i, label in zip(ids, labels) if label != -100]
    assert labelled == [label for label in labels if label != -100]  # a label is the token it sits on
    end = tokenizer.eos_token_id
    assert tokenizer.decode(labelled) == agent_task.tool_call_text("37*48") + "<|end|>1776<|end|>"
    assert labelled.count(end) == 2  # each reply ends the model's turn
    assert agent_task.calculator(tokenizer.decode(labelled, skip_special_tokens=True)) == "1776"


def test_the_calculator_answers_a_product_call_and_nothing_else():
    assert agent_task.calculator(agent_task.tool_call_text("12*34")) == "408"
    assert agent_task.calculator(agent_task.tool_call_text("12+34")) == "error"
    assert agent_task.calculator("<tool_call>{not json</tool_call>") == "error"
    assert agent_task.calculator("408") is None


def test_the_example_programs_calculator_evaluates_arithmetic_and_refuses_python():
    program = load_program()
    assert program.calculator(json.dumps({"expression": "37*48"})) == "1776"
    assert program.calculator(json.dumps({"expression": "(7-1)/4"})) == "1.5"
    for refused in ("__import__('os').system('true')", "2**100000", "1/0", "x"):
        assert program.calculator(json.dumps({"expression": refused})) == "error"
    assert program.calculator("not json") == "error"


def test_the_build_writes_a_model_whose_saved_tokenizer_and_template_encode_like_the_built_ones(tiny_assets):
    out, manifest = tiny_assets
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["sft_steps"] == 3 and 0.0 <= manifest["base_greedy_accuracy"] <= 1.0
    train, held_out = load_dataset(out / manifest["train"]), load_dataset(out / manifest["eval"])
    assert (len(train), len(held_out)) == (64, 8)
    assert not {item.prompt for item in train} & {item.prompt for item in held_out}
    assert {item.verifier for item in train + held_out} == {agent_task.VERIFIER}
    reloaded, built = AutoTokenizer.from_pretrained(out / "model"), agent_tokenizer()
    rng = random.Random(0)
    for _ in range(100):
        problem = agent_task.Problem(rng.randint(10, 99), rng.randint(10, 99))
        assert agent_task.encode_episode(reloaded, problem) == agent_task.encode_episode(built, problem)
    # the environment's tokens after a reply, as the gateway computes them, are the template's
    after = ConversationFormat(reloaded, "chat").tool_turn(["1776"], [reloaded.eos_token_id])
    assert reloaded.decode(after) == "<|tool|>1776<|end|><|assistant|>"
