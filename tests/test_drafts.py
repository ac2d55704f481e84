"""HistoryDrafter: drafts from siblings, history, the prompt and the request itself; adaptive k; bounds; errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusedrl.generation.drafts import NO_DRAFT, SOURCES, Draft, HistoryDrafter

PROMPT = [1, 2, 3, 10, 11, 12, 4, 5]  # "10 11" is followed by 12 in the prompt


def test_sibling_continuation():
    d = HistoryDrafter()
    d.start("a", PROMPT)
    d.start("b", PROMPT)
    d.extend("a", [50, 60, 70, 80, 90])  # A B C D E
    d.extend("b", [7, 50, 60])  # ... A B
    assert d.propose("b") == Draft((70, 80, 90), "siblings")
    assert d.propose("b", limit=2) == Draft((70, 80), "siblings")


def test_first_tokens_from_a_sibling_ahead():
    # The prompt's tail is context too: a sibling's first tokens follow it.
    d = HistoryDrafter()
    d.start("a", PROMPT)
    d.extend("a", [50, 60, 70])
    d.start("b", PROMPT)
    assert d.propose("b") == Draft((50, 60, 70), "siblings")


def test_longest_match_wins():
    d = HistoryDrafter()
    d.start("s1", PROMPT)
    d.start("s2", PROMPT)
    d.start("r", PROMPT)
    d.extend("s1", [30, 40, 50, 60, 61])  # "30 40 50" -> 60
    d.extend("s2", [99, 40, 50, 70, 71])  # "40 50" -> 70, more recent than s1's
    d.extend("r", [30, 40, 50])
    assert d.propose("r") == Draft((60, 61), "siblings")
    d.start("r2", PROMPT)
    d.extend("r2", [33, 40, 50])  # only the 2-gram matches: its most recent occurrence
    assert d.propose("r2") == Draft((70, 71), "siblings")


def _priority_case(sibling: bool, history: bool) -> Draft:
    d = HistoryDrafter()
    if history:
        d.start("h", PROMPT)
        d.extend("h", [20, 10, 11, 13, 14])
        d.finish("h")
    d.start("r", PROMPT)
    if sibling:
        d.start("s", PROMPT)
        d.extend("s", [21, 10, 11, 15, 16])
    d.extend("r", [22, 10, 11])  # only the 2-gram "10 11" occurs anywhere
    return d.propose("r", limit=2)


def test_source_priority_at_equal_length():
    assert _priority_case(sibling=True, history=True) == Draft((15, 16), "siblings")
    assert _priority_case(sibling=False, history=True) == Draft((13, 14), "history")
    assert _priority_case(sibling=False, history=False) == Draft((12, 4), "prompt")


def test_prompt_quote():
    prompt = [100, 101, 102, 103, 104, 105, 106, 107, 108]
    d = HistoryDrafter()
    d.start("r", prompt)
    d.extend("r", [1, 2, 103, 104])
    assert d.propose("r") == Draft((105, 106, 107, 108), "prompt")


def test_self_repetition_extends_periodically():
    d = HistoryDrafter()
    d.start("r", [1, 2])
    d.extend("r", [7, 8, 9, 7, 8, 9, 7, 8])
    assert d.propose("r") == Draft((9, 7, 8, 9, 7, 8, 9, 7), "self")


def test_history_across_rollouts_and_group_freed():
    d = HistoryDrafter()
    d.start("a", PROMPT)
    d.start("b", PROMPT)
    d.extend("a", [40, 41, 42, 43])
    d.extend("b", [50, 51])
    d.finish("a")
    d.finish("b", keep=False)  # exported: not kept
    assert d.sizes()["groups"] == 0 and d.sizes()["index_entries"] == 0
    assert d.state_dict()["history"] == [[PROMPT, [[40, 41, 42, 43]]]]
    d.start("c", PROMPT)  # a later rollout
    assert d.propose("c") == Draft((40, 41, 42, 43), "history")
    d.extend("c", [50, 51])
    assert d.propose("c") == NO_DRAFT  # b's tokens were not kept
    d.start("other", [9, 8, 7])
    assert d.propose("other") == NO_DRAFT  # another prompt's history is not a source


def test_history_bounds():
    d = HistoryDrafter(history_prompts=2, history_tokens_per_prompt=10)

    def rollout(i, prompt, tokens):
        d.start(i, prompt)
        d.extend(i, tokens)
        d.finish(i)

    def kept():
        return {tuple(p): seqs for p, seqs in d.state_dict()["history"]}

    for i, prompt in enumerate([[1, 1], [2, 2], [1, 1], [3, 3]]):  # [1, 1] is used again: [2, 2] is least recent
        rollout(i, prompt, [i] * 4)
    assert list(kept()) == [(1, 1), (3, 3)]
    for i in range(4, 7):
        rollout(i, [1, 1], [i] * 4)
    assert kept()[(1, 1)] == [[5] * 4, [6] * 4]  # 5 responses of 4 over 10 tokens: oldest dropped first
    d.start("x", [3, 3])
    d.finish("x", keep=False)  # a group start touches its prompt: [1, 1] is now least recent
    rollout(7, [4, 4], list(range(15)))
    assert list(kept()) == [(3, 3), (4, 4)]
    assert kept()[(4, 4)] == [list(range(10))]  # a response over the bound keeps its first tokens
    assert d.sizes()["history_tokens"] == 14 and d.sizes()["history_prompts"] == 2


def test_state_dict_round_trip():
    a = HistoryDrafter()
    tokens = [5, 6, 7, 5, 6, 8, 9, 5, 6, 7, 1, 2]
    for i, prompt in enumerate([PROMPT, PROMPT, [3, 4]]):
        a.start(i, prompt)
        a.extend(i, tokens[i:])
        a.finish(i)
    b = HistoryDrafter()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    for d in (a, b):
        d.start("r", PROMPT)
    for t in tokens:
        assert a.propose("r") == b.propose("r")
        a.extend("r", [t])
        b.extend("r", [t])
    assert a.stats()["drafted_history"] > 0


def _resume_script(d: HistoryDrafter, resumed: bool) -> list[Draft]:
    d.start("h", PROMPT)
    d.extend("h", [60, 61, 62, 63, 64, 65])
    d.finish("h")
    d.start("s", PROMPT)
    d.extend("s", [30, 31, 32, 33, 34, 35, 36])
    generated = [9, 7, 8, 7, 8]
    if resumed:
        d.start("r", PROMPT, generated=generated)
    else:
        d.start("r", PROMPT)
        for t in generated:
            d.extend("r", [t])
    out = []
    for t in [33, 34, 62, 63, 10, 11, 5]:
        out.append(d.propose("r"))
        d.extend("r", [t])
    return out


def test_resumed_request_matches_token_by_token():
    incremental = _resume_script(HistoryDrafter(), resumed=False)
    assert _resume_script(HistoryDrafter(), resumed=True) == incremental
    assert [draft.source for draft in incremental] == ["self", "", "siblings", "", "history", "", "prompt"]


def _always_matching() -> HistoryDrafter:
    d = HistoryDrafter(probe_every=3)
    d.start("s", PROMPT)
    d.extend("s", [50, 60] + list(range(100, 110)))
    d.start("r", PROMPT)
    d.extend("r", [50, 60])
    return d


def test_adaptive_k_shrinks_to_zero_and_recovers():
    d = _always_matching()
    lengths = []
    while (draft := d.propose("r")).tokens:
        lengths.append(len(draft.tokens))
        d.record("r", draft, 0)
        assert len(lengths) < 10, "rejections must drive k to 0"
    assert lengths == [8, 4, 2, 1, 1]  # rate halves: k = floor(8 * rate + 1/2)
    assert d.propose("r") == NO_DRAFT  # 2nd call at k = 0; the 3rd probes
    probe = d.propose("r")
    assert probe == Draft((100,), "siblings")
    d.record("r", probe, 1)
    lengths = []
    for _ in range(4):
        draft = d.propose("r")
        lengths.append(len(draft.tokens))
        d.record("r", draft, len(draft.tokens))
    assert lengths == [4, 6, 7, 8]
    assert len(d.propose("r", limit=3).tokens) == 3
    assert d.propose("r", limit=0) == NO_DRAFT
    s = d.stats()
    assert s["probes"] == 1 and s["skipped"] == 2 and s["verify_steps"] == 10


def test_rejected_probe_waits_again():
    d = _always_matching()
    for _ in range(5):
        d.record("r", d.propose("r"), 0)
    got = [len(d.propose("r").tokens) for _ in range(3)]
    assert got == [0, 0, 1]
    d.record("r", Draft((100,), "siblings"), 0)
    assert [len(d.propose("r").tokens) for _ in range(3)] == [0, 0, 1]


def test_stats_add_up():
    d = HistoryDrafter()
    d.start("h", PROMPT)
    d.extend("h", [20, 10, 11, 13, 14])
    d.finish("h")
    d.start("s", PROMPT)
    d.extend("s", [40, 41, 42, 43, 44, 45])
    d.start("r", PROMPT)
    drafted = {s: 0 for s in SOURCES}
    accepted = {s: 0 for s in SOURCES}
    proposals = empty = 0
    for i, t in enumerate([40, 41, 90, 10, 11, 91, 92, 10, 11, 93, 94, 95]):
        draft = d.propose("r", limit=1 + i % 5)
        if draft.tokens:
            proposals += 1
            drafted[draft.source] += len(draft.tokens)
            accepted[draft.source] += i % (len(draft.tokens) + 1)
            d.record("r", draft, i % (len(draft.tokens) + 1))
        else:
            empty += 1
        d.extend("r", [t])
    s = d.stats()
    assert sum(drafted.values()) > 0 and sum(v > 0 for v in drafted.values()) >= 3
    assert s["proposals"] == s["verify_steps"] == proposals and s["misses"] + s["skipped"] == empty
    for source in SOURCES:
        assert (s[f"drafted_{source}"], s[f"accepted_{source}"]) == (drafted[source], accepted[source])
    assert s["drafted"] == sum(drafted.values()) and s["accepted"] == sum(accepted.values())
    d.reset_stats()
    assert set(d.stats().values()) == {0}


def test_index_grows_linearly_and_is_freed():
    d = HistoryDrafter()
    per_token = d.max_ngram - d.min_ngram + 1
    x = 12345
    prompt = [(x := (x * 1103515245 + 12345) % 2**31) % 50 for _ in range(300)]
    for r in range(8):
        d.start(r, prompt)
    for step in range(200):
        for r in range(8):
            d.extend(r, [(x := (x * 1103515245 + 12345) % 2**31) % 50])
        if step % 50 == 0:
            sizes = d.sizes()
            assert sizes["index_entries"] <= per_token * sizes["indexed_tokens"]
    sizes = d.sizes()
    assert sizes["indexed_tokens"] == 300 + 8 * (4 + 200)
    assert sizes["index_entries"] > sizes["indexed_tokens"]  # the random tokens repeat rarely at n >= 3
    for r in range(8):
        d.finish(r)
    assert d.sizes() == {
        "requests": 0,
        "groups": 0,
        "indexed_tokens": 0,
        "index_entries": 0,
        "history_prompts": 1,
        "history_tokens": 1600,
    }


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda d: d.propose("r", limit=-1), ValueError, "limit"),
        (lambda d: d.propose("nope"), KeyError, "start()"),
        (lambda d: d.extend("nope", [1]), KeyError, "start()"),
        (lambda d: d.record("nope", NO_DRAFT, 0), KeyError, "start()"),
        (lambda d: d.finish("nope"), KeyError, "start()"),
        (lambda d: d.start("r", [1]), ValueError, "finish()"),
        (lambda d: d.record("r", Draft((1, 2), "siblings"), 3), ValueError, "accepted"),
        (lambda d: d.record("r", Draft((1,), "oracle"), 0), ValueError, "source"),
        (lambda d: d.load_state_dict({"history": []}), ValueError, "state_dict()"),
        (lambda d: d.load_state_dict({"version": 1, "history": [[[1], [["x"]]]]}), ValueError, "state_dict()"),
        (lambda d: HistoryDrafter(min_ngram=5), ValueError, "min_ngram"),
        (lambda d: HistoryDrafter(max_draft=0), ValueError, "max_draft"),
    ],
)
def test_bad_inputs(call, error, words):
    d = HistoryDrafter()
    d.start("r", PROMPT)
    with pytest.raises(error) as info:
        call(d)
    message = str(info.value)
    assert "\n" not in message and words in message


def test_no_state_change_on_bad_tokens():
    d = HistoryDrafter()
    d.start("r", PROMPT)
    with pytest.raises(TypeError):
        d.extend("r", [1, "x"])
    with pytest.raises(TypeError):
        d.start("q", PROMPT, generated=[1.5])
    assert d.sizes()["requests"] == 1 and d.sizes()["indexed_tokens"] == len(PROMPT) + 4


_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("drafts", sys.argv[1])
m = importlib.util.module_from_spec(spec); sys.modules["drafts"] = m; spec.loader.exec_module(m)
d = m.HistoryDrafter(max_ngram=3, min_ngram=1)
x, out = 7, []
for rollout in range(3):
    ids = [f"req-{rollout}-{r}" for r in range(4)]
    for i in ids:
        d.start(i, [1, 2, 3])
    for step in range(60):
        for i in ids:
            draft = d.propose(i)
            x = (x * 1103515245 + 12345) % 2**31
            if draft.tokens:
                d.record(i, draft, x % (len(draft.tokens) + 1))
            out.append([list(draft.tokens), draft.source])
            d.extend(i, [x % 6])
    for n, i in enumerate(ids):
        d.finish(i, keep=n % 2 == 0)
print(json.dumps([out, d.stats(), d.state_dict()]))
"""


def test_deterministic_across_hash_seeds():
    path = str(Path(__file__).resolve().parents[1] / "fusedrl" / "generation" / "drafts.py")
    runs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        runs.append(
            subprocess.run([sys.executable, "-c", _SCRIPT, path], env=env, capture_output=True, text=True, check=True).stdout
        )
    assert runs[0] == runs[1] and json.loads(runs[0])[1]["drafted"] > 0
