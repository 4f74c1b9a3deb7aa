"""Fixtures, and the hypothesis profile of the property-based tests; the shared helpers (ToyModel, toy_data,
toy_loader, make_trainer, ...) live in helpers.py."""

import logging
import os

import lightning.pytorch as L
import pytest
import torch
from helpers import ToyModel, make_trainer, toy_loader
from hypothesis import HealthCheck, settings

from lightning_oso import OSODP

# The property-based tests (test_properties.py) run the same examples on every run and every machine: derandomized
# (the examples follow from each test's code, not from a random seed or a database of past failures), a modest number
# of examples, no deadline (a CPU shared with other jobs makes example times vary). HYPOTHESIS_PROFILE=explore draws
# fresh random examples, many more of them, to look for counterexamples locally.
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=12,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", max_examples=300, deadline=None, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test runs on one intra-op thread, whatever the test before it left: the examples' ``main`` sets
    ``torch.set_num_threads`` for their command-line users (up to 4, and never puts it back), and the
    tests' tiny models then ran every later test with threads fighting for the cores (several times slower under
    load). One thread is also what the tests' small tensors run fastest on."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _lightning_log_level():
    """Lightning's logger keeps the level it had before the test: the examples' workers quiet it
    (``setLevel(ERROR)``, for their command-line users) and never put it back, so a test that reads Lightning's
    messages (``caplog``) read nothing when one of them had run before it in the same process."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.fixture(autouse=True)
def _seed():
    L.seed_everything(1234, verbose=False)


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Every test runs in its own directory: trainers write their logs and privacy ledgers under the working
    directory (their default_root_dir), never into the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _reproducible_default_streams(request, monkeypatch):
    """A DP callback or search given no seed draws its root from the operating system (production behaviour, so no
    two runs share noise). Tests assert statistical properties of whole runs, so here a run without a seed gets a
    root fixed per test instead (as ``seed_everything`` fixed torch's global generator before): a failure then
    reproduces. Resume nonces (``randomness.os_nonce``) and ``secure_rng`` still come from the OS."""
    import zlib

    import numpy as np

    from lightning_oso import callbacks, randomness
    from lightning_oso.search import harness

    original = randomness.root_seed_sequence
    test_key = zlib.crc32(request.node.nodeid.encode())

    def fixed_for_this_test(seed):
        return original(np.random.SeedSequence(1234, spawn_key=(test_key,)) if seed is None else seed)

    for module in (randomness, callbacks, harness):
        monkeypatch.setattr(module, "root_seed_sequence", fixed_for_this_test)


@pytest.fixture
def fit_toy():
    """Train the toy problem privately: ``fit_toy(model=None, dp=None, loader=None, **trainer_kwargs)`` fits
    ``model`` (a fresh ``ToyModel``) on ``loader`` (``toy_loader()``: 200 records, expected batch 20) with the DP
    callback ``dp`` (``OSODP(target_epsilon=3.0, target_delta=1e-4)``) on a quiet CPU trainer (``make_trainer``:
    3 epochs unless ``trainer_kwargs`` say otherwise), and returns the trainer."""

    def fit(model=None, dp=None, loader=None, **trainer_kwargs):
        model = ToyModel() if model is None else model
        dp = OSODP(target_epsilon=3.0, target_delta=1e-4) if dp is None else dp
        trainer = make_trainer([dp], **trainer_kwargs)
        trainer.fit(model, toy_loader() if loader is None else loader)
        return trainer

    return fit


def pytest_collection_modifyitems(config, items):
    """The tests marked slow run first, each module's in their order. Under ``make test`` (pytest-xdist's work
    stealing) a worker whose queue runs out takes the last half of another's: with the long tests at the front, what
    is left to share at the end is short, and no worker is left alone with a long test while the others are idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
