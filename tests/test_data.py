import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from fusedrl.components.data import PromptLoader, load_prompts
from fusedrl.components.tokenizer import ByteTokenizer, HFTokenizer
from fusedrl.config import InputError
from fusedrl.tasks.debug import sample_prompts

TOK = ByteTokenizer()
DEBUG_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "debug" / "tokenizer"
# A Llama-3 style template: writes the BOS itself, refuses unknown roles. In the byte tokenizer only <|bos|> is a
# special token, so a rendered prompt's ids are the BOS id followed by the UTF-8 bytes of the rest.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _write(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_jsonl_bad_rows_reported_with_line_numbers(tmp_path, caplog):
    path = _write(
        tmp_path / "p.jsonl",
        [
            b'{"prompt": "hello"}',  # 1 ok
            b'{"prompt": "hel',  # 2 malformed JSON
            b'{"text": "no prompt"}',  # 3 missing field
            b'{"prompt": "   "}',  # 4 empty
            b'{"prompt": "caf\xe9"}',  # 5 invalid UTF-8 (latin-1 byte)
            b'{"prompt": 42}',  # 6 not a string
            b"",  # blank line: skipped, not a row
            b'["prompt"]',  # 8 not an object
            b'{"prompt": null}',  # 9 null
            b'{"prompt": "' + b"x" * 50 + b'"}',  # 10 over-long
            b'{"prompt": "world"}',  # 11 ok
        ],
    )
    with caplog.at_level(logging.WARNING):
        ds = load_prompts(path, TOK, max_prompt_len=20)
    assert ds.prompts == ["hello", "world"] and ds.source_rows == [1, 11]
    assert ds.token_ids[0] == TOK.encode("hello")
    bad = {b.where: b.reason for b in ds.report.bad}
    assert list(bad) == ["line 2", "line 3", "line 4", "line 5", "line 6", "line 8", "line 9"]
    assert "malformed JSON" in bad["line 2"]
    assert "missing prompt field 'prompt'" in bad["line 3"]
    assert bad["line 4"] == "empty prompt"
    assert "invalid UTF-8" in bad["line 5"]
    assert "int, not a string" in bad["line 6"]
    assert "not an object" in bad["line 8"]
    assert "null" in bad["line 9"]
    assert ds.report.overlong_dropped == 1 and ds.report.rows == 10 and ds.report.kept == 2
    assert "line 2: malformed JSON" in caplog.text and "1 over-long dropped" in caplog.text


@pytest.fixture
def chat_tok(tmp_path) -> HFTokenizer:
    """The debug byte tokenizer with TEMPLATE as the chat_template of its tokenizer_config.json."""
    folder = shutil.copytree(DEBUG_TOKENIZER, tmp_path / "chat_tokenizer")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return HFTokenizer(folder)


def _turn(role: str, text: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}"


def _chat_ids(*turns: tuple[str, str]) -> list[int]:
    """Hand-built ids of TEMPLATE's rendering: one BOS, then the bytes of the turns and the generation prompt."""
    text = "".join(_turn(role, content) + "<|eot_id|>" for role, content in turns) + _turn("assistant", "")
    return [TOK.bos_id, *text.encode("utf-8")]


def test_truncate_chat_template_and_vocab(tmp_path, chat_tok):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"q": "abcdefghij"}).encode(), json.dumps({"q": "ok"}).encode()])
    ds = load_prompts(path, chat_tok, prompt_key="q", chat_template=True, max_prompt_len=105, overlong="truncate")
    # chat_template=True: a plain prompt is one user message; the template's BOS is the only one
    assert ds.prompts[1] == "<|bos|>" + _turn("user", "ok") + "<|eot_id|>" + _turn("assistant", "")
    assert ds.token_ids[1] == _chat_ids(("user", "ok")) and ds.token_ids[1].count(TOK.bos_id) == 1
    assert ds.token_ids[0] == _chat_ids(("user", "abcdefghij"))[-105:]
    assert ds.report.overlong_truncated == 1
    with pytest.raises(ValueError, match="token id 257 out of range for vocab size 200"):
        load_prompts(path, chat_tok, prompt_key="q", chat_template=True, vocab_size=200)


def test_errors(tmp_path):
    empty = _write(tmp_path / "e.jsonl", [b""])
    with pytest.raises(ValueError, match="no usable prompts left.*0 rows"):
        load_prompts(empty, TOK)
    bad = _write(tmp_path / "b.jsonl", [b"{", b'{"prompt": ""}'])
    with pytest.raises(ValueError, match=r"no usable prompts left.*line 1: malformed JSON.*line 2: empty prompt"):
        load_prompts(bad, TOK)
    with pytest.raises(ValueError, match="token id 257 out of range for vocab size 200"):
        load_prompts(_write(tmp_path / "v.jsonl", [b'{"prompt": "a"}']), TOK, vocab_size=200)
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_prompts(tmp_path / "missing.jsonl", TOK)
    with pytest.raises(InputError, match="data.chat_template = true, but the tokenizer ByteTokenizer has no chat template"):
        load_prompts(empty, TOK, chat_template=True)
    with pytest.raises(ValueError, match="data.format"):
        load_prompts(empty, TOK, format="csv")


