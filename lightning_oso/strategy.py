"""The Strategy that makes a single-device Lightning run differentially private.

It owns the mechanics of a private step, in the order of spec section 1:

1. ``process_dataloader``: the training loader becomes a Poisson-sampled one (``data.poisson_loader``).
2. Hooks attached to the user's module without wrapping it keep what backward needs for per-sample norms and sums:
   each layer's input and output gradient (``book_keeping.BookKeeping``, the default fast path) or, with
   ``grad_sample_mode="hooks"``, every per-sample gradient (Opacus' hooks fill ``p.grad_sample``).
3. ``optimizer_step`` runs Lightning's closure (forward + backward), then replaces every gradient by its
   sanitised value (per-sample norms -> the clipping rule's weights -> weighted sums -> ``private_step`` noise and
   scaling), *before* the ``on_before_optimizer_step`` hooks and the optimizer see it, then steps, then lets the
   rule update itself (``C_t``) and the learning rate (``rho_t``) from the sanitised values.

The privacy settings (rule, seeds) come from a DP callback such as :class:`~lightning_oso.OSODP`, which also does
the accounting. ``Trainer(callbacks=[OSODP(...)])`` installs this strategy by itself on a single device;
``Trainer(strategy=DPStrategy(), callbacks=[OSODP(...)])`` is the explicit form.

All of this lives in :class:`PrivateTraining`, which knows one thing of several processes: their sums are added
up (``sum_across_processes``) before the division by ``B``, and only rank 0 adds noise. On one device both are
trivial; ``lightning_oso.ddp.DPDDPStrategy`` puts the same mechanics on Lightning's DDP.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage
from opacus.grad_sample import GradSampleHooks
from torch import Tensor
from typing_extensions import override

from lightning_oso import _compat, checks, private_step
from lightning_oso.book_keeping import BookKeeping
from lightning_oso.data import poisson_loader
from lightning_oso.errors import PrivateStepRefused
from lightning_oso.randomness import NOISE, RunRandomness

#: How per-sample norms and sums are computed: the book-keeping fast path, or Opacus' per-sample gradients.
GRAD_SAMPLE_MODES = ("book_keeping", "hooks")


class PrivateTraining:
    """The private step, as a mixin for a Lightning ``Strategy`` (single device, or one process of DDP).

    It relies on the strategy's ``global_rank`` and ``world_size``: each process Poisson-samples its own shard of
    the records, the weighted sums of all processes are added up, and rank 0 alone adds the noise, so every Gaussian
    is added once globally and every process ends the step with the same sanitised values.
    """

    def _init_privacy(self) -> None:
        self.rule = None  # the clipping rule; set by the DP callback before the first step
        #: the run's random streams (noise and sampling, keyed per step); set by the DP callback
        self.randomness: RunRandomness | None = None
        #: the privacy ledger's step counter and write-ahead record (``ledger.RunLedger``); set by the DP callback
        self.ledger = None
        self.loss_reduction = "mean"
        self.num_samples: int | None = None
        self.expected_batch_size: float | None = None  # B = qN
        self.sample_rate: float | None = None
        self.grad_sample_mode = "book_keeping"
        self._hooks: GradSampleHooks | BookKeeping | None = None
        self._batch_size: int | None = None
        #: opt-in, non-private statistics of the last step (spec section 0); empty unless collect_diagnostics
        self.collect_diagnostics = False
        self._noise_stream: tuple | None = None  # (step, generator) of the step being privatised
        self._training_data: tuple[Any, Any] | None = None  # (dataset, collate_fn): the structure for the checks
        self.diagnostics: dict[str, Tensor] = {}

    @property
    def adds_noise(self) -> bool:
        """Whether this process draws the noise: rank 0 only, so each Gaussian is added once globally."""
        return self.global_rank == 0

    def sum_across_processes(self, tensors: list[Tensor]) -> list[Tensor]:
        """The sums of all processes (in place; identity on one process): one all-reduce per dtype."""
        if self.world_size == 1:
            return tensors
        for dtype in {t.dtype for t in tensors}:
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in group])
            torch.distributed.all_reduce(flat)
            for t, chunk in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(chunk.view_as(t))
        return tensors

    # ------------------------------------------------------------------ configuration from the callback
    def configure_privacy(
        self,
        randomness: RunRandomness,
        loss_reduction: str = "mean",
        grad_sample_mode: str = "book_keeping",
    ) -> None:
        """The run's random streams (``randomness.RunRandomness``: every step's noise and Poisson draw come from a
        stream keyed on the ledger's step counter), the reduction of the user's loss over the batch, and how
        per-sample norms and sums are computed (one of ``GRAD_SAMPLE_MODES``)."""
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}, got {grad_sample_mode!r}")
        self.randomness = randomness
        self.loss_reduction = loss_reduction
        self.grad_sample_mode = grad_sample_mode

    @property
    def privacy_configured(self) -> bool:
        return self.randomness is not None

    @property
    def executed_steps(self) -> int:
        """The ledger's executed-step counter (0 before the callback connects a ledger)."""
        return self.ledger.steps if self.ledger is not None else 0

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not self.privacy_configured or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader  # validation / test / predict loaders: no privacy cost, left alone
        if not isinstance(dataloader, torch.utils.data.DataLoader):
            raise TypeError(
                f"the training data must come from a torch DataLoader to be Poisson-sampled; got {type(dataloader).__name__}"
            )
        self._training_data = (dataloader.dataset, dataloader.collate_fn)
        loader = poisson_loader(
            dataloader,
            seed=self.randomness,
            rank=self.global_rank,
            world_size=self.world_size,
            first_step=self.executed_steps,
        )
        self.num_samples = loader.batch_sampler.num_samples
        self.sample_rate = loader.batch_sampler.sample_rate
        self.expected_batch_size = self.sample_rate * self.num_samples  # B = qN over all processes (spec section 0)
        return loader

    # ------------------------------------------------------------------ hooks
    def attach_hooks(self) -> None:
        """Attach the per-sample hooks to the user's module (its class and forward stay as they are)."""
        if self._hooks is not None:
            return
        if self.grad_sample_mode == "book_keeping":
            self._hooks = BookKeeping(self.lightning_module, loss_reduction=self.loss_reduction)
            return
        # Opacus' full backward hooks on the first layer fire although the input needs no gradient; harmless
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        self._hooks = GradSampleHooks(
            self.lightning_module, batch_first=True, loss_reduction=self.loss_reduction, strict=False
        )
        self._hooks.enable_hooks()

    def detach_hooks(self) -> None:
        if isinstance(self._hooks, BookKeeping):
            self._hooks.remove()
        elif self._hooks is not None:
            self._hooks.cleanup()
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
        if self.rule is not None and self._hooks is not None and self._training_data is not None:
            params = [p for group in self.optimizers[0].param_groups for p in group["params"] if p.requires_grad]
            checks.check_before_training(self, params, *self._training_data)

    # ------------------------------------------------------------------ the private step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        self._batch_size = _leading_dim(batch)
        if isinstance(self._hooks, BookKeeping):
            self._hooks.clear()  # nothing from an earlier forward without a step may mix into this one
            self._hooks.freeze()  # no autograd weight gradients: the private step replaces them (until unfreeze)
        return super().training_step(*args, **kwargs)

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
        released: dict[str, Any] = {}

        def private_closure() -> Any:
            try:
                loss = closure()  # forward + backward: the hooks keep what the per-sample norms and sums need
            finally:
                if isinstance(self._hooks, BookKeeping):
                    self._hooks.unfreeze()
            released["sanitised"], released["scalars"] = self.privatise(optimizer)
            return loss

        result = super().optimizer_step(optimizer, private_closure, model, **kwargs)
        # the rule learns from sanitised values only (spec section 0): post-processing, no privacy cost
        lr_factor = self.rule.update(released["sanitised"], released["scalars"])
        if lr_factor is not None:
            for group in optimizer.param_groups:  # rho_t, applied multiplicatively (spec section 1, step 7)
                group["lr"] = group["lr"] * lr_factor
        return result

    def privatise(self, optimizer: torch.optim.Optimizer) -> tuple[list[Tensor], Tensor | None]:
        """Replace each trainable parameter's gradient by the sanitised clipped-gradient query.

        Returns the sanitised vector queries per parameter (``[k, *shape]``; row ``rule.GRADIENT`` is the new
        gradient) and the rule's sanitised scalar queries (``[m]``, or ``None`` if it has none).
        """
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        per_sample = (
            _BookKeepingSource(self._hooks, params)
            if isinstance(self._hooks, BookKeeping)
            else _GradSampleSource(params)
        )
        if per_sample.empty and self._batch_size != 0:
            raise RuntimeError(
                "no per-sample gradients after training_step: it returned no loss, or the loss does not depend on "
                "the trainable parameters. Under DP every step, including those on empty Poisson batches, must "
                "return the loss to backpropagate."
            )
        norms = per_sample.norms()
        weights = self.rule.weights(norms)
        if self.collect_diagnostics:
            self.diagnostics = _nonprivate_diagnostics(norms, self.rule.clip)
        # parameters not used in this step get zero sums, still noised: whether a parameter was used may depend on
        # the data
        sums = per_sample.weighted_sums(weights)
        per_sample.release()
        contributions = self.rule.scalar_queries(norms)
        scalar_sums = [contributions.sum(dim=0)] if contributions is not None else []
        # a NaN/inf per-sample gradient has a NaN/inf norm: its sensitivity is unbounded, so such a step must not be
        # released, not even noised over. The count travels with the sums, so every process refuses the same step.
        nonfinite = (~torch.isfinite(norms)).sum()
        status = nonfinite.to(norms.dtype).reshape(1)
        noisy = self.add_noise(sums, self.rule.noise_stds())
        noisy_scalars = self.add_noise(scalar_sums, self.rule.scalar_noise_stds()) if scalar_sums else []
        totals = self.sum_across_processes([*noisy, *noisy_scalars, status])
        # the one host read of a step, after the sums and noise are queued (on a GPU the device keeps working while
        # the host waits)
        if bool(status.any()):
            self._refuse_step(int(nonfinite), norms.shape[0])
        # the write-ahead record: charged (and on disk) before anything of the step can leave the process
        if self.ledger is not None:
            self.ledger.record_step()
        sanitised = private_step.average(totals[: len(sums)], self.expected_batch_size)
        for p, s in zip(params, sanitised):
            p.grad = s[self.rule.GRADIENT].to(p.dtype)
        scalars = private_step.average(totals[len(sums) : -1], self.expected_batch_size)[0] if scalar_sums else None
        return sanitised, scalars

    def add_noise(self, sums: list[Tensor], stds: Tensor) -> list[Tensor]:
        """Gaussian noise ``N(0, stds[k]^2)`` on row ``k`` of every sum, drawn by rank 0 only: the other processes add
        nothing, so after the sum across processes each Gaussian is there exactly once."""
        if not self.adds_noise:
            return sums
        return private_step.add_gaussian_noise(sums, stds, self._noise_generator())

    def _noise_generator(self):
        """This step's noise stream, keyed on the ledger's executed-step counter (never reused across steps,
        resumes or crashes: see ``randomness``). Scalar queries draw from it after the vector ones."""
        if self._noise_stream is None or self._noise_stream[0] != self.executed_steps:
            generator = self.randomness.generator(NOISE, self.executed_steps, device=self.root_device)
            self._noise_stream = (self.executed_steps, generator)
        return self._noise_stream[1]

    def _refuse_step(self, nonfinite: int, size: int) -> None:
        step = self.lightning_module.trainer.global_step
        if nonfinite:
            raise PrivateStepRefused(_NON_FINITE.format(count=nonfinite, size=size, step=step))
        raise PrivateStepRefused(
            f"training step {step} was refused by another process (non-finite per-sample gradients; its error says "
            "more): no process applied it"
        )


