"""Multi-turn rollouts with environments, end to end: the trained ids are exactly the sampled ids and the observations'
ids, observations are out of every loss, a one-turn environment gives the single-turn run exactly, and a trainer run
with a two-turn environment trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusedrl.envs import Environment, EnvStep
from fusedrl.tasks import debug

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"


def reward(prompts, responses, **_):
    """The debug task's score of a response, as finished whatever its end (an environment cannot tell)."""
    return [debug.true_score(p, r, True) for p, r in zip(prompts, responses)]


class OneTurn(Environment):
    """Scores the first turn with :func:`reward` and ends."""

    def __init__(self, row):
        self.prompt = row["prompt"]

    def step(self, text):
        return EnvStep(reward=reward([self.prompt], [text])[0], done=True)


class TwoTurns(Environment):
    """Answers the first turn with "again" and scores the second."""

    def __init__(self, row):
        self.prompt, self.turns = row["prompt"], []

    def step(self, text):
        self.turns.append(text)
        if len(self.turns) == 1:
            return EnvStep(observation=" again:", info={"tool": "echo"})
        return EnvStep(reward=reward([self.prompt], [text])[0], done=True)


TINY = [
    "--job.config_file",
    str(ROOT / "train_configs" / "debug_grpo.toml"),
    "--parallelism.pp=1",
    "--parallelism.dp_shard=1",
    "--model.actor_path=",
    "--model.reference_path=",
    "--generation.stop_token_ids=" + ",".join(map(str, range(0, 512, 4))),
    "--generation.max_new_tokens=8",
    "--ppo.batch_size=8",
    "--ppo.minibatch_size=8",
    "--ppo.microbatch_size=4",
    "--ppo.microbatch_tokens=0",
    "--generation.n=4",
    "--training.steps=2",
    "--checkpoint.export_hf=false",
    "--checkpoint.interval=0",
    "--metrics.trace=[]",
    "--lr_scheduler.warmup_steps=0",
    "--optimizer.actor_lr=1e-3",
]


def _runs(out: str) -> dict[str, list[dict]]:
    """One process: the single-turn run with :func:`reward`, the same with the one-turn environment, and a two-turn
    environment."""
    from fusedrl.config import load_config
    from fusedrl.train import run

    def cfg(name: str, *extra: str):
        return load_config([*TINY, f"--job.output_dir={out}/{name}", *extra])

    return {
        "single": run(cfg("single", f"--model.reward_fn={__name__}:reward")),
        "one_turn": run(cfg("one_turn", "--model.reward_fn=", f"--env.env={__name__}:OneTurn", "--env.max_tokens=24")),
        "two_turns": run(cfg("two_turns", "--model.reward_fn=", f"--env.env={__name__}:TwoTurns", "--env.max_tokens=40")),
    }


