"""The real SmolLM2-135M-Instruct folder (``scripts/smollm2_from_gguf.py``; ``.ci/run`` builds it): its architecture
and tokenizer come from its own files, and fusedrl's logits, greedy tokens and chat prompts are transformers'."""

import os
from pathlib import Path

import pytest
import torch

from fusedrl.components import load_tokenizer
from fusedrl.generation import GenerationEngine, Request, SamplingParams
from fusedrl.models import from_pretrained
from fusedrl.tasks import arithmetic

FOLDER = Path(os.environ.get("FUSEDRL_SMOLLM2", Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"))
pytestmark = pytest.mark.skipif(
    not (FOLDER / "config.json").is_file(),
    reason=f"no SmolLM2 folder at {FOLDER}: build it with scripts/smollm2_from_gguf.py (or set FUSEDRL_SMOLLM2)",
)
QUESTIONS = ["What is 7 + 5? Answer with the number only.", "Which number is larger, 41 or 38? Answer with the number only."]


@pytest.fixture(scope="module")
def models():
    transformers = pytest.importorskip("transformers")
    ours, flavor = from_pretrained(FOLDER)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    return ours.eval(), flavor, theirs


def test_architecture_comes_from_config_json(models):
    _, flavor, _ = models
    shape = (flavor.family, flavor.num_layers, flavor.embed_dim, flavor.num_heads, flavor.num_kv_heads, flavor.head_dim)
    assert shape == ("llama", 30, 576, 9, 3, 64)
    assert (flavor.vocab_size, flavor.rope_base, flavor.tie_word_embeddings, flavor.max_seq_len) == (49152, 1e5, True, 8192)


def test_chat_prompts_and_stop_tokens_are_transformers(models):
    transformers = pytest.importorskip("transformers")
    ours, theirs = load_tokenizer(FOLDER), transformers.AutoTokenizer.from_pretrained(FOLDER)
    for question in QUESTIONS:
        chat = [{"role": "user", "content": question}]
        text = ours.render_chat(chat)
        assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.encode(text, add_bos=False) == theirs(text, add_special_tokens=False).input_ids
        assert arithmetic.answer_of(text) in (12, 41)
    assert ours.stop_token_ids == (theirs.convert_tokens_to_ids("<|im_end|>"),) == (2,)


@pytest.mark.slow
def test_logits_and_greedy_tokens_equal_transformers(models):
    model, _, hf = models
    tok = load_tokenizer(FOLDER)
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": q}]), add_bos=False) for q in QUESTIONS]
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-4, atol=2e-3)  # logits std ~3; fp32 over 30 layers
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=tok.stop_token_ids)
    results = GenerationEngine(model, max_slots=2, max_len=96).generate([Request(i, p, greedy) for i, p in enumerate(prompts)])
    for ids, result in zip(prompts, sorted(results, key=lambda r: r.id)):
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        assert result.tokens == out[0, len(ids) :].tolist()
