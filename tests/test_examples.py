"""The main demo runs end to end at its smallest setting and writes what the README promises."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import digits_oso  # noqa: E402


def test_digits_demo_smallest_setting(tmp_path):
    plot = tmp_path / "plot.png"
    result = digits_oso.main(["--epochs", "1", "--epsilon", "2.0", "--log-dir", str(tmp_path / "logs"),
                              "--plot", str(plot)])
    assert result["epsilon"] <= 2.0 and result["steps"] == 23
    assert 0.0 <= result["test_accuracy"] <= 1.0
    assert plot.stat().st_size > 10_000
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*"))
