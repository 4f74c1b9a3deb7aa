"""The private step's Lightning wiring, as a mixin for a ``Strategy``, in the order of
(docs/algorithms.md, "OSO-DPSGD"):

1. ``process_dataloader``: the training loader becomes a Poisson-sampled one (``data.poisson_loader``).
2. Hooks attached to the user's module without wrapping it keep what backward needs for per-sample norms and sums
   (``per_sample.attach``): each layer's input and output gradient (``per_sample.BookKeeping``, the default fast
   path) or, with ``grad_sample_mode="hooks"``, every per-sample gradient (Opacus' hooks fill ``p.grad_sample``).
3. ``backward``: the loss is backpropagated scaled so that every record's own loss has the weight 1
   (``per_sample.loss_scale``: a mean's ``1/n`` never reaches 16-bit arithmetic); then the batch's per-sample norms
   -> the clipping rule's weights -> weighted sums (``step.clip_and_sum``), added to the logical batch's sums; the
   per-sample state is let go.
4. ``optimizer_step`` runs Lightning's closure (forward + backward), then replaces every gradient by its
   sanitised value (``step.release``: noise -> sum across processes -> division by ``B``), *before* the
   ``on_before_optimizer_step`` hooks and the optimizer see it, lets the rule update itself (``C_t``) from the
   sanitised values, then steps, then multiplies the learning rate by the rule's factor (``rho_t``).

With ``Trainer(accumulate_grad_batches=k)`` the Poisson sampler yields each logical batch (rate
``q = k * batch_size * world_size / N``) as ``k`` micro-batches (``data.PoissonBatchSampler``); Lightning runs
training_step and backward on each, and the optimizer step after the k-th: the clipped sums of the k micro-batches
are added up in 3, and 4 noises, reduces, records and accounts them once. Lightning divides each micro-batch's loss
by k; ``backward`` multiplies it back (with the micro-batch's size, for a mean) before the backward pass, so that every
sample's gradient is its own loss's, as without accumulation.

What the step needs of the run (the clipping rule, the random streams, the ledger, the settings) comes from a DP
callback such as :class:`~lightning_oso.OSODP` in one :class:`~lightning_oso.strategies.PrivacyPlan`
(``configure_privacy``). The strategy records each released step in the plan's ledger with its mechanism ``(nu, q)``
and never calls the callback; the callback reads what it needs back (the sampling rate, the diagnostics) from the
strategy's attributes, and does the accounting's checks and the budget stop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from typing_extensions import override

from lightning_oso import checks, per_sample
from lightning_oso.clipping import ClippingRule
from lightning_oso.data import PoissonBatchSampler, poisson_loader
from lightning_oso.errors import PrivacyConfigurationError, PrivateStepRefused
from lightning_oso.per_sample import GRAD_SAMPLE_MODES, GradientHooks, loss_scale, norm_bounds
from lightning_oso.randomness import RunRandomness
from lightning_oso.step import ClippedSums, SanitisedStep, clip_and_sum, laid_end_to_end, release
from lightning_oso.strategies.plan import PrivacyPlan
from lightning_oso.strategies.release import ProcessRelease

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

# The mixin comes before a Lightning Strategy in its subclasses' bases; type-checked as one (at run time a plain
# class, so that the strategy's own base decides the method resolution order).
if TYPE_CHECKING:
    _StrategyBase = Strategy
else:
    _StrategyBase = object


class PrivateTraining(_StrategyBase):
    """The private step, as a mixin for a Lightning ``Strategy`` (single device, or one process of DDP).

    It relies on the strategy's ``global_rank`` and ``world_size``: each process Poisson-samples its own shard of
    the records, the weighted sums of all processes are added up, and rank 0 alone adds the noise, so every Gaussian
    is added once globally and every process ends the step with the same sanitised values.
    """

    if TYPE_CHECKING:  # set by SingleDeviceStrategy, properties of ParallelStrategy
        global_rank: int
        world_size: int

    def _init_privacy(self) -> None:
        #: what the DP callback planned (rule, randomness, ledger, settings); ``None``: a plain strategy
        self.plan: PrivacyPlan | None = None
        self.num_samples: int | None = None
        self.expected_batch_size: float | None = None  # B = qN
        self.sample_rate: float | None = None
        self._hooks: GradientHooks | None = None
        self._batch_size: int | None = None
        self._training_data: tuple[Any, Any] | None = None  # (dataset, collate_fn): the structure for the checks
        #: micro-batches per optimizer step (the trainer's accumulate_grad_batches), set with the training loader
        self.accumulation = 1
        #: optimizer steps per epoch of the Poisson-sampled training loader
        self.steps_per_epoch: int | None = None
        self._clipped: ClippedSums | None = None  # the logical batch's clipped sums so far (never released as such)
        self._lr_factor: Tensor | None = None  # the rule's learning-rate factor from the step being taken
        #: opt-in, non-private statistics of the last step (docs/algorithms.md, "What is private"); empty unless the
        #: plan's collect_diagnostics
        self.diagnostics: dict[str, Tensor] = {}
        #: the noise and the sum across processes of each release (``release.ProcessRelease``)
        self.process_release = ProcessRelease(self)

    # ------------------------------------------------------------------ the plan, from the callback
    def configure_privacy(self, plan: PrivacyPlan) -> None:
        """Take the DP callback's plan (:class:`~lightning_oso.strategies.PrivacyPlan`), whole: the run's random
        streams, its ledger, the clipping rule once training starts, and the settings. The strategy only reads it.

        Raises:
            PrivacyConfigurationError: for a ``grad_sample_mode`` not in ``GRAD_SAMPLE_MODES``.
        """
        mode = plan.grad_sample_mode
        if mode not in GRAD_SAMPLE_MODES:
            raise PrivacyConfigurationError(
                f"grad_sample_mode={mode!r} is not a way to compute per-sample gradients. Pass one of "
                f"{GRAD_SAMPLE_MODES}."
            )
        self.plan = plan

    @property
    def privacy_configured(self) -> bool:
        return self.plan is not None

    @property
    def rule(self) -> ClippingRule | None:
        """The plan's clipping rule (``None`` before training starts, or without a plan)."""
        return self.plan.rule if self.plan is not None else None

    @property
    def randomness(self) -> RunRandomness | None:
        """The plan's random streams (``None`` without a plan)."""
        return self.plan.randomness if self.plan is not None else None

    @property
    def loss_reduction(self) -> str:
        """How the user's loss reduces over the batch (the plan's; ``"mean"`` without one)."""
        return self.plan.loss_reduction if self.plan is not None else "mean"

    @property
    def executed_steps(self) -> int:
        """The ledger's executed-step counter (0 before the plan holds a ledger)."""
        ledger = self.plan.ledger if self.plan is not None else None
        return ledger.steps if ledger is not None else 0

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not self.privacy_configured or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader  # validation / test / predict loaders: no privacy cost, left alone
        if not isinstance(dataloader, torch.utils.data.DataLoader):
            raise TypeError(
                "the training data must come from a torch DataLoader to be Poisson-sampled; got "
                f"{type(dataloader).__name__}"
            )
        self._training_data = (dataloader.dataset, dataloader.collate_fn)
        self.accumulation = int(trainer.accumulate_grad_batches)
        loader = poisson_loader(
            dataloader,
            seed=self.randomness,
            rank=self.global_rank,
            world_size=self.world_size,
            first_step=self.executed_steps,
            accumulation=self.accumulation,
        )
        sampler = cast(PoissonBatchSampler, loader.batch_sampler)
        self.num_samples = sampler.num_samples
        self.sample_rate = sampler.sample_rate
        self.steps_per_epoch = sampler.steps
        # B = qN over all processes (docs/algorithms.md, "What is private")
        self.expected_batch_size = self.sample_rate * self.num_samples
        return loader

    # ------------------------------------------------------------------ hooks
    def attach_hooks(self) -> None:
        """Attach the per-sample hooks to the user's module (its class and forward stay as they are)."""
        if self._hooks is None and self.lightning_module is not None:
            # attached for a sum whatever the loss's reduction: ``backward`` scales a mean loss by the batch size
            # before the backward pass (``loss_scale``), so the hooks multiply nothing back
            mode = self.plan.grad_sample_mode if self.plan is not None else "book_keeping"
            self._hooks = per_sample.attach(self.lightning_module, mode, "sum")

    @property
    def hooks(self) -> GradientHooks | None:
        """The per-sample hooks attached to the user's module (``None`` before :meth:`attach_hooks`)."""
        return self._hooks

    @property
    def _attached_hooks(self) -> GradientHooks:
        if self._hooks is None:
            raise RuntimeError(
                "the private step has no per-sample hooks to read. Train with a DP callback in "
                "Trainer(callbacks=[...]): it attaches them when the fit starts (or call attach_hooks())."
            )
        return self._hooks

    def detach_hooks(self) -> None:
        per_sample.detach(self._hooks)
        self._hooks = None

    @override
    def teardown(self) -> None:
        self.detach_hooks()
        super().teardown()

    @override
    def on_train_start(self) -> None:
        """Once per fit, before the first private step: the consistency checks of the model against the per-sample
        path (``checks``), on a synthetic batch shaped like the first training record, never on a private one."""
        super().on_train_start()
        self._clipped = None  # nothing of an interrupted fit's logical batch carries over
        if self.rule is not None and self._hooks is not None and self._training_data is not None:
            params = [p for group in self.optimizers[0].param_groups for p in group["params"] if p.requires_grad]
            checks.check_before_training(self, params, *self._training_data)

    # ------------------------------------------------------------------ the private step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        self._batch_size = _leading_dim(batch)
        if self._hooks is not None:
            # nothing from an earlier forward without a step may mix into this one; on the fast path, no autograd
            # weight gradients: the private step replaces them (until end_backward)
            self._hooks.start_forward()
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward pass of the loss scaled so that every record's own loss has the weight 1, then this
        (micro-)batch's clipped sums are added to the logical batch's (``step.clip_and_sum``) and its per-sample
        state is let go: peak memory is that of one micro-batch.

        Raises:
            PrivacyConfigurationError: a mean loss returned in 16 bits (``loss_scale.check_loss_dtype``), before the
                backward pass.
        """
        if self.rule is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # Lightning divided the micro-batch's loss by k, and a mean divides by the micro-batch's size n: both are
        # multiplied back before the backward pass, so that every record's output gradients are its own loss's before
        # any 16-bit layer rounds them (a 1/n rounded there would make each record's rounding depend on n, which is
        # private), and the clipping threshold means the same with or without accumulation
        hooks, module = self._attached_hooks, self.lightning_module
        records = hooks.records_in_forward(module) if module is not None else 0
        scaled = loss_scale.scale_loss(closure_loss, self.loss_reduction, records, self.accumulation)
        try:
            with hooks.during_backward():
                super().backward(scaled, optimizer, *args, **kwargs)
        finally:
            hooks.end_backward()  # the trainable parameters are those that require gradients again
        self._add_micro_batch(optimizer if optimizer is not None else self.optimizers[0], records)
        return closure_loss.detach()

    def _trainable(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]

    def _add_micro_batch(self, optimizer: torch.optim.Optimizer, records: int | None = None) -> None:
        """Add the last backward pass's clipped sums to the logical batch's (``records``: the batch size the loss was
        scaled by, if it was)."""
        if self.rule is None:
            raise RuntimeError("the private step needs a DP callback's rule")
        source = self._attached_hooks.source(self._trainable(optimizer))
        if source.empty and self._batch_size != 0:
            raise RuntimeError(
                "no per-sample gradients after training_step: it returned no loss, or the loss does not depend on "
                "the trainable parameters. Under DP every step, including those on empty Poisson batches, must "
                "return the loss to backpropagate."
            )
        if records is not None and not source.empty and source.batch_size != records:
            source.release()
            raise RuntimeError(
                f"the trainable layers' outputs had up to {records} rows along dim 0 in the forward pass, but the "
                f"per-sample gradients of the backward pass are {source.batch_size}: a trainable layer ran on inputs "
                "with another batch dimension than the others (e.g. a flattened [n*T, ...] input, or an output that "
                "the loss does not use), so the loss could not be scaled by the number of records. Every trainable "
                "layer must see one row per record."
            )
        with norm_bounds.exact_float32_products(self.root_device):  # norms and sums in float32 or better
            self._clipped = clip_and_sum(source, self.rule, into=self._clipped)

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        if self.rule is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        self._lr_factor = None

        def private_closure() -> Any:
            try:
                loss = closure()  # forward + backward: the hooks keep what the per-sample norms and sums need
            finally:
                if self._hooks is not None:
                    self._hooks.end_backward()
            # the released step is not kept: the rule took what it learns from, p.grad holds the gradients, and its
            # float64 values are freed before the optimizer steps
            self.privatise(optimizer)
            return loss

        result = super().optimizer_step(optimizer, private_closure, model, **kwargs)
        # the rule learned from the released step in privatise; its learning-rate factor is rho_{t+1} / rho_t, for the
        # next step (this one stepped with rho_t)
        lr_factor, self._lr_factor = self._lr_factor, None
        if lr_factor is not None:
            # a float: a learning rate stays what the user gave (a float, or their tensor), and the optimizer reads a
            # float once a step instead of a tensor's value once per parameter (one host read a step on a GPU, which
            # an optimizer given a tensor makes anyway)
            factor = float(lr_factor)
            for group in optimizer.param_groups:  # rho_t, applied multiplicatively (docs/algorithms.md, "OSO-DPSGD")
                group["lr"] = group["lr"] * factor
        return result

    def privatise(self, optimizer: torch.optim.Optimizer) -> SanitisedStep:
        """Replace each trainable parameter's gradient by the sanitised clipped-gradient query of the logical batch
        (its micro-batches' clipped sums, added up after each backward pass), once per optimizer step.

        Returns the released step (``step.SanitisedStep``): the sanitised vector queries per parameter
        (``[k, *shape]``; row ``rule.GRADIENT`` is the new gradient) and the rule's sanitised scalar queries (``[m]``,
        or ``None`` if it has none).

        A record whose per-sample gradient is not finite gets weight 0 (``step.clip_and_sum``): no record's values
        decide whether the step happens.

        Raises:
            PrivateStepRefused: the logical batch did not come in exactly ``accumulation`` micro-batches (a
                training_step that returned no loss, or a loop that stepped early): nothing is released or charged.
        """
        if self.rule is None or self.expected_batch_size is None:
            raise RuntimeError("the private step needs a DP callback's rule and a Poisson-sampled training loader")
        params = self._trainable(optimizer)
        clipped, self._clipped = self._clipped, None  # a step's sums never carry over to the next, even if refused
        if clipped is None:  # no backward pass went through this strategy's backward (e.g. no loss)
            self._add_micro_batch(optimizer)
            clipped, self._clipped = self._clipped, None
        assert clipped is not None
        if clipped.micro_batches != self.accumulation:
            raise PrivateStepRefused(
                f"the optimizer step came after {clipped.micro_batches} micro-batch(es) of a logical batch that has "
                f"{self.accumulation} (accumulate_grad_batches): a part of a Poisson batch is not a Poisson sample, "
                "so the step is refused and nothing of it is released. Every training_step must return the loss, "
                "and the epoch must hold whole logical batches (limit_train_batches, fast_dev_run and a checkpoint "
                "saved between two optimizer steps can cut one)."
            )
        plan = self.plan
        assert plan is not None  # a rule comes with a plan
        if plan.collect_diagnostics:
            self._observe_norms(torch.cat(clipped.norms))
        with norm_bounds.exact_float32_products(self.root_device):  # sums and noise in float32 or better
            wiring = self.process_release.wiring(self._record_step if plan.ledger is not None else None)
            released = release(clipped, self.rule, self.expected_batch_size, wiring)
        # the rule learns from sanitised values only (docs/algorithms.md, "What is private"): post-processing, no
        # privacy cost. Here, while the raw sums are alive, because OSO reads its previous step's vectors and lets
        # them go before it copies this step's deferred row out of the sums: the three are never alive together
        factor = self.rule.update(released)
        # an optimizer that runs its closure more than once a step (each run a release, charged) gets every release's
        # factor, as C_t got every release's update
        if factor is not None:
            self._lr_factor = factor if self._lr_factor is None else self._lr_factor * factor
        del clipped  # the raw sums, freed before the gradients are written: one model-sized buffer less at the peak
        # the ledger has charged the step (release's write-ahead record): the gradients may now be written, cast to
        # the parameters' dtype (bfloat16 under precision="bf16-true") only here, and always as copies: a user's
        # hook, gradient clipping or the optimizer may edit p.grad, while the rule keeps the released values
        write_gradients(params, released.gradients)
        return released

    def _record_step(self) -> None:
        """The ledger's write-ahead record of the step being released, with its mechanism: ``nu`` of the rule that
        noises it, ``q`` of the loader that sampled it."""
        rule, ledger = self.rule, self.plan.ledger if self.plan is not None else None
        if rule is None or ledger is None or self.sample_rate is None:
            raise RuntimeError("a step is released before the plan holds its rule and ledger and the loader its rate")
        ledger.record_step(rule.noise_multiplier, self.sample_rate)

    def _observe_norms(self, norms: Tensor) -> None:
        if self.rule is not None:
            self.diagnostics = _nonprivate_diagnostics(norms, self.rule.clip)


def write_gradients(params: list[Tensor], gradients: list[Tensor]) -> None:
    """``p.grad`` = a copy of each released gradient in ``p``'s dtype. Where the gradients are views of one buffer
    (the release's) and the parameters share a dtype and device, one conversion of the buffer, whose views become the
    gradients: one operation instead of one per parameter (each ``p.grad`` is still its own tensor of ``p``'s shape,
    contiguous)."""
    flat = laid_end_to_end(gradients)
    if (
        flat is not None
        and params
        and len({(p.dtype, p.device) for p in params}) == 1
        and all(p.shape == g.shape for p, g in zip(params, gradients))
    ):
        converted = flat.to(device=params[0].device, dtype=params[0].dtype, copy=True)
        for p, part in zip(params, converted.split([g.numel() for g in gradients])):
            p.grad = part.view(p.shape)
        return
    for p, gradient in zip(params, gradients):
        p.grad = gradient.to(p.dtype, copy=True)


def _nonprivate_diagnostics(norms: Tensor, clip: Tensor) -> dict[str, Tensor]:
    """Statistics of the raw per-sample norms: NOT differentially private (logged only on explicit opt-in).
    ``zeroed_records``: how many records had a norm that is not finite (NaN or inf), hence weight 0 in every sum;
    nothing else tells."""
    stats = {"batch_size": torch.tensor(float(norms.shape[0]))}
    stats["zeroed_records"] = (~torch.isfinite(norms)).sum().float()
    if norms.numel():
        stats["clipped_fraction"] = (norms > clip).float().mean()
        stats["grad_norm_median"] = norms.median().float()
        stats["grad_norm_max"] = norms.max().float()
    return stats


def _leading_dim(batch: Any) -> int | None:
    """Size of the first tensor's leading dimension in a (nested) batch, or None if it holds no tensor."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = _leading_dim(item)
            if size is not None:
                return size
    return None
