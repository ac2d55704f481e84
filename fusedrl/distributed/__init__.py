"""Parallel layouts: ParallelDims / DeviceMesh, FSDP2, tensor parallelism, pipeline stage splitting, full state
dicts from a training layout, float8, regional compilation, the layout's startup checks; a heartbeat that names dead
ranks after a failed collective."""

from fusedrl.distributed.compile import CompiledLayer, apply_compile
from fusedrl.distributed.float8 import check_float8, convert_to_float8
from fusedrl.distributed.fsdp import apply_activation_checkpointing, apply_fsdp, transformer_layers
from fusedrl.distributed.heartbeat import Heartbeat, describe_failure
from fusedrl.distributed.parallel_dims import (
    ParallelDims,
    check_device,
    check_dims,
    check_model_split,
    check_nodes,
    check_parallelism,
    default_backend,
    group_devices,
    init_distributed,
    mesh_lines,
    select_device,
)
from fusedrl.distributed.pipeline import DecoderStage, TiedEmbeddings, split_decoder, stage_layer_ranges
from fusedrl.distributed.reshard import ReshardPlan, plan_from_boxes, plan_reshard, reshard
from fusedrl.distributed.state_dict import gather_full_state_dict
from fusedrl.distributed.tp import VOCAB_MODULES, apply_tp

__all__ = [
    "CompiledLayer",
    "DecoderStage",
    "Heartbeat",
    "ParallelDims",
    "ReshardPlan",
    "TiedEmbeddings",
    "VOCAB_MODULES",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fsdp",
    "apply_tp",
    "check_device",
    "check_dims",
    "check_float8",
    "check_model_split",
    "check_nodes",
    "check_parallelism",
    "convert_to_float8",
    "default_backend",
    "describe_failure",
    "gather_full_state_dict",
    "group_devices",
    "init_distributed",
    "mesh_lines",
    "plan_from_boxes",
    "plan_reshard",
    "reshard",
    "select_device",
    "split_decoder",
    "stage_layer_ranges",
    "transformer_layers",
]
