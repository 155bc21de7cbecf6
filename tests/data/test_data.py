"""data.py: cheap checks, loading/rendering/tokenising, and the resumable sampler."""

from __future__ import annotations

import copy
import json
import logging

import pytest
from support.configs import unvalidated
from support.files import write_jsonl
from support.processes import run_python

from leangrpo.config.run import DataConfig
from leangrpo.contracts import Prompt
from leangrpo.data.files import DataError
from leangrpo.data.prompts import check_chat_rows, check_data
from leangrpo.data.prompts import load_prompts as load_prompt_set
from leangrpo.data.sampler import PromptSampler
from leangrpo.data.templates import TemplateError

WORDS = ["<unk>", "<s>", "</s>", "<|user|>", "<|system|>", "<|assistant|>", "be", "brief"]
WORDS += [f"q{i}" for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer that adds <s> as its special token, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    wrapped.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    return wrapped


def load_prompts(*args, **kwargs):
    """(train, eval) prompts; the metrics are tested where they matter."""
    prompts = load_prompt_set(*args, **kwargs)
    return prompts.train, prompts.eval


ROWS = [
    {"question": " ".join(f"q{j}" for j in range(i % 5 + 1)), "answer": str(i), "level": i % 3}
    for i in range(12)
]


# ---- check_data -----------------------------------------------------------------------------


def test_check_data_missing_file_names_key_and_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"data\.path = .*nope\.jsonl.*not found"):
        check_data(DataConfig(path=str(missing)))
    with pytest.raises(DataError, match=r"data\.eval_path .*not found"):
        check_data(
            DataConfig(
                path=write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}]), eval_path=str(missing)
            )
        )


def test_check_data_unsupported_extension(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("hello")
    with pytest.raises(DataError, match=r"unsupported file type '\.txt'"):
        check_data(unvalidated(DataConfig, path=str(path)))  # DataConfig refuses it too
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl' holds no rows"):
        check_data(DataConfig(path=str(tmp_path / "empty.jsonl")))
    (tmp_path / "lines.json").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    check_data(DataConfig(path=str(tmp_path / "lines.json")))  # JSON lines under a .json name


def test_check_data_missing_column_names_existing_ones(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError) as err:
        check_data(DataConfig(path=path))
    message = str(err.value)
    assert "no column 'prompt'" in message and "d.jsonl" in message
    assert "question, answer, level" in message and "data.column_map" in message
    check_data(DataConfig(path=path, column_map={"question": "prompt"}))  # the fix works
    with pytest.raises(DataError, match=r"no column 'solution'"):
        check_data(DataConfig(path=path, column_map={"question": "prompt"}, columns=["solution"]))
    with pytest.raises(DataError, match=r"column_map renames 'query'"):
        check_data(DataConfig(path=path, column_map={"query": "prompt"}))


def test_check_data_reports_bad_jsonl_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b" "x": 1}\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 3 is not valid JSON"):
        check_data(DataConfig(path=str(path)))
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"line 2 is a list, not a JSON object"):
        check_data(DataConfig(path=str(path)))


def test_check_data_reads_csv_parquet_and_json_headers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.csv").write_text("question,answer\nq1,1\n")
    pq.write_table(pa.table({"question": ["q1"], "answer": ["1"]}), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps([{"question": "q1", "answer": "1"}]))
    for name in ("d.csv", "d.parquet", "d.json"):
        path = str(tmp_path / name)
        check_data(DataConfig(path=path, column_map={"question": "prompt"}, columns=["answer"]))
        with pytest.raises(DataError, match=r"it has: question, answer"):
            check_data(DataConfig(path=path))