class DPStrategy(PrivateTraining, SingleDeviceStrategy):
    """Single-device strategy running the private step of the attached DP callback.

    Args:
        device: the device to train on (as for ``SingleDeviceStrategy``); by default the accelerator's.
        **kwargs: passed to ``SingleDeviceStrategy``.

    Example::

        trainer = L.Trainer(strategy=DPStrategy(), callbacks=[OSODP(target_epsilon=3.0)])
    """

    strategy_name = "dp_single_device"

    def __init__(self, device: str | torch.device = "cpu", **kwargs: Any) -> None:
        super().__init__(device=device, **kwargs)
        self._init_privacy()

    @classmethod
    def from_single_device(cls, strategy: SingleDeviceStrategy) -> DPStrategy:
        """A DPStrategy that takes over a connected ``SingleDeviceStrategy`` (device, accelerator, precision, IO)."""
        new = cls(
            device=strategy.root_device,
            accelerator=strategy.accelerator,
            checkpoint_io=_compat.checkpoint_io(strategy),
            precision_plugin=_compat.precision_plugin(strategy),
        )
        if strategy.lightning_module is not None:
            new.connect(strategy.lightning_module)
        return new


class _GradSampleSource:
    """Per-sample norms and sums from the per-sample gradients Opacus' hooks left in ``p.grad_sample``."""

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self.samples = [getattr(p, "grad_sample", None) for p in params]
        for p, gs in zip(params, self.samples):
            if gs is None and p.grad is not None:
                raise RuntimeError(_NO_PER_SAMPLE.format(shape=tuple(p.shape)))
            if isinstance(gs, list):
                raise RuntimeError(_SEVERAL_BACKWARDS)
        self.present = [gs for gs in self.samples if gs is not None]
        self.empty = not self.present
        self.batch_size = self.present[0].shape[0] if self.present else 0

    def norms(self) -> Tensor:
        if self.present:
            return private_step.per_sample_norms(self.present)
        return torch.zeros(0, dtype=self.params[0].dtype, device=self.params[0].device)

    def weighted_sums(self, weights: Tensor) -> list[Tensor]:
        full = [
            gs if gs is not None else torch.zeros((weights.shape[0], *p.shape), dtype=p.dtype, device=p.device)
            for p, gs in zip(self.params, self.samples)
        ]
        return private_step.weighted_sums(full, weights)

    def release(self) -> None:
        for p in self.params:
            p.grad_sample = None


