"""`gptlab bench reference`: one training step of each preset by the naive C++ engine, by torch fp32 and by the
fastest torch path, on tiny shapes (one torch thread, so a busy machine does not stall them). Its printed table is
held to its own figures (tokens/s from batch x T over the ms, GFLOP/s from the model's FLOPs, the share from the
peak, the ratios from the ms, the by-function shares of the naive step); no assertion on which path is faster."""

import json
import re

import pytest
import torch

from helpers import number, one_thread  # noqa: F401 (one_thread: a fixture)
from gptlab.bench import reference
from gptlab.cli import main
from gptlab.model import GPT
from gptlab.peak import Peak, write_peak
from gptlab.reference import library
from gptlab.runtime import device_name

pytestmark = pytest.mark.skipif(library.missing() is not None, reason=f"the naive engine cannot run here: "
                                f"{library.missing()}")

CPU = torch.device("cpu")
ROW = re.compile(r"^(?P<name>naive C\+\+ fp32|torch fp32|torch fastest \([^)]*\))\s+(?P<B>\d+) x (?P<T>\d+)\s+"
                 r"(?P<ms>[\d,.]+)\s+(?P<best>[\d,.]+)\s+(?P<tps>[\d,.]+)\s+(?P<gflops>[\d,.]+)\s+"
                 r"(?P<share>[\d.]+%|-)\s+(?P<ratio>[\d,.]+)x$")
FUNCTION = re.compile(r"^  (?P<name>\S.*?)\s+(?P<ms>[\d,.]+) ms\s+(?P<share>[\d.]+)%")




def tables(out: str) -> list[dict]:
    """Each shape's printed rows and by-function lines, in order."""
    shapes = []
    for line in out.splitlines():
        if re.match(r"^\S.* layers x \d+ wide", line):
            shapes.append({"rows": [], "functions": {}, "step_ms": None})
        elif (row := ROW.match(line)) and shapes:
            shapes[-1]["rows"].append(row.groupdict())
        elif line.startswith("naive C++ fp32 step by function") and shapes:
            shapes[-1]["step_ms"] = number(re.search(r"([\d,.]+) ms\):$", line).group(1))
        elif (fn := FUNCTION.match(line)) and shapes:
            shapes[-1]["functions"][fn["name"]] = (number(fn["ms"]), number(fn["share"]))
    return shapes


def within(value: float, low: float, high: float) -> bool:
    return low <= value <= high


def check_rows(shape: dict, flops_per_token: float, peak: Peak | None) -> None:
    """Every printed figure of a row from the others, within what their printed rounding allows."""
    rows = shape["rows"]
    assert [r["name"] for r in rows[:2]] == ["naive C++ fp32", "torch fp32"] and len(rows) == 3
    assert rows[2]["name"] == reference.fastest_torch()[0]
    naive_ms = number(rows[0]["ms"])
    for r in rows:
        tokens, ms, tps, gflops = int(r["B"]) * int(r["T"]), number(r["ms"]), number(r["tps"]), number(r["gflops"])
        assert number(r["best"]) <= ms + 0.01
        assert within(tps, tokens * 1e3 / (ms + 0.005) - 0.05, tokens * 1e3 / (ms - 0.005) + 0.05)
        assert gflops == pytest.approx(flops_per_token * tps / 1e9, abs=0.0005 + flops_per_token * 0.05 / 1e9)
        ratio = number(r["ratio"])
        assert within(ratio, (naive_ms - 0.005) / (ms + 0.005) - 0.005, (naive_ms + 0.005) / (ms - 0.005) + 0.005)
        if peak is None:
            assert r["share"] == "-"
        else:
            flops = peak.bf16 if r["name"].endswith("(bf16 autocast)") else peak.fp32  # not "(fp32: no native bf16)"
            assert number(r["share"][:-1]) == pytest.approx(gflops * 1e9 / flops * 100, abs=0.005 + 0.0005e11 / flops)
    assert rows[0]["ratio"] == "1.00"


