"""The privacy mutation check: small bugs in privacy-critical lines, each of which some test must catch.

Each mutant is one textual edit (``old`` -> ``new``) of one line of one file of ``lightning_oso``: no clipping, a
noise dropped or doubled, a ledger write skipped, and so on. The script applies each to a fresh copy of the checkout
(never to the working tree), runs the tests the mutant names there, and records whether they fail (the mutant is
*killed*) or pass (it *survived*: the tests would not notice that bug). It exits non-zero if any mutant survives, if
an ``old`` string is not found exactly once (the code moved on and the mutant must follow it, so the check cannot go
stale silently), or if the named tests fail on the unmutated copy (a mutant killed by a broken test proves nothing).

Usage: ``python tools/mutants.py [--jobs 2] [--only NAME ...] [--list]`` (``make mutants``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What a copy needs to run the tests: the package, the tests, the examples and benchmarks some tests import, and the
#: pytest configuration.
COPIED = ("lightning_oso", "tests", "examples", "benchmarks", "pyproject.toml")
#: Seconds one mutant's tests may run; a mutant that makes them hang counts as killed (the hang is noticed).
TIMEOUT = 600


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids or files, relative to the repository root
    what: str  # the bug, in words


RELEASE = "tests/test_release_noise.py"

MUTANTS = (
    Mutant(
        "no_clipping",
        "lightning_oso/clipping.py",
        "return _ratio(clip, norms).clamp(max=1.0).unsqueeze(1)",
        "return torch.ones_like(norms).unsqueeze(1)",
        (
            f"{RELEASE}::test_the_clipped_sum_is_released_with_noise_of_std_clip_times_nu_g",
            "tests/test_methods.py::test_fixed_threshold_sum_matches_brute_force",
        ),
        "every record's gradient summed whole: the sensitivity is unbounded",
    ),
    Mutant(
        "oso_clipped_sum_without_c_t",
        "lightning_oso/clipping.py",
        "unclipped.addcmul_(directions, scales[s.dtype])",
        "unclipped.add_(directions)",
        (
            f"{RELEASE}::test_the_clipped_sum_is_released_with_noise_of_std_clip_times_nu_g[oso]",
            "tests/test_per_sample.py::test_sensitivity_on_neighbouring_batches",
            "tests/test_step.py::test_clipped_and_direction_sums_match_brute_force",
        ),
        "OSO's clipped sum adds the clipped records' unit directions without the factor C_t",
    ),
    Mutant(
        "division_by_actual_batch_size",
        "lightning_oso/step.py",
        "released = average(noisy, expected_batch_size)",
        "released = average(noisy, clipped.size)",
        (
            f"{RELEASE}::test_the_clipped_sum_is_released_with_noise_of_std_clip_times_nu_g[fixed]",
            "tests/test_step.py::test_division_by_expected_not_actual_batch_size",
        ),
        "the gradient divided by the (private) actual batch size instead of B = qN",
    ),
    Mutant(
        "gradient_noise_dropped",
        "lightning_oso/step.py",
        "noisy = add_noise(released_rows, torch.stack(row_stds[:vectors])) if vectors else []",
        "noisy = [s.clone() for s in released_rows]",
        (f"{RELEASE}::test_the_clipped_sum_is_released_with_noise_of_std_clip_times_nu_g[fixed]",),
        "the clipped sums released without noise",
    ),
    Mutant(
        "gradient_noise_doubled",
        "lightning_oso/step.py",
        "row_stds = [exact_noise.grid_noise_std(stds[k], multipliers[k], coordinates) for k in range(len(stds))]",
        "row_stds = [2 * exact_noise.grid_noise_std(stds[k], multipliers[k], coordinates) for k in range(len(stds))]",
        (f"{RELEASE}::test_the_clipped_sum_is_released_with_noise_of_std_clip_times_nu_g[fixed]",),
        "every vector query's noise twice its standard deviation (utility lost, and the grid no longer the priced one)",
    ),
    Mutant(
        "oso_gradient_noise_without_c_t",
        "lightning_oso/clipping.py",
        "return torch.stack([self.clip * self.gradient_noise_multiplier, direction])",
        "return torch.stack([torch.full_like(self.clip, self.gradient_noise_multiplier), direction])",
        (f"{RELEASE}::test_the_clipped_sum_is_released_with_noise_of_std_clip_times_nu_g[oso]",),
        "OSO's gradient noise of std nu_g instead of C_t nu_g: mis-scaled whenever C_t != 1",
    ),
    Mutant(
        "quantile_gradient_noise_of_nu",
        "lightning_oso/clipping.py",
        "return (self.clip * self.gradient_noise_multiplier).reshape(1)",
        "return (self.clip * self.noise_multiplier).reshape(1)",
        (f"{RELEASE}::test_the_clipped_sum_is_released_with_noise_of_std_clip_times_nu_g[quantile]",),
        "the quantile rule's gradient noised at nu, not at its share nu_g > nu: the pair costs more than nu",
    ),
    Mutant(
        "ledger_write_skipped",
        "lightning_oso/accounting/ledger.py",
        "self.file.record_step(self.accountant.steps + 1, noise_multiplier, sample_rate)",
        "pass",
        ("tests/test_resume.py::test_the_ledger_holds_counts_and_mechanism_parameters_only",),
        "a released step not written ahead to the ledger: a crash after it would leave it uncharged",
    ),
    Mutant(
        "calibrated_for_t_minus_1_steps",
        "lightning_oso/planning.py",
        "max(1, int(remaining_steps)),",
        "max(1, int(remaining_steps) - 1),",
        ("tests/test_methods.py::test_fixed_threshold_with_adam_is_dpadam",),
        "the noise calibrated for one step fewer than the trainer plans",
    ),
    Mutant(
        "late_budget_stop",
        "lightning_oso/callbacks/_budget.py",
        "return self.max_steps is None or self.accountant.steps >= self.max_steps",
        "return self.max_steps is None or self.accountant.steps > self.max_steps",
        ("tests/test_callback.py::test_budget_stop_with_fixed_noise_multiplier",),
        "training stops one step after the budget is spent",
    ),
    Mutant(
        "oso_clip_sign_flipped",
        "lightning_oso/clipping.py",
        "self.clip = _kept_in_range(self.clip * torch.exp(self.clip_lr * clip_sign))",
        "self.clip = _kept_in_range(self.clip * torch.exp(-self.clip_lr * clip_sign))",
        (
            "tests/test_step.py::test_oso_update_rule_signs",
            "tests/test_methods.py::test_oso_with_momentum_replays_from_sanitised_values",
        ),
        "C_t moves against the hypergradient's sign (eq. 20)",
    ),
    Mutant(
        "direction_noise_of_nu",
        "lightning_oso/clipping.py",
        "direction = torch.full_like(self.clip, self.direction_noise_multiplier)",
        "direction = torch.full_like(self.clip, self.noise_multiplier)",
        (
            f"{RELEASE}::test_the_direction_query_is_read_with_noise_of_std_nu_q_along_the_vector",
            f"{RELEASE}::test_the_materialised_direction_query_has_noise_of_std_nu_q_per_coordinate",
        ),
        "OSO's direction query noised at nu instead of nu_q = 7.124 nu: the split no longer holds",
    ),
    Mutant(
        "deferred_direction_unscaled",
        "lightning_oso/step.py",
        "return torch.where(norm > 0, norm * released, torch.zeros_like(norm)) / self._expected_batch_size",
        "return torch.where(norm > 0, released, torch.zeros_like(norm)) / self._expected_batch_size",
        (f"{RELEASE}::test_the_direction_query_is_read_with_noise_of_std_nu_q_along_the_vector",),
        "the deferred inner product v . q~ missing its factor ||v||",
    ),
    Mutant(
        "deferred_direction_noise_dropped",
        "lightning_oso/step.py",
        "released = exact_noise.on_grid(projection, exact_noise.grid_exponent(self._scalar_std)) + self._noise",
        "released = exact_noise.on_grid(projection, exact_noise.grid_exponent(self._scalar_std))",
        (f"{RELEASE}::test_the_direction_query_is_read_with_noise_of_std_nu_q_along_the_vector",),
        "the deferred direction query read without its scalar noise",
    ),
    Mutant(
        "grid_inflation_without_sqrt_d",
        "lightning_oso/exact_noise.py",
        "inflation = multiplier * math.sqrt(coordinates) * 2.0**-GRID_BITS",
        "inflation = multiplier * 2.0**-GRID_BITS",
        ("tests/test_exact_release.py::test_grid_noise_keeps_the_accountants_multiplier",),
        "the noise widened for one coordinate's rounding, not for the sqrt(d) the grid adds to the sensitivity",
    ),
    Mutant(
        "sampler_ignores_block_shares",
        "lightning_oso/exact_noise.py",
        "per_bucket = torch.where(counts > 0, envelope / counts.to(torch.float64), 0.0)  # w m / N",
        "per_bucket = torch.where(counts > 0, envelope, 0.0)  # w m / N",
        (
            "tests/test_exact_release.py::test_sampler_law_is_the_gaussian_density_to_the_charged_float64_error",
            "tests/test_exact_release.py::test_discrete_gaussian_has_the_exact_law_tails_included",
        ),
        "the sampler's acceptance not divided by the buckets its block holds: blocks rounded up are over-drawn",
    ),
    Mutant(
        "sampler_acceptance_from_the_anchor_distance",
        "lightning_oso/exact_noise.py",
        "return factor * torch.exp(-((y - anchor) * (y + anchor)) * table.inv_two_var)",
        "return factor * torch.exp(-((y - anchor) * (y - anchor)) * table.inv_two_var)",
        (
            "tests/test_exact_release.py::test_sampler_law_is_the_gaussian_density_to_the_charged_float64_error",
            "tests/test_exact_release.py::test_discrete_gaussian_has_the_exact_law_tails_included",
        ),
        "the sampler's acceptance within a block computed from the distance to the anchor, not the density ratio",
    ),
    Mutant(
        "sampler_early_drop_rounded_down",
        "lightning_oso/exact_noise.py",
        "never = (highest + (2**low_bits - 1)) >> low_bits",
        "never = highest >> low_bits",
        ("tests/test_exact_release.py::test_early_decisions_are_those_of_the_acceptance",),
        "the sampler's early rejection threshold rounded down: trials the acceptance would keep are dropped unread",
    ),
    Mutant(
        "host_draw_off_the_stream",
        "lightning_oso/exact_noise.py",
        "        return words(count, device).cpu()",
        '        return torch_words(None)(count, torch.device("cpu"))',
        (
            "tests/test_exact_release.py::test_a_small_draw_for_an_accelerator_is_the_compiled_loops_on_the_accelerators_words",
        ),
        "an accelerator's small draws made from the process's unkeyed default generator, not the step's noise stream",
    ),
    Mutant(
        "sampler_tie_dropped",
        "lightning_oso/exact_noise.py",
        "if tie.numel():",
        "if False:",
        ("tests/test_exact_release.py::test_a_trial_is_decided_by_the_word_in_hand_and_a_tie_by_further_bits",),
        "a trial tied with a fractional threshold dropped without its further bits: a tail probability loses mass",
    ),
    Mutant(
        "sampler_empty_positions_kept",
        "lightning_oso/exact_noise.py",
        "ready = wanted if filled == dropped.numel() else int(dropped[filled])",
        "ready = wanted",
        ("tests/test_exact_release.py::test_discrete_gaussian_has_the_exact_law_tails_included",),
        "a chunk short of spare proposals released with its dropped proposals in the positions left empty",
    ),
    Mutant(
        "compiled_sampler_keeps_at_the_sure_threshold",
        "lightning_oso/exact_noise_kernel.py",
        "if verdict < bucket_table[bucket, SURE]:",
        "if verdict <= bucket_table[bucket, SURE]:",
        ("tests/test_exact_release.py::test_the_compiled_loop_decides_every_proposal_as_the_vectorised_passes_do",),
        "the CPU sampler keeps a trial whose top bits equal the early threshold: one acceptance is rounded up",
    ),
    Mutant(
        "compiled_sampler_tie_dropped",
        "lightning_oso/exact_noise_kernel.py",
        "elif uniform > whole:",
        "elif uniform >= whole:",
        ("tests/test_exact_release.py::test_both_samplers_settle_a_tie_with_the_threshold_by_further_bits",),
        "the CPU sampler drops a trial tied with a fractional threshold unread: a tail probability loses mass",
    ),
    Mutant(
        "compiled_sampler_wide_position_from_other_bits",
        "lightning_oso/exact_noise_kernel.py",
        "value += ((f >> low_bits) & (mask[block] >> narrow_bits)) << narrow_bits",
        "value += ((f >> (low_bits - 1)) & (mask[block] >> narrow_bits)) << narrow_bits",
        ("tests/test_exact_release.py::test_the_compiled_loop_decides_every_proposal_as_the_vectorised_passes_do",),
        "the CPU sampler's position in a wide block read from a bit its trial's uniform number also reads",
    ),
    Mutant(
        "compiled_grid_index_by_the_inverse_step",
        "lightning_oso/exact_noise_kernel.py",
        "index = np.rint(np.float64(source[i]) / step)",
        "index = np.rint(np.float64(source[i]) * (1.0 / step))",
        ("tests/test_exact_release.py::test_the_compiled_grid_index_is_the_torch_passes_bit_for_bit",),
        "the CPU's grid index taken with 1 / gamma, infinite for a subnormal step: NaN for a zero sum, inf for others",
    ),
    Mutant(
        "compiled_grid_index_not_clamped_above",
        "lightning_oso/exact_noise_kernel.py",
        "        if index > limit:",
        "        if False:",
        ("tests/test_exact_release.py::test_the_compiled_grid_index_is_the_torch_passes_bit_for_bit",),
        "the CPU's grid index not clamped above: a huge sum's index is no longer exact after the noise is added",
    ),
    Mutant(
        "compiled_grid_index_rounded_half_up",
        "lightning_oso/exact_noise_kernel.py",
        "index = np.rint(np.float64(source[i]) / step)",
        "index = np.floor(np.float64(source[i]) / step + 0.5)",
        ("tests/test_exact_release.py::test_the_compiled_grid_index_is_the_torch_passes_bit_for_bit",),
        "the CPU's grid index rounds ties up, not to even: not the rounding the accelerators' release makes",
    ),
    Mutant(
        "keyed_words_step_without_carry",
        "lightning_oso/exact_noise_kernel.py",
        "carry = _ONE if next_low < inc_low else np.uint64(0)  # the low half's sum wrapped",
        "carry = np.uint64(0)",
        ("tests/test_randomness.py::test_the_compiled_loop_makes_the_keyed_streams_very_words",),
        "the CPU sampler's own PCG64DXSM step drops the carry: its words are not the keyed stream's",
    ),
    Mutant(
        "claimed_words_not_passed",
        "lightning_oso/randomness.py",
        "bits.advance(count)  # the stream goes on after the claimed words: none is given twice",
        "pass",
        ("tests/test_exact_release.py::test_words_made_in_the_loop_draw_what_the_streams_words_draw",),
        "a stream whose words the sampler's loop makes does not move past them: the next chunk reuses them",
    ),
    Mutant(
        "grid_index_by_the_inverse_step",
        "lightning_oso/exact_noise.py",
        "return values.div_(step).round_()",
        "return values.mul_(step.reciprocal()).round_()",
        ("tests/test_exact_release.py::test_the_release_is_the_grid_mechanism_at_every_noise_std",),
        "the grid index taken with 1 / gamma, which is infinite for a tiny std: NaN for a zero sum, the sign of others",
    ),
    Mutant(
        "sampler_scale_by_the_inverse_step",
        "lightning_oso/exact_noise.py",
        "scale = std.to(device=index.device, dtype=torch.float64) / step",
        "scale = std.to(device=index.device, dtype=torch.float64) * step.reciprocal()",
        ("tests/test_exact_release.py::test_the_release_is_the_grid_mechanism_at_every_noise_std",),
        "the noise's scale on the grid taken with 1 / gamma, infinite for a tiny std: the noise is no longer the law",
    ),
    Mutant(
        "noise_std_not_floored",
        "lightning_oso/exact_noise.py",
        "return std.to(torch.float64).clamp_min(MIN_NOISE_STD) / (1.0 - inflation)",
        "return std.to(torch.float64) / (1.0 - inflation)",
        ("tests/test_exact_release.py::test_the_release_is_the_grid_mechanism_at_every_noise_std",),
        "a vanishing noise std drawn at as it is: its grid step rounds to 0 and the release to infinities and NaN",
    ),
    Mutant(
        "adaptive_clip_unbounded",
        "lightning_oso/clipping.py",
        "return clip.clamp(*CLIP_RANGE)",
        "return clip",
        ("tests/test_step.py::test_adaptive_thresholds_stay_in_range_however_long_they_move_one_way",),
        "an adaptive C_t left to reach 0 or infinity in a long run: an infinite threshold clips nothing",
    ),
    Mutant(
        "charged_at_nu_g",
        "lightning_oso/strategies/private_training.py",
        "ledger.record_step(rule.noise_multiplier, self.sample_rate)",
        "ledger.record_step(rule.gradient_noise_multiplier, self.sample_rate)",
        ("tests/test_resume.py::test_the_ledger_holds_counts_and_mechanism_parameters_only",),
        "each step charged at the gradient's multiplier nu_g > nu: the direction query goes unpaid",
    ),
    Mutant(
        "non_finite_record_not_zeroed",
        "lightning_oso/per_sample/parts.py",
        "return torch.where(weighted.reshape(shape), x, 0)",
        "return x",
        ("tests/test_nonfinite.py::test_a_non_finite_record_adds_nothing_to_the_sums",),
        "a record with a NaN or inf gradient multiplied by its weight 0 (NaN) instead of left out",
    ),
    Mutant(
        "proposal_table_kept_for_another_scale",
        "lightning_oso/exact_noise.py",
        "_cpu_table(float(scale.numpy()),",
        "_cpu_table(float(2**30),",
        ("tests/test_exact_release.py::test_a_kept_proposal_table_draws_what_a_freshly_built_one_draws",),
        "the CPU's kept proposal tables are looked up without the scale: every release draws at one stale noise level",
    ),
    Mutant(
        "prv_mean_of_an_untruncated_cdf",
        "lightning_oso/accounting/prv.py",
        "(self._prv.cdf(t) - self._below) / self._mass",
        "self._prv.cdf(t) / self._mass",
        ("tests/test_accounting.py::test_the_prv_cdf_of_one_point_is_the_cdf_of_the_grid",),
        "the PRV's mean is integrated on a CDF that is not the truncated one: the discretisation's mean shift, and so "
        "epsilon, comes out wrong",
    ),
    Mutant(
        "compiled_squares_in_float32",
        "lightning_oso/per_sample/norm_kernel.py",
        "value = np.float64(x[i, j])",
        "value = x[i, j]",
        (
            "tests/test_sensitivity.py::test_sq_norm_upper_of_a_large_record_at_float32s_limits",
            "tests/test_sensitivity.py::test_sq_norm_upper_in_chunks_bounds_every_record",
        ),
        "the CPU's squared norms square float32 values in float32: a huge record's norm overflows, a small one's "
        "squares round",
    ),
    Mutant(
        "split_sums_chunk_overwrites_its_column",
        "lightning_oso/per_sample/linear.py",
        "                            flat[k].addmm_(*product)",
        "                            torch.mm(*product, out=flat[k])",
        ("tests/test_per_sample.py::test_split_sums_equal_the_two_column_product",),
        "OSO's split sums taken a few records at a time keep the last chunk's product only: the other records' "
        "shares of the sums are dropped",
    ),
    Mutant(
        "forward_conv_stride_for_stride",
        "lightning_oso/per_sample/conv.py",
        "        stride=dilation,",
        "        stride=stride,",
        (
            "tests/test_properties.py::test_both_conv_instantiations_equal_the_oracle",
            "tests/test_sensitivity.py::test_a_forward_convolutions_gradients_cannot_hide_a_records_norm",
        ),
        "a convolution's per-sample gradients by the forward convolution read the input at the layer's stride where "
        "its dilation belongs: another layer's gradients, bounded as this one's",
    ),
    Mutant(
        "conv_record_blocks_out_of_order",
        "lightning_oso/per_sample/conv.py",
        "    return [rows for rows in (slice(0, whole), slice(whole, n)) if rows.stop > rows.start]",
        "    return [rows for rows in (slice(whole, n), slice(0, whole)) if rows.stop > rows.start]",
        (
            "tests/test_properties.py::test_both_conv_instantiations_equal_the_oracle",
            "tests/test_sensitivity.py::test_per_sample_convolutions_in_record_blocks_cannot_hide_a_records_norm",
            "tests/test_sensitivity.py::test_recomputed_convolution_sums_cannot_hide_a_records_norm",
        ),
        "a convolution's per-sample gradients convolved in blocks of records are joined in the wrong order: each "
        "record is clipped by another's norm",
    ),
    Mutant(
        "conv_weight_grad_blocks_rest_misplaced",
        "lightning_oso/per_sample/conv.py",
        "    return blocks + [slice(whole + rows.start, whole + rows.stop) for rows in record_blocks(n - whole)]",
        "    return blocks + [slice(rows.start, rows.stop) for rows in record_blocks(n - whole)]",
        (
            "tests/test_properties.py::test_both_conv_instantiations_equal_the_oracle",
            "tests/test_sensitivity.py::test_recomputed_convolution_sums_cannot_hide_a_records_norm",
            "tests/test_layer_zoo.py::test_recomputed_convolution_sums_equal_one_record_at_a_time",
        ),
        "a convolution's per-sample gradients formed in blocks take the last records' block from the first records: "
        "the last records get other records' gradients and norms",
    ),
    Mutant(
        "recomputed_conv_sums_unmasked_gradients",
        "lightning_oso/per_sample/conv.py",
        "kept = zero_unweighted(g, weighted)",
        "kept = g",
        ("tests/test_nonfinite.py::test_a_non_finite_record_adds_nothing_to_the_sums",),
        "a convolution that recomputes its sums over the batch lets the output gradients of a record of weight 0 into "
        "the product: one NaN or inf record makes every sum NaN, and whether the step happens depends on it",
    ),
    Mutant(
        "recomputed_conv_sums_unmasked_inputs",
        "lightning_oso/per_sample/conv.py",
        "torch.where(_per_record(weighted, x), x, x.new_zeros(()), out=inputs[:n])",
        "inputs[:n].copy_(x)",
        ("tests/test_nonfinite.py::test_a_non_finite_record_adds_nothing_to_the_sums",),
        "a convolution that recomputes its sums over the batch lets the inputs of a record of weight 0 into the "
        "product (times its zeroed output gradients: 0 * inf is NaN)",
    ),
    Mutant(
        "recomputed_conv_sums_unscaled",
        "lightning_oso/per_sample/conv.py",
        "torch.mul(every, kept.unsqueeze(1), out=scaled[:n])",
        "scaled[:n].copy_(kept.unsqueeze(1).expand_as(scaled[:n]))",
        ("tests/test_sensitivity.py::test_recomputed_convolution_sums_cannot_hide_a_records_norm",),
        "a convolution that recomputes its sums adds every record's gradient whole to every column, unclipped: a "
        "record moves the sums by its whole gradient",
    ),
    Mutant(
        "recomputed_conv_norms_out_of_order",
        "lightning_oso/per_sample/conv.py",
        "return torch.cat([nb.sq_norm_upper(self.of_records(rows)).sqrt_() for rows in blocks])",
        "return torch.cat([nb.sq_norm_upper(self.of_records(rows)).sqrt_() for rows in blocks[::-1]])",
        (
            "tests/test_sensitivity.py::test_recomputed_convolution_sums_cannot_hide_a_records_norm",
            "tests/test_properties.py::test_both_conv_instantiations_equal_the_oracle",
        ),
        "a convolution that takes its norms a block of records at a time joins the blocks in the wrong order: each "
        "record is clipped by another's norm",
    ),
    Mutant(
        "tied_ghost_cross_term_once",
        "lightning_oso/per_sample/tied.py",
        "* (2 * f_r)",
        "* f_r",
        ("tests/test_tied.py::test_the_tied_part_is_ghost_where_every_use_is",),
        "a tied weight's ghost norm counts the head-embedding cross term once, not twice: norms off either way",
    ),
    Mutant(
        "tied_ghost_no_rounding_margin",
        "lightning_oso/per_sample/tied.py",
        "ghost_sum.clamp_min_(0).add_(error).add_(eta)",
        "ghost_sum.clamp_min_(0).add_(eta)",
        ("tests/test_tied.py::test_a_head_cancelling_its_embedding_cannot_hide_a_records_norm",),
        "a tied weight's computed ghost sum taken as the norm: a record whose uses cancel is clipped at the residue",
    ),
    Mutant(
        "tied_conv1d_orientation",
        "lightning_oso/per_sample/linear.py",
        "return Positions(cols=self.b, rows=self.a) if self.transposed else Positions(cols=self.a, rows=self.b)",
        "return Positions(cols=self.a, rows=self.b)",
        (
            "tests/test_transformers.py::"
            "test_a_conv1d_tied_to_an_embedding_takes_the_ghost_norm_in_the_weights_orientation",
        ),
        "a Conv1D's positions given to a tied part in the wrong orientation: its cross term with an embedding is wrong",
    ),
    Mutant(
        "record_chunks_all_the_first",
        "lightning_oso/per_sample/norm_bounds.py",
        "return [slice(i, i + step) for i in range(0, n, step)] or [slice(0, 0)]",
        "return [slice(0, step) for i in range(0, n, step)] or [slice(0, 0)]",
        ("tests/test_sensitivity.py::test_cancelling_positions_cannot_hide_a_records_norm",),
        "every chunk of a chunked norm computed on the first records: a record is bounded by another's values",
    ),
    Mutant(
        "record_chunks_mispaired",
        "lightning_oso/per_sample/norm_bounds.py",
        "return torch.cat([compute(*(x[s] if x is not None else None for x in tensors)) for s in slices])",
        "return torch.cat([compute(*(x[s] if x is first else x[: s.stop - s.start] if x is not None else None"
        " for x in tensors)) for s in slices])",
        ("tests/test_sensitivity.py::test_cancelling_positions_cannot_hide_a_records_norm",),
        "a chunked ghost norm pairs each chunk's first tensor with the first chunk's other tensors",
    ),
    Mutant(
        "noise_on_every_rank",
        "lightning_oso/strategies/release.py",
        "return self._process.global_rank == 0",
        "return True",
        ("tests/test_ddp.py::test_two_processes_add_the_noise_once_to_the_sum_of_their_clipped_sums",),
        "with secure_rng, every process adds its own noise to the sum across processes",
    ),
    Mutant(
        "noise_stream_per_rank",
        "lightning_oso/strategies/release.py",
        "(NOISE, step, rank=0, device=self._process.root_device)",
        "(NOISE, step, rank=self._process.global_rank, device=self._process.root_device)",
        ("tests/test_ddp.py::test_two_processes_add_the_noise_once_to_the_sum_of_their_clipped_sums",),
        "each process draws its own noise for the one release: the processes' models differ, and together reveal more",
    ),
    Mutant(
        "constant_noise_key",
        "lightning_oso/strategies/release.py",
        "generator = self._randomness().generator(NOISE, step, rank=0, device=self._process.root_device)",
        "generator = self._randomness().generator(NOISE, 0, rank=0, device=self._process.root_device)",
        ("tests/test_randomness.py::test_runs_sharing_a_ledger_never_share_noise_even_with_one_seed",),
        "every step draws the same noise: the difference of two releases reveals the clipped sums",
    ),
    Mutant(
        "sampler_at_one_and_a_half_q",
        "lightning_oso/data.py",
        "self.gaps = gap_law(self.sample_rate)",
        "self.gaps = gap_law(min(1.0, 1.5 * self.sample_rate))",
        (
            "tests/test_sampler.py::test_sampler_batches_follow_the_bernoulli_law_on_small_index_sets",
            "tests/test_randomness.py::test_secure_poisson_sampling_has_the_binomial_batch_sizes",
        ),
        "records sampled at 1.5 q while the accountant charges q",
    ),
    Mutant(
        "quantile_count_unnoised",
        "lightning_oso/step.py",
        "noisy_scalars = add_noise(",
        "noisy_scalars = (lambda sums, stds: [s.clone() for s in sums])(",
        (f"{RELEASE}::test_the_quantile_count_is_released_with_noise_of_std_sigma_b",),
        "the quantile rule's count released without noise",
    ),
    Mutant(
        "quantile_count_noise_doubled",
        "lightning_oso/clipping.py",
        "return torch.full((1,), self.count_noise_std, dtype=torch.float64, device=self.clip.device)",
        "return torch.full((1,), 2 * self.count_noise_std, dtype=torch.float64, device=self.clip.device)",
        (f"{RELEASE}::test_the_quantile_count_is_released_with_noise_of_std_sigma_b",),
        "the count's noise twice sigma_b",
    ),
    Mutant(
        "quantile_count_not_centred",
        "lightning_oso/clipping.py",
        "count = (norms <= clip).to(norms.dtype) - 0.5",
        "count = (norms <= clip).to(norms.dtype)",
        (f"{RELEASE}::test_the_quantile_count_is_released_with_noise_of_std_sigma_b",),
        "the raw 0/1 count (sensitivity 1) released with noise priced for the centred count (sensitivity 1/2)",
    ),
    Mutant(
        "pur_noise_halved",
        "lightning_oso/clipping.py",
        "return (2.0 * self.clip * self.noise_multiplier).reshape(1)",
        "return (self.clip * self.noise_multiplier).reshape(1)",
        (f"{RELEASE}::test_pur_full_batch_sums_are_released_with_noise_of_n_sigma_t_at_each_step",),
        "PURDP's sums noised for the add/remove sensitivity L while the multiplier is charged for replace-one 2L",
    ),
    Mutant(
        "random_stopping_run_epsilon_halved_not_thirded",
        "lightning_oso/search/selection.py",
        "run_epsilon = (target_epsilon - 3 * math.sqrt(2 * run_delta)) / 3",
        "run_epsilon = (target_epsilon - 3 * math.sqrt(2 * run_delta)) / 2",
        ("tests/test_search.py::test_random_stopping_run_budget_meets_liu_and_talwars_closed_form",),
        "random stopping's runs given half the target each: Theorem 3.4's factor 3 on epsilon dropped",
    ),
    Mutant(
        "random_stopping_run_delta_squared_only",
        "lightning_oso/search/selection.py",
        "run_delta = ((target_delta - delta_2) / upsilon) ** 2 / 2",
        "run_delta = ((target_delta - delta_2) / upsilon) ** 2",
        ("tests/test_search.py::test_random_stopping_run_budget_meets_liu_and_talwars_closed_form",),
        "random stopping's per-run delta twice what Theorem 3.4 allows",
    ),
    Mutant(
        "grid_power_of_two_without_subnormals",
        "lightning_oso/exact_noise.py",
        "second = (e - first).clamp(-1022, 1023)",
        "second = (e - first).clamp(0, 1023)",
        ("tests/test_exact_release.py::test_powers_of_two_are_exact_over_float64s_whole_range",),
        "powers of two below 2^-1022 come out as 2^-1022: a grid finer than the normal range would be wrong",
    ),
    Mutant(
        "checks_under_the_runs_tf32",
        "lightning_oso/checks.py",
        "        _ieee_float32_products(),\n",
        "        contextlib.nullcontext(),\n",
        ("tests/test_checks.py::test_the_checks_run_with_ieee_float32_products_and_give_the_runs_settings_back",),
        "the consistency checks in the run's TF32 products: a plain layer refused as tied on CUDA",
    ),
    Mutant(
        "normalisation_norms_without_rounding_margin",
        "lightning_oso/per_sample/norm_bounds.py",
        ".square().sum(dim=1).mul_(F64 / (1.0 - gamma(per_sample + 1, u64)))",
        ".square().sum(dim=1)",
        ("tests/test_sensitivity.py::test_sq_norm_upper_of_float32_sums_bounds_every_record_without_scaling",),
        "a normalisation layer's squared norms as float64 computes them, rounded down as often as up: a record's "
        "bound can fall below its norm",
    ),
    Mutant(
        "record_groups_cached_across_edits",
        "lightning_oso/per_sample/parts.py",
        "if entry is not None and entry[0] is weights and entry[1] == weights._version:",
        "if entry is not None and entry[0] is weights:",
        ("tests/test_per_sample.py::test_the_records_groups_are_taken_once_per_weight_matrix_and_follow_its_edits",),
        "the records' groups of a weight matrix reused after it was edited in place: records summed with weights "
        "they no longer have",
    ),
    Mutant(
        "shared_input_side_keyed_without_storage",
        "lightning_oso/per_sample/linear.py",
        "a.untyped_storage().data_ptr(),",
        "0,  # the storage left out",
        ("tests/test_sensitivity.py::test_layers_that_read_different_inputs_are_bounded_apart",),
        "layers whose inputs merely have one shape share the first one's input side: a layer that reads a larger "
        "input is bounded from the smaller one, below its norm",
    ),
    Mutant(
        "ghost_tail_rounding_of_the_first_layer",
        "lightning_oso/per_sample/linear.py",
        "eps = [_ghost_rounding(d_in, d_out, t, u, u_mm) for d_in, d_out, t, _ in layout]",
        "eps = [_ghost_rounding(*layout[0][:3], u, u_mm) for d_in, d_out, t, _ in layout]",
        ("tests/test_sensitivity.py::test_ghost_norms_together_equal_each_layers_own_bit_for_bit",),
        "the stacked tail gives every layer the first one's rounding allowance: a wider layer, or one with more "
        "positions, gets too little for its Gram sum's rounding",
    ),
    Mutant(
        "ghost_tail_bias_on_other_rows",
        "lightning_oso/per_sample/linear.py",
        "rows, zero = iter(bias), torch.zeros_like(bias[0])",
        "rows, zero = iter(bias.flip(0)), torch.zeros_like(bias[0])",
        ("tests/test_sensitivity.py::test_ghost_norms_together_equal_each_layers_own_bit_for_bit",),
        "the stacked tail adds the biases' bounds to other layers' rows: a layer's bias bound is lost",
    ),
    Mutant(
        "composite_piece_takes_another_pieces_norm",
        "lightning_oso/per_sample/composite.py",
        "parts = [known[j] if j in known else piece.sq_norms() for j, (piece, slots) in "
        "enumerate(self.pieces) if slots]",
        "parts = [known[0] if j in known else piece.sq_norms() for j, (piece, slots) in "
        "enumerate(self.pieces) if slots]",
        ("tests/test_sensitivity.py::test_norms_with_composite_layers_taken_together_equal_each_parts_own",),
        "a composite layer's pieces all take the first piece's norm from the batched ghost norms: the attention's "
        "output projection is bounded by its input projection's norm",
    ),
    Mutant(
        "shared_input_side_edited_by_a_member",
        "lightning_oso/per_sample/linear.py",
        "torch.sum(gram_b.mul_(gram_a), dim=2, out=summed[member])",
        "torch.sum(gram_a.mul_(gram_b), dim=2, out=summed[member])",
        ("tests/test_sensitivity.py::test_layers_that_read_one_input_are_bounded_as_one_layer",),
        "the first layer of a group multiplies the shared Gram matrix in place: the next layers' ghost sums read a "
        "product of Gram matrices instead of the input's",
    ),
    Mutant(
        "largest_magnitude_misses_negatives",
        "lightning_oso/per_sample/norm_bounds.py",
        "return torch.linalg.vector_norm(x, ord=math.inf, dim=dims)",
        "return x.amax(dim=dims)",
        ("tests/test_sensitivity.py::test_both_routes_to_a_samples_largest_magnitude_scale_it_alike",),
        "on an accelerator a sample's largest magnitude is its largest value: a sample of large negative values is "
        "scaled too little, and its products can overflow",
    ),
    Mutant(
        "stacked_largest_misses_negatives",
        "lightning_oso/per_sample/norm_bounds.py",
        "torch.stack([x.amin(dim=dims) for x, dims in views]).neg_(),",
        "torch.stack([x.amax(dim=dims) for x, dims in views]),",
        ("tests/test_sensitivity.py::test_stacked_powers_of_two_are_each_tensors_own",),
        "the ghost norms' stacked powers of two take a CPU sample's largest magnitude as its largest value: a sample "
        "of large negative values is scaled too little, and its products can overflow",
    ),
    Mutant(
        "ghost_output_gradient_scaled_by_another_tensors_power",
        "lightning_oso/per_sample/linear.py",
        "gram_b = _gram(b, powers.reciprocal[row], diagonals[row])",
        "gram_b = _gram(b, powers.reciprocal[0], diagonals[row])",
        ("tests/test_sensitivity.py::test_cancelling_positions_cannot_hide_a_records_norm",),
        "each output gradient of a ghost norm scaled by the first input's power of two while its own is put back: "
        "the bound is off by the ratio of the two",
    ),
    Mutant(
        "ghost_member_rows_off_by_one",
        "lightning_oso/per_sample/linear.py",
        "outputs += range(row + 1, row + 1 + count)",
        "outputs += range(row, row + count)",
        ("tests/test_sensitivity.py::test_cancelling_positions_cannot_hide_a_records_norm",),
        "each layer's ghost norm reads the stacked row before its own: its input's (or the layer before it's) "
        "positions' norms and power of two in place of its output gradient's",
    ),
    Mutant(
        "normalisation_bounds_on_other_parameters",
        "lightning_oso/per_sample/normalisation.py",
        "for (part, p), bound in zip(members, bounds):",
        "for (part, p), bound in zip(members, bounds.flip(0)):",
        ("tests/test_sensitivity.py::test_normalisation_bounds_taken_together_equal_each_layers_own",),
        "the normalisation layers' bounds, taken together, given to the parameters in the wrong order: a layer is "
        "clipped by another layer's norm",
    ),
    Mutant(
        "normalisation_err_of_the_first_layer",
        "lightning_oso/per_sample/normalisation.py",
        "err=column([err for err, _ in layout]),",
        "err=column([layout[0][0] for err, _ in layout]),",
        ("tests/test_sensitivity.py::test_normalisation_bounds_taken_together_equal_each_layers_own",),
        "the normalisation layers' bounds taken together with the first layer's rounding allowance: a layer with "
        "more positions gets too little for its sums' rounding",
    ),
    Mutant(
        "ghost_bias_norms_of_other_layers",
        "lightning_oso/per_sample/linear.py",
        "torch.stack([nb.sq_norm_upper(bias) for bias in biases])",
        "torch.stack([nb.sq_norm_upper(bias) for bias in biases[::-1]])",
        ("tests/test_sensitivity.py::test_ghost_norms_together_equal_each_layers_own_bit_for_bit",),
        "the ghost norms' bias bounds, taken together, given to the layers in the wrong order: a layer's bias is "
        "bounded by another layer's",
    ),
    Mutant(
        "split_stream_not_moved_past_its_segments",
        "lightning_oso/randomness.py",
        "self._bits.advance(segments << SEGMENT_BITS)",
        "pass",
        ("tests/test_randomness.py::test_a_split_keyed_stream_gives_disjoint_segments_and_moves_past_them",),
        "a keyed stream split for the sampler's threads is not moved past its segments: its next read (another draw "
        "of the step) replays the first segment's words, the same noise twice",
    ),
    Mutant(
        "split_segments_overlap",
        "lightning_oso/randomness.py",
        "self._bits.advance(((segment - self._segment) << SEGMENT_BITS) - self._used)",
        "self._bits.advance(segment - self._segment)",
        ("tests/test_randomness.py::test_a_split_keyed_stream_gives_disjoint_segments_and_moves_past_them",),
        "a split stream's segments start one word apart: the runs of one draw share almost all their words, so "
        "their noise is nearly the same integers, shifted",
    ),
    Mutant(
        "sampler_threads_draw_every_run",
        "lightning_oso/exact_noise.py",
        "while (k := next(claims)) < runs:",
        "for k in range(runs):",
        ("tests/test_exact_release.py::test_a_split_draw_is_each_runs_own_segment_on_any_number_of_threads",),
        "each of the sampler's threads takes every run (a counter of its own): on two threads each run's noise is "
        "drawn twice from the same words, added twice to the grid index",
    ),
    Mutant(
        "direction_projection_reads_one_chunk_again",
        "lightning_oso/step.py",
        "torch.dot(a[i : i + chunk], b[i : i + chunk].to(torch.float64))",
        "torch.dot(a[i : i + chunk], b[:chunk].to(torch.float64))",
        ("tests/test_step.py::test_dot_in_float64_converts_by_chunks_and_equals_the_float64_dot",),
        "the direction query's projection pairs every chunk of g~ with the first chunk of S: one record's share is "
        "read several times, beyond the scalar's sensitivity of 1",
    ),
    Mutant(
        "compiled_projection_reads_one_task_again",
        "lightning_oso/step.py",
        "task = slice(starts[k], starts[k] + PRODUCT_TASK)",
        "task = slice(0, PRODUCT_TASK)",
        ("tests/test_step.py::test_the_compiled_float64_products_read_every_coordinate_once_in_float64",),
        "the CPU's compiled projection reads the first task's coordinates for every task: one record's share of S is "
        "read several times, beyond the scalar's sensitivity of 1",
    ),
    Mutant(
        "compiled_projection_in_float32",
        "lightning_oso/dot_kernel.py",
        "dot += value * np.float64(b[i])",
        "dot += np.float32(value) * b[i]",
        ("tests/test_step.py::test_the_compiled_float64_products_read_every_coordinate_once_in_float64",),
        "the direction query's projection multiplied in float32 against float32 sums: its rounding, which depends on "
        "every record, is no longer negligible beside the query's sensitivity",
    ),
)


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    status: str  # "killed", "survived", "timeout" (counted as killed), "stale" (old string not found once)
    seconds: float
    detail: str


def copy_checkout(into: Path) -> None:
    """The working tree's package, tests and configuration (uncommitted edits included) into ``into``."""
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"))
        elif source.exists():
            shutil.copy2(source, into / name)


