import json

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
