"""The HLO reader on hand-written text in each format jax 0.10-0.12 prints."""

from jaxshard.analysis import hlo

MODULE = """HloModule jit_step, entry_computation_layout={()->f32[]}, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%max (x.1: f32[], y.1: f32[]) -> f32[] {
  %x.1 = f32[] parameter(0)
  %y.1 = f32[] parameter(1)
  ROOT %mx = f32[] maximum(%x.1, %y.1)
}

%fused_slice (param_0.1: f32[16,64], param_1.2: s32[]) -> f32[2,64] {
  %param_0.1 = f32[16,64]{1,0} parameter(0)
  %param_1.2 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %dynamic-slice.3 = f32[2,64]{1,0} dynamic-slice(%param_0.1, %param_1.2, %c), dynamic_slice_sizes={2,64}
}

%body (p: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %p = (s32[], f32[8,64]{1,0}) parameter(0)
  %g = f32[8,64]{1,0} get-tuple-element(%p), index=1
  %ag = f32[64,64]{1,0} all-gather(%g), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,64]{1,0}) tuple(%i, %g)
}

%cond (p.1: (s32[], f32[8,64])) -> pred[] {
  %p.1 = (s32[], f32[8,64]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: f32[16,64], b: f32[4], w: (s32[], f32[8,64])) -> f32[] {
  %a = f32[16,64]{1,0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %w = (s32[], f32[8,64]{1,0}) parameter(2)
  %ar = f32[16,64]{1,0} all-reduce(%a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %pid = s32[] partition-id()
  %sl = f32[2,64]{1,0} fusion(%ar, %pid), kind=kLoop, calls=%fused_slice
  %combined = (f32[4]{0}, f32[16,64]{1,0}) all-reduce(%b, %a), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %e0 = f32[4]{0} get-tuple-element(%combined), index=0
  %e1 = f32[16,64]{1,0} get-tuple-element(%combined), index=1
  %use = f32[16,64]{1,0} add(%e1, %e1)
  %loop = (s32[], f32[8,64]{1,0}) while(%w), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %m = f32[4,64]{1,0} all-gather(%sl), channel_id=4, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_0'}, dimensions={0}, use_global_device_ids=true
  %cp = f32[2,64]{1,0} collective-permute(%sl), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %rs-start = ((f32[16,64]{1,0}), f32[2,64]{1,0}) reduce-scatter-start(%a), channel_id=6, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}, to_apply=%add
  %amax = f32[] parameter(3)
  %maxed = f32[] all-reduce(%amax), channel_id=7, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%max
  ROOT %r = f32[] constant(0)
}
"""


def by_name():
    return {c.name: c for c in hlo.parse(MODULE)}


def test_all_reduce_followed_only_by_a_slice_is_a_reduce_scatter():
    c = by_name()["ar"]
    assert (c.kind, c.spelled_as, c.bytes, c.group_size) == ("reduce-scatter", "all-reduce", 16 * 64 * 4, 8)
    assert c.sent_bytes == 7 / 8 * c.bytes


def test_combined_collective_is_split_and_iota_groups_transposed():
    found = by_name()
    small, big = found["combined#0"], found["combined#1"]
    assert small.shapes == ((4,),) and big.shapes == ((16, 64),)
    assert small.kind == big.kind == "all-reduce"  # used whole, not sliced
    assert small.groups == ((0, 4), (1, 5), (2, 6), (3, 7))  # [4,2]<=[2,4]T(1,0)
    assert big.sent_bytes == 2 * (2 - 1) / 2 * big.bytes


def test_a_reducing_collective_says_what_it_reduces_with():
    found = by_name()
    assert found["maxed"].reduction == "maximum" and found["maxed"].kind == "all-reduce"
    assert found["ar"].reduction == found["combined#0"].reduction == found["rs-start"].reduction == "add"
    assert found["ag"].reduction == found["cp"].reduction == ""


def test_loop_trip_count_multiplies_executions():
    ag = by_name()["ag"]
    assert (ag.kind, ag.executions, ag.shapes, ag.bytes) == ("all-gather", 3, ((64, 64),), 64 * 64 * 4)
    assert ag.groups == (tuple(range(8)),)


def test_mesh_groups_with_device_ids():
    m = by_name()["m"]
    # devices laid out as arange(8).reshape(4, 2).T = [[0,2,4,6],[1,3,5,7]] on a (2, 1, 4) mesh;
    # the group varies axis_0 (size 2)
    assert m.groups == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_permute_pairs_and_async_reduce_scatter():
    found = by_name()
    assert found["cp"].groups == ((0, 1), (1, 2), (2, 3), (3, 0))
    # Devices 0-3 send their buffer, 4-7 nothing: half a buffer per device on average.
    assert found["cp"].sent_bytes == 2 * 64 * 4 * 4 / 8
    rs = found["rs-start"]
    assert (rs.kind, rs.shapes, rs.bytes) == ("reduce-scatter", ((2, 64),), 16 * 64 * 4)
    assert rs.groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_attribute_names_mesh_axes():
    found = hlo.attribute(hlo.parse(MODULE), ("data", "tensor"), (2, 4))
    axes = {c.name: c.axes for c in found}
    assert axes["ar"] == ("data", "tensor")
    assert axes["combined#0"] == ("data",)  # {0,4}: same tensor index, other data index
    assert axes["rs-start"] == ("tensor",)
    summary = {s["kind"]: s for s in hlo.summary(found)}
    assert summary["all-gather"]["count"] == 3 + 1


