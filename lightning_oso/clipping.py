"""Clipping rules: the weights a rule needs from the per-sample norms, the noise it adds, and its update from
sanitised values.

A rule is a small stateful object with one interface (what the private step asks of it is ``step.StepRule``), so the
private step (``step.py``) is the same for every method; only the rule varies:

- ``weights(norms)``: ``[n, k]``, one column per weighted sum of per-sample gradients the rule releases
  (column ``GRADIENT`` = 0 is the clipped-gradient sum that becomes the parameter gradient);
- ``noise_stds()``: ``[k]``, the standard deviation of the Gaussian noise of each sum;
- ``scalar_queries(norms)``: ``[n, m]`` per-sample contributions to scalar sums (e.g. the quantile rule's count),
  or ``None``; ``scalar_noise_stds()``: ``[m]``;
- ``DEFERRED_ROWS``: how many of the last weight columns are read only through one inner product with a later,
  independent vector (OSO's direction query): they get one scalar noise draw instead of a model-sized one
  (``step.DeferredQuery``);
- ``update(released)``: post-processing of the step's sanitised values only (docs/algorithms.md, "What is
  private"); returns a factor for the learning rate(s) or ``None``.

The weight functions the rules use (plain clipping, OSO's split columns, the quantile rule's centred count) are here
too, beside the rules: this module imports ``step`` for the released values' types, never the other way round.

Every rule keeps ``noise_multiplier`` (``nu``, what the accountant sees per step) equal to the multiplier of the
single Gaussian mechanism that its queries, released together, amount to (docs/algorithms.md, "OSO-DPSGD",
"Fixed-threshold clipping", "Quantile clipping").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from typing_extensions import override

from lightning_oso.step import DeferredQuery, SanitisedStep, flat_dot, laid_end_to_end
from lightning_oso.validation import CLIP_RANGE, check_clip, check_number, check_open_interval, check_positive

# The rules' defaults, written once: the rules' constructors and the DP callbacks' signatures refer to these.
#: OSO, the OSO paper's defaults: ``C_0``, ``rho_c`` (step of ``C_t``) and ``rho_r`` (step of the learning rate).
OSO_INITIAL_CLIP = 0.1
OSO_CLIP_LR = 2.5e-3
OSO_LR_LR = 2.5e-3
#: Quantile clipping as run in the OSO paper: ``gamma`` (the median), ``C_0`` and ``eta_C``; ``sigma_b`` follows
#: the expected batch size (:func:`default_count_noise_std`).
QUANTILE_TARGET = 0.5
QUANTILE_INITIAL_CLIP = 0.1
QUANTILE_CLIP_LR = 0.2


# ----------------------------------------------------------------------------------------------------- weights
# The rules' weight functions: what each record weighs in the sums, from its per-sample norm.
def _ratio(numerator: Tensor | float, norms: Tensor) -> Tensor:
    """``numerator / norms`` (one correctly rounded division, within ``u`` relative of the exact ratio), with a
    subnormal result flushed to 0: a subnormal's rounding is not relative, and 0 is the safe side. A zero norm
    counts as the smallest normal one (its weight multiplies zeros); a NaN or infinite norm gives 0."""
    tiny = torch.finfo(norms.dtype).tiny
    ratio = numerator / norms.clamp_min(tiny)
    return torch.where(ratio >= tiny, ratio, 0.0)  # NaN >= tiny is False: a NaN norm's ratio is 0 too


def clip_weights(norms: Tensor, clip: Tensor) -> Tensor:
    """The one weight column of plain clipping (eq. 4), shape ``[n, 1]``: ``min(1, C_t / ||g_i||)``, 0 for a norm
    that is not finite."""
    return _ratio(clip, norms).clamp(max=1.0).unsqueeze(1)


def oso_split_weights(norms: Tensor, clip: Tensor) -> Tensor:
    """OSO's two sums with each record in one column only, shape ``[n, 2]``: column 0 holds the records left whole
    (``||g_i|| <= C_t``, weight 1), column 1 the unit directions of the clipped ones (weight ``1 / ||g_i||``, eq. 11).
    The clipped sum (eq. 4) is column 0 plus ``C_t`` times column 1 (:func:`clipped_sum_from_split`); a layer can
    form the two columns with one product per record (``per_sample.parts.disjoint_groups``). A norm that is not
    finite gets 0 in both columns (a NaN is neither ``<= C_t`` nor ``> C_t``; an infinite one has ``1 / inf = 0``)."""
    clipped = norms > clip
    return torch.stack([(norms <= clip).to(norms.dtype), torch.where(clipped, _ratio(1.0, norms), 0.0)], dim=1)


def clipped_sum_from_split(sums: list[Tensor], clip: Tensor) -> list[Tensor]:
    """``[unclipped sum, direction sum]`` -> ``[clipped sum, direction sum]`` per parameter, in place: row 0 gains
    ``C' x`` row 1 with ``C' = C_t (1 - 4u)`` rounded to the sums' dtype, so that a clipped record's share
    ``C' fl(1 / N_i) g_i``, rounded twice more than the one division ``fl(C_t / N_i)`` of plain clipping, stays
    below ``C_t / N_i`` times its gradient: the sensitivity ``C_t`` is kept with margin."""
    scales: dict[torch.dtype, Tensor] = {}  # one C' per dtype, not per parameter (this runs every micro-batch)
    for s in sums:
        if s.dtype not in scales:
            u = torch.finfo(s.dtype).eps / 2
            # on the device (no host read); the cast to the sums' dtype rounds by at most u, inside the margin
            scales[s.dtype] = (clip.to(torch.float64) * (1.0 - 4.0 * u)).to(s.dtype)
        unclipped, directions = s.unbind(0)  # both rows' views in one call, where s[0] and s[1] take two
        unclipped.addcmul_(directions, scales[s.dtype])
    return sums


def centred_unclipped_count(norms: Tensor, clip: Tensor) -> Tensor:
    """Per-sample contributions ``b_i - 1/2`` with ``b_i = 1[||g_i|| <= C_t]`` to the quantile rule's count, shape
    ``[n, 1]`` (docs/algorithms.md, "Quantile clipping"). Centring halves the sensitivity: adding or removing a record
    moves the sum by 1/2.

    A record whose norm is not finite (weight 0 in the clipped sum) contributes exactly 0, as if it were absent: not
    ``-1/2``, which would count it as clipped and let it move ``b~_t``. Every contribution stays in ``{-1/2, 0,
    1/2}``, so adding or removing any record still moves the sum by at most 1/2."""
    count = (norms <= clip).to(norms.dtype) - 0.5
    return torch.where(torch.isfinite(norms), count, 0.0).unsqueeze(1)


def _kept_in_range(clip: Tensor) -> Tensor:
    """An adaptive rule's next ``C_t``, kept within ``validation.CLIP_RANGE``: its multiplicative steps would take it to
    0 or to infinity after a few thousand steps in one direction, and an infinite threshold clips nothing while its
    noise ``C_t nu`` is no longer a number. Inside the range the rule is the paper's. The threshold is already
    public (a function of released values): clamping it is post-processing."""
    return clip.clamp(*CLIP_RANGE)


# ----------------------------------------------------------------------------------------------------- the rules
class ClippingRule:
    """Shared plumbing of the rules: the threshold ``C_t`` as a float64 tensor on the training device, no scalar
    queries, no learning-rate factor, and a resume check on the noise multipliers.

    Args:
        noise_multiplier: ``nu``, what the accountant sees per step.
        clip: the initial (or constant) threshold ``C_0``.
    """

    #: The sanitised query that becomes the parameter gradient.
    GRADIENT = 0
    #: How many of the last weight columns are deferred queries (``step.DeferredQuery``), read through one inner
    #: product each.
    DEFERRED_ROWS = 0
    #: Names of the attributes whose values must not change across a resume (they define the mechanism).
    _mechanism_keys: tuple[str, ...] = ("noise_multiplier",)

    def __init__(self, noise_multiplier: float, clip: float) -> None:
        self.noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        self.gradient_noise_multiplier = self.noise_multiplier
        self.clip = torch.tensor(check_clip("clip", clip), dtype=torch.float64)

    def to(self, device: torch.device) -> ClippingRule:
        self.clip = self.clip.to(device)
        return self

    def noise_multipliers(self) -> dict[str, float]:
        """The per-query noise multipliers, by the names under which they are logged (``dp/<name>``)."""
        return {"noise_multiplier": self.noise_multiplier, "gradient_noise_multiplier": self.gradient_noise_multiplier}

    # --- what the private step asks of a rule
    def weights(self, norms: Tensor) -> Tensor:
        return clip_weights(norms, self.clip.to(norms.dtype))

    def queries(self, sums: list[Tensor]) -> list[Tensor]:
        """The rule's query sums from the weighted sums of its weight columns (here the same)."""
        return sums

    def noise_stds(self) -> Tensor:
        """``C_t nu_g``: the clipped sum has sensitivity ``C_t``."""
        return (self.clip * self.gradient_noise_multiplier).reshape(1)

    def query_multipliers(self) -> list[float]:
        """Each row's noise multiplier (its noise std over its sensitivity, a host float): the exact release widens
        each row's noise by its grid's rounding at this multiplier (``exact_noise.grid_noise_std``)."""
        return [self.gradient_noise_multiplier]

    def scalar_queries(self, norms: Tensor) -> Tensor | None:
        return None

    def scalar_noise_stds(self) -> Tensor | None:
        return None

    def scalar_query_multipliers(self) -> list[float]:
        """Each scalar query's noise multiplier (std over sensitivity)."""
        return []

    def update(self, released: SanitisedStep) -> Tensor | None:
        """Post-processing of the step's released queries, once they are released (the strategy calls it before the
        optimizer steps, so that OSO can let its previous vectors go while the step's sums are alive); returns a
        learning-rate factor for the next step, or ``None`` (no change)."""
        return None

    def step_metrics(self) -> dict[str, Tensor]:
        """Sanitised per-step values worth logging (as ``dp/<name>``), beyond ``C_t`` and the learning rate."""
        return {}

    # --- resume
    def state_dict(self) -> dict:
        state = {key: getattr(self, key) for key in self._mechanism_keys}
        state["clip"] = self.clip.detach().cpu()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's ``C_t`` (and the rule's other state). The mechanism (noise multipliers) is
        this run's: a resume may change it (another target, a recalibration), and the accountant composes each
        step with the mechanism it ran with."""
        clip = state["clip"].to(device=self.clip.device, dtype=torch.float64)
        check_clip("the checkpoint's clip", float(clip))  # our updates keep C_t in range: another value was edited in
        self.clip = clip


class FixedThresholdClipping(ClippingRule):
    """Fixed-threshold DP-SGD (Abadi et al. 2016; docs/algorithms.md, "Fixed-threshold clipping"): ``C_t = C``, one
    query, ``nu_g = nu``.

    The clipped sum ``sum_i g_i min(1, C / ||g_i||)`` has sensitivity ``C`` and gets noise ``N(0, (C nu)^2 I)``.
    Works with any optimizer: the optimizer only post-processes the sanitised gradient.
    """


class FixedQuantileClipping(ClippingRule):
    """Quantile-based adaptive clipping (Andrew et al. 2021) as run in the OSO paper (docs/algorithms.md, "Quantile
    clipping").

    Per step, besides the clipped sum, the centred count ``sum_i (b_i - 1/2)`` with ``b_i = 1[||g_i|| <= C_t]``
    (sensitivity 1/2 under add/remove-one) gets noise ``N(0, sigma_b^2)``:
    ``b~_t = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / B + 1/2``, then ``C_{t+1} = C_t exp(-eta_C (b~_t - gamma))``.

    The two queries cost one Gaussian mechanism with ``1/nu^2 = 1/nu_g^2 + 1/(2 sigma_b)^2`` (the count's
    multiplier is ``sigma_b / (1/2)``), so ``nu_g = (nu^-2 - (2 sigma_b)^-2)^-1/2``; there is no ``nu_g`` when
    ``nu >= 2 sigma_b``. Opacus' AdaClip counts the raw 0/1 values (sensitivity 1) with the same formula: we do not.

    Args:
        noise_multiplier: ``nu``.
        target_quantile: ``gamma``, the fraction of unclipped samples the threshold seeks.
        count_noise_std: ``sigma_b`` (the OSO paper's runs: ``B / 20``).
        initial_clip: ``C_0``.
        clip_lr: ``eta_C``.
    """

    COUNT = 0  # the row of the scalar queries holding the count
    _mechanism_keys = ("noise_multiplier", "gradient_noise_multiplier", "count_noise_std", "target_quantile")

    def __init__(
        self,
        noise_multiplier: float,
        target_quantile: float,
        count_noise_std: float,
        initial_clip: float = QUANTILE_INITIAL_CLIP,
        clip_lr: float = QUANTILE_CLIP_LR,
    ) -> None:
        super().__init__(noise_multiplier, initial_clip)
        self.target_quantile = check_open_interval("target_quantile", target_quantile, 0, 1)
        self.count_noise_std = check_positive("count_noise_std", count_noise_std)
        self.clip_lr = check_number("clip_lr", clip_lr)
        self.gradient_noise_multiplier = quantile_gradient_noise_multiplier(noise_multiplier, count_noise_std)
        self.unclipped_fraction: Tensor | None = None  # b~_t of the last step

    @override
    def noise_multipliers(self) -> dict[str, float]:
        return {**super().noise_multipliers(), "count_noise_multiplier": 2 * self.count_noise_std}

    @override
    def scalar_queries(self, norms: Tensor) -> Tensor:
        return centred_unclipped_count(norms, self.clip.to(norms.dtype))

    @override
    def scalar_noise_stds(self) -> Tensor:
        return torch.full((1,), self.count_noise_std, dtype=torch.float64, device=self.clip.device)

    @override
    def scalar_query_multipliers(self) -> list[float]:
        return [2.0 * self.count_noise_std]  # the centred count has sensitivity 1/2

    @override
    def update(self, released: SanitisedStep) -> None:
        if released.scalars is None:
            raise ValueError("the quantile rule learns from its sanitised count: the step released no scalars")
        unclipped_fraction = released.scalars[self.COUNT].to(torch.float64) + 0.5  # b~_t (the 1/2 un-centres the count)
        self.clip = _kept_in_range(self.clip * torch.exp(-self.clip_lr * (unclipped_fraction - self.target_quantile)))
        self.unclipped_fraction = unclipped_fraction
        return None

    @override
    def step_metrics(self) -> dict[str, Tensor]:
        """``b~_t``, the noisy fraction of unclipped samples (sanitised: free to log)."""
        return {} if self.unclipped_fraction is None else {"unclipped_fraction": self.unclipped_fraction}


def default_count_noise_std(expected_batch_size: float) -> float:
    """``sigma_b = B / 20``, the count's noise in the OSO paper's runs (``B`` the expected batch size)."""
    return expected_batch_size / 20.0


def quantile_gradient_noise_multiplier(noise_multiplier: float, count_noise_std: float) -> float:
    """``nu_g = (nu^-2 - (2 sigma_b)^-2)^-1/2`` (docs/algorithms.md, "Quantile clipping"); refuses
    ``nu >= 2 sigma_b``."""
    count_multiplier = 2.0 * count_noise_std  # the centred count has sensitivity 1/2
    if not noise_multiplier < count_multiplier:
        raise ValueError(
            f"the quantile rule needs noise_multiplier < 2 * count_noise_std, got nu={noise_multiplier:.4g} and "
            f"sigma_b={count_noise_std:.4g}: the count alone would spend the whole budget. Raise count_noise_std "
            "(the default is expected_batch_size / 20), the batch size, or the privacy budget."
        )
    return (noise_multiplier**-2 - count_multiplier**-2) ** -0.5


#: Default ratio ``nu_q / nu`` of the direction query's noise multiplier (OSO paper, "Privacy Analysis": a 1%
#: increase of ``nu_g`` over ``nu`` gives ``nu_q ~= 7.124 nu``).
DEFAULT_DIRECTION_NOISE_RATIO = 7.124


def split_noise_multiplier(
    noise_multiplier: float, direction_noise_ratio: float = DEFAULT_DIRECTION_NOISE_RATIO
) -> tuple[float, float]:
    """Split one Gaussian mechanism's multiplier into OSO's two queries (OSO paper, Proposition 1).

    Returns ``(nu_g, nu_q)`` with ``nu_q = direction_noise_ratio * nu`` and ``1/nu^2 = 1/nu_g^2 + 1/nu_q^2``, so the
    clipped-gradient query (sensitivity ``C_t``, noise ``C_t nu_g``) and the direction query (sensitivity 1, noise
    ``nu_q``) released together cost exactly one Gaussian mechanism with multiplier ``nu``
    (docs/algorithms.md, "OSO-DPSGD").

    Example:
        >>> nu_g, nu_q = split_noise_multiplier(2.0)
        >>> round(nu_g, 3), round(nu_q, 3)
        (2.02, 14.248)
        >>> round(combined_noise_multiplier(nu_g, nu_q), 12)
        2.0
    """
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be positive and finite, got {noise_multiplier}")
    if not direction_noise_ratio > 1:
        raise ValueError(
            f"direction_noise_ratio must be > 1 (nu_q must exceed nu for nu_g to exist), got {direction_noise_ratio}"
        )
    nu_q = direction_noise_ratio * noise_multiplier
    nu_g = (noise_multiplier**-2 - nu_q**-2) ** -0.5
    return nu_g, nu_q


def combined_noise_multiplier(*multipliers: float) -> float:
    """The single Gaussian multiplier equivalent to joint queries with these multipliers (Proposition 1, inverted)."""
    return sum(m**-2 for m in multipliers) ** -0.5


class OSOClipping(ClippingRule):
    """Online Sensitivity Optimisation (OSO paper, Algorithm 1; docs/algorithms.md, "OSO-DPSGD").

    Per step: the clipped-gradient sum with noise ``N(0, (C_t nu_g)^2 I)`` and the direction sum of the clipped
    samples with noise ``N(0, nu_q^2 I)``; ``nu_g`` and ``nu_q`` split ``nu`` by Proposition 1. Once the step is
    released, from sanitised values only (post-processing, no privacy cost), eqs. 20-21 (``rho_{t+1}`` applies from
    the next step):

    ``C_{t+1} = C_t exp(rho_c sign(g~_t . q~_{t-1}))`` and ``rho_{t+1} = rho_t exp(rho_r sign(g~_t . g~_{t-1}))``,
    with ``q~_0 = g~_0 = 0`` (``sign(0) = 0``: no change at the first step). With SGD momentum the hypergradient
    only gains a positive factor, so the same sign rules hold (docs/algorithms.md, "OSO-DPSGD", step 8).

    The direction query ``q~_{t-1}`` is read only through ``g~_t . q~_{t-1}``, and ``g~_t`` does not depend on its
    noise: it is a deferred query (``step.DeferredQuery``), noised by one scalar draw, and materialised as a vector
    with a fresh model-sized draw only when it leaves the process (:meth:`state_dict`; docs/algorithms.md,
    "OSO-DPSGD", "One Gaussian draw per step").

    Args:
        noise_multiplier: ``nu``, what the accountant sees per step.
        initial_clip: ``C_0``.
        clip_lr: ``rho_c``.
        lr_lr: ``rho_r``.
        direction_noise_ratio: ``nu_q / nu``.
    """

    #: The weight column of the direction query ``q~_t``: the last, deferred.
    DIRECTION = 1
    DEFERRED_ROWS = 1
    _mechanism_keys = ("noise_multiplier", "direction_noise_multiplier")

    def __init__(
        self,
        noise_multiplier: float,
        initial_clip: float = OSO_INITIAL_CLIP,
        clip_lr: float = OSO_CLIP_LR,
        lr_lr: float = OSO_LR_LR,
        direction_noise_ratio: float = DEFAULT_DIRECTION_NOISE_RATIO,
    ) -> None:
        super().__init__(noise_multiplier, initial_clip)
        self.gradient_noise_multiplier, self.direction_noise_multiplier = split_noise_multiplier(
            noise_multiplier, direction_noise_ratio
        )
        self.clip_lr = check_number("clip_lr", clip_lr)
        self.lr_lr = check_number("lr_lr", lr_lr)
        self.prev_gradient: list[Tensor] | None = None  # g~_{t-1}
        # q~_{t-1}: deferred (its raw sum and one scalar draw) until it is read or leaves the process, then a vector
        self._prev_direction: DeferredQuery | list[Tensor] | None = None
        #: ``g~_t . q~_{t-1}`` of the last step (sanitised: ``C_t`` moves by its sign), ``None`` before the second
        self.direction_product: Tensor | None = None

    @override
    def to(self, device: torch.device) -> OSOClipping:
        super().to(device)
        if self.prev_gradient is not None:
            self.prev_gradient = [t.to(device) for t in self.prev_gradient]
        if isinstance(self._prev_direction, list):
            self._prev_direction = [t.to(device) for t in self._prev_direction]
        elif self._prev_direction is not None:
            self._prev_direction = self._prev_direction.to(device)
        return self

    @override
    def noise_multipliers(self) -> dict[str, float]:
        return {**super().noise_multipliers(), "direction_noise_multiplier": self.direction_noise_multiplier}

    @override
    def weights(self, norms: Tensor) -> Tensor:
        """Each record in one column: left whole, or its unit direction if clipped (:func:`oso_split_weights`), so
        that the layers can form both sums with one product per record; :meth:`queries` makes the clipped sum."""
        return oso_split_weights(norms, self.clip.to(norms.dtype))

    @override
    def queries(self, sums: list[Tensor]) -> list[Tensor]:
        """The clipped sum (eq. 4) and the direction sum (eq. 11) from the split columns."""
        return clipped_sum_from_split(sums, self.clip)

    @override
    def query_multipliers(self) -> list[float]:
        return [self.gradient_noise_multiplier, self.direction_noise_multiplier]

    @override
    def noise_stds(self) -> Tensor:
        """``C_t nu_g`` (sensitivity ``C_t``) and ``nu_q`` (sensitivity 1)."""
        direction = torch.full_like(self.clip, self.direction_noise_multiplier)
        return torch.stack([self.clip * self.gradient_noise_multiplier, direction])

    @override
    def update(self, released: SanitisedStep) -> Tensor:
        """Eqs. 20-21 from this step's released queries: the gradient ``g~_t`` and the deferred direction ``q~_t``.

        Updates ``C_t`` in place and returns the factor ``exp(rho_r sign(g~_t . g~_{t-1}))`` by which the caller
        multiplies the optimizer's learning rate(s).
        """
        gradient = released.gradients
        [direction] = released.deferred
        if self.prev_gradient is None or self._prev_direction is None:  # t = 1: q~_0 = g~_0 = 0, sign(0) = 0
            lr_factor = torch.ones_like(self.clip)
        else:
            self.direction_product, gradient_product = self._read_products(gradient)
            clip_sign = torch.sign(self.direction_product).to(self.clip.dtype)
            lr_sign = torch.sign(gradient_product).to(self.clip.dtype)
            self.clip = _kept_in_range(self.clip * torch.exp(self.clip_lr * clip_sign))  # Eq. 20
            lr_factor = torch.exp(self.lr_lr * lr_sign)
        # the previous step's vectors are let go before this step's are kept (the direction row copied out of the
        # step's sums, DeferredQuery.keep): a step's peak holds one step's vectors besides its sums, not two
        self.prev_gradient = self._prev_direction = None
        self.prev_gradient = kept_gradient(gradient)
        self._prev_direction = direction.keep()
        return lr_factor

    def _read_products(self, gradient: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """``g~_t . q~_{t-1}`` and ``g~_t . g~_{t-1}``: through the deferred query's one inner product, both in one
        pass over ``g~_t`` (on a CPU), or (after a checkpoint or a resume) with the materialised ``q~_{t-1}``."""
        assert self.prev_gradient is not None and self._prev_direction is not None
        if isinstance(self._prev_direction, list):
            return flat_dot(gradient, self._prev_direction), flat_dot(gradient, self.prev_gradient)
        direction, product = self._prev_direction.inner_beside(gradient, self.prev_gradient)
        assert product is not None
        return direction, product

    @property
    def prev_direction(self) -> list[Tensor] | None:
        """``q~_{t-1}``, materialised with a fresh model-sized draw if it is still deferred (from then on the run
        continues from this vector, as the mechanism as written would)."""
        if self._prev_direction is not None and not isinstance(self._prev_direction, list):
            self._prev_direction = self._prev_direction.materialise()
        return self._prev_direction

    @override
    def state_dict(self) -> dict:
        """``C_t``, ``g~_{t-1}`` and ``q~_{t-1}``: a deferred ``q~_{t-1}`` is materialised first (its raw sum never
        leaves the process)."""
        state = super().state_dict()
        state["prev_gradient"] = None if self.prev_gradient is None else [t.cpu() for t in self.prev_gradient]
        direction = self.prev_direction
        state["prev_direction"] = None if direction is None else [t.cpu() for t in direction]
        return state

    @override
    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        device = self.clip.device
        self.prev_gradient = None if state["prev_gradient"] is None else [t.to(device) for t in state["prev_gradient"]]
        self._prev_direction = (
            None if state["prev_direction"] is None else [t.to(device) for t in state["prev_direction"]]
        )


def kept_gradient(gradient: Sequence[Tensor]) -> list[Tensor]:
    """``g~_t`` as OSO keeps it until the next step: rounded to float32, saturating at float32's largest finite value,
    one copy of the vector laid end to end (a view of it per parameter).

    Its one use is the sign of ``g~_{t+1} . g~_t`` (Eq. 21), taken in float64: rounding each coordinate moves that
    product by at most ``2^-24 ||g~_{t+1}|| ||g~_t||`` (plus ``2^-150 ||g~_{t+1}||_1`` where a coordinate falls below
    float32's normal range), so it can change the sign only where the two gradients are orthogonal to within a
    cosine of ``2^-24``, as the paper's float32 arithmetic would. Saturating, a coordinate beyond float32's range
    moves the product by less than the coordinate itself and never makes it NaN. Half the memory of the release's
    float64 values, which were alive at the peak of the next step's release (DeferredQuery.keep)."""
    flat = laid_end_to_end(gradient)
    if flat is None:
        flat = torch.cat([g.detach().reshape(-1) for g in gradient]) if gradient else torch.zeros(0)
    largest = torch.finfo(torch.float32).max
    kept = flat.detach().to(torch.float32, copy=True).clamp_(-largest, largest)
    return [part.view(g.shape) for part, g in zip(kept.split([g.numel() for g in gradient]), gradient)]


class ScheduledNoiseClipping(ClippingRule):
    """A fixed threshold with a noise multiplier that follows a data-independent schedule: full-batch DP-GD with
    PUR noise (docs/algorithms.md, "PUR schedules"; ``schedules.PURSchedule``).

    The threshold is the per-example Lipschitz constant ``L``: under the schedule's assumption no gradient is
    clipped, and the clipping enforces the sensitivity where the assumption fails. Step ``t`` adds noise of
    standard deviation ``sigma_t`` to the mean gradient, ``N sigma_t`` to the sum, and the accountant sees
    ``nu_t = sigma_t N / (2L)``: the multiplier w.r.t. the replace-one sensitivity ``2L`` of the sum (the paper's
    adjacency; it also bounds add/remove, whose sensitivity is ``L``).

    Args:
        schedule: ``sigma_t`` for ``t = 1, 2, ...`` (e.g. ``PURSchedule.noise_std``).
        lipschitz: ``L``.
        num_samples: ``N`` (the sums are divided by it: full batch, ``q = 1``).
        first_step: the ``t`` of the next step (resume).
    """

    _mechanism_keys = ("lipschitz", "num_samples")

    def __init__(
        self, schedule: Callable[[int], float], lipschitz: float, num_samples: int, first_step: int = 1
    ) -> None:
        self.schedule, self.lipschitz, self.num_samples = schedule, float(lipschitz), int(num_samples)
        self.t = first_step
        super().__init__(self._multiplier(first_step), lipschitz)

    def _multiplier(self, t: int) -> float:
        return self.schedule(t) * self.num_samples / (2.0 * self.lipschitz)

    @property
    def noise_std(self) -> float:
        """``sigma_t`` of the next step (on the mean gradient; data-independent, so free to log)."""
        return self.schedule(self.t)

    @override
    def noise_stds(self) -> Tensor:
        return (2.0 * self.clip * self.noise_multiplier).reshape(1)  # = N sigma_t on the sum

    @override
    def update(self, released: SanitisedStep) -> None:
        self.t += 1
        self.noise_multiplier = self.gradient_noise_multiplier = self._multiplier(self.t)
        return None

    @override
    def step_metrics(self) -> dict[str, Tensor]:
        return {"noise_std": torch.tensor(self.schedule(self.t - 1))}  # the step just taken (after update)

    @override
    def state_dict(self) -> dict:
        return {**super().state_dict(), "t": self.t}

    @override
    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.t = state["t"]
        self.noise_multiplier = self.gradient_noise_multiplier = self._multiplier(self.t)
