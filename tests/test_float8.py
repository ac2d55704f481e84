"""Float8 training via torchao: a clear error without CUDA, a training step on CUDA."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusedrl.distributed import convert_to_float8
from fusedrl.models import build_model


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_float8_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"float8 training needs a CUDA GPU .* set `\[training\] float8 = false`"):
        convert_to_float8(build_model("debug"))


def test_float8_on_old_gpu_is_a_clear_error():
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)),
    ):
        with pytest.raises(RuntimeError, match=r"compute capability 8.9\+, this GPU has 8.0"):
            convert_to_float8(build_model("debug"))


def test_float8_skips_head_and_unaligned_linears():
    from torchao.float8.float8_linear import Float8Linear

    model = nn.ModuleDict(
        {
            "aligned": nn.Linear(32, 48),
            "unaligned": nn.Linear(32, 24),
            "output": nn.Linear(32, 32),
            "ffn": nn.Sequential(nn.Linear(64, 16)),
        }
    )
    # Module swapping itself needs no GPU: pretend one is there to check which linears are converted.
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)),
    ):
        convert_to_float8(model)
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {"aligned", "ffn.0"}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9), reason="float8 needs SM89+")
def test_float8_debug_large_trains_a_step_on_cuda():
    torch.manual_seed(0)
    model = build_model("debug_large", device="cuda")
    tokens = torch.randint(0, 512, (4, 129), device="cuda")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def loss_fn() -> torch.Tensor:
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    with torch.no_grad():
        ref_loss = loss_fn().item()
    convert_to_float8(model)
    assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 7 * len(model.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model.layers[0].mlp.w1.weight.detach().clone()
    loss = loss_fn()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and abs(loss.item() - ref_loss) < 0.05 * ref_loss
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert not torch.equal(model.layers[0].mlp.w1.weight, before)
