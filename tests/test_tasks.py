"""Tasks reach the trainer as one Task object that job.task names (the trainer names none)."""

from pathlib import Path

import pytest

from fusedrl.config import ConfigError, load_config
from fusedrl.tasks import arithmetic, debug, load_task, synthetic_prompts, task_reward_fn

ROOT = Path(__file__).resolve().parents[1]


def test_configs_name_their_task_and_its_parts_are_used():
    recipe = load_config(["--job.config_file", str(ROOT / "train_configs/smollm2_135m_ppo.toml")])
    task = load_task(recipe.job.task)
    assert task is arithmetic.TASK and task_reward_fn(recipe, task) is arithmetic.reward_fn
    assert synthetic_prompts(recipe, task) is None  # its prompts come from data.path

    cfg = load_config(["--job.config_file", str(ROOT / "train_configs/debug_ppo.toml")])
    task = load_task(cfg.job.task)
    assert task is debug.TASK and task_reward_fn(cfg, task) is None  # model.reward_fn is unset there
    prompts = synthetic_prompts(cfg, task, count=8)
    assert prompts == debug.sample_prompts(8, cfg.job.seed) and all(debug.parse_prompt(p) for p in prompts)
    assert load_task("") is None and load_task(None) is None


def test_a_task_without_the_part_a_key_needs_is_refused_in_one_line():
    cfg = load_config(["--job.config_file", str(ROOT / "train_configs/debug_ppo.toml"), "--model.reward_fn=task"])
    with pytest.raises(
        ConfigError, match=r"^data.format = \"synthetic\" takes .* the task 'arithmetic' has no prompts; set --job.task"
    ) as e:
        synthetic_prompts(cfg, arithmetic.TASK)
    assert "\n" not in str(e.value)
    assert task_reward_fn(cfg, debug.TASK) is debug.reward_fn
