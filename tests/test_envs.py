"""fusedrl.envs: the environment interface's checks, EnvRunner (threads, limits, errors, stats), the word-problem tool
environment and its prompt, and the TextArena adapter played offline."""

import dataclasses
import math
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from fusedrl.envs import EnvError, Environment, EnvRunner, EnvStep, check_opening, check_step, load_env_factory
from fusedrl.envs.calculator import calculate, extract_call
from fusedrl.envs.sandbox import SandboxLimits, run_python
from fusedrl.envs.tools import PYTHON_LIMITS
from fusedrl.tasks import word_problems
from fusedrl.tasks.word_problems_tools import (
    EXAMPLE_ANSWER,
    EXAMPLE_PROBLEM,
    EXAMPLE_RESULT,
    WordProblemToolEnv,
    problem_answer,
    tool_prompt_messages,
    word_problems_calc,
    word_problems_python,
)


class Scripted(Environment):
    """Each step waits at ``row["barrier"]`` (if given), sleeps ``row["sleep"]`` s, then does ``row["mode"]`` (after
    ``row["ok_steps"]`` "ok" steps): "ok" (an EnvStep of ``reward``, done after ``steps`` steps, ``info`` as given),
    "raise", "invalid" (returns a dict) or "nan" (a non-finite reward)."""

    threads: list[int] = []

    def __init__(self, row):
        self.row = row
        self.steps = 0

    def opening(self):
        return self.row.get("opening")

    def step(self, text):
        Scripted.threads.append(threading.get_ident())
        if "barrier" in self.row:
            self.row["barrier"].wait()
        time.sleep(self.row.get("sleep", 0.0))
        self.steps += 1
        mode = self.row.get("mode", "ok") if self.steps > self.row.get("ok_steps", 0) else "ok"
        if mode == "raise":
            raise RuntimeError("boom\nsecond line")
        if mode == "invalid":
            return {"reward": 1.0}
        if mode == "nan":
            return EnvStep(observation="x", reward=math.nan)
        done = self.steps >= self.row.get("steps", 1_000_000)
        return EnvStep(
            observation=None if done else f"obs {self.steps}",
            reward=self.row.get("reward", 0.0),
            done=done,
            info=self.row.get("info", {}),
        )


def drain(runner, count, timeout_s=5.0):
    """``count`` results from ``runner.wait``, in the order it gave them."""
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < count and time.monotonic() < deadline:
        out += runner.wait(deadline - time.monotonic())
    assert len(out) == count, out
    return out


# -- the interface ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step, problem",
    [
        ({"observation": "x"}, "returned dict"),
        (EnvStep(observation="x", done=1), "done=1"),
        (EnvStep(observation="x", reward=math.nan), "reward=nan"),
        (EnvStep(observation="x", reward=math.inf), "reward=inf"),
        (EnvStep(observation="x", reward="1"), "reward='1'"),
        (EnvStep(observation="x", reward=True), "reward=True"),
        (EnvStep(observation=3.5), "observation float"),
        (EnvStep(observation=[1, -2]), "observation list"),
        (EnvStep(observation=b"ab"), "observation bytes"),
        (EnvStep(observation="x", done=True), "done=True"),
        (EnvStep(), "observation=None with done=False"),
        (EnvStep(observation="x", info={1: "calc"}), "info[1]"),
        (EnvStep(observation="x", info={"tool": ["calc"]}), "info['tool']"),
        (EnvStep(observation="x", info=[("tool", "calc")]), "info list"),
    ],
)
def test_check_step_names_the_environment_the_problem_and_the_fix(step, problem):
    class Bad(Scripted):
        pass

    with pytest.raises(EnvError) as e:
        check_step(Bad({}), step)
    message = str(e.value)
    assert "\n" not in message and message.startswith("Bad.step() returned"), message
    assert problem in message and "; " in message, message  # the problem, then the fix


def test_check_step_passes_valid_steps_and_holds_token_ids_as_a_tuple():
    text = EnvStep(observation="x", reward=1, info={"tool": "calc", "n": 2.0})
    assert check_step(Scripted({}), text) is text
    ids = check_step(Scripted({}), EnvStep(observation=[1, 2, 3]))
    assert ids.observation == (1, 2, 3)
    assert check_step(Scripted({}), EnvStep(reward=-0.5, done=True)).done