def run_tests(copy: Path, tests: tuple[str, ...]) -> subprocess.CompletedProcess:
    """The named tests in ``copy``, whose ``lightning_oso`` is the one imported (``PYTHONPATH`` and the working
    directory both point there); stop at the first failure."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", *tests]
    return subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def apply(mutant: Mutant, copy: Path) -> str | None:
    """Edit the copy; the reason it cannot be edited, if it cannot."""
    path = copy / mutant.path
    if not path.exists():
        return f"{mutant.path} does not exist"
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        return f"{mutant.old!r} occurs {count} times in {mutant.path}, not once"
    path.write_text(text.replace(mutant.old, mutant.new))
    return None


def failed_tests(output: str) -> str:
    names = re.findall(r"^FAILED (\S+)", output, flags=re.MULTILINE)
    if names:
        return ", ".join(names)
    errors = re.findall(r"^ERROR (\S+)", output, flags=re.MULTILINE)
    return "error: " + ", ".join(errors) if errors else output.strip().splitlines()[-1] if output.strip() else ""


def check(mutant: Mutant) -> Outcome:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        copy = Path(tmp)
        copy_checkout(copy)
        problem = apply(mutant, copy)
        if problem is not None:
            return Outcome(mutant, "stale", time.monotonic() - start, problem)
        try:
            result = run_tests(copy, mutant.tests)
        except subprocess.TimeoutExpired:
            return Outcome(mutant, "timeout", time.monotonic() - start, f"tests ran past {TIMEOUT} s")
    status = "survived" if result.returncode == 0 else "killed"
    detail = failed_tests(result.stdout + result.stderr) if status == "killed" else "the named tests passed"
    if result.returncode not in (0, 1):  # pytest's 1 is "tests failed"; other codes: collection or usage errors
        detail = f"pytest exit {result.returncode}: {failed_tests(result.stdout + result.stderr)}"
    return Outcome(mutant, status, time.monotonic() - start, detail)


def baseline(mutants: list[Mutant]) -> subprocess.CompletedProcess:
    """Every named test on an unmutated copy: they must pass there, and the copy's package must be the one used."""
    tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as tmp:
        copy = Path(tmp)
        copy_checkout(copy)
        # a file only the copy has: the tests must import lightning_oso from the copy, or no mutant is seen at all
        marker = "_MUTATION_COPY = True\n"
        init = copy / "lightning_oso" / "__init__.py"
        init.write_text(init.read_text() + marker)
        probe = copy / "tests" / "test_zz_mutation_copy.py"
        probe.write_text(
            "import lightning_oso\n\n\ndef test_the_copy_is_imported():\n    assert lightning_oso._MUTATION_COPY\n"
        )
        return run_tests(copy, (*tests, "tests/test_zz_mutation_copy.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="mutants checked at once (default 2)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="check only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the named tests unmutated")
    args = parser.parse_args(argv)
    names = [m.name for m in MUTANTS]
    if len(set(names)) != len(names):
        raise SystemExit("two mutants share a name")
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.only and len(mutants) != len(set(args.only)):
        raise SystemExit(f"unknown mutant(s): {sorted(set(args.only) - set(names))}")
    if args.list:
        for m in mutants:
            print(f"{m.name:46} {m.path}: {m.what}")
        return 0
    start = time.monotonic()
    if not args.no_baseline:
        result = baseline(mutants)
        if result.returncode != 0:
            print(result.stdout[-4000:] + result.stderr[-2000:])
            print("the named tests fail without any mutant: fix them first")
            return 1
        print(f"baseline: the named tests pass unmutated ({time.monotonic() - start:.0f} s)", flush=True)
    failures = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for outcome in pool.map(check, mutants):
            bad = outcome.status in ("survived", "stale")
            failures += bad
            mark = "FAIL" if bad else "ok  "
            print(f"{mark} {outcome.status:8} {outcome.mutant.name:46} {outcome.seconds:5.0f} s  {outcome.detail}")
            sys.stdout.flush()
    print(f"{len(mutants) - failures} of {len(mutants)} mutants killed in {time.monotonic() - start:.0f} s")
    if failures:
        print("a survivor is a bug the tests would miss: add the test that catches it; a stale mutant must be moved")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
