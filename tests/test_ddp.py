"""DP training on Lightning's DDP: 2 CPU processes with the gloo backend (tests/ddp_worker.py runs them).

The worker script runs every scenario once per test session (``ddp_runs``: one launch, which Lightning relaunches for
rank 1, each scenario its own Trainer in the same two processes); the processes write what they ended with, and the
tests compare the processes with each other and with a single-process run of the same settings.
"""

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from helpers import ToyModel, make_trainer, toy_loader
from torch import nn

from lightning_oso import OSODP, DPDDPStrategy, FixedThresholdDP, compute_epsilon, step
from lightning_oso.clipping import FixedThresholdClipping
from lightning_oso.per_sample import TensorSource
from lightning_oso.randomness import RunRandomness
from lightning_oso.strategies import PrivacyPlan, PrivateTraining
from lightning_oso.validation import PrivacyConfigurationError

WORKER = Path(__file__).parent / "ddp_worker.py"


def _launch_refused(scenario, out):
    """One scenario alone, which must fail (``sum``, tests/test_checks.py): its completed process."""
    result = subprocess.run(
        [sys.executable, str(WORKER), scenario, str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode != 0, result.stdout[-2000:]
    return result


def _results(out, suffix=""):
    return [torch.load(out / f"rank{r}{suffix}.pt") for r in range(2)]


@pytest.fixture(scope="session")
def ddp_runs(tmp_path_factory):
    """The folder of ``ddp_worker.py all``'s results: launched once per test session, by whichever test process needs
    it first (the others wait on the lock and read the same results, or the same failure)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's folder, under xdist
    out, status = shared / "ddp_runs", shared / "ddp_runs.json"
    with FileLock(str(shared / "ddp_runs.lock")):
        if not status.exists():
            result = subprocess.run(
                [sys.executable, str(WORKER), "all", str(out)],
                capture_output=True,
                text=True,
                timeout=600,
                cwd=Path(__file__).parent.parent,
            )
            status.write_text(json.dumps({"returncode": result.returncode, "stderr": result.stderr[-4000:]}))
    launched = json.loads(status.read_text())
    assert launched["returncode"] == 0, launched["stderr"]
    return out


def _same_on_every_process(ranks, keys):
    for key in keys:
        assert ranks[0][key] == ranks[1][key], key
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_processes_stay_identical_and_spend_what_one_process_would(ddp_runs):
    """OSO with momentum on 2 processes, stopped by the budget: parameters, C_t, rho_t, steps and epsilon are the
    same on both; each process saw only its shard; the accountant saw the global rate, and the run spent exactly
    what one process with the global batch size spends."""
    ranks = _results(ddp_runs / "train")
    _same_on_every_process(ranks, ["clip", "lr", "steps", "epsilon", "max_steps", "stop_reason"])
    run = ranks[0]
    assert run["world_size"] == 2 and run["stop_reason"]  # stopped by the budget, on both processes
    assert not all(torch.equal(a, b) for a, b in zip(run["initial"], run["params"]))
    assert run["lr"] != 0.5  # rho_t moved, identically on both
    for r, seen in enumerate(r["seen"] for r in ranks):
        assert len(seen) == run["steps"] and all(i % 2 == r for batch in seen for i in batch)  # its own shard
    assert run["sample_rate"] == pytest.approx(20 / 200)  # 10 per process, 2 processes, 200 records
    history = [(run["noise_multiplier"], run["sample_rate"], run["steps"])]
    expected = compute_epsilon(history, 1e-3) + _floating_point_term(run)
    assert run["epsilon"] == pytest.approx(expected, rel=1e-9) and run["epsilon"] <= 1.0
    single = OSODP(target_epsilon=1.0, target_delta=1e-3, noise_multiplier=1.5, seed=3)
    make_trainer([single], max_epochs=50).fit(ToyModel(momentum=0.5), toy_loader(batch_size=20))
    assert (single.steps, single.max_steps, single.sample_rate) == (run["steps"], run["max_steps"], run["sample_rate"])
    assert single.epsilon == pytest.approx(run["epsilon"], rel=1e-9)


@pytest.mark.slow
def test_accumulated_micro_batches_make_one_step_across_processes(ddp_runs):
    """accumulate_grad_batches=2 on 2 processes: each process runs 2 micro-batches of its shard per optimizer step,
    the processes stay identical (one all-reduce per optimizer step), and the run is accounted as one process with
    the global logical batch: q = 2 * 5 * 2 / 200, ceil(N / qN) = 10 optimizer steps an epoch."""
    ranks = _results(ddp_runs / "accumulate")
    _same_on_every_process(ranks, ["clip", "lr", "steps", "epsilon", "sample_rate"])
    run = ranks[0]
    assert run["sample_rate"] == pytest.approx(0.1) and run["steps"] == 2 * 10
    for r, seen in enumerate(r["seen"] for r in ranks):
        assert len(seen) == 2 * run["steps"] and all(i % 2 == r for batch in seen for i in batch)
        for t in range(run["steps"]):  # the two parts of a logical batch: nearly equal, disjoint
            first, second = seen[2 * t], seen[2 * t + 1]
            assert abs(len(first) - len(second)) <= 1 and not set(first) & set(second)
    history = [(run["noise_multiplier"], 0.1, run["steps"])]
    assert run["epsilon"] == pytest.approx(compute_epsilon(history, 1e-3) + _floating_point_term(run), rel=1e-9)


@pytest.mark.slow
def test_noise_is_added_once_globally(ddp_runs):
    """Zero gradients, one step with lr 1: the weights move by the noise alone, std nu C / B with B the global
    expected batch size, as on one process. Noise added by each process would show sqrt(2) times that."""
    ranks = _results(ddp_runs / "noise")
    _same_on_every_process(ranks, ["steps"])
    delta = torch.cat([(a - b).flatten() for a, b in zip(ranks[0]["params"], ranks[0]["initial"])])
    expected = 2.0 * 0.5 / 20.0  # nu * C / (q N)
    tolerance = 5 / (2 * delta.numel()) ** 0.5
    assert delta.std().item() == pytest.approx(expected, rel=tolerance)

    class ZeroLoss(ToyModel):
        def training_step(self, batch, batch_idx):
            return 0.0 * self(batch[0]).sum()

    model = ZeroLoss(net=nn.Sequential(nn.Linear(10, 2000)), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    dp = FixedThresholdDP(target_epsilon=10.0, target_delta=1e-4, noise_multiplier=2.0, clip=0.5, seed=3)
    make_trainer([dp], max_steps=1).fit(model, toy_loader(batch_size=20))
    single = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert delta.std().item() / single.std().item() == pytest.approx(1.0, rel=2 * tolerance)


@pytest.mark.slow
def test_resume_on_several_processes_ends_where_the_uninterrupted_run_ends(ddp_runs):
    """deterministic_resume across processes: an interrupted run resumed from its checkpoint ends where the
    uninterrupted one ends, on every process (the ledger, written by rank 0, charges the same steps on all)."""
    full = _results(ddp_runs / "resume" / "full")
    # the interrupted run (one epoch, its checkpoint: "_part"), then the run resumed from it to 4 epochs
    assert _results(ddp_runs / "resume", "_part")[0]["steps"] == 10
    resumed = _results(ddp_runs / "resume", "_load")
    _same_on_every_process(resumed, ["clip", "lr", "steps", "epsilon"])
    assert resumed[0]["steps"] == full[0]["steps"] == 40
    for key in ("clip", "lr", "epsilon", "noise_multiplier"):
        assert resumed[0][key] == pytest.approx(full[0][key], rel=1e-12), key
    for a, b in zip(full[0]["params"], resumed[0]["params"]):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_non_finite_gradient_on_one_process_stops_no_process(ddp_runs):
    """An inf input on rank 1 only: the record gets weight 0 there, and both processes take every step and end
    identical (nothing tells one process, or the user, that a record was zeroed)."""
    ranks = _results(ddp_runs / "nan")
    _same_on_every_process(ranks, ["clip", "lr", "steps", "epsilon"])
    assert ranks[0]["steps"] == 10
    assert all(torch.isfinite(p).all() for p in ranks[0]["params"])


class _World:
    """Processes simulated as threads of one test: ``torch.distributed.all_reduce`` replaced by a sum over the
    threads (in rank order, so every process gets the same bits), everything else the private step's own code."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots = [None] * size
        self.local = threading.local()

    def all_reduce(self, tensor, *args, **kwargs):
        self.slots[self.local.rank] = tensor.clone()
        self.barrier.wait()
        total = self.slots[0].clone()
        for other in self.slots[1:]:
            total += other
        self.barrier.wait()
        tensor.copy_(total)

    def run(self, process):
        results, errors = [None] * self.size, []

        def target(rank):
            self.local.rank = rank
            try:
                results[rank] = process(rank)
            except BaseException as err:  # re-raised in the test's thread
                errors.append(err)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


class _Process(PrivateTraining):
    """One process of a DDP world: the strategy's private step (``privatise``) with its rank and world size."""

    def __init__(self, rank, world_size, randomness, rule, expected_batch_size):
        self._init_privacy()
        self.global_rank, self.world_size, self.root_device = rank, world_size, torch.device("cpu")
        self.configure_privacy(PrivacyPlan(randomness, rule=rule))
        self.expected_batch_size = expected_batch_size


@pytest.mark.parametrize("secure_rng", [False, True])
def test_two_processes_add_the_noise_once_to_the_sum_of_their_clipped_sums(monkeypatch, secure_rng):
    """Two processes, each with its own records, run one private step: both end with the same gradient, and that
    gradient times ``B`` is the sum of the two processes' clipped sums plus noise of std ``C nu`` (one draw, on the
    grid of that std), whether the noise comes from the step's keyed stream (every process draws the same integers)
    or from the operating system (rank 0 draws, the others add zeros). Noise added by each process would have std
    ``sqrt(2) C nu``; noise drawn per process from its own stream would leave the processes apart. The slow
    ``test_noise_is_added_once_globally`` checks the same through Lightning's DDP."""
    world = _World(2)
    monkeypatch.setattr(torch.distributed, "all_reduce", world.all_reduce)
    nu, clip, expected_batch_size, shapes = 1.7, 0.6, 16.0, [(300, 200), (40_000,)]
    records = []
    for rank in range(2):
        g = torch.Generator().manual_seed(10 + rank)
        records.append([torch.randn(5, *shape, generator=g, dtype=torch.float64) * 0.003 for shape in shapes])

    def process(rank):
        rule = FixedThresholdClipping(noise_multiplier=nu, clip=clip)
        randomness = RunRandomness(secure=True) if secure_rng else RunRandomness(3)
        strategy = _Process(rank, 2, randomness, rule, expected_batch_size)
        params = [nn.Parameter(torch.zeros(shape, dtype=torch.float64)) for shape in shapes]
        strategy._clipped = step.clip_and_sum(TensorSource(records[rank]), rule)
        strategy.privatise(torch.optim.SGD(params, lr=1.0))
        return torch.cat([p.grad.flatten() for p in params])

    first, second = world.run(process)
    assert torch.equal(first, second)  # one release, the same on every process
    noiseless = torch.zeros_like(first)
    for rank in range(2):
        for g in torch.cat([r.flatten(1) for r in records[rank]], dim=1):
            noiseless += g * min(1.0, clip / g.norm().item())
    assert noiseless.norm() > 2 * clip  # every record clipped (norm ~0.95), from both processes
    total = first * expected_batch_size  # exact: B is a power of two
    n = total.numel()
    widened = clip * nu / (1 - nu * math.sqrt(n) * 2.0**-30)
    gamma = 2.0 ** (math.frexp(widened)[1] - 31)
    assert torch.equal(total / gamma, (total / gamma).round())  # on the grid of one noise of std C nu
    noise = total - noiseless
    assert noise.std().item() == pytest.approx(widened, rel=5 / math.sqrt(2 * n))
    assert abs(noise.mean().item()) < 5 * widened / math.sqrt(n)


def test_wrapper_arguments_and_plain_ddp_are_refused():
    with pytest.raises(PrivacyConfigurationError, match="find_unused_parameters"):
        DPDDPStrategy(find_unused_parameters=True)
    from lightning.pytorch.strategies import DDPStrategy

    with pytest.raises(PrivacyConfigurationError, match="DPDDPStrategy"):
        make_trainer([OSODP(target_epsilon=1.0)], strategy=DDPStrategy(process_group_backend="gloo")).fit(
            ToyModel(), toy_loader()
        )


def _floating_point_term(run):
    """The exact release's floating-point term the run charged beside the accountant's epsilon
    (``exact_noise.floating_point_epsilon``: two model-sized rows per step)."""
    from lightning_oso.exact_noise import floating_point_epsilon

    coordinates = sum(p.numel() for p in run["params"])
    return floating_point_epsilon(2 * (coordinates + 1), run["steps"])
