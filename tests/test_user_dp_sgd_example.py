"""examples/dp_sgd.py: DP-SGD with ``per_sample_clip`` on the example language model, its loss compiled in."""
from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "dp_sgd.py"


def test_the_dp_sgd_example_checks_its_norms_clips_and_keeps_the_loss_in_the_region():
    main = runpy.run_path(str(EXAMPLE))["main"]
    out = main(["--steps", "3", "--batches", "1"])
    assert out["norm_rel_err"] <= 1e-5, out["norm_rel_err"]
    assert len(out["losses"]) == 3 and all(0 < c <= 1 for c in out["clipped"]), out  # NB: C is below the norms
    assert "embedding lookup" in out["reason"] and "sum(s) over time" in out["reason"], out["reason"]
