"""The fence around Opacus' PRV internals (lightning_oso/accounting/prv.py, "Opacus' PRV internals"): every name,
constructor keyword and attribute the PRV accountant reads is where it reads it, and one that moves fails loudly,
naming it, instead of falling back to RDP in silence."""

import opacus.accountants.analysis.prv as upstream
import pytest

from lightning_oso import compute_epsilon
from lightning_oso.accounting import prv


@pytest.fixture
def fresh_prv_cache():
    """The PRV bounds are cached per history: computed anew inside the test, and not kept from a patched Opacus."""
    prv._prv_bounds_cached.cache_clear()
    yield
    prv._prv_bounds_cached.cache_clear()


def test_every_opacus_prv_internal_the_accountant_reads_is_where_it_reads_it():
    problems = prv.opacus_prv_api_problems()
    assert not problems, (
        f"Opacus' PRV internals moved (lightning_oso's accessors were written against opacus "
        f"{prv.OPACUS_PRV_TESTED}):\n" + "\n".join(problems)
    )
    assert set(prv.OPACUS_PRV_API) <= set(upstream.__all__)


def test_a_name_gone_from_opacus_fails_loudly_naming_it(monkeypatch, fresh_prv_cache):
    monkeypatch.delattr(upstream, "compose_heterogeneous")
    history = [(1.0, 0.01, 100)]
    with pytest.raises(ImportError, match=r"opacus\.accountants\.analysis\.prv\.compose_heterogeneous is gone"):
        prv.prv_epsilon(history, 1e-5)
    # not an AccountingError: the default accountant must not answer with RDP as if the PRV method had failed
    with pytest.raises(ImportError, match="compose_heterogeneous"):
        compute_epsilon(history, 1e-5)
    problems = prv.opacus_prv_api_problems()
    assert len(problems) == 1 and "prv.compose_heterogeneous is gone" in problems[0]
    assert prv.OPACUS_PRV_TESTED in problems[0]


def test_a_renamed_constructor_keyword_is_named(monkeypatch):
    class Domain:  # Opacus' Domain with its size renamed: called by keyword, it cannot take a number meant for another
        def __init__(self, t_min, t_max, points, shifts=0.0):
            pass

    monkeypatch.setattr(upstream, "Domain", Domain)
    assert prv.opacus_prv_api_problems() == ["opacus.accountants.analysis.prv.Domain takes no argument 'size'"]


def test_a_missing_attribute_is_named(monkeypatch):
    original = upstream.Domain

    class Domain:  # everything the accountant reads but the composer's bookkeeping of shifts
        def __init__(self, t_min, t_max, size):
            self._inner = original(t_min=t_min, t_max=t_max, size=size)
            self.t_min, self.t_max, self.size = t_min, t_max, size
            self.dt, self.ts, self.shift_right = self._inner.dt, self._inner.ts, self._inner.shift_right

    monkeypatch.setattr(upstream, "Domain", Domain)
    assert prv.opacus_prv_api_problems() == ["opacus.accountants.analysis.prv.Domain(...) has no attribute 'shifts'"]


def test_a_call_that_upstream_refuses_is_named(monkeypatch):
    def compose_heterogeneous(dprvs, num_self_compositions):
        raise ValueError("dprvs and num_self_compositions must have the same length")

    monkeypatch.setattr(upstream, "compose_heterogeneous", compose_heterogeneous)
    [problem] = prv.opacus_prv_api_problems()
    assert problem.startswith("opacus.accountants.analysis.prv.compose_heterogeneous(...) failed as lightning_oso")
    assert "ValueError" in problem
