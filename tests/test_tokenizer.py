import base64
import json
import re

import pytest

from fusedrl.components.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TorchtuneTokenizer,
    _byte_level_alphabet,
    check_vocab,
    load_tokenizer,
)
from fusedrl.models import FLAVORS

TEXTS = ["hello world", "héllo 日本語 🎉", "  leading and trailing  \n\t", ""]


@pytest.fixture
def byte_folder(tmp_path):
    return ByteTokenizer().save(tmp_path / "byte")


@pytest.fixture
def llama3_file(tmp_path):
    """A tiny tiktoken file: 256 single bytes plus two merges."""
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll"]
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return path


@pytest.fixture
def qwen_folder(tmp_path):
    """Tiny GPT-2 style vocab.json + merges.txt: 256 byte symbols plus two merges."""
    chars = _byte_level_alphabet()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["he"] = 256
    vocab["ll"] = 257
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\nh e\nl l\n")
    return folder


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert ids[1:-1] == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == f"<|bos|>{text}<|eos|>"
    assert tok.vocab_size <= 512 and tok.stop_token_ids == (tok.eos_id,)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_as_tokenizer_json_gives_same_ids(byte_folder, text):
    hf = load_tokenizer(byte_folder)
    byte = ByteTokenizer()
    assert isinstance(hf, HFTokenizer)
    assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.pad_id) == (byte.vocab_size, byte.bos_id, byte.eos_id, byte.pad_id)
    for add_bos in (True, False):
        assert hf.encode(text, add_bos=add_bos, add_eos=True) == byte.encode(text, add_bos=add_bos, add_eos=True)
    assert hf.decode(hf.encode(text, add_eos=True)) == text


def test_invalid_utf8_decodes_with_replacement(byte_folder, llama3_file, qwen_folder):
    # 0xC3 starts a 2-byte sequence, 0xFF never appears in UTF-8
    for tok in (ByteTokenizer(), load_tokenizer(byte_folder), load_tokenizer(qwen_folder)):
        assert tok.decode([0xC3, ord("A"), 0xFF]) == "\ufffdA\ufffd"
    assert load_tokenizer(llama3_file).decode([0xFF, ord("A")]) == "\ufffdA"


def test_unknown_ids_are_dropped_when_decoding(byte_folder, llama3_file, qwen_folder):
    for tok in (ByteTokenizer(), load_tokenizer(byte_folder), load_tokenizer(llama3_file), load_tokenizer(qwen_folder)):
        assert tok.decode([ord("o"), 5000, -1, ord("k")]) == "ok"