def test_check_opening():
    assert check_opening(Scripted({}), None) is None and check_opening(Scripted({}), "hi") == "hi"
    with pytest.raises(EnvError, match=r"^Scripted\.opening\(\) returned list"):
        check_opening(Scripted({}), ["hi"])


def test_load_env_factory_takes_classes_and_callables():
    assert load_env_factory("fusedrl.tasks.word_problems_tools:WordProblemToolEnv") is WordProblemToolEnv
    assert load_env_factory("fusedrl.tasks.word_problems_tools:word_problems_calc") is word_problems_calc


@pytest.mark.parametrize(
    "path, problem",
    [
        ("fusedrl.envs.base", "is not an import path"),
        ("fusedrl_no_such_module:f", "cannot import module"),
        ("fusedrl.envs.base:no_such_factory", "has no attribute 'no_such_factory'"),
        ("fusedrl.envs.base:EnvStep", "not an Environment subclass"),
        ("fusedrl.envs.tools:TOOL_SYNTAX", "not callable"),
    ],
)
def test_load_env_factory_errors_are_one_line(path, problem):
    with pytest.raises(ValueError) as e:
        load_env_factory(path)
    message = str(e.value)
    assert "\n" not in message and repr(path) in message and problem in message, message


# -- the runner ---------------------------------------------------------------------------------------------------


def test_steps_run_off_the_callers_thread_and_overlap():
    # Each step waits at a barrier for all four: they pass it only if the four run at once, and each submit returned
    # while its step still waited there (a step run in submit, or one at a time, breaks the barrier after 30 s).
    Scripted.threads.clear()
    together = threading.Barrier(4, timeout=30)
    with EnvRunner(Scripted, workers=4, step_timeout_s=60) as runner:
        for i in range(4):
            runner.start(i, {"barrier": together, "steps": 1})
        for i in range(4):
            runner.submit(i, "turn")
        results = drain(runner, 4, timeout_s=90)
    assert sorted(i for i, _ in results) == [0, 1, 2, 3]
    assert all("env_error" not in step.info for _, step in results), results
    assert threading.get_ident() not in Scripted.threads and len(set(Scripted.threads)) == 4


def test_results_come_in_completion_order():
    with EnvRunner(Scripted, workers=3) as runner:
        for i, sleep in enumerate((0.5, 0.05, 0.25)):
            runner.start(i, {"sleep": sleep, "steps": 1})
            runner.submit(i, "turn")
        assert runner.poll() == [] and runner.pending() == 3
        results = drain(runner, 3)
        assert [i for i, _ in results] == [1, 2, 0]
        assert runner.pending() == 0 and runner.wait(None) == []  # nothing pending: returns at once


@pytest.mark.parametrize(
    "mode, kind, detail",
    [
        ("raise", "exception", "RuntimeError: boom second line"),
        ("invalid", "invalid", "Scripted.step() returned dict"),
        ("nan", "invalid", "reward=nan"),
    ],
)
def test_a_failed_step_ends_its_episode_with_the_error_reward(mode, kind, detail):
    with EnvRunner(Scripted, error_reward=-1.0) as runner:
        runner.start(0, {"mode": mode})
        runner.submit(0, "turn")
        [(sample, step)] = drain(runner, 1)
        assert sample == 0 and step == EnvStep(observation=None, reward=-1.0, done=True, info=step.info)
        assert step.info["env_error"].startswith(f"{kind}: ") and detail in step.info["env_error"], step.info
        stats = runner.stats()
        assert stats[f"env_errors_{kind}"] == 1 and stats["env_errors"] == 1 and stats["env_episodes_done"] == 1
        with pytest.raises(ValueError, match="is over"):
            runner.submit(0, "again")
        assert runner.close(0)["reward"] == -1.0


def test_an_error_replaces_the_rewards_of_the_steps_before_it():
    with EnvRunner(Scripted, error_reward=-1.0) as runner:
        runner.start(0, {"mode": "raise", "ok_steps": 2, "reward": 0.5})
        runner.start(1, {"ok_steps": 2, "reward": 0.5})
        for _ in range(2):
            runner.submit(0, "turn")
            runner.submit(1, "turn")
            drain(runner, 2)
        assert runner.episode_stats(0)["reward"] == 1.0
        runner.submit(0, "turn")
        [(_, step)] = drain(runner, 1)
        assert step.done and step.reward == -1.0
        assert runner.close(0)["reward"] == -1.0  # not 0.5 + 0.5 - 1.0
        runner.record_error(1, "invalid", "observation: it has no tokens")
        assert runner.close(1)["reward"] == -1.0


