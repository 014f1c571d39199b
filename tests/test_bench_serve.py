"""`gptlab bench serve` on a tiny run, few clients: the table's shape, every request accounted for, and a small
queue's 429s beside accepted requests that all complete."""

import re

import pytest
from helpers import tiny_run

from gptlab.bench.serve import percentile
from gptlab.cli import main

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "32", "--batch-size", "4",
        "--eval-interval", "5", "--eval-batches", "2", "--log-interval", "5", "--precision", "fp32", "--quiet"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):

    return tiny_run(tmp_path_factory.mktemp("bench-serve"), 5, TINY)


def bench(capsys, run_dir, *flags):
    capsys.readouterr()
    assert main(["bench", "serve", "--run", str(run_dir), "--precision", "fp32", *flags]) == 0
    return capsys.readouterr().out


def test_bench_serve_reports_both_modes_and_a_headline(run_dir, capsys):
    out = bench(capsys, run_dir, "--clients", "3", "--requests", "2", "--sequential", "2", "--max-tokens", "12")
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()
            if line.startswith(("one at a time", "concurrent"))}
    assert rows["one at a time"][4:10] == ["1", "2", "2", "0", "0", "24"]  # clients, requests, ok, 429, errors, tokens
    assert rows["concurrent"][1:7] == ["3", "6", "6", "0", "0", "72"]
    assert "TTFT p95" in out and "lat p95" in out and "every request was sent" in out
    assert re.search(r"3 concurrent clients: [\d.]+ tokens/s, [\d.]+x one client's [\d.]+; p95 latency [\d.]+ s; "
                     r"6 of 6 requests completed$", out.strip())


def test_a_small_queue_refuses_the_excess_with_429_and_completes_the_rest(run_dir, capsys):
    out = bench(capsys, run_dir, "--clients", "12", "--requests", "1", "--sequential", "1", "--max-tokens", "1000",
                "--max-batch", "2", "--queue", "2")
    line = next(line for line in out.splitlines() if "refused with 429" in line)
    refused, sent, accepted, completed = map(int, re.findall(r"(\d+) of (\d+) requests refused.*; (\d+) accepted, "
                                                              r"(\d+) completed", line)[0])
    # 12 arrive together for 2 places in the batch and 2 in the queue; a request lasts far longer than the burst
    assert sent == 12 and refused >= 12 - 4 - 2 and accepted == completed == 12 - refused
    assert "errors (not 429): 0" in out


def test_percentiles_by_nearest_rank():
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile(list(map(float, range(1, 101))), 95) == 95.0
