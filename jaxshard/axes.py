"""The two vocabularies: mesh axes (where) and logical dims (what).

Model code names every parameter dim and key activation dim with a :class:`Dim`;
only :mod:`jaxshard.rules` maps those to :class:`MeshAxis` names.
"""

from enum import StrEnum


class MeshAxis(StrEnum):
    DATA = "data"  # batch; with --zero also optimizer state / grads / params
    FSDP = "fsdp"  # batch and params, grads, optimizer state (ZeRO-3)
    STAGE = "stage"  # pipeline stages over the layer stack
    EXPERT = "expert"  # mixture-of-experts experts
    SEQUENCE = "sequence"  # context parallelism over the sequence
    TENSOR = "tensor"  # Megatron tensor parallelism


# Canonical nesting (outermost first) for axes the user leaves out of --mesh.
MESH_AXES: tuple[MeshAxis, ...] = tuple(MeshAxis)

# Axes that split the batch (the DistributedSampler axes); ``expert`` splits it too outside the
# MoE layers (GShard).
BATCH_AXES: tuple[MeshAxis, ...] = (MeshAxis.DATA, MeshAxis.FSDP, MeshAxis.EXPERT)


class Dim(StrEnum):
    # parameter dims
    VOCAB = "vocab"
    EMBED = "embed"
    HEADS = "heads"
    KV_HEADS = "kv_heads"
    HEAD_DIM = "head_dim"
    MLP = "mlp"
    LAYERS = "layers"
    EXPERTS = "experts"
    POSITION = "position"
    # activation dims
    BATCH = "batch"
    LENGTH = "length"  # inside attention and the MLP
    RESIDUAL_LENGTH = "residual_length"  # the residual stream between sublayers (SP splits it)
    ACT_EMBED = "act_embed"
    ACT_HEADS = "act_heads"
    ACT_KV_HEADS = "act_kv_heads"
    ACT_MLP = "act_mlp"
    ACT_VOCAB = "act_vocab"


LogicalAxes = tuple[Dim | None, ...]

# The residual stream between sublayers (its sequence split by SP), and a sublayer's input as
# its matmuls use it (the sequence whole).
RESIDUAL_BLD = (Dim.BATCH, Dim.RESIDUAL_LENGTH, Dim.ACT_EMBED)
INPUT_BLD = (Dim.BATCH, Dim.LENGTH, Dim.ACT_EMBED)