def test_a_timed_out_step_ends_its_episode_and_its_late_result_is_dropped():
    with EnvRunner(Scripted, step_timeout_s=0.2, error_reward=-1.0) as runner:
        runner.start(0, {"sleep": 0.7, "reward": 5.0})
        runner.start(1, {"steps": 1, "reward": 1.0})
        runner.submit(0, "slow")
        begin = time.monotonic()
        [(sample, step)] = drain(runner, 1)
        assert time.monotonic() - begin < 0.6  # at the timeout, not when the step returns
        assert sample == 0 and step.done and step.reward == -1.0 and step.info["env_error"].startswith("timeout: ")
        assert runner.stats()["env_stuck"] == 1
        runner.submit(1, "turn")  # the other workers still serve
        assert drain(runner, 1) == [(1, EnvStep(observation=None, reward=1.0, done=True))]
        time.sleep(0.7)  # the stuck step returns now
        assert runner.poll() == [] and runner.pending() == 0
        stats = runner.stats()
        assert stats["env_late_results"] == 1 and stats["env_stuck"] == 0 and stats["env_errors_timeout"] == 1
        assert runner.close(0)["reward"] == -1.0  # the late reward of 5.0 never counted


def test_queued_work_times_out_when_every_worker_is_stuck():
    with EnvRunner(Scripted, workers=1, step_timeout_s=0.15) as runner:
        runner.start(0, {"sleep": 0.6})
        runner.opening(0)
        runner.start(1, {})
        runner.submit(0, "hangs")
        runner.submit(1, "queued behind it")
        results = drain(runner, 2, timeout_s=0.5)
        assert [i for i, _ in results] == [0, 1]
        assert results[1][1].info["env_error"].startswith("timeout: no free worker")
        time.sleep(0.5)  # the stuck step returns before the next test


def test_the_turn_limit_ends_an_episode_after_its_step():
    with EnvRunner(Scripted, max_turns=3) as runner:
        runner.start(7, {"reward": 0.5})
        steps = []
        for _ in range(3):
            runner.submit(7, "turn")
            steps += [s for _, s in drain(runner, 1)]
        assert [s.done for s in steps] == [False, False, True] and steps[0].observation == "obs 1"
        assert steps[-1] == EnvStep(observation=None, reward=0.5, done=True, info={"limit": "turns"})
        totals = runner.close(7)
        assert totals.pop("step_seconds") >= 0  # how long the scripted steps took depends on the machine's load
        assert totals == {"turns": 3, "reward": 1.5, "tool_calls": 0, "tool_errors": 0, "errors": 0, "done": 1.0}
        assert runner.stats()["env_turn_limits"] == 1


def test_a_failed_start_is_the_first_submits_result():
    def factory(row):
        if row["kind"] == "raise":
            raise KeyError("no such game")
        return Scripted(row) if row["kind"] == "ok" else "not an environment"

    with EnvRunner(factory) as runner:
        for i, kind in enumerate(("raise", "wrong", "ok")):
            runner.start(i, {"kind": kind, "opening": "rules"})
        assert [runner.opening(i) for i in range(3)] == [None, None, "rules"]
        for i in range(3):
            runner.submit(i, "turn")
        errors = {i: s.info.get("env_error", "") for i, s in drain(runner, 3)}
        assert errors[0].startswith("exception: start: KeyError") and "no such game" in errors[0]
        assert errors[1].startswith("invalid: start: the factory factory returned str") and errors[2] == ""


def test_caller_mistakes_raise():
    with EnvRunner(Scripted) as runner:
        with pytest.raises(ValueError, match="no episode"):
            runner.submit(3, "turn")
        runner.start(3, {"sleep": 0.2})
        with pytest.raises(ValueError, match="already has an episode"):
            runner.start(3, {})
        runner.submit(3, "turn")
        with pytest.raises(ValueError, match="in flight"):
            runner.submit(3, "turn")
        assert runner.close(3)["turns"] == 0  # closed before its step returned: nothing more comes
        time.sleep(0.3)
        assert runner.poll() == [] and runner.pending() == 0
    with pytest.raises(RuntimeError, match="shut down"):
        runner.start(4, {})
    with pytest.raises(ValueError, match="workers"):
        EnvRunner(Scripted, workers=0)


