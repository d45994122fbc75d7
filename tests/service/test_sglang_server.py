"""Smoke tests of the real SGLang server (0.5.20 on CPU): the facts of its HTTP API that our client relies on.

They run on the session's shared server (the `sglang_server` fixture), with the checkpoint's weights loaded again
first (tests/e2e/test_sglang_rl.py pushes others into it); none of them changes its weights.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from areal_k8s_testing.sglang_server import SGLangServer, SGLangServerError
from support.sglang_server import skip_or_fail_without_env
from transformers import Qwen2ForCausalLM

from areal_k8s.common.sglang import token_load

GREEDY = {"temperature": 0.0, "ignore_eos": True}
# SGLang and transformers both compute in float32 here; they differ only by the order of float operations
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def checkpoint_model(sglang_server, sglang_model) -> Qwen2ForCausalLM:
    """The served checkpoint, loaded by transformers: the reference for what the server computes, which serves it
    again from its files (SGLang's own reload) whatever weights an earlier test pushed."""
    status, answer = sglang_server.request("POST", "/update_weights_from_disk", {"model_path": str(sglang_model)})
    assert status == 200 and answer["success"], answer
    return Qwen2ForCausalLM.from_pretrained(sglang_model, dtype=torch.float32).eval()


def reference_logprobs(model: Qwen2ForCausalLM, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Log-probabilities over the vocabulary at each output position, given the prompt and the output before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) + len(output) - 1]


def assert_matches_checkpoint(model: Qwen2ForCausalLM, prompt: list[int], answer: dict) -> None:
    output, entries = answer["output_ids"], answer["meta_info"]["output_token_logprobs"]
    assert [token for _logprob, token, _text in entries] == output
    reference = reference_logprobs(model, prompt, output)
    served = torch.tensor([logprob for logprob, _token, _text in entries])
    chosen = reference[torch.arange(len(output)), torch.tensor(output)]
    torch.testing.assert_close(served, chosen, atol=LOGPROB_TOLERANCE, rtol=0)
    # greedy: each chosen token is a most likely one (up to ties within the tolerance)
    assert torch.all(chosen >= reference.max(dim=-1).values - LOGPROB_TOLERANCE)


def test_generate_returns_per_token_logprobs_and_weight_version_spans(sglang_server, checkpoint_model):
    prompt = [72, 101, 108, 108, 111]
    status, answer = sglang_server.request(
        "POST",
        "/generate",
        {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 32}, "return_logprob": True},
    )
    assert status == 200, answer
    meta = answer["meta_info"]
    assert len(answer["output_ids"]) == meta["completion_tokens"] == 32
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["finish_reason"]["type"] == "length"
    for entry in meta["output_token_logprobs"]:
        assert len(entry) == 3 and isinstance(entry[0], float) and isinstance(entry[1], int) and entry[2] is None
        assert entry[0] <= 0.0
    # one weight version served the whole output: a single span over all of it, named as weight_version says
    assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": 32}]
    assert isinstance(meta["weight_version"], str)
    assert meta["num_retractions"] == 0
    assert_matches_checkpoint(checkpoint_model, prompt, answer)


def test_batched_prompts_of_different_lengths_are_each_served_correctly(sglang_server, checkpoint_model):
    # one batch fills the KV slots of both requests at once: each must read back its own
    prompts = [[10, 20, 30], [200, 150, 100, 50, 25, 12, 6, 3]]
    status, answers = sglang_server.request(
        "POST",
        "/generate",
        {"input_ids": prompts, "sampling_params": {**GREEDY, "max_new_tokens": 16}, "return_logprob": True},
    )
    assert status == 200, answers
    assert len(answers) == 2
    for prompt, answer in zip(prompts, answers):
        assert answer["meta_info"]["prompt_tokens"] == len(prompt)
        assert len(answer["output_ids"]) == 16
        assert_matches_checkpoint(checkpoint_model, prompt, answer)


def test_model_info_carries_the_weight_version_and_get_weight_version_is_gone(sglang_server, sglang_model):
    status, info = sglang_server.request("GET", "/model_info")
    assert status == 200, info
    assert isinstance(info["weight_version"], str)
    assert info["model_type"] == "qwen2"
    assert info["architectures"] == ["Qwen2ForCausalLM"]
    assert info["model_path"] == str(sglang_model)
    status, answer = sglang_server.request("GET", "/get_weight_version")
    assert status == 404, answer


def test_v1_loads_gives_the_token_load_the_worker_reports(sglang_server):
    """/v1/loads has the fields `token_load` reads (KV tokens in use or queued, the KV capacity) for each rank; an
    idle server's load is 0 of a positive capacity."""
    status, answer = sglang_server.request("GET", "/v1/loads")
    assert status == 200, answer
    (rank,) = answer["loads"]
    assert rank["max_total_num_tokens"] > 0 and rank["num_total_tokens"] >= rank["num_used_tokens"] >= 0
    assert token_load(answer) == rank["num_total_tokens"] / rank["max_total_num_tokens"]


def test_pause_with_abort_ends_a_running_request_and_continue_resumes(sglang_server):
    request = urllib.request.Request(
        sglang_server.url + "/generate",
        data=json.dumps(
            {"input_ids": [1, 2, 3], "sampling_params": {**GREEDY, "max_new_tokens": 1000}, "stream": True}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as stream:
            first = json.loads(stream.readline().decode().removeprefix("data:"))
            assert first["meta_info"]["finish_reason"] is None  # the request is running
            status, answer = sglang_server.request("POST", "/pause_generation", {"mode": "abort"})
            assert status == 200, answer
            events = [line.removeprefix("data:").strip() for line in stream.read().decode().splitlines()]
    finally:
        status, answer = sglang_server.request("POST", "/continue_generation", {})
    assert status == 200, answer
    chunks = [json.loads(event) for event in events if event and event != "[DONE]"]
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 1000
    status, answer = sglang_server.request(
        "POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {**GREEDY, "max_new_tokens": 4}}
    )
    assert status == 200, answer
    assert answer["meta_info"]["finish_reason"]["type"] == "length"


def test_a_server_that_cannot_start_raises_with_its_log(tmp_path):
    skip_or_fail_without_env()
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    server = SGLangServer(not_a_model, tmp_path / "server.log")
    with pytest.raises(SGLangServerError, match="exited with code") as raised:
        server.start()
    assert str(not_a_model) in str(raised.value)  # the log's tail names what it could not load
    assert server.process is None