BRANCHES = """HloModule jit_step, entry_computation_layout={()->f32[]}, num_partitions=8

%idle (q: f32[8,64]) -> f32[8,64] {
  ROOT %q = f32[8,64]{1,0} parameter(0)
}

%work (q.1: f32[8,64]) -> f32[8,64] {
  %q.1 = f32[8,64]{1,0} parameter(0)
  ROOT %ar.1 = f32[8,64]{1,0} all-reduce(%q.1), channel_id=7, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
}

%body.2 (p.2: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %p.2 = (s32[], f32[8,64]{1,0}) parameter(0)
  %i.2 = s32[] get-tuple-element(%p.2), index=0
  %g.2 = f32[8,64]{1,0} get-tuple-element(%p.2), index=1
  %c.2 = f32[8,64]{1,0} conditional(%i.2, %g.2, %g.2), branch_computations={%idle, %work}
  ROOT %t.2 = (s32[], f32[8,64]{1,0}) tuple(%i.2, %c.2)
}

ENTRY %main.2 (w.2: (s32[], f32[8,64])) -> f32[] {
  %w.2 = (s32[], f32[8,64]{1,0}) parameter(0)
  %loop.2 = (s32[], f32[8,64]{1,0}) while(%w.2), condition=%cond, body=%body.2, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r.2 = f32[] constant(0)
}
"""


def test_a_collective_in_any_branch_of_a_conditional_in_a_loop_counts_as_conditional():
    """Every branch of ``branch_computations`` is followed (not only the first); a collective
    there runs at most once per iteration, and is marked as conditional."""
    c, = hlo.parse(BRANCHES)
    assert (c.name, c.executions, c.conditional) == ("ar.1", 5, True)
    assert not any(x.conditional for x in hlo.parse(MODULE))


def test_a_partial_permute_is_sent_by_its_sources_only():
    """A compiled shift with no wrap-around (a pipeline's stages passing forward: the last sends
    nothing) on 8 devices: 7 devices send their buffer; a full ring, all 8."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))
    x = np.zeros((8, 16), np.float32)

    def sent(perm):
        f = jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, "stage", perm), mesh=mesh,
                                  in_specs=P("stage"), out_specs=P("stage")))
        c, = hlo.parse(f.lower(x).compile().as_text())
        assert c.kind == "collective-permute" and c.bytes == 16 * 4
        return c.sent_bytes

    assert sent([(i, i + 1) for i in range(7)]) == 16 * 4 * 7 / 8
    assert sent([(i, (i + 1) % 8) for i in range(8)]) == 16 * 4


def test_the_fingerprint_sees_the_program_not_where_its_source_lies():
    """Equal for the same program whether compiled afresh or loaded from the compilation cache
    (which keeps fewer source tables and stack frames); different for another constant."""
    import re

    import jax
    import jax.numpy as jnp

    x = jnp.ones((8, 8))
    text = jax.jit(lambda a: jnp.sin(a) @ a.T + 1).lower(x).compile().as_text()
    bare = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(\d+ .*\n)*", "\n", text)
    bare = re.sub(r", metadata=\{[^{}]*\}", "", bare)
    assert hlo.fingerprint(bare) == hlo.fingerprint(text)
    other = jax.jit(lambda a: jnp.sin(a) @ a.T + 2).lower(x).compile().as_text()
    assert hlo.fingerprint(other) != hlo.fingerprint(text)


TICKS = """HloModule jit_step, entry_computation_layout={()->f32[]}, num_partitions=2

%fused_dot (p0: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  ROOT %d2 = f32[8,8]{1,0} dot(%p0, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%run (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %d1 = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/while/body/cond/branch_1_fun/pipeline_tick_F/dot_general"}
  ROOT %f = f32[8,8]{1,0} fusion(%d1), kind=kOutput, calls=%fused_dot
}

%idle (x.1: f32[8,8]) -> f32[8,8] {
  %x.1 = f32[8,8]{1,0} parameter(0)
  %n = f32[8,8]{1,0} negate(%x.1), metadata={op_name="jit(step)/while/body/cond/branch_0_fun/neg"}
  ROOT %d3 = f32[8,8]{1,0} dot(%n, %n), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%tick (q: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %q = (s32[], f32[8,8]{1,0}) parameter(0)
  %i.3 = s32[] get-tuple-element(%q), index=0
  %v = f32[8,8]{1,0} get-tuple-element(%q), index=1
  %y = f32[8,8]{1,0} conditional(%i.3, %v, %v), branch_computations={%idle, %run}, metadata={op_name="jit(step)/while/body/cond"}
  ROOT %t.3 = (s32[], f32[8,8]{1,0}) tuple(%i.3, %y)
}

%ticking (q.1: (s32[], f32[8,8])) -> pred[] {
  %q.1 = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %go = pred[] constant(true)
}

ENTRY %main.3 (s: (s32[], f32[8,8])) -> f32[] {
  %s = (s32[], f32[8,8]{1,0}) parameter(0)
  %loop.3 = (s32[], f32[8,8]{1,0}) while(%s), condition=%ticking, body=%tick, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r.3 = f32[] constant(0)
}
"""


def test_a_scoped_branchs_dots_count_as_often_as_its_op_runs():
    """A pipeline tick's op (``pipeline_tick_F``) taken in half the ticks: its dots count half
    the loop's runs, the one XLA fused without a name too (the scope its computation's named
    instructions share); the idle branch's dot, under no scope, counts every tick, as does
    every dot without ``share``."""
    one = 2 * 8 * 8 * 8  # a dot's FLOPs
    assert hlo.dot_flops(TICKS) == 3 * 4 * one
    assert hlo.dot_flops(TICKS, {"F": 0.5}, "pipeline_tick_") == (2 * 2 + 4) * one
    assert hlo.dot_flops(TICKS, {"B": 0.5}, "pipeline_tick_") == 3 * 4 * one  # (no such op here)
