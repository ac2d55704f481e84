"""fusedrl: PyTorch-native RLHF (PPO) with inter-stage and intra-stage fusion."""

import logging

__version__ = "0.1.0"

# torchao, imported through torchtune, warns on every rank at import that its C++ kernels do not match this torch
# build; fusedrl calls none of them (its float8 training and int8 weight-only paths are torch ops).
logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Skipping import of cpp extensions"))