def test_parquet_and_hf_disk(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["one", None, "", "two"], "other": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "p.parquet")
    ds = load_prompts(tmp_path / "p.parquet", TOK, format="parquet")
    assert ds.prompts == ["one", "two"] and ds.source_rows == [1, 4]
    assert [(b.where, b.reason) for b in ds.report.bad] == [("row 2", "prompt field 'prompt' is null"), ("row 3", "empty prompt")]
    assert ds.rows == [{"prompt": "one"}, {"prompt": "two"}]  # the other columns are not read without an environment
    whole = load_prompts(tmp_path / "p.parquet", TOK, format="parquet", whole_rows=True)
    assert whole.rows == [{"prompt": "one", "other": 1}, {"prompt": "two", "other": 4}]
    binary = pa.table({"prompt": pa.array([b"ok", b"\xff\xfe"], type=pa.binary())})
    pq.write_table(binary, tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"row 1: .*binary.*row 2: invalid UTF-8"):
        load_prompts(tmp_path / "b.parquet", TOK, format="parquet")
    with pytest.raises(ValueError, match="no column 'text'"):
        load_prompts(tmp_path / "p.parquet", TOK, format="parquet", prompt_key="text")

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a", "b", " "]})}).save_to_disk(str(tmp_path / "hf"))
    ds = load_prompts(tmp_path / "hf", TOK, format="hf_disk")
    assert ds.prompts == ["a", "b"] and ds.report.bad[0].where == "row 3"
    datasets.Dataset.from_dict({"prompt": ["a"], "answer": [7]}).save_to_disk(str(tmp_path / "hf2"))
    assert load_prompts(tmp_path / "hf2", TOK, format="hf_disk").rows == [{"prompt": "a"}]
    assert load_prompts(tmp_path / "hf2", TOK, format="hf_disk", whole_rows=True).rows == [{"prompt": "a", "answer": 7}]
    with pytest.raises(ValueError, match="splits"):
        load_prompts(tmp_path / "hf", TOK, format="hf_disk", split="test")


def test_synthetic_prompts_come_from_the_caller():
    ds = load_prompts(None, TOK, format="synthetic", texts=sample_prompts(50, seed=3))
    assert len(ds) == 50 and all(p.startswith("repeat ") for p in ds.prompts)
    assert ds.prompts == load_prompts(None, TOK, format="synthetic", texts=sample_prompts(50, seed=3)).prompts
    with pytest.raises(ValueError, match="texts="):
        load_prompts(None, TOK, format="synthetic")


def test_loader_sharding_determinism_and_resume():
    ds = load_prompts(None, TOK, format="synthetic", texts=sample_prompts(10))
    loaders = [PromptLoader(ds, batch_size=2, rank=r, world_size=2, seed=7) for r in range(2)]
    seen = []
    for _ in range(5):  # 5 global batches of 4 = 2 epochs
        batches = [loader.next_batch() for loader in loaders]
        assert batches[0].sample_ids[-1] + 1 == batches[1].sample_ids[0]
        for b in batches:
            seen += b.dataset_indices
            assert b.token_ids == [ds.token_ids[i] for i in b.dataset_indices]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # each epoch is reshuffled

    a = PromptLoader(ds, batch_size=3, seed=1)
    for _ in range(4):
        a.next_batch()
    state = a.state_dict()
    assert state["epoch"] == 1 and state["position"] == 2
    expected = [a.next_batch().sample_ids for _ in range(3)]
    b = PromptLoader(ds, batch_size=3, seed=1)
    b.load_state_dict(state)
    assert [b.next_batch().sample_ids for _ in range(3)] == expected
    with pytest.raises(ValueError, match="same data"):
        PromptLoader(ds, batch_size=3, seed=2).load_state_dict(state)


def test_out_of_vocab_rows_are_counted_with_line_numbers_and_the_rest_kept(tmp_path):
    class CodePoints:  # one id per character: non-ASCII text gives ids beyond a 128-entry vocabulary
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    path = _write(
        tmp_path / "v.jsonl", [b'{"prompt": "abc"}', json.dumps({"prompt": "caf\u00e9"}).encode(), b'{"prompt": "xyz"}']
    )
    ds = load_prompts(path, CodePoints(), vocab_size=128)
    assert ds.prompts == ["abc", "xyz"] and ds.source_rows == [1, 3]
    assert [(b.where, b.reason) for b in ds.report.bad] == [
        ("line 2", "token id 233 out of range for vocab size 128 (tokenizer does not match the model)")
    ]