@pytest.mark.slow
def test_a_one_turn_environment_gives_the_single_turn_run_and_two_turns_train(tmp_path, rank_pools):
    (runs,) = rank_pools(1).run(_runs, str(tmp_path), timeout_s=300.0)
    single, one_turn, two = runs["single"], runs["one_turn"], runs["two_turns"]
    for a, b in zip(single, one_turn):  # the same samples, rewards and update
        assert a["samples_digest"] == b["samples_digest"]
        for key in ("reward_mean", "policy_loss", "grad_norm_actor", "kl_loss", "response_len_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
    assert all(r["env_turns_mean"] == 1.0 and r["env_observation_tokens"] == 0 for r in one_turn)
    for r in two:  # every episode: a turn, " again:", a turn; the observation tokens are counted, not trained
        assert r["env_turns_p50"] == 2.0 and r["env_turns_max"] == 2.0 and r["tool_calls"] == 8
        assert r["env_observation_tokens"] == 8 * len(" again:")  # the byte tokenizer: one id per character
        assert r["env_errors"] == 0 and torch.isfinite(torch.tensor(r["policy_loss"]))


def _episodes_on_an_engine():
    """An engine and Episodes over the debug model with the byte tokenizer, as a test double of a rollout."""
    from fusedrl.components import ByteTokenizer
    from fusedrl.envs import EnvRunner
    from fusedrl.generation import GenerationEngine
    from fusedrl.models import build_model
    from fusedrl.rlhf import Episodes

    torch.manual_seed(0)
    engine = GenerationEngine(build_model("debug").eval(), max_slots=4, max_len=96)
    return engine, Episodes(engine, EnvRunner(TwoTurns, workers=2), ByteTokenizer(), max_tokens=48)


def _drive(engine, episodes) -> list:
    ended = []
    while engine.has_work() or episodes.waiting:
        done = engine.step() if engine.has_work() else []
        ended += episodes.on_results(done)
        ended += episodes.pump(0.05 if not engine.has_work() else None)
    return ended


def test_trained_ids_are_the_sampled_ids_and_the_observation_ids_and_observations_leave_the_loss():
    from fusedrl.components import ByteTokenizer
    from fusedrl.generation import Request, SamplingParams
    from fusedrl.rlhf import Scorer, ScoringModels

    engine, episodes = _episodes_on_an_engine()
    tok = ByteTokenizer()
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=tuple(range(0, 512, 3)))
    prompts = ["repeat ab 3 times:", "repeat q 2 times:"]
    requests = [Request(i, tok.encode(p), params, seed=i) for i, p in enumerate(prompts)]
    for r in episodes.begin(requests, [{"prompt": p} for p in prompts]):
        engine.add_request(r)
    results = sorted(_drive(engine, episodes), key=lambda r: r.id)
    again = tok.encode(" again:", add_bos=False)
    exp = Scorer(ScoringModels(None, None, None), env_rewards=True, pad_id=tok.pad_id).score(results)
    for row, res in enumerate(results):
        ((start, end),) = res.observations
        assert res.tokens[start:end] == again  # the observation's ids, appended once
        turn1, turn2 = res.tokens[:start], res.tokens[end:]
        p = len(res.prompt)
        n = res.num_tokens
        assert exp.tokens[row, :n].tolist() == res.prompt + turn1 + again + turn2  # nothing re-tokenized
        assert exp.response_mask[row, :n].tolist() == [0.0] * p + [1.0] * len(turn1) + [0.0] * len(again) + [1.0] * len(turn2)
        assert res.reward is not None and exp.scores[row] == pytest.approx(res.reward)


def test_an_observation_past_the_episode_budget_ends_the_episode():
    from fusedrl.components import ByteTokenizer
    from fusedrl.generation import Request, SamplingParams

    engine, episodes = _episodes_on_an_engine()
    episodes.max_tokens = 8  # a 6-token turn leaves no room for " again:" and a next token
    tok = ByteTokenizer()
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=(511,))
    (request,) = episodes.begin([Request(0, tok.encode("repeat ab 3 times:"), params)], [{"prompt": "repeat ab 3 times:"}])
    engine.add_request(request)
    (result,) = _drive(engine, episodes)
    assert result.observations == [] and len(result.tokens) == 6 and engine.num_awaiting == 0
    assert episodes.take_figures()["limit_tokens"] == 1


def test_an_episode_never_passes_its_token_budget_and_one_a_limit_cut_is_not_finished():
    from fusedrl.components import ByteTokenizer
    from fusedrl.envs import EnvRunner
    from fusedrl.generation import Request, SamplingParams
    from fusedrl.rlhf import Episodes

    tok = ByteTokenizer()
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=(511,))
    prompt = tok.encode("repeat ab 3 times:")
    engine, episodes = _episodes_on_an_engine()
    episodes.max_tokens = 16  # 6 sampled + 7 of " again:" leave 3 for the second turn, not its 6
    (request,) = episodes.begin([Request(0, prompt, params)], [{"prompt": "repeat ab 3 times:"}])
    engine.add_request(request)
    (result,) = _drive(engine, episodes)
    assert result.observations == [(6, 13)] and len(result.tokens) == 16 and result.finish_reason == "max_len"
    assert episodes.take_figures()["limit_tokens"] == 1

    # the turn limit ends an episode its environment would go on with: its last turn stopped, the episode did not
    engine, _ = _episodes_on_an_engine()
    episodes = Episodes(engine, EnvRunner(TwoTurns, workers=1, max_turns=1), tok, max_tokens=48)
    stopping = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=tuple(range(512)))
    (request,) = episodes.begin([Request(0, prompt, stopping)], [{"prompt": "repeat ab 3 times:"}])
    engine.add_request(request)
    (result,) = _drive(engine, episodes)
    assert len(result.tokens) == 1 and result.finish_reason == "length"


class BadObservation(Environment):
    """Answers the first turn with the row's observation token ids."""

    def __init__(self, row):
        self.ids = tuple(row["ids"])

    def step(self, text):
        return EnvStep(observation=self.ids)


