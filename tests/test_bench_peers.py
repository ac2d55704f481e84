"""bench.peers' pure parts: the prompt list, the reward TRL gets, the command line and fusedrl's overrides; no run of
TRL or of training (``python -m fusedrl.bench.peers`` itself is the benchmark)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from fusedrl.bench import peers
from fusedrl.config import load_config
from fusedrl.tasks import arithmetic


def test_the_prompt_list_is_fixed_and_right() -> None:
    rows = peers.prompt_rows()
    assert len(rows) == 512 and rows == peers.prompt_rows()
    pairs = set()
    for row in rows:
        assert set(row) == {"messages", "answer"} and len(row["messages"]) == 1
        turn = row["messages"][0]
        assert turn["role"] == "user"
        m = re.fullmatch(r"What is (\d) \+ (\d)\? Answer with the number only\.", turn["content"])
        assert m is not None, turn["content"]
        a, b = int(m.group(1)), int(m.group(2))
        assert 1 <= a <= 9 and 1 <= b <= 9 and row["answer"] == a + b == arithmetic.answer_of(turn["content"])
        pairs.add((a, b))
    assert len(pairs) > 70  # of the 81: a spread, not a handful repeated


def test_write_rows_is_what_the_data_loader_reads(tmp_path: Path) -> None:
    rows = peers.prompt_rows(3)
    lines = peers.write_rows(tmp_path / "p.jsonl", rows).read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows


def test_trl_reward_is_the_task_checker() -> None:
    stop = {2}
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 3 + 4? Answer with the number only."}]
    cases = [  # (completion text, ids, expected)
        ("7", [33, 2], 1.0),
        ("The answer is 7.", [1, 2, 3, 2], 1.0),
        ("3 + 4 = 7", [5, 2], 1.0),
        ("7, no, 8", [5, 2], 0.0),  # the last number counts
        ("7", [33], 0.0),  # hit the token limit: not finished
        ("seven", [5, 2], 0.0),
        ("", [2], 0.0),
    ]
    completions = [[{"role": "assistant", "content": text}] for text, _, _ in cases]
    ids = [i for _, i, _ in cases]
    got = peers.score_completions([chat] * len(cases), completions, ids, stop)
    assert got == [e for _, _, e in cases]
    # plain-text prompts and completions score the same, and agree with fusedrl's reward_fn on the same samples
    texts = [t for t, _, _ in cases]
    plain = peers.score_completions(["What is 3 + 4? Answer with the number only."] * len(cases), texts, ids, stop)
    fused = arithmetic.reward_fn(
        ["<|im_start|>user\nWhat is 3 + 4? Answer with the number only.<|im_end|>"] * len(cases),
        texts,
        prompt_ids=[[0]] * len(cases),
        response_ids=ids,
        finished=[i[-1] in stop for i in ids],
    )
    assert plain == fused == got


@pytest.mark.parametrize("text, expected", [("4x4", (4, 4)), ("4x8", (4, 8)), ("1x2", (1, 2))])
def test_variants(text: str, expected: tuple[int, int]) -> None:
    assert peers.parse_variant(text) == expected


@pytest.mark.parametrize("text", ["4", "4x1", "0x4", "4*4", "x4", "4x", "ax4"])
def test_bad_variants(text: str) -> None:
    with pytest.raises(ValueError, match="PROMPTSxSAMPLES"):
        peers.parse_variant(text)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_arguments(model: Path) -> None:
    args = peers.parse_args(
        ["--model", str(model), "--variants", "4x4,4x8", "--fusedrl-args", "--ppo.microbatch_size=16 --a.b='c d'"]
    )
    assert args.steps == 5 and args.dtypes == ["float32", "bfloat16"] and args.variants == [(4, 4), (4, 8)]
    assert args.fusedrl_args == ["--ppo.microbatch_size=16", "--a.b=c d"] and args.only is None and args.threads == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "--model FOLDER is required"),
        (["--model", "/nonexistent"], "no config.json"),
        (["--steps", "1"], "--steps 1: must be at least 2"),
        (["--dtypes", "float16"], "--dtypes float16: choose from float32, bfloat16"),
        (["--dtypes", ""], "--dtypes"),
        (["--variants", "4x4,4x1"], "--variants: variant '4x1'"),
        (["--only", "vllm"], "invalid choice"),
        (["--fusedrl-nproc", "0"], "at least 1"),
        (["--fusedrl-args", "'unclosed"], "--fusedrl-args"),
    ],
)
def test_argument_errors(model: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    full = argv if argv[:1] == ["--model"] or not argv else ["--model", str(model), *argv]
    with pytest.raises(SystemExit) as e:
        peers.parse_args(full)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_without_trl_one_line_and_exit_2(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert peers.main(["--model", str(model)]) == 2
    assert capsys.readouterr().err == 'TRL is not installed: pip install -e ".[peers]"\n'


@pytest.mark.parametrize("dtype", peers.DTYPES)
def test_fusedrl_overrides_are_the_workload(tmp_path: Path, dtype: str) -> None:
    argv = peers.fusedrl_argv(tmp_path / "m", tmp_path / "p.jsonl", tmp_path / "out", 4, 8, dtype, 5, ["--ppo.microbatch_size=8"])
    cfg = load_config(argv)
    assert (cfg.ppo.batch_size, cfg.ppo.minibatch_size, cfg.ppo.epochs, cfg.ppo.microbatch_size) == (32, 32, 1, 8)
    assert cfg.ppo.microbatch_tokens == 32 * (64 + 48) and cfg.data.max_prompt_len == 64  # the batch in one packed row
    assert (cfg.generation.n, cfg.generation.max_new_tokens, cfg.generation.temperature) == (8, 48, 1.0)
    assert (cfg.generation.top_p, cfg.generation.top_k) == (1.0, 0)
    assert (cfg.ppo.kl_coef, cfg.ppo.kl_loss_coef, cfg.ppo.kl_estimator) == (0.0, 0.04, "k3")
    assert cfg.optimizer.actor_lr == 1e-6 and cfg.training.steps == 5
    assert (cfg.parallelism.pp, cfg.parallelism.dp_shard) == (1, 1)  # one process, whatever the recipe's layout
    assert not cfg.fusion.inter_stage and not cfg.fusion.intra_stage and not cfg.checkpoint.export_hf
    assert cfg.checkpoint.interval == 0 and cfg.metrics.jsonl and cfg.data.prompt_key == "messages"
    t = cfg.training
    assert {t.mixed_precision_param, t.frozen_dtype, t.rollout_dtype, t.kv_cache_dtype} == {dtype}


def test_ratios_against_trl() -> None:
    def run(trainer: str, variant: str, dtype: str, sps: float) -> dict:
        return {"trainer": trainer, "variant": variant, "dtype": dtype, "samples_per_s": sps}

    runs = [
        run("trl", "4x4", "float32", 1.0),
        run("fusedrl", "4x4", "float32", 1.5),
        run("trl", "4x4", "bfloat16", 2.0),
        run("fusedrl", "4x4", "bfloat16", 3.0),
        run("fusedrl", "4x8", "float32", 1.0),
    ]
    assert peers.ratios(runs) == {
        "4x4/float32": {"vs_same_dtype": 1.5, "vs_best": 0.75},
        "4x4/bfloat16": {"vs_same_dtype": 1.5, "vs_best": 1.5},
        "4x8/float32": {"vs_same_dtype": None, "vs_best": None},
    }


def test_main_alternates_runs_and_reports_ratios(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bench's plumbing with each run's process replaced by one writing what the trainer would: the order of
    the runs, the timed steps (2..N) of each, the JSON line."""
    order = []

    def fake_run(cmd: list[str], env: dict[str, str], log: Path, what: str) -> None:
        order.append(what)
        assert env["OMP_NUM_THREADS"] == "2"
        if "--worker" in cmd:  # TRL: every on_step_end, 10 s apart from step 1's end (bfloat16: 5 s)
            spec = json.loads(cmd[cmd.index("--spec") + 1])
            gap = 5.0 if spec["dtype"] == "bfloat16" else 10.0
            logs = [{"reward": 0.5, "completions/mean_length": 20.0}] * spec["steps"]
            ends = [100.0 + gap * i for i in range(spec["steps"])]
            Path(cmd[cmd.index("--result") + 1]).write_text(json.dumps({"step_ends": ends, "logs": logs}))
            return
        assert cmd[1:3] == ["-m", "fusedrl.train"]
        cfg = load_config(cmd[3:])
        out = Path(cfg.job.output_dir)
        out.mkdir(parents=True)
        phases = {f"time_{p}": 1.0 for p in peers.PHASES}
        records = [  # step 1 slow (not timed); then 4 s + 1 s outside
            {"step": s, "time_step": 30.0 if s == 1 else 4.0, "time_outside": 0.0 if s == 1 else 1.0, **phases}
            | {"reward_fn_mean": 0.25, "response_len_mean": 22.0, "train_mfu": 0.1 * s}
            for s in range(1, cfg.training.steps + 1)
        ]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    monkeypatch.setattr(peers, "_run", fake_run)
    monkeypatch.setattr(peers, "_check_fusedrl", lambda *a: None)  # the fake model folder would not build
    monkeypatch.setattr(peers, "_trl_installed", lambda: True)  # every run is faked: TRL need not be installed
    assert peers.main(["--model", str(model), "--steps", "3", "--json"]) == 0
    assert order == ["TRL 4x4 float32", "fusedrl 4x4 float32", "TRL 4x4 bfloat16", "fusedrl 4x4 bfloat16"]
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    by = {(r["trainer"], r["dtype"]): r for r in result["runs"]}
    assert by["trl", "float32"]["samples_per_s"] == pytest.approx(16 / 10) and by["trl", "float32"]["timed_step_s"] == [10.0] * 2
    assert by["fusedrl", "float32"]["samples_per_s"] == pytest.approx(16 / 5)
    assert by["fusedrl", "float32"]["phases_s"] == dict.fromkeys(peers.PHASES, 1.0)
    assert by["fusedrl", "float32"]["peak_fractions"] == {"train_mfu": pytest.approx(0.25)}  # steps 2, 3; no score_mfu logged
    assert result["ratios"]["4x4/float32"] == {"vs_same_dtype": pytest.approx(2.0), "vs_best": pytest.approx(1.0)}