def _msg(role: str, content) -> dict:
    return {"role": role, "content": content}


def test_jsonl_chat_rows_rendered_and_malformed_ones_reported(tmp_path, chat_tok):
    rows = [
        {"messages": [_msg("system", "be brief"), _msg("user", "2+2?")]},  # 1 ok
        {"messages": "plain"},  # 2 ok: a plain string prompt, tokenised as is (with the tokenizer's BOS)
        {"messages": {"role": "user", "content": "x"}},  # 3 not a list
        {"messages": []},  # 4 empty
        {"messages": [_msg("user", "x"), {"role": "user"}]},  # 5 no content
        {"messages": [_msg("user", ["x"])]},  # 6 non-string content
        {"messages": ["x"]},  # 7 not an object
        {"messages": [_msg(None, "x")]},  # 8 null role
        {"messages": [_msg("tool", "x")]},  # 9 the template refuses it
        {"messages": [_msg("user", " ")]},  # 10 nothing to say
        {"messages": [_msg("user", "héllo")]},  # 11 ok
    ]
    path = _write(tmp_path / "c.jsonl", [json.dumps(r).encode() for r in rows])
    ds = load_prompts(path, chat_tok, prompt_key="messages")
    assert ds.source_rows == [1, 2, 11]
    assert ds.token_ids == [
        _chat_ids(("system", "be brief"), ("user", "2+2?")),
        TOK.encode("plain"),
        _chat_ids(("user", "héllo")),
    ]
    assert ds.prompts[2] == "<|bos|>" + _turn("user", "héllo") + "<|eot_id|>" + _turn("assistant", "")
    assert [(b.where, b.reason) for b in ds.report.bad] == [
        ("line 3", "prompt field 'messages' is a dict, not a string or a list of messages"),
        ("line 4", "prompt field 'messages' is an empty list of messages"),
        ("line 5", "message 2 has no 'content'"),
        ("line 6", "message 1 content is a list, not a string (text-only chats)"),
        ("line 7", "message 1 is a str, not a {role, content} object"),
        ("line 8", "message 1 role is null"),
        ("line 9", "the chat template rejected the messages: unknown role tool"),
        ("line 10", "every message is empty"),
    ]
    # data.chat_template = true: the plain row is rendered as one user message too
    ds = load_prompts(path, chat_tok, prompt_key="messages", chat_template=True)
    assert ds.token_ids[1] == _chat_ids(("user", "plain"))


def test_parquet_and_hf_disk_chat_rows(tmp_path, chat_tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = [
        [_msg("user", "one")],
        None,
        [_msg("system", "s"), {"role": "user"}],
        [_msg("user", "two"), _msg("assistant", "2"), _msg("user", "3?")],
    ]
    pq.write_table(pa.table({"messages": chats}), tmp_path / "c.parquet")  # a list<struct<role, content>> column
    ds = load_prompts(tmp_path / "c.parquet", chat_tok, format="parquet", prompt_key="messages")
    assert ds.source_rows == [1, 4]
    assert ds.token_ids == [_chat_ids(("user", "one")), _chat_ids(("user", "two"), ("assistant", "2"), ("user", "3?"))]
    # Parquet gives a struct field a message lacks as null
    assert [(b.where, b.reason) for b in ds.report.bad] == [
        ("row 2", "prompt field 'messages' is null"),
        ("row 3", "message 2 content is null"),
    ]

    datasets.Dataset.from_dict({"messages": [chats[0], chats[3]]}).save_to_disk(str(tmp_path / "hf"))
    hf = load_prompts(tmp_path / "hf", chat_tok, format="hf_disk", prompt_key="messages")
    assert hf.token_ids == ds.token_ids and hf.prompts == ds.prompts


def test_chat_rows_need_a_chat_template(tmp_path):
    path = _write(tmp_path / "c.jsonl", [b'{"messages": "plain"}', json.dumps({"messages": [_msg("user", "hi")]}).encode()])
    template_less = HFTokenizer(shutil.copytree(DEBUG_TOKENIZER, tmp_path / "tok"))
    for tok, name in ((template_less, str(tmp_path / "tok" / "tokenizer.json")), (TOK, "ByteTokenizer")):
        with pytest.raises(InputError) as e:
            load_prompts(path, tok, prompt_key="messages")
        message = str(e.value)
        assert message == (
            f"{path} line 2 holds chat messages, but the tokenizer {name} has no chat template; use a tokenizer "
            "folder whose tokenizer_config.json has a chat_template (or with a chat_template.jinja next to "
            "tokenizer.json), or store plain-string prompts"
        )
        with pytest.raises(InputError, match=re.escape(f"data.chat_template = true, but the tokenizer {name} has no chat")):
            load_prompts(path, tok, prompt_key="messages", chat_template=True)
