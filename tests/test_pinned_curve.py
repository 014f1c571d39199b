"""A short loss curve of the default preset, pinned in a file: any change that alters training (initialisation,
batches, schedule, optimizer, precision policy, the model's arithmetic) shows up here, not weeks later as a worse
`make run`. Regenerate deliberately with GPTLAB_REPIN=1 after a change that is meant to alter training."""

import json
import os
from pathlib import Path

import pytest

from gptlab.data.prepare import prepare
from gptlab.runs import resolve, start

PINNED = Path(__file__).parent / "data" / "char_quick_curve.json"
STEPS = 30
# fp32 everywhere; CPUs with other vector units round the same products differently, by ~1e-6 a step
TOLERANCE = 2e-3


def test_the_default_preset_follows_its_pinned_curve(tmp_path):
    data = tmp_path / "shakespeare"
    prepare([], data, "char", quiet=True)
    spec = resolve(data=data, run=tmp_path / "run", train=dict(max_steps=STEPS, log_interval=1, eval_interval=STEPS,
                                                               eval_batches=4, precision="fp32", device="cpu"))
    assert spec.preset == "char-quick"
    result = start(spec, quiet=True)
    curve = {"train": [round(r["loss"], 6) for r in result.history if r["kind"] == "train"],
             "val": round(result.val_loss, 6)}
    if os.environ.get("GPTLAB_REPIN"):
        PINNED.write_text(json.dumps(curve, indent=1) + "\n")
    pinned = json.loads(PINNED.read_text())
    assert len(curve["train"]) == len(pinned["train"]) == STEPS
    assert curve["train"] == pytest.approx(pinned["train"], abs=TOLERANCE)
    assert curve["val"] == pytest.approx(pinned["val"], abs=TOLERANCE)
