"""A model's layer stack split into pipeline stages, built from the model's pieces.

:class:`StagedModel` stores the stack as a :class:`~jaxshard.parallel.pipeline.StageLayout`
says (stage s holding its chunks, empty slots where stages are uneven) and runs a schedule's
tables through the executor (:func:`jaxshard.parallel.pipeline.run`) with the model's
:meth:`embed`, layers and :meth:`head` as the stage work. The model itself knows no stage: it
provides the pieces (:class:`jaxshard.model.Stageable`), as torchtitan's models leave
``parallelize`` to the trainer.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp

from jaxshard import remat as remat_lib
from jaxshard.axes import Dim
from jaxshard.errors import ConfigError
from jaxshard.model import MOE_METRICS, Loss, Params, Stageable
from jaxshard.parallel import attention, pipeline
from jaxshard.parallel.vocab import cross_entropy
from jaxshard.rows import microbatch_rows
from jaxshard.rules import StateKind, active, constrain, for_compute


class StagedModel:
    """``model`` with its layer stack stored as ``layout`` says: :meth:`init` and
    :meth:`abstract_params` give the stored stack, :meth:`loss` takes it, and
    :meth:`model_order` turns it back into the model's layer order."""

    def __init__(self, model: Stageable, layout: pipeline.StageLayout):
        if layout.n_layers != model.cfg.n_layers:
            raise ConfigError(f"a stage layout of {layout.n_layers} layers for model {model.cfg.name} "
                              f"with {model.cfg.n_layers}")
        self.model = model
        self.stage_layout = layout
        self._abstract: Params | None = None

    # ---- the model's description, unchanged by the layout -------------------------------------
    @property
    def cfg(self) -> Any:
        return self.model.cfg

    @property
    def remat(self) -> Any:
        return self.model.remat

    @property
    def unroll(self) -> bool:
        return self.model.unroll

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.model.moe_layers

    @property
    def stacks(self) -> tuple[str, ...]:
        return self.model.stacks

    @property
    def stack(self) -> str:
        return self.model.stack

    def param_axes(self) -> dict:
        return self.model.param_axes()

    def n_params(self) -> int:
        """The model's (without the layout's empty slots)."""
        return self.model.n_params()

    def n_active_params(self) -> int:
        return self.model.n_active_params()

    # ---- the stored stack -------------------------------------------------------------------
    def _stored(self) -> bool:
        return not self.stage_layout.trivial

    def model_order(self, params: Params) -> Params:
        """Params with the layer stack in model order (as an unstaged model stores it)."""
        if not self._stored():
            return params
        return {**params, self.stack: jax.tree.map(self.stage_layout.to_model, params[self.stack])}

    def stored_order(self, params: Params) -> Params:
        """The inverse of :meth:`model_order`."""
        if not self._stored():
            return params
        return {**params, self.stack: jax.tree.map(self.stage_layout.to_stored, params[self.stack])}

    def init(self, key: jax.Array) -> Params:
        """Fresh params (the model's, whatever the layout), in stored order."""
        return self.stored_order(self.model.init(key))

    def abstract_params(self) -> Params:
        if self._abstract is None:
            self._abstract = jax.eval_shape(self.init, jax.random.key(0))
        return self._abstract

    def loss(self, params: Params, inputs_BL: jax.Array, targets_BL: jax.Array, *,
             key: jax.Array | None = None) -> Loss:
        """The model's loss on stored params (every layer on every stage: no schedule)."""
        return self.model.loss(self.model_order(params), inputs_BL, targets_BL, key=key)

    # ---- through a schedule -----------------------------------------------------------------
    def pipeline_grads(self, params: Params, inputs_BL: jax.Array, targets_BL: jax.Array,
                       schedule: pipeline.Schedule, *, key: jax.Array | None = None,
                       seed: jax.Array | float = 1.0,
                       cast: Callable[[Any], Any] = lambda p: p) -> tuple[Loss, Params]:
        """(the :class:`Loss`, gradients of ``seed`` x its total) with the layer stack run by
        ``schedule`` (whose layout must be this one). Microbatch ``i`` is rows ``i, i + M, ...``
        of the batch, so each stays spread over the batch shards; dropout (``key``) drops what
        :meth:`loss` would. ``cast``: applied to the params where they are used (the compute
        dtype)."""
        loss, d_stack, d_outer = self._run(params, inputs_BL, targets_BL, schedule, key, cast,
                                           seed=seed, train=True)
        tokens = self._counted_tokens(inputs_BL)
        if self.moe_layers:  # (nll, the auxiliary losses, the routing statistics): token-weighted sums
            nll, extra, stats = loss
            sums = Loss(nll + extra, tokens, nll, dict(zip(MOE_METRICS, stats)))
        else:
            sums = Loss(loss, tokens, loss, {})
        return sums, {**d_outer, self.stack: d_stack}

    def pipeline_loss(self, params: Params, inputs_BL: jax.Array, targets_BL: jax.Array,
                      schedule: pipeline.Schedule, *,
                      cast: Callable[[Any], Any] = lambda p: p) -> Loss:
        """The :class:`Loss` as :meth:`loss` gives it, each stage running its own layers in
        the pipeline's forward slots (no stage gathers another's layers)."""
        nll = self._run(params, inputs_BL, targets_BL, schedule, None, cast, train=False)
        return Loss(nll, self._counted_tokens(inputs_BL), nll, {})

    def _documents(self, tokens_BL: jax.Array) -> tuple[Any, Any, Any]:
        """Packed documents' (segment ids, positions, targets that count) of ``tokens_BL``
        (:func:`attention.document_layout`), or Nones: one sequence a row."""
        eot = self.model.cfg.documents_eot
        return (None, None, None) if eot is None else attention.document_layout(tokens_BL, eot)

    def _counted_tokens(self, tokens_BL: jax.Array) -> jax.Array:
        """The targets the loss counts: all, or with packed documents all but those after an
        end-of-text (as the model's loss counts them)."""
        counted_BL = self._documents(tokens_BL)[2]
        return jnp.asarray(tokens_BL.size, jnp.float32) if counted_BL is None else counted_BL.sum(dtype=jnp.float32)

    def _run(self, params, inputs_BL, targets_BL, schedule, key, cast, **run):
        model = self.model
        model.check_seq_len(inputs_BL)
        layout = schedule.layout
        if layout != self.stage_layout:
            raise ConfigError("the params are not stored in the pipeline schedule's stage layout")
        M = schedule.microbatches
        B, L = inputs_BL.shape
        rules = active()
        replicas = pipeline.replica_axes(rules)  # the executor is manual over these too

        def split(x_BL):
            return constrain(x_BL.reshape(B // M, M, L).swapaxes(0, 1), (None, Dim.BATCH, None))

        def keys(key):  # as the model's loss splits them: the embedding's, then one per layer
            if key is None:
                return None, None
            k_embed, k_blocks = jax.random.split(key)
            return k_embed, jax.random.split(k_blocks, model.cfg.n_layers)

        @contextlib.contextmanager
        def microbatch(i, tokens_BL):
            """Trace microbatch ``i`` (this device's rows of it), its packed documents if any."""
            segments_BL, positions_BL, _ = self._documents(tokens_BL)
            with microbatch_rows(i, M, replicas), attention.documents(segments_BL, positions_BL):
                yield

        def embed(outer, tokens_BL, i, key):
            with microbatch(i, tokens_BL):
                return model.embed(cast(outer), tokens_BL, key=keys(key)[0])

        def body(chunk, x_BLD, tokens_BL, i, layers, key):
            layer_keys = keys(key)[1]
            if layer_keys is not None:
                layer_keys = layer_keys[jnp.maximum(layers, 0)]
            present = layers >= 0 if layout.padded else None
            with microbatch(i, tokens_BL):
                if not self.moe_layers:
                    return model.blocks({model.stack: cast(chunk)}, x_BLD, layer_keys=layer_keys, present=present)
                return self._moe_chunk(cast(chunk), x_BLD, layer_keys, present, self._counted_tokens(tokens_BL))

        def last(chunk, outer, x_BLD, tokens_BL, targets_BL, i, layers, key):
            ordered = pipeline.orders_by_data() and rules.state_axes(StateKind.PARAMS)
            if ordered:
                reads = head_reads(outer, x_BLD, tokens_BL, targets_BL, i, key)
                outer, x_BLD = gathered_first(outer, x_BLD, reads)
            y = body(chunk, x_BLD, tokens_BL, i, layers, key)
            y_BLD, side = y if self.moe_layers else (y, None)
            if ordered:
                y_BLD, outer = reduced_first(y_BLD, outer, reads)
            nll = head(outer, y_BLD, tokens_BL, targets_BL, i, key)
            return nll if side is None else (nll, side)

        def head_reads(outer, y_BLD, tokens_BL, targets_BL, i, key):
            """{index among ``outer``'s leaves: logical axes} of the leaves the head's loss is
            computed from (from its jaxpr)."""
            leaves, tree = jax.tree.flatten(outer)
            jaxpr = jax.make_jaxpr(lambda *o: head(jax.tree.unflatten(tree, o), y_BLD, tokens_BL, targets_BL, i,
                                                   key))(*leaves).jaxpr
            live = {v for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal)}
            for e in reversed(jaxpr.eqns):
                if any(v in live for v in e.outvars):
                    live |= {v for v in e.invars if not isinstance(v, jax.extend.core.Literal)}
            axes = jax.tree.leaves({k: self.param_axes()[k] for k in outer}, is_leaf=lambda a: isinstance(a, tuple))
            return {n: axes[n] for n, v in enumerate(jaxpr.invars) if v in live}

        def gathered_first(outer, x_BLD, reads):
            """XLA:CPU runs a computation's independent ops in the order they become ready,
            and its fake devices may take a collective and a loop holding collectives in
            different orders: one device gathering the head's params (FSDP, ZeRO-3) while the
            other entered the layers' loop, each waiting in its collective for the other. The
            MoE pipeline on ``fsdp=2,stage=2,expert=2`` hung so in every run of a few hundred
            steps under load, and in none of 1,500 steps with this; an optimization barrier
            does not help (XLA:CPU's runtime orders by data alone). So on CPU the params the
            head reads (``reads``) are gathered first and the layers' input made to depend on
            them (+ 0 from each, read on each device's own shard of its layout in compute):
            the same gathers, ordered (:func:`reduced_first` orders their gradients'
            reductions). Elsewhere the runtime keeps the program's order and nothing changes."""
            leaves, tree = jax.tree.flatten(outer)
            zero = 0
            for n, ax in reads.items():
                leaves[n] = for_compute(leaves[n], ax)
                zero += pipeline.zero_from(leaves[n], rules.compute_param_spec(ax, tuple(leaves[n].shape)))
            return jax.tree.unflatten(tree, leaves), x_BLD + jnp.asarray(zero).astype(x_BLD.dtype)

        def reduced_first(y_BLD, outer, reads):
            """The backward pass's side of :func:`gathered_first`: the layers' backward loop
            takes the head's output gradient plus 0 made from each of the head's params'
            gradients, reduced into their layout (each device reading its own shard), so the
            reductions come before it on every device."""
            leaves, tree = jax.tree.flatten(outer)
            specs = [rules.param_spec(ax, tuple(leaves[n].shape), StateKind.GRADS) for n, ax in reads.items()]

            @jax.custom_vjp
            def tie(y, picked):
                return y, picked

            def tie_bwd(_, grads):
                d_y, d_picked = grads
                zero = sum(pipeline.zero_from(d, spec) for d, spec in zip(d_picked, specs))
                return d_y + zero.astype(d_y.dtype), d_picked

            tie.defvjp(lambda y, picked: (tie(y, picked), None), tie_bwd)
            y_BLD, picked = tie(y_BLD, [leaves[n] for n in reads])
            for n, x in zip(reads, picked):
                leaves[n] = x
            return y_BLD, jax.tree.unflatten(tree, leaves)

        def head(outer, y_BLD, tokens_BL, targets_BL, i, key):  # the head and the loss (zero-bubble: apart)
            nll_BL = cross_entropy(model.head(cast(outer), y_BLD), targets_BL, model.cfg.vocab_size)
            counted_BL = self._documents(tokens_BL)[2]
            return (nll_BL if counted_BL is None else jnp.where(counted_BL, nll_BL, 0.0)).sum()

        # A learned position table enters as its first L rows, the only ones with a gradient:
        # the executor accumulates and reduces those, not the whole table.
        outer = {k: v for k, v in params.items() if k not in self.stacks}
        table = outer.get("positions")
        if table is not None:  # (in the table's own layout: a slice needs no communication)
            spec = rules.param_spec(self.param_axes()["positions"], table.shape)
            outer["positions"] = jax.lax.with_sharding_constraint(table[:L], rules.named(spec))
        side = jnp.zeros(len(MOE_METRICS), jnp.float32) if self.moe_layers else None
        out = pipeline.run(
            schedule, rules.context_mesh, embed=embed, body=body, last=last, blocks=params[self.stack],
            outer=outer, inputs_MBL=split(inputs_BL), targets_MBL=split(targets_BL), aux=key,
            replicas=replicas, side=side, head=head, **run,
            grad_specs=(rules.param_specs(self.param_axes()[self.stack], params[self.stack], StateKind.GRADS)
                        if rules.state_axes(StateKind.GRADS) else None))
        if table is None or not run.get("train"):
            return out
        loss, d_stack, d_outer = out
        d_outer["positions"] = jnp.pad(d_outer["positions"], ((0, table.shape[0] - L), (0, 0)))
        return loss, d_stack, d_outer

    def _moe_chunk(self, chunk: Params, x_BLD: jax.Array, layer_keys, present, tokens: jax.Array):
        """A pipeline chunk of MoE layers (every layer one): (output, (its auxiliary losses,
        its routing statistics)), both weighted by the microbatch's ``tokens`` (the targets
        that count) as the model's loss weights them, the chunk's share of the mean over the
        model's MoE layers."""
        model = self.model

        def layer(x, xs):
            layer_params, layer_key, here = xs

            def run():
                y, r = model.moe_block(layer_params, x, key=layer_key)
                return y, r.stats

            if here is None:
                return run()
            return jax.lax.cond(here, run, lambda: (x, (jnp.zeros((), jnp.float32),) * len(MOE_METRICS)))  # an empty slot

        x_BLD, stats = jax.lax.scan(remat_lib.apply(layer, model.remat), x_BLD, (chunk, layer_keys, present),
                                    unroll=model.unroll)
        per_token = tokens / model.cfg.n_moe_layers
        sums = [per_token * jnp.sum(s) for s in stats]
        return x_BLD, (model.aux_loss(**dict(zip(MOE_METRICS, sums))), jax.lax.stop_gradient(jnp.stack(sums)))


def staged(model: Stageable | StagedModel, layout: pipeline.StageLayout) -> StagedModel:
    """``model`` stored as ``layout`` says (a staged model's own layout replaced)."""
    return StagedModel(model.model if isinstance(model, StagedModel) else model, layout)

