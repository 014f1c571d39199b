"""`gptlab bench race`: the time to a target loss is read at the first evaluation under it, and the race table
puts the reference first and names the fastest contender."""

import json

from gptlab.bench.race import contenders, run_lap, run_race, time_to_target

TINY_MODEL = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, dropout=0.0)


def test_time_to_target_is_the_training_time_of_the_first_evaluation_under_it():
    history = [{"kind": "train", "step": 5, "loss": 2.0},
               {"kind": "eval", "step": 10, "val_loss": 2.5, "train_s": 1.0},
               {"kind": "eval", "step": 20, "val_loss": 1.9, "train_s": 2.1},
               {"kind": "eval", "step": 30, "val_loss": 1.8, "train_s": 3.0}]
    assert time_to_target(history, 2.0) == (20, 2.1)
    assert time_to_target(history, 1.9) == (20, 2.1)  # at or under
    assert time_to_target(history, 1.0) == (None, None)


def test_a_small_race_prints_the_reference_first_and_names_the_fastest(char_data, capsys):
    reference = dict(model=TINY_MODEL, train=dict(batch_size=4, max_steps=30, lr=1e-3, min_lr=1e-4, warmup_steps=5,
                                                  precision="fp32"))
    changes = dict(model=TINY_MODEL, train=dict(batch_size=4, max_steps=30, lr=1e-2, warmup_steps=5))
    laps = run_race(["adamw", "muon"], eval_every=5, data=char_data, reference=reference, changes=changes)
    out = capsys.readouterr().out.splitlines()
    assert [lap.name for lap in laps] == ["nanoGPT CPU recipe (reference)", "char-quick, adamw", "char-quick, muon"]
    assert out[0].startswith(f"race to validation loss {laps[0].final_val:.4f}")  # the reference's own final loss
    assert laps[0].steps_to_target is not None  # ... which it reaches (at or under, not only below)
    assert out[2].startswith("nanoGPT CPU recipe (reference)") and out[2].rstrip().endswith("1.00x")
    # a target every contender reaches at its first evaluation: the headline names the fastest of them
    laps = run_race(["adamw", "muon"], target=100.0, eval_every=5, data=char_data, reference=reference,
                    changes=changes)
    headline = capsys.readouterr().out.splitlines()[-1]
    assert all(lap.steps_to_target == 5 for lap in laps)
    fastest = min(laps[1:], key=lambda lap: lap.seconds_to_target)
    ratio = laps[0].seconds_to_target / fastest.seconds_to_target
    assert headline == f"headline: {fastest.name} reaches the reference's 100.0000 {ratio:.2f}x faster than the reference"


def test_contenders_are_each_optimizer_in_each_precision_and_auto_is_the_presets_own_choice():
    got = contenders(["adamw", "muon"], ["auto", "fp32"], dict(train=dict(max_steps=7)))
    assert [name for name, _, _, _ in got] == ["char-quick, adamw", "char-quick, muon", "char-quick, adamw, fp32",
                                               "char-quick, muon, fp32"]
    assert [(p, t["optimizer"], t["precision"], t["max_steps"]) for _, p, _, t in got] == [
        ("char-quick", "adamw", "auto", 7), ("char-quick", "muon", "auto", 7), ("char-quick", "adamw", "fp32", 7),
        ("char-quick", "muon", "fp32", 7)]
    assert [name for name, _, _, _ in contenders(["adamw"])] == ["char-quick, adamw"]
    assert [(name, p) for name, p, _, _ in contenders(["adamw", "muon"], ["fp32"], presets=["char-quick", "char-race"])
            ] == [("char-quick, adamw, fp32", "char-quick"), ("char-quick, muon, fp32", "char-quick"),
                  ("char-race, adamw, fp32", "char-race"), ("char-race, muon, fp32", "char-race")]  # preset by preset


def test_the_race_trains_each_contender_from_its_own_preset(char_data, monkeypatch):
    from gptlab.bench import race

    reference = dict(model=TINY_MODEL, train=dict(batch_size=4, max_steps=2, lr=1e-3, min_lr=1e-4, warmup_steps=1,
                                                  precision="fp32"))
    trained = []

    def lap(name, *args, preset=None, **kw):
        trained.append((name, preset))
        return real(name, *args, preset=preset, **kw)
    real = race.run_lap
    monkeypatch.setattr(race, "run_lap", lap)
    race.run_race(["muon"], target=100.0, eval_every=1, data=char_data, reference=reference,
                  changes=dict(train=dict(max_steps=1)), precisions=["fp32"], presets=["char-race"])
    assert trained == [("nanoGPT CPU recipe (reference)", None), ("char-race, muon, fp32", "char-race")]


def test_a_lap_of_the_race_preset_trains_its_shape_and_settings(char_data, tmp_path):
    """char-race is the fp32 race's preset: 2 layers 192 wide, Muon at 0.04 (docs/benchmarks.md, the sweep)."""
    lap, history = run_lap("char-race, muon, fp32", char_data, {}, {"optimizer": "muon", "precision": "fp32",
                                                                    "max_steps": 2}, tmp_path / "r", 1, 100.0,
                           preset="char-race")
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (config["preset"], config["model"]["n_layer"], config["model"]["n_embd"], config["model"]["block_size"]) \
        == ("char-race", 2, 192, 64)
    assert (config["train"]["optimizer"], config["train"]["muon_lr"], config["train"]["batch_size"],
            config["train"]["precision"]) == ("muon", 0.04, 32, "fp32")
    assert lap.steps_to_target == 1 and [r["step"] for r in history if r.get("kind") == "eval"][:2] == [1, 2]


def test_the_command_line_races_the_presets_optimizers_and_precisions_it_names(monkeypatch):
    """`gptlab bench race`'s flags as the race receives them (the race itself is the tests above: minutes here)."""
    from gptlab.bench import race
    from gptlab.cli import main

    asked = []
    monkeypatch.setattr(race, "run_race", lambda optimizers, **kw: asked.append((optimizers, kw)))
    assert main(["bench", "race", "--presets", "char-quick", "char-race", "--optimizers", "muon",
                 "--precisions", "fp32", "--eval-every", "5", "--target", "1.9"]) == 0
    assert main(["bench", "race"]) == 0
    assert asked == [
        (["muon"], dict(target=1.9, eval_every=5, precisions=["fp32"], presets=["char-quick", "char-race"])),
        (["adamw", "muon"], dict(target=None, eval_every=25, precisions=["auto"], presets=["char-quick"]))]