def test_torchtune_llama3_tokenizer(llama3_file):
    tok = load_tokenizer(llama3_file)
    assert isinstance(tok, TorchtuneTokenizer) and isinstance(tok, Tokenizer)
    ids = tok.encode("hello héllo", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id == 128000 and ids[-1] == tok.eos_id == 128001
    assert ids[1:3] == [256, 257]  # "he", "ll" merges applied
    assert tok.decode(ids) == "hello héllo"
    assert tok.eos_id in tok.stop_token_ids and 128009 in tok.stop_token_ids  # <|eot_id|>
    # The text vocab ends at the last text special token, as the Llama 3 embedding does.
    assert tok.vocab_size == 128256
    check_vocab(tok, FLAVORS["llama3_1_8b"].vocab_size)


def test_torchtune_qwen_tokenizer(qwen_folder):
    tok = load_tokenizer(qwen_folder)
    assert isinstance(tok, TorchtuneTokenizer)
    ids = tok.encode("hello héllo", add_bos=True, add_eos=True)
    assert tok.bos_id is None and ids[:2] == [256, 257] and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "hello héllo"
    assert set(tok.stop_token_ids) == {tok.eos_id, tok.pad_id}
    check_vocab(tok, FLAVORS["qwen2_5_0_5b"].vocab_size)
    with pytest.raises(ValueError, match="vocab_size is 512"):
        check_vocab(tok, FLAVORS["debug_qwen"].vocab_size)


def test_load_tokenizer_picks_by_files(tmp_path, byte_folder, llama3_file, qwen_folder):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(byte_folder / "tokenizer.json"), HFTokenizer)
    assert isinstance(load_tokenizer(llama3_file.parent), TorchtuneTokenizer)
    # A folder with both formats uses tokenizer.json unless torchtune's is asked for.
    ByteTokenizer().save(qwen_folder)
    assert isinstance(load_tokenizer(qwen_folder), HFTokenizer)
    assert isinstance(load_tokenizer(qwen_folder, kind="torchtune"), TorchtuneTokenizer)
    with pytest.raises(ValueError, match=re.escape("special token '<|im_end|>' is missing from")):
        TorchtuneTokenizer.qwen2_5(qwen_folder / "vocab.json", qwen_folder / "merges.txt", qwen_folder / "tokenizer.json")
    with pytest.raises(ValueError, match="no tokenizer files in"):
        load_tokenizer(_empty(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        load_tokenizer(byte_folder, kind="sentencepiece")


def _empty(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def test_hf_tokenizer_special_tokens_from_config_files(byte_folder):
    (byte_folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|pad|>"}}))
    (byte_folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 258]}))
    tok = HFTokenizer(byte_folder)
    assert tok.eos_id == 256 and tok.stop_token_ids == (256, 258)
    assert tok.bos_id == 257  # not in the config: found by its well-known name
    with pytest.raises(ValueError, match="'<nope>' is not in the vocabulary"):
        HFTokenizer(byte_folder, bos_token="<nope>")


def test_hf_tokenizer_rejects_bad_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not a valid HF tokenizer.json"):
        load_tokenizer(path)


def test_check_vocab():
    check_vocab(ByteTokenizer(), FLAVORS["debug"].vocab_size)
    with pytest.raises(ValueError, match=r"tokenizer ids reach 258 but the model's vocab_size is 200"):
        check_vocab(ByteTokenizer(), 200)


# ---------------------------------------------------------------------------- chat templates

# Llama-3 style: the template writes the BOS itself; unknown roles are refused through raise_exception.
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Indented block tags on their own lines: the output is this compact only with trim_blocks + lstrip_blocks (as HF).
# No BOS, plus HF's extras: tojson without HTML escaping, loop controls, {% generation %} blocks.
LAYOUT_STYLE = """\
{% for m in messages %}
    {% if loop.index0 == 3 %}{% break %}{% endif %}
    {% if m.role == 'system' %}
[SYS]{{ m.content | tojson }}
    {% else %}
{% generation %}[{{ m.role | upper }}]{{ m.content }}{% endgeneration %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}
"""
CHAT = [
    {"role": "system", "content": "be <brief> é"},
    {"role": "user", "content": " hi "},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "cut by break"},
]


