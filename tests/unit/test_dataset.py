import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_k8s.data.dataset import GSM8K_INSTRUCTION, DatasetError, DatasetItem, load_dataset


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def jsonl(path, records):
    return write_lines(path, [json.dumps(r) for r in records])


GSM8K_RECORD = {"question": "Tom has 3 apples and buys 1,000 more. How many?", "answer": "3 + 1000 = 1003\n#### 1,003"}


def test_areal_format_with_defaults(tmp_path):
    path = jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "1+2=", "answer": "3"},
            {"id": "x7", "prompt": "2+2=", "answer": 4, "verifier": "addition"},
        ],
    )
    assert load_dataset(path) == [
        DatasetItem(id="train-1", prompt="1+2=", reference="3", verifier="math"),
        DatasetItem(id="x7", prompt="2+2=", reference="4", verifier="addition"),
    ]


def test_gsm8k_format(tmp_path):
    path = jsonl(tmp_path / "gsm.jsonl", [GSM8K_RECORD])
    (item,) = load_dataset(path)
    assert item == DatasetItem(
        id="gsm-1", prompt=GSM8K_RECORD["question"] + GSM8K_INSTRUCTION, reference="1003", verifier="math"
    )
    assert item.prompt.endswith("put your final answer within \\boxed{}.")


def test_auto_detection_is_per_file_and_explicit_format_is_enforced(tmp_path):
    areal = jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "answer": "1"}])
    gsm = jsonl(tmp_path / "g.jsonl", [GSM8K_RECORD])
    assert load_dataset(areal)[0].reference == "1"
    assert load_dataset(gsm)[0].reference == "1003"
    assert load_dataset(gsm, fmt="gsm8k")[0].reference == "1003"
    with pytest.raises(DatasetError, match=r"g\.jsonl:1: missing key 'prompt'"):
        load_dataset(gsm, fmt="areal")


def test_blank_lines_are_skipped_but_keep_line_numbers(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", ["", json.dumps({"prompt": "p", "answer": "1"}), "   "])
    assert [item.id for item in load_dataset(path)] == ["d-2"]


@pytest.mark.parametrize(
    ("lines", "where", "problem"),
    [
        (['{"prompt": "p", "answer": "1"}', '{"prompt": "q", "answer": '], ":2:", "bad JSON"),
        (['{"prompt": "p"}'], ":1:", "missing key 'answer'"),
        (['{"answer": "1", "text": "p"}'], ":1:", "cannot tell the format"),
        (['["prompt", "answer"]'], ":1:", "expected a JSON object"),
        (['{"prompt": "p", "answer": null}'], ":1:", "'answer' must be a string"),
        (['{"prompt": "", "answer": "1"}'], ":1:", "'prompt' is empty"),
        ([json.dumps(GSM8K_RECORD), '{"question": "q", "answer": "it is 4"}'], ":2:", "no '#### <number>'"),
        (['{"question": "q", "answer": "4\\n####  "}'], ":1:", "nothing after '####'"),
        (
            ['{"id": "a", "prompt": "p", "answer": "1"}', '{"id": "a", "prompt": "q", "answer": "2"}'],
            ":2:",
            "duplicate id 'a'",
        ),
        # a default id can collide with an explicit one
        (
            ['{"prompt": "p", "answer": "1"}', '{"id": "bad-1", "prompt": "q", "answer": "2"}'],
            ":2:",
            "duplicate id 'bad-1'",
        ),
        ([], ":1:", "empty file"),
        (["", "  "], ":1:", "empty file"),
    ],
)
def test_malformed_input_names_file_and_line(tmp_path, lines, where, problem):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetError) as error:
        load_dataset(path)
    message = str(error.value)
    assert message.startswith(f"{path}{where}")
    assert problem in message
    assert "\n" not in message


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"prompt": "p", "answer": "1"}\n\xff\xfe\n')
    with pytest.raises(DatasetError, match=r"bin\.jsonl:2: not valid UTF-8"):
        load_dataset(path)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(DatasetError, match="cannot read dataset"):
        load_dataset(tmp_path / "absent.jsonl")
    path = jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "answer": "1"}])
    with pytest.raises(DatasetError, match="unknown dataset format 'csv'"):
        load_dataset(path, fmt="csv")