@pytest.mark.parametrize("ids", [(), (7, 10**6)], ids=["empty", "past_the_vocabulary"])
def test_an_observation_the_model_cannot_take_ends_its_episode_with_the_error_reward(ids):
    from fusedrl.components import ByteTokenizer
    from fusedrl.envs import EnvRunner
    from fusedrl.generation import Request, SamplingParams
    from fusedrl.rlhf import Episodes

    engine, _ = _episodes_on_an_engine()
    episodes = Episodes(engine, EnvRunner(BadObservation, workers=1, error_reward=-1.0), ByteTokenizer(), max_tokens=48)
    tok = ByteTokenizer()
    params = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=(511,))
    (request,) = episodes.begin([Request(0, tok.encode("repeat ab 3 times:"), params)], [{"ids": ids}])
    engine.add_request(request)
    (result,) = _drive(engine, episodes)  # the run goes on; the episode ends after its first turn
    assert result.reward == -1.0 and result.observations == [] and len(result.tokens) == 4
    figures = episodes.take_figures()
    assert figures["runner"]["env_errors_invalid"] == 1 and engine.num_unfinished == 0


@pytest.mark.skipif(not SMOLLM2.exists(), reason="needs models/SmolLM2-135M-Instruct (README, 'What it does today')")
def test_re_tokenizing_the_rendered_conversation_drifts_and_the_sampled_ids_are_trained():
    # token drift: a model may sample " answ" then "er"; rendered to text and tokenized again that is " answer", one
    # other id
    from fusedrl.components import load_tokenizer
    from fusedrl.generation import Request, RequestResult
    from fusedrl.rlhf import Scorer, ScoringModels, observation_ids

    tok = load_tokenizer(SMOLLM2)
    user = [{"role": "user", "content": "What is 5 + 7?"}]
    prompt = tok.encode(tok.render_chat(user), add_bos=False)
    stop = tok.stop_token_ids[0]
    turn1 = tok.encode(" answ", add_bos=False) + tok.encode("er", add_bos=False) + [stop]
    obs = observation_ids(tok, "user", "Correct.", tok.stop_token_ids)
    turn2 = tok.encode("Done", add_bos=False) + [stop]
    sampled = turn1 + obs + turn2
    observations = [(len(turn1), len(turn1) + len(obs))]
    result = RequestResult(Request(0, prompt), sampled, [0.0] * len(sampled), "stop", observations=observations, reward=1.0)
    conversation = [
        *user,
        {"role": "assistant", "content": tok.decode(turn1[:-1])},
        {"role": "user", "content": "Correct."},
        {"role": "assistant", "content": tok.decode(turn2[:-1])},
    ]
    rendered = tok.encode(tok.render_chat(conversation), add_bos=False)
    assert rendered[: len(prompt)] == prompt
    # the drift, in the first turn itself: its two sampled ids come back as one
    assert rendered[len(prompt) : len(prompt) + len(turn1)] != turn1
    assert tok.encode(tok.decode(turn1[:-1]), add_bos=False) == tok.encode(" answer", add_bos=False) != turn1[:-1]
    exp = Scorer(ScoringModels(None, None, None), env_rewards=True, pad_id=tok.pad_id).score([result])
    assert exp.tokens[0].tolist() == prompt + sampled  # fusedrl trains on what was sampled and appended
    assert exp.response_mask[0, len(prompt) + len(turn1) : len(prompt) + len(turn1) + len(obs)].sum() == 0


def test_a_chat_template_that_refuses_the_observation_role_stops_the_job_at_startup(tmp_path):
    import json
    import shutil

    from fusedrl.components import HFTokenizer
    from fusedrl.config import InputError, load_config
    from fusedrl.rlhf import build_episodes

    engine, _ = _episodes_on_an_engine()
    template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}assistant: "
    )
    folder = shutil.copytree(ROOT / "assets" / "debug" / "tokenizer", tmp_path / "tokenizer")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    tok = HFTokenizer(folder)
    env = [f"--env.env={__name__}:TwoTurns", "--env.max_tokens=48", "--generation.max_new_tokens=8"]
    cfg = load_config([*TINY, *env, "--env.observation_role=tool"])
    with pytest.raises(
        InputError, match=r"env.observation_role = 'tool' .*roles must be user or assistant.*--env.observation_role=user"
    ):
        build_episodes(cfg, engine, tok)
    episodes = build_episodes(load_config([*TINY, *env, "--env.observation_role=user"]), engine, tok)
    assert episodes is not None
    episodes.close()