def test_a_file_that_is_not_parquet_is_named_before_pyarrow_is_imported(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet at all\n")
    with pytest.raises(DataError) as err:
        check_data(DataConfig(path=str(fake)))
    assert str(err.value).startswith(f"{fake} is not a Parquet file (it starts with b'not '")
    assert "convert it to Parquet, or give it the extension of its format" in str(err.value)
    real = tmp_path / "real.parquet"
    pq.write_table(pa.table({"prompt": ["q1"] * 50}), real)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(real.read_bytes()[:-20])
    with pytest.raises(DataError, match=r"cut.parquet is not a Parquet file \(its end is missing"):
        check_data(DataConfig(path=str(cut)))
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"not a Parquet file \(it is empty"):
        check_data(DataConfig(path=str(tmp_path / "empty.parquet")))
    probe = (
        "import sys\nfrom leangrpo.config.run import DataConfig\n"
        "from leangrpo.data.prompts import check_data\n"
        "try:\n    check_data(DataConfig(path=sys.argv[1]))\nexcept Exception as e:\n"
        "    print(type(e).__name__, 'pyarrow' in sys.modules)\n"
    )
    assert run_python(probe, str(fake)).stdout.strip() == "DataError False"


CSV_DEFECTS = {
    "unclosed quote": (
        'prompt,answer\nq1,1\n"q2,2\nq3,3\n',
        "line 3: a quoted field opens there and is never closed (the file ends inside it)",
    ),
    "text after a closing quote": (
        'prompt,answer\n"q1"x,1\n',
        "line 2: malformed quoting (',' expected after '\"')",
    ),
    "more fields than the header": (
        "prompt,answer\nq1,1\nq2, 3,2\n",
        "line 3 has 3 fields but the header has 2; quote fields that hold a comma",
    ),
}


@pytest.mark.parametrize("defect", sorted(CSV_DEFECTS))
def test_csv_defects_are_named_with_their_line(tmp_path, defect):
    text, named = CSV_DEFECTS[defect]
    path = tmp_path / "d.csv"
    path.write_text(text)
    with pytest.raises(DataError) as err:
        check_data(DataConfig(path=str(path)))
    assert str(err.value).startswith(f"{path} {named}"), str(err.value)


def test_csv_quoted_newlines_and_blank_lines_keep_their_line_numbers(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('prompt,answer\n"q1\nq2",1\n\nq3,3\n,4\n')
    with pytest.raises(DataError, match=r"d\.csv' row 2 \(line 6\) has an empty prompt"):
        check_data(DataConfig(path=str(path)))


def test_check_data_source_rules():
    """check_data's own rules, for sections that skipped DataConfig's (which has them too)."""
    with pytest.raises(DataError, match="exactly one of data.path"):
        check_data(unvalidated(DataConfig))
    with pytest.raises(DataError, match="eval_split needs data.dataset"):
        check_data(unvalidated(DataConfig, path="x.jsonl", eval_split="test"))
    with pytest.raises(DataError, match="system_prompt is only used with data.chat_template"):
        check_data(unvalidated(DataConfig, dataset="gsm8k", system_prompt="be brief"))


# ---- load_prompts ---------------------------------------------------------------------------


def test_load_raw_prompts_with_column_map(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    train, evals = load_prompts(DataConfig(path=path, column_map={"question": "prompt"}), tokenizer)
    assert evals == [] and [p.uid for p in train] == list(range(len(ROWS)))
    for p, row in zip(train, ROWS):
        assert p.text == row["question"]
        assert p.ids == [1] + [WORDS.index(w) for w in row["question"].split()]  # <s> added
        assert p.columns == {"answer": row["answer"], "level": row["level"]}
    train, _ = load_prompts(
        DataConfig(path=path, column_map={"question": "prompt"}, columns=["answer"]), tokenizer
    )
    assert train[3].columns == {"answer": "3"}


def test_json_lines_keep_their_types_and_missing_keys_read_none(tmp_path, tokenizer):
    rows = [{"prompt": "q1", "answer": 42}, {"prompt": "q2", "answer": 4.5, "hint": "h"}]
    train, _ = load_prompts(DataConfig(path=write_jsonl(tmp_path / "d.jsonl", rows)), tokenizer)
    assert [p.columns for p in train] == [
        {"answer": 42, "hint": None},  # `datasets` would give 42.0 (a float64 column)
        {"answer": 4.5, "hint": "h"},
    ]
    assert type(train[0].columns["answer"]) is int


def test_local_json_lines_load_without_importing_datasets(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    code = (
        "import sys; from leangrpo.config.run import DataConfig;"
        "from leangrpo.data.prompts import _load_rows;"
        f"cfg = DataConfig(path={path!r}, column_map={{'question': 'prompt'}});"
        f"rows = _load_rows(cfg, {path!r}, None);"
        "assert rows[1] == {'prompt': 'q0 q1', 'answer': '1', 'level': 1}, rows[1];"
        "assert 'datasets' not in sys.modules"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr


def test_load_with_chat_template_and_system_prompt(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "q1 q2"}, {"prompt": [{"role": "user", "content": "q3"}]}]
    )
    cfg = DataConfig(path=path, chat_template=True, system_prompt="be brief")
    train, _ = load_prompts(cfg, tokenizer)
    assert train[0].text == "<|system|> be brief </s> <|user|> q1 q2 </s> <|assistant|> "
    assert train[0].ids == tokenizer(train[0].text, add_special_tokens=False)["input_ids"]
    assert train[0].ids[0] != 1  # the template decides about BOS; none added twice
    assert train[1].text == "<|system|> be brief </s> <|user|> q3 </s> <|assistant|> "


def test_chat_template_missing_is_a_clear_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q1"}])
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>")
    with pytest.raises(DataError, match="no chat template; name one with data.chat_template"):
        load_prompts(DataConfig(path=path, chat_template=True), bare)
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "q1"}, {"prompt": None}])
    with pytest.raises(DataError, match=r"row 1 \(line 2\): column 'prompt' holds None"):
        load_prompts(DataConfig(path=path), tokenizer)