def _with_template(folder, template, *, jinja_file=False):
    if jinja_file:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def test_hf_chat_template_renders_like_hand_written_text(byte_folder):
    tok = HFTokenizer(_with_template(byte_folder, LLAMA3_STYLE))
    assert tok.chat_template == LLAMA3_STYLE
    expected = (
        "<|bos|><|start_header_id|>system<|end_header_id|>\n\nbe <brief> é<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.render_chat(CHAT[:2]) == expected
    with pytest.raises(ValueError, match="the chat template rejected the messages: unknown role tool"):
        tok.render_chat([{"role": "tool", "content": "x"}])

    tok = HFTokenizer(_with_template(byte_folder, LAYOUT_STYLE, jinja_file=True))  # the .jinja file wins over the config
    assert tok.chat_template == LAYOUT_STYLE
    assert tok.render_chat(CHAT) == '[SYS]"be <brief> é"\n[USER] hi \n[ASSISTANT]ok\n[ASSISTANT]\n'


def test_hf_chat_template_matches_transformers(byte_folder):
    transformers = pytest.importorskip("transformers")
    for template, jinja_file in ((LLAMA3_STYLE, False), (LAYOUT_STYLE, True)):
        folder = _with_template(byte_folder, template, jinja_file=jinja_file)
        ours, theirs = HFTokenizer(folder), transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
        for chat in (CHAT[:1], CHAT[:2], CHAT):
            text = ours.render_chat(chat)
            assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            ids = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
            assert ours.encode(text, add_bos=False) == list(ids)
        (folder / "chat_template.jinja").unlink(missing_ok=True)


# Templates in the style of each supported family (written for these tests), on the byte tokenizer's files: ChatML with
# a default system turn (Qwen2, SmolLM2), Qwen3's namespace and reasoning-block stripping, Mistral's [INST] turns that
# must alternate. Rendering and ids must be transformers' apply_chat_template(..., add_generation_prompt=True).
CHATML_STYLE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a careful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN3_STYLE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- set content = m.content %}
    {%- if m.role == 'assistant' and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {%- if loop.index0 > ns.last_user and m.role == 'assistant' %}{%- set content = content | trim %}{%- endif %}
{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
MISTRAL_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate user/assistant') }}"
    "{% endif %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
TURNS = [
    {"role": "user", "content": "What is 7 + 5?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n12"},
    {"role": "user", "content": "And 3 + 4?"},
]


@pytest.mark.parametrize(
    "template,chats",
    [
        (CHATML_STYLE, (TURNS[:1], TURNS, [CHAT[0], *TURNS])),
        (QWEN3_STYLE, (TURNS[:1], TURNS, [CHAT[0], *TURNS])),
        (MISTRAL_STYLE, (TURNS[:1], TURNS)),
    ],
    ids=["chatml", "qwen3", "mistral"],
)
def test_family_chat_templates_render_and_encode_like_transformers(byte_folder, template, chats):
    transformers = pytest.importorskip("transformers")
    folder = _with_template(byte_folder, template)
    ours, theirs = HFTokenizer(folder), transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    for chat in chats:
        text = ours.render_chat(chat)
        assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ours.encode(text, add_bos=False) == list(ids)
    if template is MISTRAL_STYLE:
        with pytest.raises(ValueError, match="roles must alternate"):
            ours.render_chat([CHAT[0], *TURNS])


def test_hf_chat_template_sources_and_errors(byte_folder):
    tok = HFTokenizer(byte_folder)
    assert tok.chat_template is None
    with pytest.raises(
        ValueError, match=rf"tokenizer {re.escape(str(byte_folder / 'tokenizer.json'))} has no chat template; use"
    ):
        tok.render_chat(CHAT[:1])
    _with_template(byte_folder, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}])
    assert HFTokenizer(byte_folder).render_chat(CHAT[:1]) == "D<|eos|>"
    _with_template(byte_folder, [{"name": "tool_use", "template": "T"}])
    with pytest.raises(ValueError, match=r"chat templates \['tool_use'\] but none named 'default'"):
        HFTokenizer(byte_folder)
    _with_template(byte_folder, 42)
    with pytest.raises(ValueError, match="chat_template in .*tokenizer_config.json is a int, not a Jinja string"):
        HFTokenizer(byte_folder)
    _with_template(byte_folder, "{% for m in messages %}", jinja_file=True)
    with pytest.raises(ValueError, match=r"chat template in .*chat_template.jinja does not parse \(line 1: "):
        HFTokenizer(byte_folder)
    # No clock in the sandbox: a prompt must not depend on the day it is rendered.
    _with_template(
        byte_folder, "{% if strftime_now is defined %}{{ strftime_now('%Y') }}{% else %}26 Jul 2024{% endif %}", jinja_file=True
    )
    assert HFTokenizer(byte_folder).render_chat(CHAT[:1]) == "26 Jul 2024"
    # The sandbox refuses to mutate the caller's messages.
    _with_template(byte_folder, "{{ messages.append(1) }}", jinja_file=True)
    with pytest.raises(ValueError, match="rejected the messages.*unsafe"):
        HFTokenizer(byte_folder).render_chat(CHAT[:1])


def test_hf_tokenizer_save_carries_its_files(byte_folder, tmp_path):
    (byte_folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    tok = HFTokenizer(_with_template(byte_folder, LAYOUT_STYLE, jinja_file=True))
    saved = HFTokenizer(tok.save(tmp_path / "export"))
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == [
        "chat_template.jinja",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert saved.encode("héllo <|eos|>") == tok.encode("héllo <|eos|>")
    assert (saved.bos_id, saved.eos_id, saved.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert saved.render_chat(CHAT) == tok.render_chat(CHAT)