def test_stats_add_up():
    calc, failed = {"tool": "calc"}, {"tool": "python", "tool_error": "timeout"}
    rows = [{"steps": 3, "reward": 1.0, "info": calc}, {"steps": 2, "info": failed, "sleep": 0.05}, {"mode": "raise"}]
    with EnvRunner(Scripted, workers=2) as runner:
        for i, row in enumerate(rows):
            runner.start(i, row)
        live = {0, 1, 2}
        for i in live:
            runner.submit(i, "turn")
        while live:
            for i, step in runner.wait(5.0):
                if step.done:
                    live.discard(i)
                else:
                    runner.submit(i, "turn")
        totals = runner.stats()
        per = [runner.close(i) for i in range(3)]
    assert [p["turns"] for p in per] == [3, 2, 1] and [p["tool_calls"] for p in per] == [3, 2, 0]
    for name, total in (
        ("turns", "env_steps"),
        ("tool_calls", "tool_calls"),
        ("tool_errors", "tool_errors"),
        ("errors", "env_errors"),
        ("done", "env_episodes_done"),
    ):
        assert totals[total] == sum(p[name] for p in per), name
    assert totals["env_step_seconds"] == pytest.approx(sum(p["step_seconds"] for p in per)) and totals["env_step_seconds"] >= 0.1
    assert totals["tool_errors"] == 2 and totals["env_episodes"] == 3 and totals["env_open"] == 3 and totals["env_pending"] == 0
    assert [p["reward"] for p in per] == [3.0, 0.0, 0.0]


# -- the word-problem tool environment ----------------------------------------------------------------------------


def _row():
    question, answer = word_problems.sample_problem(random.Random(5), 2)
    return question, answer, {"messages": [{"role": "user", "content": question}], "answer": answer}


def test_word_problem_tool_call_gets_the_calculators_answer():
    env = word_problems_calc(_row()[2])
    assert env.step("First the boxes. <calc>4 * 6 - 5</calc>") == EnvStep(observation="19", info={"tool": "calc"})
    assert env.step("<calc>1/0</calc>") == EnvStep(
        observation="error: division by zero", info={"tool": "calc", "tool_error": "error"}
    )
    # the call that closes last is the one that runs
    assert env.step("<calc>1+1</calc> then <calc>2+3</calc>").observation == "5"


def test_word_problem_final_answer_gets_the_checkers_reward():
    question, answer, row = _row()
    env, with_bonus = WordProblemToolEnv(row), WordProblemToolEnv(row, format_bonus=True)
    for text in (f"So {answer} in all.\nAnswer: {answer}", f"It is {answer}.", f"Answer: {answer + 1}", "I do not know."):
        step = env.step(text)
        assert step.done and step.observation is None
        assert step.reward == word_problems.score(question, text, True)
        assert with_bonus.step(text).reward == pytest.approx(word_problems.score_with_format(question, text, True))
    assert env.step(f"Answer: {answer}").reward == 1.0 and env.step(f"Answer: {answer + 1}").reward == 0.0
    # a row without its answer: read from the problem, as the checker does
    assert WordProblemToolEnv({"messages": row["messages"]}).answer == answer
    with pytest.raises(ValueError, match="answer='7'"):
        WordProblemToolEnv({"answer": "7"})


# What these tests check is the tools' results, not their limits (tests/test_tools.py): a wall clock generous enough
# for a loaded machine, where starting the sandbox's interpreter alone passed the tool's 3 s.
UNHURRIED = dataclasses.replace(PYTHON_LIMITS, timeout_s=60.0)


def test_word_problem_python_tool():
    env = word_problems_python(_row()[2], python_limits=UNHURRIED)
    assert env.step("<python>print(6 * 7)</python>") == EnvStep(observation="42\n", info={"tool": "python"})
    step = env.step("<python>1/0</python>")
    assert step.info == {"tool": "python", "tool_error": "error"} and "ZeroDivisionError" in step.observation
    assert env.step("<python>x = 1</python>").observation.startswith("(no output")
    assert env.step("<python>print(1)</python> <calc>2 + 3</calc>").observation == "5"  # the call closing last runs
    # without the python tool, a python tag is no call: the turn is final
    assert word_problems_calc(_row()[2]).step("<python>print(1)</python>").done


