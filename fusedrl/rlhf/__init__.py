"""PPO pieces: the experience batch, KL-shaped rewards, GAE, whitening and PPO losses."""

from fusedrl.rlhf.advantages import gae, kl_estimate, kl_shaped_rewards, masked_mean_var, whiten
from fusedrl.rlhf.experience import Experience
from fusedrl.rlhf.scoring import Scorer, ScoringModels
from fusedrl.rlhf.losses import (
    PolicyLoss,
    ValueLoss,
    explained_variance,
    policy_loss,
    shift_to_tokens,
    token_entropy,
    token_logprobs,
    value_loss,
)

__all__ = [
    "Scorer",
    "ScoringModels",
    "Experience",
    "PolicyLoss",
    "ValueLoss",
    "explained_variance",
    "gae",
    "kl_estimate",
    "kl_shaped_rewards",
    "masked_mean_var",
    "policy_loss",
    "shift_to_tokens",
    "token_entropy",
    "token_logprobs",
    "value_loss",
    "whiten",
]
