"""The Strategy that makes a single-device Lightning run differentially private.

It owns the mechanics of a private step, in the order of spec section 1:

1. ``process_dataloader``: the training loader becomes a Poisson-sampled one (``data.poisson_loader``).
2. Opacus' grad-sample hooks, attached to the user's module without wrapping it, fill ``p.grad_sample``
   during backward.
3. ``optimizer_step`` runs Lightning's closure (forward + backward), then replaces every gradient by its
   sanitised value (``private_step.sanitise`` with the clipping rule's weights and noise), *before* the
   ``on_before_optimizer_step`` hooks and the optimizer see it, then steps, then lets the rule update itself
   (``C_t``) and the learning rate (``rho_t``) from the sanitised values.

The privacy settings (rule, seeds) come from a DP callback such as :class:`~lightning_oso.OSODP`, which also does
the accounting. ``Trainer(callbacks=[OSODP(...)])`` installs this strategy by itself on a single device;
``Trainer(strategy=DPStrategy(), callbacks=[OSODP(...)])`` is the explicit form.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage
from opacus.grad_sample import GradSampleHooks
from torch import Tensor

from lightning_oso import private_step
from lightning_oso.data import poisson_loader


class DPStrategy(SingleDeviceStrategy):
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
        self.rule = None  # the clipping rule; set by the DP callback before the first step
        self.sampling_seed: int | None = None
        self.noise_generator: torch.Generator | None = None
        self.loss_reduction = "mean"
        self.num_samples: int | None = None
        self.expected_batch_size: float | None = None  # B = qN
        self.sample_rate: float | None = None
        self._hooks: GradSampleHooks | None = None
        self._batch_size: int | None = None
        #: opt-in, non-private statistics of the last step (spec section 0); empty unless collect_diagnostics
        self.collect_diagnostics = False
        self.diagnostics: dict[str, Tensor] = {}

    @classmethod
    def from_single_device(cls, strategy: SingleDeviceStrategy) -> "DPStrategy":
        """A DPStrategy that takes over a connected ``SingleDeviceStrategy`` (device, accelerator, precision, IO)."""
        new = cls(
            device=strategy.root_device,
            accelerator=strategy.accelerator,
            checkpoint_io=strategy._checkpoint_io,
            precision_plugin=strategy._precision_plugin,
        )
        if strategy.lightning_module is not None:
            new.connect(strategy.lightning_module)
        return new

    # ------------------------------------------------------------------ configuration from the callback
    def configure_privacy(self, sampling_seed: int, noise_seed: int, loss_reduction: str = "mean") -> None:
        """Seeds of the sampling and noise randomness, and the reduction of the user's loss over the batch."""
        self.sampling_seed = sampling_seed
        self.noise_generator = torch.Generator(device=self.root_device).manual_seed(noise_seed)
        self.loss_reduction = loss_reduction

    @property
    def privacy_configured(self) -> bool:
        return self.sampling_seed is not None

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not self.privacy_configured or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader  # validation / test / predict loaders: no privacy cost, left alone
        if not isinstance(dataloader, torch.utils.data.DataLoader):
            raise TypeError(
                f"the training data must come from a torch DataLoader to be Poisson-sampled; got {type(dataloader).__name__}"
            )
        self.num_samples = len(dataloader.dataset)
        loader = poisson_loader(dataloader, seed=self.sampling_seed)
        self.sample_rate = loader.batch_sampler.sample_rate
        self.expected_batch_size = self.sample_rate * self.num_samples  # B = qN (spec section 0)
        return loader

    # ------------------------------------------------------------------ hooks
    def attach_hooks(self) -> None:
        """Attach Opacus' per-sample gradient hooks to the user's module (its class and forward stay as they are)."""
        if self._hooks is None:
            # Opacus' full backward hooks on the first layer fire although the input needs no gradient; harmless
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            self._hooks = GradSampleHooks(
                self.lightning_module, batch_first=True, loss_reduction=self.loss_reduction, strict=False
            )
            self._hooks.enable_hooks()

    def detach_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.cleanup()
            self._hooks = None

    def teardown(self) -> None:
        self.detach_hooks()
        super().teardown()

    # ------------------------------------------------------------------ the private step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        self._batch_size = _leading_dim(batch)
        return super().training_step(*args, **kwargs)

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
            loss = closure()  # forward + backward: fills p.grad_sample
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
        samples = [getattr(p, "grad_sample", None) for p in params]
        for p, gs in zip(params, samples):
            if gs is None and p.grad is not None:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} received a gradient but no per-sample gradient: it is "
                    "not inside the trained LightningModule, or a layer computes it in a way Opacus' hooks cannot "
                    "see. Every optimised parameter must belong to a layer with per-sample gradients."
                )
            if isinstance(gs, list):
                raise RuntimeError(
                    "several backward passes before one optimizer step (gradient accumulation or a training_step "
                    "calling backward twice): not supported under DP"
                )
        present = [gs for gs in samples if gs is not None]
        if not present and self._batch_size != 0:
            raise RuntimeError(
                "no per-sample gradients after training_step: it returned no loss, or the loss does not depend on "
                "the trainable parameters. Under DP every step, including those on empty Poisson batches, must "
                "return the loss to backpropagate."
            )
        if present:
            norms = private_step.per_sample_norms(present)
        else:
            norms = torch.zeros(0, dtype=params[0].dtype, device=params[0].device)
        weights = self.rule.weights(norms)
        if self.collect_diagnostics:
            self.diagnostics = _nonprivate_diagnostics(norms, self.rule.clip)
        stds = self.rule.noise_stds()
        # parameters not used in this step: per-sample gradients are all zero (still noised: whether a parameter
        # was used may depend on the data)
        full = [
            gs if gs is not None else torch.zeros((norms.shape[0], *p.shape), dtype=p.dtype, device=p.device)
            for p, gs in zip(params, samples)
        ]
        sanitised = private_step.sanitise(full, weights, stds, self.expected_batch_size, self.noise_generator)
        for p, s in zip(params, sanitised):
            p.grad = s[self.rule.GRADIENT].to(p.dtype)
            p.grad_sample = None
        contributions = self.rule.scalar_queries(norms)
        scalars = None
        if contributions is not None:
            scalars = private_step.sanitise_scalars(
                contributions, self.rule.scalar_noise_stds(), self.expected_batch_size, self.noise_generator
            )
        return sanitised, scalars

    # ------------------------------------------------------------------ resume
    def privacy_state_dict(self) -> dict:
        return {
            "sampling_seed": self.sampling_seed,
            "noise_generator": self.noise_generator.get_state() if self.noise_generator is not None else None,
        }

    def load_privacy_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampling_seed = state["sampling_seed"]
        if state["noise_generator"] is not None:
            self.noise_generator = torch.Generator(device=self.root_device)
            self.noise_generator.set_state(state["noise_generator"])


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
