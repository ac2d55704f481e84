"""Packed training micro-batches (ppo.microbatch_tokens): the row layout, document-causal attention, and a packed
update equal to the padded one in float32 (losses, stats and gradients) on one rank, dp_shard = 2, tp = 2 and pp = 2
(the fused schedule), in every loss aggregation mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from fusedrl.config import ConfigError, load_config, run_checks
from fusedrl.distributed import split_decoder
from fusedrl.models import build_model
from fusedrl.models.documents import DocumentSpans
from fusedrl.rlhf import Experience, PackedRows, pack_rows, sequence_lengths

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_ppo.toml")
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def test_pack_rows_places_every_sequence_once_in_the_fewest_equal_counts_of_rows():
    lengths = [[30, 10, 50, 20, 40], [60, 5, 5]]
    rows = pack_rows(lengths, 64)
    # shard 0 holds 150 tokens: at least 3 rows of 64; shard 1 gets as many
    assert [len(r) for r in rows] == [3, 3]
    for shard, shard_rows in zip(lengths, rows):
        assert sorted(i for row in shard_rows for i in row) == list(range(len(shard)))
        assert all(sum(shard[i] for i in row) <= 64 for row in shard_rows)
    with pytest.raises(ValueError, match=r"ppo.microbatch_tokens = 40.*raise it to at least the longest sequence"):
        pack_rows([[41, 3]], 40)


def test_packed_rows_lay_out_tokens_and_documents():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0]], dtype=torch.float32)
    lengths = sequence_lengths(mask)
    assert lengths == [3, 3, 2]
    tokens = torch.arange(15).view(3, 5)
    packed = PackedRows.of([[0, 2], [1]], lengths, 64)
    assert packed.length == 8  # the longer row's 5 tokens, rounded up to a multiple of max(8, 64 / 64)
    pad = [0] * 3
    assert packed.pack(tokens).tolist() == [[0, 1, 2, 10, 11, *pad], [5, 6, 7, 0, 0, *pad]]
    assert packed.documents.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 1, 1, 1, 2, 2]]
    assert packed.positions == 16
    assert PackedRows.of([[0, 2], [1]], [300, 3, 90], 480).length == 392  # 390 tokens, a multiple of 480 / 64 = 8
    # padding comes in pieces no longer than the longest sequence
    assert PackedRows.of([[0]], [3], 512).documents.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2]]
    # a row without a response token packs as one token, which no loss counts
    assert sequence_lengths(torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])) == [3, 1]


def test_document_spans_attention_equals_each_sequence_alone():
    """A packed stage forward (and its gradients) equals each sequence's own forward, float32."""
    torch.manual_seed(0)
    (stage,) = split_decoder(build_model("debug"), 1)
    lengths = [7, 3, 12, 1]
    seqs = [torch.randint(0, 500, (1, n)) for n in lengths]
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    packed = stage(torch.cat(seqs, dim=1), documents=documents)
    alone = torch.cat([stage(s) for s in seqs], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    weight = torch.randn_like(alone)
    grads = [torch.autograd.grad((out * weight).sum(), list(stage.parameters())) for out in (packed, alone)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    assert DocumentSpans.from_ids(documents).lengths == (tuple(lengths),)


def test_a_budget_below_the_longest_sequence_or_a_pipelines_rows_is_refused_in_one_line():
    cfg = load_config(["--job.config_file", DEBUG, "--ppo.microbatch_tokens=100"])
    with pytest.raises(ConfigError, match=r"ppo.microbatch_tokens = 100 .*smaller than the longest sequence.*160"):
        run_checks(cfg, 4)
    cfg = load_config(["--job.config_file", DEBUG, "--ppo.microbatch_tokens=512"])  # pp = 2, micro-batches of 4
    with pytest.raises(ConfigError, match=r"parallelism.pp = 2 .*raise it to at least 800, or set 0"):
        run_checks(cfg, 4)
    run_checks(load_config(["--job.config_file", DEBUG, "--ppo.microbatch_tokens=800"]), 4)
    with pytest.raises(ValueError, match=r"does not fit 2 packed rows of ppo.microbatch_tokens = 64"):
        pack_rows([[40, 40, 40]], 64, count=2)


def _minibatch(batch: int, vocab: int) -> Experience:
    """Rows of varied prompt and response lengths, right-padded; every per-token field random."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, 12, (batch,), generator=g)
    responses = torch.randint(1, 24, (batch,), generator=g)
    seq = int((prompts + responses).max())
    positions = torch.arange(seq)
    mask = ((positions >= prompts[:, None]) & (positions < (prompts + responses)[:, None])).float()
    return Experience(
        tokens=torch.randint(0, vocab, (batch, seq), generator=g),
        response_mask=mask,
        logprobs=-torch.rand(batch, seq, generator=g) * mask,
        ref_logprobs=-torch.rand(batch, seq, generator=g) * mask,
        values=torch.randn(batch, seq, generator=g) * mask,
        advantages=torch.randn(batch, seq, generator=g) * mask,
        returns=torch.randn(batch, seq, generator=g) * mask,
    )


def debug_update_layout(*overrides: str):
    """The debug config in float32 with random weights (and ``overrides``): its config, training layout, executor and
    trained stages, built on this rank (collective)."""
    from fusedrl.layouts import build_rollout_layout, build_training_layout, load_initial_weights
    from fusedrl.rlhf import build_executor

    dtypes = [f"--training.{k}=float32" for k in ("mixed_precision_param", "frozen_dtype", "rollout_dtype", "kv_cache_dtype")]
    cfg = load_config(
        [
            "--job.config_file",
            DEBUG,
            "--model.actor_path=",
            "--model.critic_path=",
            "--model.reward_path=",
            "--ppo.kl_loss_coef=0.05",
            "--ppo.entropy_coef=0.01",
            *dtypes,
            *overrides,
        ]
    )
    device = torch.device("cpu")
    layout = build_training_layout(cfg, device)
    load_initial_weights(cfg, layout, build_rollout_layout(cfg, device))
    stages = [s for s in (layout.actor_stage, layout.critic_stage) if s is not None]
    return cfg, layout, build_executor(cfg, layout, device), stages


def full_grads(stages: list) -> list[torch.Tensor]:
    """Copies of the stages' whole gradients (a sharded one gathered)."""
    return [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for s in stages for p in s.parameters()]


def _packed_equals_padded(pp: int, dp_shard: int, tp: int) -> bool:
    import torch.distributed as dist

    from fusedrl.rlhf.update import _forward_backward

    torch.set_num_threads(1)
    cfg, layout, executor, stages = debug_update_layout(
        f"--parallelism.pp={pp}", f"--parallelism.dp_shard={dp_shard}", f"--parallelism.tp={tp}"
    )
    mb = _minibatch(cfg.ppo.minibatch_size, 500)
    for mode in MODES:
        cfg.ppo.loss_agg_mode = mode
        runs = []
        # pp = 1: the fewest rows of the smallest budget; pp = 2: the program's micro-batch count, the budget it needs
        budget = cfg.sequence_budget if pp == 1 else (cfg.ppo.microbatch_size + 1) * cfg.sequence_budget
        for tokens in (0, budget):
            cfg.ppo.microbatch_tokens = tokens
            for stage in stages:
                stage.zero_grad(set_to_none=True)
            stats, positions = _forward_backward(cfg, layout, executor, mb)
            runs.append((stats, full_grads(stages), positions))
        (padded, padded_grads, padded_positions), (packed, packed_grads, packed_positions) = runs
        assert packed_positions < padded_positions, (mode, packed_positions, padded_positions)
        # every loss and token-mean stat; not logprob_diff_max, a mean of per-micro-batch maxima (split-dependent)
        for k in (k for k in padded if not k.endswith("_max")):
            torch.testing.assert_close(packed[k], padded[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{mode} {k}: {m}")
        for a, b in zip(packed_grads, padded_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()), msg=lambda m: f"{mode}: {m}")
    dist.barrier()
    return True


def test_packed_update_equals_padded_on_one_rank(rank_pools):
    assert rank_pools(1).run(_packed_equals_padded, 1, 1, 1) == [True]


@pytest.mark.parametrize(("pp", "dp_shard", "tp"), [(1, 2, 1), (1, 1, 2), (2, 1, 1)], ids=["dp_shard2", "tp2", "pp2"])
def test_packed_update_equals_padded_on_two_ranks(two_ranks, pp, dp_shard, tp):
    """pp = 2: the fused Actor + Critic schedule of the debug config, the document ids passed to every stage."""
    assert two_ranks.run(_packed_equals_padded, pp, dp_shard, tp) == [True, True]


def test_auto_packing_follows_the_sequence_budget():
    from fusedrl.config import load_config

    config = Path(__file__).resolve().parents[1] / "train_configs" / "smollm2_135m_grpo.toml"

    def cfg(*extra: str):
        return load_config(["--job.config_file", str(config), *extra])

    assert cfg().packing_tokens == (cfg().ppo.microbatch_size + 1) * cfg().sequence_budget  # the recipe's "auto"
    longer = cfg("--generation.max_new_tokens=48")
    assert longer.packing_tokens == (longer.ppo.microbatch_size + 1) * (longer.data.max_prompt_len + 48)
    assert cfg("--ppo.microbatch_tokens=0").packing_tokens == 0 and cfg("--ppo.microbatch_tokens=900").packing_tokens == 900