def check_functions(shape: dict) -> None:
    """The engine's functions' shares of the naive step sum to at most 100%, with the rest to 100%; each share is
    its ms over the step's."""
    functions, step = dict(shape["functions"]), shape["step_ms"]
    rest = functions.pop("the rest (no function of the engine)")
    assert {"linear_forward", "linear_backward", "attention_forward", "adamw", "clip_grad_norm"} <= set(functions)
    shares = [share for _, share in functions.values()]
    assert shares == sorted(shares, reverse=True) and all(s >= 0 for s in shares)
    assert sum(shares) <= 100 + 0.005 * len(shares)
    assert sum(shares) + rest[1] == pytest.approx(100, abs=0.005 * (len(shares) + 1))
    for ms, share in [*functions.values(), rest]:
        assert within(share, 100 * max(ms - 0.005, 0) / (step + 0.005) - 0.005, 100 * (ms + 0.005) / (step - 0.005) + 0.005)


def test_the_table_holds_to_its_own_figures_with_and_without_a_peak(capsys, one_thread):
    shapes = reference.reference_shapes(["char-quick", "char-small"], tiny=True)
    flops = [GPT(s.model).flops_per_token() for s in shapes]
    reference.run_reference_bench(shapes, steps=2, warmup=1)
    out = capsys.readouterr().out
    assert "no measured peak for it" in out and re.search(r"^machine load: ", out, re.MULTILINE)
    printed = tables(out)
    assert len(printed) == 2
    for shape, fpt in zip(printed, flops):
        assert {(r["B"], r["T"]) for r in shape["rows"]} == {("2", "16")}
        check_rows(shape, fpt, None)
        check_functions(shape)
    assert out.strip().splitlines()[-1].startswith("char-small (tiny): torch fastest")
    peak = Peak(1e10, device_name(CPU), bf16=2e10, measured_at="then")
    assert write_peak(CPU, peak)
    reference.run_reference_bench(shapes[:1], steps=1, warmup=0)
    out = capsys.readouterr().out
    assert "peaks measured then: fp32 10 GFLOP/s, bf16 20 GFLOP/s" in out and "no measured peak" not in out
    check_rows(tables(out)[0], flops[0], peak)
    assert "of the fp32 peak" in out.strip().splitlines()[-1]


def test_the_cli_prints_one_json_object_whose_figures_agree(capsys, one_thread):
    assert main(["bench", "reference", "--tiny", "--presets", "char-quick", "--steps", "2", "--warmup", "0",
                 "--batch-size", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["peak"] is None and report["load"].startswith("machine load: ") and report["threads"] == 1
    (shape,) = report["shapes"]
    assert shape["preset"] == "char-quick (tiny)" and shape["batch_size"] == 3 and shape["tokens_per_step"] == 48
    assert [r["contender"] for r in shape["rows"]] == ["naive C++ fp32", "torch fp32", reference.fastest_torch()[0]]
    naive_ms = shape["rows"][0]["ms_per_step"]
    for r in shape["rows"]:
        assert r["tokens_per_s"] == pytest.approx(48 / (r["ms_per_step"] / 1e3))
        assert r["gflops"] == pytest.approx(shape["flops_per_token"] * r["tokens_per_s"] / 1e9)
        assert r["vs_naive"] == pytest.approx(naive_ms / r["ms_per_step"]) and r["share"] is None
        assert r["best_ms"] <= r["ms_per_step"] and r["peak"] == ("bf16" if r["precision"] == "bf16" else "fp32")
    assert sum(shape["naive_by_function"].values()) + shape["naive_rest_s"] == pytest.approx(shape["naive_step_s"])
    assert 0 <= sum(shape["naive_by_function"].values()) <= shape["naive_step_s"]


def test_a_preset_runs_its_own_batch_unless_a_naive_step_of_it_is_over_the_limit():
    quick, small = reference.reference_shapes(["char-quick", "char-small"])
    assert quick.train.batch_size == 32 and small.train.batch_size == 1  # the presets' own: 32 and 64
    assert GPT(small.model).flops_per_token() * 256 * 64 > reference.NAIVE_STEP_LIMIT
    assert (quick.model.n_layer, quick.model.block_size, small.model.n_embd, small.model.dropout) == (4, 64, 384, 0.2)
    assert [s.train.batch_size for s in reference.reference_shapes(["char-quick", "char-small"], batch_size=5)] == [5, 5]


@pytest.mark.parametrize("argv, flag", [(["--steps", "0"], "--steps"), (["--warmup", "-1"], "--warmup"),
                                        (["--batch-size", "0"], "--batch-size")])
def test_the_cli_refuses_bad_numbers_in_one_line(capsys, argv, flag):
    assert main(["bench", "reference", "--tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and len(err.strip().splitlines()) == 1
