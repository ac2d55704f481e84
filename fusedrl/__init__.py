"""fusedrl: PyTorch-native RLHF (PPO) with inter-stage and intra-stage fusion."""

__version__ = "0.1.0"
