"""PPO pieces: the experience batch, scoring (neural and rule-based rewards), KL-shaped rewards, GAE, whitening and
PPO losses."""

from fusedrl.rlhf.advantages import gae, kl_estimate, kl_shaped_rewards, masked_mean_var, whiten
from fusedrl.rlhf.experience import Experience
from fusedrl.rlhf.losses import (
    DEFAULT_LOGITS_BUDGET_BYTES,
    PolicyLoss,
    ValueLoss,
    chunked_policy_loss,
    chunked_token_logprobs,
    chunked_token_logprobs_entropy,
    explained_variance,
    head_vocab_size,
    logits_chunk_positions,
    policy_loss,
    shift_to_tokens,
    token_entropy,
    token_logprobs,
    value_loss,
)
from fusedrl.rlhf.reward_fn import RewardFn, RewardFunctionError, RuleReward, load_reward_fn, reward_fn_metrics
from fusedrl.rlhf.scoring import Scorer, ScoringModels, decoder_hidden_states, scoring_micro_batches

__all__ = [
    "DEFAULT_LOGITS_BUDGET_BYTES",
    "RewardFn",
    "RewardFunctionError",
    "RuleReward",
    "Scorer",
    "ScoringModels",
    "chunked_policy_loss",
    "chunked_token_logprobs",
    "chunked_token_logprobs_entropy",
    "decoder_hidden_states",
    "head_vocab_size",
    "logits_chunk_positions",
    "scoring_micro_batches",
    "Experience",
    "PolicyLoss",
    "ValueLoss",
    "explained_variance",
    "gae",
    "kl_estimate",
    "kl_shaped_rewards",
    "load_reward_fn",
    "masked_mean_var",
    "policy_loss",
    "reward_fn_metrics",
    "shift_to_tokens",
    "token_entropy",
    "token_logprobs",
    "value_loss",
    "whiten",
]