@pytest.mark.parametrize("tools", [("calc",), ("python",), ("calc", "python")])
def test_tool_prompt_has_one_worked_example_then_the_problem(tools):
    question, answer = "Mia has 15 pencils. She finds 2 more pencils. How many pencils does Mia have now?", 17
    messages = tool_prompt_messages(f"{question}\n{word_problems.INSTRUCTION}", tools)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in messages)
    instruction = messages[-1]["content"].removeprefix(question + " ")
    assert messages[0]["content"].endswith(" " + instruction) and word_problems.INSTRUCTION not in messages[-1]["content"]
    for name in tools:
        assert f"<{name}>" in instruction
    calls = [name for m in messages if m["role"] == "assistant" for name in ("calc", "python") if f"</{name}>" in m["content"]]
    assert calls == [tools[0]]  # one worked example, calling the first tool
    assert messages[3]["content"] == f"Answer: {EXAMPLE_ANSWER}"
    assert sum(len(m["content"]) for m in messages[:4]) < 400  # short for a 135M model
    # the example is true: a problem of the task, and each tool's result as the tool gives it; the answer is the last
    # problem's, however the prompt is read
    assert word_problems.answer_of(EXAMPLE_PROBLEM) == EXAMPLE_ANSWER
    source = extract_call(messages[1]["content"], tools[0])
    result = (
        calculate(source)
        if tools[0] == "calc"
        else run_python(source, dataclasses.replace(SandboxLimits(), timeout_s=60.0)).observation
    )
    assert result == EXAMPLE_RESULT[tools[0]] == messages[2]["content"]
    assert problem_answer(messages[-1]["content"]) == answer == WordProblemToolEnv({"messages": messages}).answer


def test_tool_prompt_refuses_unknown_tools():
    with pytest.raises(ValueError, match="name each tool once"):
        tool_prompt_messages("P", ("calc", "web"))


def test_the_word_problem_env_runs_in_the_runner():
    _, answer, row = _row()
    with EnvRunner(load_env_factory("fusedrl.tasks.word_problems_tools:word_problems_calc")) as runner:
        runner.start(0, row)
        assert runner.opening(0) is None
        runner.submit(0, "<calc>2 + 2</calc>")
        assert drain(runner, 1) == [(0, EnvStep(observation="4", info={"tool": "calc"}))]
        runner.submit(0, f"Answer: {answer}")
        assert drain(runner, 1) == [(0, EnvStep(reward=1.0, done=True))]
        assert runner.close(0)["tool_calls"] == 1


# -- TextArena ----------------------------------------------------------------------------------------------------

HANOI = ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]", "[B C]", "[A C]"]  # 3 disks from A to C in 7 moves


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the test's code tried to use the network")

    monkeypatch.setattr(socket.socket, "__init__", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_textarena_plays_tower_of_hanoi_offline(no_network):
    from fusedrl.envs.textarena import from_row

    with EnvRunner(from_row, max_turns=10) as runner:
        runner.start(0, {"env_id": "TowerOfHanoi-v0-raw", "messages": []})
        opening = runner.opening(0)
        assert "Tower of Hanoi with 3 disks" in opening and "A: [3, 2, 1]" in opening
        runner.submit(0, "[A A A]")  # not a move: the game says so, the episode goes on
        [(_, step)] = drain(runner, 1)
        assert not step.done and "invalid move" in step.observation
        observations = []
        for move in HANOI:
            runner.submit(0, f"I move a disk. {move}")
            [(_, step)] = drain(runner, 1)
            observations.append(step)
        assert all(not s.done and "Current Board" in s.observation and "I move" not in s.observation for s in observations[:-1])
        assert "C: [1]" in observations[0].observation and observations[0].observation.count("Current Board") == 1
        final = observations[-1]
        assert final.done and final.reward == 1.0 and final.observation is None and "solved" in final.info["reason"]
        stats = runner.close(0)
        assert stats["reward"] == 1.0 and stats["turns"] == 8 and stats["errors"] == 0


def test_textarena_adapter_without_textarena_names_the_extra(monkeypatch):
    from fusedrl.envs.textarena import TextArenaEnv

    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(ImportError, match=r"pip install fusedrl\[textarena\]"):
        TextArenaEnv("TowerOfHanoi-v0-raw")


def test_fusedrl_envs_imports_neither_torch_nor_textarena():
    code = "import sys, fusedrl.envs, fusedrl.envs.textarena; print(sorted({'torch', 'textarena'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