class _BookKeepingSource:
    """Per-sample norms and sums from the book-keeping hooks (``book_keeping.BookKeeping``)."""

    def __init__(self, hooks: BookKeeping, params: list[Tensor]) -> None:
        self.hooks, self.params = hooks, params
        for p in params:
            if id(p) not in hooks.covered and p.grad is not None:
                raise RuntimeError(_NO_PER_SAMPLE.format(shape=tuple(p.shape)))
        if hooks.several_backward_passes:
            raise RuntimeError(_SEVERAL_BACKWARDS)
        self.batch_size = hooks.batch_size or 0
        self.empty = hooks.batch_size is None

    def norms(self) -> Tensor:
        if self.empty:
            return torch.zeros(0, dtype=self.params[0].dtype, device=self.params[0].device)
        return self.hooks.norms()

    def weighted_sums(self, weights: Tensor) -> list[Tensor]:
        return self.hooks.weighted_sums(self.params, weights)

    def release(self) -> None:
        self.hooks.clear()


_NO_PER_SAMPLE = (
    "a parameter of shape {shape} received a gradient but no per-sample gradient: it is not inside the trained "
    "LightningModule, or it is used outside the forward of the layer that owns it (e.g. a tied weight read "
    "directly), where no per-sample hook can see it. Every optimised parameter must belong to a layer with "
    "per-sample gradients."
)
_NON_FINITE = (
    "the per-sample gradients of {count} of the {size} samples in training step {step} are not finite (NaN or inf): "
    "the step was refused and training stopped, so no parameter, optimizer state or C_t was changed by it and "
    "nothing was released (noising a NaN/inf over would not be private: its sensitivity is unbounded). Check the loss "
    "and the data for NaN/inf values or lower the learning rate; a checkpoint from before this step resumes cleanly."
)
_SEVERAL_BACKWARDS = (
    "several backward passes before one optimizer step (gradient accumulation or a training_step calling backward "
    "twice): not supported under DP"
)


def _nonprivate_diagnostics(norms: Tensor, clip: Tensor) -> dict[str, Tensor]:
    """Statistics of the raw per-sample norms: NOT differentially private (logged only on explicit opt-in)."""
    stats = {"batch_size": torch.tensor(float(norms.shape[0]))}
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