def test_a_named_or_file_template_renders_chat_data_for_a_tokenizer_without_one(
    tmp_path, tokenizer
):
    """data.chat_template names a template (bundled or a file): a base model's tokenizer
    without one renders chat data with it, messages and system prompt included."""
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>")
    assert bare.chat_template is None
    chat = [{"role": "user", "content": "q1"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q1"}, {"prompt": chat}])
    cfg = DataConfig(path=path, chat_template="chatml-hermes", system_prompt="be brief")
    train, _ = load_prompts(cfg, bare)
    expected = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n"
    assert [p.text for p in train] == [expected, expected]
    assert train[0].messages == [{"role": "system", "content": "be brief"}, *chat]
    assert train[0].ids == bare(expected, add_special_tokens=False)["input_ids"]
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}>"
    )
    own, _ = load_prompts(DataConfig(path=path, chat_template=str(tmp_path / "t.jinja")), tokenizer)
    assert own[0].text == "[user] q1\n>"  # the file's, not the tokenizer's own


@pytest.mark.parametrize(
    "template, expected",
    [
        (
            "no-such-template",
            "data.chat_template = 'no-such-template' is neither a bundled template (chatml-hermes) nor a file",
        ),
        ("{broken}", "data.chat_template = '{broken}' is not a valid Jinja template"),
    ],
)
def test_a_template_that_cannot_be_used_is_refused_by_the_cheap_checks(
    tmp_path, template, expected
):
    if template == "{broken}":
        (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
        template = expected = str(tmp_path / "broken.jinja")
        expected = f"data.chat_template = {template!r} is not a valid Jinja template"
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q1"}])
    with pytest.raises(TemplateError) as err:
        check_data(DataConfig(path=path, chat_template=template))
    assert str(err.value).startswith(expected)


def test_eval_holdout_is_seeded_and_disjoint(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = DataConfig(path=path, column_map={"question": "prompt"}, eval_size=4)
    train, evals = load_prompts(cfg, tokenizer, seed=3)
    again_train, again_evals = load_prompts(cfg, tokenizer, seed=3)
    _, other_evals = load_prompts(cfg, tokenizer, seed=4)
    eval_uids = [p.uid for p in evals]
    assert len(evals) == 4 and eval_uids == [p.uid for p in again_evals]
    assert eval_uids != [p.uid for p in other_evals]
    assert sorted(eval_uids + [p.uid for p in train]) == list(range(len(ROWS)))
    assert all(p.text == ROWS[p.uid]["question"] for p in evals)
    with pytest.raises(DataError, match="eval_size = 12 leaves no train rows"):
        load_prompts(
            DataConfig(path=path, column_map={"question": "prompt"}, eval_size=12), tokenizer
        )


def test_eval_path_and_file_formats_agree(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": r["question"], "answer": r["answer"]} for r in ROWS]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "d.csv").write_text(
        "prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows)
    )
    reference, evals = load_prompts(
        DataConfig(path=jsonl, eval_path=str(tmp_path / "d.parquet")), tokenizer
    )
    assert [(p.uid, p.text, p.ids) for p in evals] == [(p.uid, p.text, p.ids) for p in reference]
    for name in ("d.parquet", "d.json", "d.csv"):
        train, _ = load_prompts(DataConfig(path=str(tmp_path / name)), tokenizer)
        assert [(p.text, p.ids, str(p.columns["answer"])) for p in train] == [
            (p.text, p.ids, p.columns["answer"]) for p in reference
        ], name


def test_long_prompts_are_dropped_and_counted(tmp_path, tokenizer, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = DataConfig(
        path=path, column_map={"question": "prompt"}, max_prompt_tokens=3, overlong_prompts="drop"
    )
    with caplog.at_level(logging.WARNING, logger="leangrpo.data"):
        prompts = load_prompt_set(cfg, tokenizer)
    expected = [i for i, r in enumerate(ROWS) if 1 + len(r["question"].split()) <= 3]
    assert [p.uid for p in prompts.train] == expected
    assert prompts.metrics["data/dropped_prompts"] == len(ROWS) - len(expected)
    assert prompts.metrics["data/prompts"] == len(expected)
    assert f"dropped {len(ROWS) - len(expected)} of {len(ROWS)} prompts" in caplog.text
    with pytest.raises(DataError, match="no train prompts left"):
        load_prompts(
            DataConfig(
                path=path,
                column_map={"question": "prompt"},
                max_prompt_tokens=1,
                overlong_prompts="drop",
            ),
            tokenizer,
        )


def test_overlong_prompt_is_an_error_naming_the_row_and_the_limit(tmp_path, tokenizer):
    from leangrpo.data.prompts import PromptLimit

    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    limit = PromptLimit(4, "the model's context of 10 positions minus rollout.max_new_tokens = 6")
    with pytest.raises(DataError) as err:
        load_prompts(DataConfig(path=path, column_map={"question": "prompt"}), tokenizer, 0, limit)
    message = str(err.value)
    assert "row 3 has 5 prompt tokens, more than the 4 allowed by the model's context" in message
    assert "the longest is row 4 with 6" in message and "data.overlong_prompts" in message


def test_overlong_prompts_truncated_left_or_right(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q1 q2 q3 q4"}, {"prompt": "q5"}])
    cut = {}
    for side in ("truncate_left", "truncate_right"):
        cfg = DataConfig(path=path, max_prompt_tokens=3, overlong_prompts=side)
        prompts = load_prompt_set(cfg, tokenizer)
        assert prompts.metrics["data/truncated_prompts"] == 1
        assert prompts.metrics["data/dropped_prompts"] == 0
        assert [len(p.ids) for p in prompts.train] == [3, 2]
        cut[side] = prompts.train[0]
    vocab = {i: w for w, i in tokenizer.get_vocab().items()}
    assert [vocab[i] for i in cut["truncate_left"].ids] == ["q2", "q3", "q4"]
    assert cut["truncate_left"].text == "q2 q3 q4"  # the text is what is trained on
    assert [vocab[i] for i in cut["truncate_right"].ids] == ["<s>", "q1", "q2"]
    assert cut["truncate_right"].text == "q1 q2"


def test_empty_prompt_is_refused_before_loading_or_dropped_and_counted(tmp_path, tokenizer):
    rows = [{"prompt": "q1"}, {"prompt": ""}, {"prompt": "q2"}, {"prompt": " \t "}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as err:
        check_data(DataConfig(path=path))  # the cheap check: before any model or tokenizer
    assert "row 1 (line 2) has an empty prompt (and 1 more rows)" in str(err.value)
    assert "data.empty_prompts: drop" in str(err.value)
    prompts = load_prompt_set(DataConfig(path=path, empty_prompts="drop"), tokenizer)
    assert [p.uid for p in prompts.train] == [0, 2]
    assert prompts.metrics["data/dropped_prompts"] == 2
    (tmp_path / "d.csv").write_text("prompt,answer\nq1,1\n,2\n")
    with pytest.raises(DataError, match=r"d\.csv' row 1 \(line 3\) has an empty prompt"):
        check_data(DataConfig(path=str(tmp_path / "d.csv")))


def test_non_utf8_data_file_is_named_with_its_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl line 2 is not UTF-8 text \(byte 0xe9\)"):
        check_data(DataConfig(path=str(path)))
    csv_path = tmp_path / "d.csv"
    csv_path.write_bytes(b"prompt\nq1\nq\xff2\n")
    with pytest.raises(DataError, match=r"d\.csv is not UTF-8 text \(byte 0xff at line 3\)"):
        check_data(DataConfig(path=str(csv_path)))


def test_hub_dataset_splits_and_errors(monkeypatch, tokenizer):
    import datasets

    splits = {
        "train": datasets.Dataset.from_dict({"question": ["q1", "q2 q3"], "answer": ["1", "2"]}),
        "test": datasets.Dataset.from_dict({"question": ["q4"], "answer": ["4"]}),
    }

    def fake_load_dataset(name, config=None, split=None):  # the hub, offline
        if name != "org/set":
            raise ConnectionError("cannot reach the hub")
        return splits[split]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = DataConfig(dataset="org/set", column_map={"question": "prompt"}, eval_split="test")
    train, evals = load_prompts(cfg, tokenizer)
    assert [p.text for p in train] == ["q1", "q2 q3"] and [p.text for p in evals] == ["q4"]
    assert evals[0].uid == 0 and evals[0].columns == {"answer": "4"}
    with pytest.raises(DataError, match=r"dataset 'org/set' split 'train' has no column 'prompt'"):
        load_prompts(DataConfig(dataset="org/set"), tokenizer)
    with pytest.raises(
        DataError, match=r"data.dataset = 'other/set'.*could not be loaded.*ConnectionError"
    ):
        load_prompts(DataConfig(dataset="other/set"), tokenizer)
    splits["train"] = datasets.Dataset.from_dict({"question": ["q1", " "], "answer": ["1", "2"]})
    with pytest.raises(DataError, match=r"data.dataset = 'org/set' row 1 has an empty prompt"):
        load_prompts(cfg, tokenizer)


# ---- PromptSampler --------------------------------------------------------------------------


def make_prompts(n):
    return [Prompt(uid=i, text=f"p{i}", ids=[i]) for i in range(n)]


def uids(batch):
    return [p.uid for p in batch]


def test_sampler_epochs_are_seeded_permutations():
    prompts = make_prompts(10)
    a, b, c = (PromptSampler(prompts, 5, seed=s) for s in (7, 7, 8))
    first = [uids(a.next_batch()) for _ in range(4)]
    assert first == [uids(b.next_batch()) for _ in range(4)]
    assert first != [uids(c.next_batch()) for _ in range(4)]
    assert sorted(first[0] + first[1]) == list(range(10)) == sorted(first[2] + first[3])
    assert first[:2] != first[2:]  # a new order each epoch
    assert a.epoch == 1 and a.position == 10
    plain = PromptSampler(prompts, 4, seed=7, shuffle=False)
    assert [uids(plain.next_batch()) for _ in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 0, 1],
    ]


def test_sampler_resumes_mid_epoch_exactly():
    prompts = make_prompts(7)
    sampler = PromptSampler(prompts, 3, seed=1)
    for _ in range(4):
        sampler.next_batch()
    sampler.requeue([prompts[5], prompts[2]])
    state = json.loads(json.dumps(sampler.state_dict()))
    assert state["requeued"] == [5, 2] and state["epoch"] == 1
    resumed = PromptSampler(prompts, 3, seed=999)
    resumed.load_state_dict(state)
    expected = [uids(sampler.next_batch()) for _ in range(5)]
    assert [uids(resumed.next_batch()) for _ in range(5)] == expected
    with pytest.raises(DataError, match="saved sampler state is for 7 prompts but 6"):
        PromptSampler(prompts[:6], 3).load_state_dict(state)


def test_requeued_prompts_come_first():
    prompts = make_prompts(6)
    sampler = PromptSampler(prompts, 2, seed=0, shuffle=False)
    assert uids(sampler.next_batch()) == [0, 1]
    sampler.requeue([prompts[0], prompts[1], prompts[4]])
    assert uids(sampler.next_batch()) == [0, 1]
    assert uids(sampler.next_batch()) == [4, 2]  # the rest of the queue, then new prompts
    assert uids(sampler.next_batch()) == [3, 4]
    with pytest.raises(DataError, match="uid 99"):
        sampler.requeue([Prompt(uid=99, text="", ids=[])])


def test_requeue_by_uid_is_what_a_checkpoint_replays():
    prompts = make_prompts(6)
    sampler = PromptSampler(prompts, 2, seed=0, shuffle=False)
    sampler.requeue_uids([5, 3])
    assert uids(sampler.next_batch()) == [5, 3]
    with pytest.raises(DataError, match="uid 99"):
        sampler.requeue_uids([99])


# ---- bad inputs found before the model loads (issue 38) ------------------------------------


def test_eval_size_over_the_rows_is_refused_by_the_cheap_checks(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": "1"} for i in range(3)])
    with pytest.raises(DataError, match="data.eval_size = 3 leaves no train rows out of 3"):
        check_data(DataConfig(path=path, eval_size=3))
    checked = check_data(DataConfig(path=path, eval_size=2))
    assert checked["data.path"].rows == 3


def test_the_columns_of_json_rows_are_their_union(tmp_path):
    rows = [{"prompt": "q0", "answer": "1"}, {"prompt": "q1", "hint": "h"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert check_data(DataConfig(path=path))["data.path"].columns == ["prompt", "answer", "hint"]
    renamed = DataConfig(path=path, column_map={"answer": "solution"})
    assert check_data(renamed)["data.path"].columns == ["prompt", "solution", "hint"]


def test_a_directory_as_data_path_points_to_data_dataset(tmp_path):
    (tmp_path / "data.jsonl").mkdir()  # DataConfig refuses it too (tests/config)
    with pytest.raises(DataError, match=r"is a directory.*data.dataset: '"):
        check_data(unvalidated(DataConfig, path=str(tmp_path / "data.jsonl")))


def strict_template(tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    )
    return strict


def bot_row_file(tmp_path) -> str:
    rows = [{"prompt": [{"role": "user", "content": "q1"}]}] * 3
    rows.append({"prompt": [{"role": "bot", "content": "q2"}]})
    return write_jsonl(tmp_path / "chat.jsonl", rows)


def test_a_row_the_chat_template_refuses_is_named(tmp_path, tokenizer):
    """bad_chat_role_traceback.sh: a jinja2 TemplateError traceback naming neither the file
    nor the row, at the set-up; preflight.py finds it before torch with the tokenizer's
    record (`check_chat_rows`), the set-up with the tokenizer (`load_prompts`)."""
    path = bot_row_file(tmp_path)
    cfg = DataConfig(path=path, chat_template=True)
    for check in (load_prompts, check_chat_rows):
        with pytest.raises(DataError) as err:
            check(cfg, strict_template(tokenizer))
        message = str(err.value)
        assert (
            f"data.path = '{path}' row 3: the chat template cannot render its messages" in message
        )
        assert "roles 'bot'" in message and "unknown role bot" in message and "\n" not in message
    check_chat_rows(cfg, tokenizer)  # a template that takes any role


def test_a_row_a_named_template_refuses_is_named_for_a_tokenizer_without_one(tmp_path, tokenizer):
    """data.chat_template naming a file: the cheap check renders with it, also where the
    tokenizer (its record) has no template of its own; without a record it checks nothing."""
    (tmp_path / "strict.jinja").write_text(strict_template(tokenizer).chat_template)
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>")
    assert bare.chat_template is None
    path = bot_row_file(tmp_path)
    cfg = DataConfig(path=path, chat_template=str(tmp_path / "strict.jinja"))
    for check in (load_prompts, check_chat_rows):
        with pytest.raises(
            DataError, match=r"row 3: the chat template cannot render .*unknown role bot"
        ):
            check(cfg, bare)
    check_chat_rows(cfg, None)  # no record yet: the set-up's load_prompts names the row
