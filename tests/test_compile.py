"""Regional compilation (training.compile): compiled decoder layers give the eager values and gradients (float32),
compile a bounded number of graphs whatever the packing, and a compiled training layout's packed update equals the
eager one at pp = 2 (FSDP2 hooks, the fused schedule), with and without activation checkpointing; tp = 2 is refused
(torch 2.13's compiled layer gave its DTensor input no gradient, or failed to compile after other graphs in the same
process)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fusedrl.config import ConfigError, load_config, run_checks
from fusedrl.distributed import CompiledLayer, apply_compile, split_decoder
from fusedrl.distributed.compat import compile_seconds, compiled_graph_count
from fusedrl.models import build_model

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_ppo.toml")


def _documents(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]


def _graphs_per_layer(model: torch.nn.Module) -> dict[str, int]:
    """Graphs compiled inside each decoder layer's calls from now on (hooks subtract the process's count before each
    call and add it after)."""
    counts = dict.fromkeys(model.layers, 0)
    for name, layer in model.layers.items():

        def entered(module, args, name=name):
            counts[name] -= compiled_graph_count()

        def left(module, args, out, name=name):
            counts[name] += compiled_graph_count()

        layer.register_forward_pre_hook(entered)
        layer.register_forward_hook(left)
    return counts


def test_compiled_layers_equal_eager_and_compile_a_bounded_number_of_graphs():
    # dynamo's counters are the process's (any earlier compile moved them): every figure here is a difference taken
    # around this test's calls. torch.compiler.reset() (public) drops earlier compiled graphs, so this test's first
    # packing compiles even when an earlier test compiled the same layer forward.
    torch.compiler.reset()
    torch.manual_seed(0)
    (eager,) = split_decoder(build_model("debug"), 1)
    compiled = copy.deepcopy(eager)
    assert apply_compile(compiled) == 2 and all(type(layer) is CompiledLayer for layer in compiled.layers.values())
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    layer_graphs = _graphs_per_layer(compiled)
    packings = [[7, 3, 12, 1], [20, 5], [4, 4, 4, 9, 2], [16], [30, 1, 1]]
    graphs_before, seconds_before = compiled_graph_count(), compile_seconds()
    graphs, seconds = [], []  # compiled by this test up to the end of each packing
    for lengths in packings:
        tokens = torch.randint(0, 500, (1, sum(lengths)))
        for documents in (_documents(lengths), None):  # packed rows, then one plain causal row
            outs = [model(tokens, documents=documents) for model in (eager, compiled)]
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
            weight = torch.randn_like(outs[0])
            grads = [torch.autograd.grad((out * weight).sum(), list(m.parameters())) for out, m in zip(outs, (eager, compiled))]
            for a, b in zip(*grads):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * float(a.abs().max()))
        graphs.append(compiled_graph_count() - graphs_before)
        seconds.append(compile_seconds() - seconds_before)
    assert graphs[0] > 0 and seconds[0] > 0  # the first packing compiled (forward and backward)
    # the first shapes compile, the second ones make lengths symbolic; every later packing reuses those graphs (and
    # compiles no backward either)
    assert graphs[1:] == [graphs[1]] * (len(packings) - 1), graphs
    assert seconds[1:] == [seconds[1]] * (len(packings) - 1), seconds
    # one layer forward shared by all layers: the first layer compiled every graph, the second reused them (graphs
    # do not grow with the layer count)
    first, *others = compiled.layers
    assert layer_graphs == {first: graphs[-1], **dict.fromkeys(others, 0)}, layer_graphs


def _compiled_update_equals_eager(checkpointing: str) -> bool:
    """A pipeline (pp = 2) packed update with compiled layers equals the eager one (float32)."""
    import torch.distributed as dist
    from test_packing import _minibatch, debug_update_layout, full_grads

    from fusedrl.rlhf.update import _forward_backward

    torch.set_num_threads(1)
    runs = []
    for compile_ in ("false", "true"):
        torch.manual_seed(0)  # the same random initial weights in both layouts
        cfg, layout, executor, stages = debug_update_layout(
            "--parallelism.pp=2",
            "--parallelism.dp_shard=1",
            f"--training.compile={compile_}",
            f"--training.activation_checkpointing={checkpointing}",
        )
        cfg.ppo.microbatch_tokens = (cfg.ppo.microbatch_size + 1) * cfg.sequence_budget  # the least pp = 2 accepts
        assert any(isinstance(m, CompiledLayer) for s in stages for m in s.modules()) == (compile_ == "true")
        stats, _ = _forward_backward(cfg, layout, executor, _minibatch(cfg.ppo.minibatch_size, 500))
        runs.append((stats, full_grads(stages)))
    (eager, eager_grads), (compiled, compiled_grads) = runs
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    for a, b in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * float(a.abs().max()))
    dist.barrier()
    return True


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_compiled_update_equals_eager_with_a_pipeline(two_ranks, checkpointing):
    assert two_ranks.run(_compiled_update_equals_eager, checkpointing) == [True, True]


def test_compile_with_tensor_parallelism_is_refused_in_one_line():
    for key in ("tp", "gen_tp"):
        cfg = load_config(["--job.config_file", DEBUG, "--training.compile=true", f"--parallelism.{key}=2"])
        world = 8 if key == "tp" else 4  # pp = 2 x dp_shard = 2 in the debug config
        with pytest.raises(ConfigError, match=rf"training.compile = true with parallelism.{key} = 2: .*--training.compile=false"):
            run_checks(cfg, world)