@given(st.text(max_size=200))
def test_arbitrary_text_loads_or_raises_dataset_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "fuzz.jsonl"
    path.write_text(text)
    try:
        items = load_dataset(path)
    except DatasetError as error:
        assert str(error).startswith(str(path))
    else:
        assert items and all(isinstance(item, DatasetItem) for item in items)


# -- code datasets -----------------------------------------------------------------------------------------------

DEEPCODER_RECORD = {
    "problem": "Add two numbers read from one line.",
    "tests": [
        {"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
        {"input": "5 5\n", "output": "10\n", "testtype": "stdin"},
    ],
}
APPS_STDIO_RECORD = {
    "question": "Print the sum.",
    "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}),
}
APPS_CALL_RECORD = {
    "question": "Write add(a, b).",
    "input_output": json.dumps({"fn_name": "add", "inputs": [[1, 2], [0, 0]], "outputs": [[3], [0]]}),
}
MBPP_RECORD = {"prompt": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3"], "task_id": 11}
ADD_STDIN = "print(sum(map(int, input().split())))"
ADD_FUNCTION = "def add(a, b):\n    return a + b"


def test_code_datasets_in_both_shapes_become_items_the_code_verifier_scores(tmp_path):
    from areal_k8s.reward.code_verifier import code_reward

    path = jsonl(tmp_path / "code.jsonl", [DEEPCODER_RECORD, APPS_STDIO_RECORD, APPS_CALL_RECORD, MBPP_RECORD])
    items = load_dataset(path)  # auto: records with tests are code, though APPS's have a `question` as GSM8K's do
    assert [item.verifier for item in items] == ["code"] * 4
    assert items[0].prompt.startswith("Add two numbers") and items[0].prompt.endswith("```python code block.")
    assert json.loads(items[0].reference) == [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]
    assert json.loads(items[2].reference) == {"asserts": ["assert add(*[1, 2]) == 3", "assert add(*[0, 0]) == 0"]}
    assert json.loads(items[3].reference) == {"asserts": ["assert add(1, 2) == 3"]}
    # the references are what the sandboxed verifier reads: a right program passes them all, a wrong one none
    for item, program in zip(items, [ADD_STDIN, ADD_STDIN, ADD_FUNCTION, ADD_FUNCTION]):
        assert code_reward(item.prompt, f"```python\n{program}\n```", item.reference, {}).reward == 1.0
        assert code_reward(item.prompt, "print(0)", item.reference, {}).reward == 0.0


def test_code_dataset_fields_are_configurable(tmp_path):
    from areal_k8s.common.config import CodeDatasetConfig

    path = jsonl(tmp_path / "lcb.jsonl", [{"statement": "Echo.", "cases": [{"input": ["a", "b"], "output": "a\nb\n"}]}])
    fields = CodeDatasetConfig(prompt_fields=["statement"], tests_fields=["cases"], instruction=" (Python)")
    (item,) = load_dataset(path, fmt="code", code=fields)
    assert item.prompt == "Echo. (Python)" and json.loads(item.reference) == [{"input": "a\nb\n", "output": "a\nb\n"}]
    with pytest.raises(DatasetError, match=r"lcb.jsonl:1: cannot tell the format: expected key 'prompt' \(areal\)"):
        load_dataset(path)  # the default fields do not name these keys


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"problem": "p", "tests": "[not json"}, "'tests' is text but not JSON"),
        (
            {"problem": "p", "tests": [{"input": "1", "output": "1", "testtype": "functional"}]},
            "only stdin/stdout cases",
        ),
        (
            {"problem": "p", "tests": {"inputs": ["1"], "outputs": []}},
            "inputs and outputs must be non-empty lists of one length",
        ),
        ({"tests": ["assert True"]}, "a code record needs one of the keys ['question', 'problem', 'prompt']"),
        (
            {"problem": "p", "tests": {"inputs": [[1]], "outputs": [[1]], "fn_name": "not a name"}},
            "fn_name must be a Python name",
        ),
    ],
)
def test_a_bad_code_record_is_refused_naming_the_file_line_and_problem(tmp_path, record, message):
    path = jsonl(tmp_path / "bad.jsonl", [record])
    with pytest.raises(DatasetError, match=re.escape(f"{path}:1: ") + ".*" + re.escape(message)):
        load_dataset(path, fmt="code")
