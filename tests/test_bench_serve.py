"""`gptlab bench serve` on a tiny run, few clients: the table's shape, every request accounted for, and a small
queue's 429s beside accepted requests that all complete; `--scenario shared-prefix` on a tiny run: the servers with
and without the prefix cache, the cached one serving the prefix's whole chunks (timings are never asserted)."""

import re

import pytest
from helpers import tiny_run

from gptlab.bench.serve import Outcome, Phase, Side, _prefix_summary, percentile, shared_prompts
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


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """A tiny run whose context (128) holds a prompt of one whole prompt-pass chunk (64 tokens) and more."""
    flags = [*TINY[:6], "--block-size", "128", *TINY[8:]]
    return tiny_run(tmp_path_factory.mktemp("bench-serve-prefix"), 2, flags)


def test_the_shared_prefix_scenario_times_both_servers_and_the_cached_one_serves_the_prefix(long_run, capsys):
    """--prefix-tokens 64 --suffix-tokens 8: a prompt of 72 tokens, of which the whole chunks before the last token
    (71 // 64 = 1 chunk of 64) are what a prefix cache can serve; the server without it serves none."""
    out = bench(capsys, long_run, "--scenario", "shared-prefix", "--prefix-tokens", "64", "--suffix-tokens", "8",
                "--max-tokens", "4", "--sequential", "2", "--clients", "3", "--requests", "1")
    # (mode, cache): clients, requests, ok, 429, errors, tokens, cached p50
    table = {(line[:14].strip(), line[15:20].strip()): line[20:].split()[:7] for line in out.splitlines()
             if line.startswith(("one at a time", "concurrent"))}
    assert table == {("one at a time", "on"): ["1", "2", "2", "0", "0", "8", "64"],
                     ("concurrent", "on"): ["3", "3", "3", "0", "0", "12", "64"],
                     ("one at a time", "off"): ["1", "2", "2", "0", "0", "8", "0"],
                     ("concurrent", "off"): ["3", "3", "3", "0", "0", "12", "0"]}
    assert "--prefix-cache-mb 512 and 0 (off)" in out and "the cache then held 1 block of 64 tokens" in out
    assert "every request was sent" in out and "errors (not 429): 0; 429s: 0" in out
    ttft = re.search(r"time to first token, one request at a time \(median of 2 and 2\): ([\d.]+) s with the prefix "
                     r"cache, ([\d.]+) s without: ([\d.]+)x faster; 64 of 72 prompt tokens served from the cache", out)
    with_cache, without, ratio = map(float, ttft.groups())
    assert quotient_of(ratio, without, with_cache, 0.0005)  # the one without over the one with, as printed
    rates = re.search(r"3 concurrent clients sharing the 64-token prefix: ([\d.]+) tokens/s with the prefix cache, "
                      r"([\d.]+) without: ([\d.]+)x$", out.strip())
    with_cache, without, ratio = map(float, rates.groups())
    assert quotient_of(ratio, with_cache, without, 0.05)


def quotient_of(ratio: float, a: float, b: float, rounded: float) -> bool:
    """Whether a printed ratio (2 decimals) is a / b for some a and b that print as these (rounded by +- rounded)."""
    lo, hi = (a - rounded) / (b + rounded), (a + rounded) / max(b - rounded, 1e-12)
    return lo - 0.005 <= ratio <= hi + 0.005


def test_shared_prompts_share_the_prefix_and_differ_after_it():
    prompt = shared_prompts(50, 10, 4)
    a, b = prompt("a"), prompt("b")
    assert len(a) == len(b) == 14 and a[:10] == b[:10] and a[10:] != b[10:] and prompt("a") == a
    assert all(0 <= i < 50 for i in a + b)


def test_a_prefix_and_suffix_past_the_context_are_refused(long_run, capsys):
    """120 + 8 tokens fit a context of 128, 120 + 9 do not (refused before any server starts)."""
    assert main(["bench", "serve", "--run", str(long_run), "--scenario", "shared-prefix", "--prefix-tokens", "120",
                 "--suffix-tokens", "9"]) == 2
    assert "--prefix-tokens + --suffix-tokens (120 + 9) must fit the model's context of 128 tokens" in \
        capsys.readouterr().err


def test_the_shared_prefix_headline_is_worked_out_from_the_requests_as_by_hand():
    """Four requests a side with known times: the median time to first token (nearest rank: the 2nd of 4) with the
    cache 0.10 s, without 0.80 s, so 8.00x; the cached tokens' median is the 2nd of [0, 64, 64, 128]; 8 clients'
    tokens/s 300 against 100: 3.00x."""
    def side(cache, ttfts, cached, tokens):
        alone = Phase("one at a time", 1, 1.0, [Outcome(200, 10, t, 1.0, "", c) for t, c in zip(ttfts, cached)])
        together = Phase("concurrent", 8, 2.0, [Outcome(200, tokens // 4) for _ in range(4)])
        return Side(cache, None, "", alone, together)
    on = side("on", [0.3, 0.1, 0.05, 0.1], [128, 64, 0, 64], 600)
    off = side("off", [0.9, 0.8, 0.8, 0.7], [0, 0, 0, 0], 200)
    lines = _prefix_summary([on, off], 768, 64, 4)
    assert lines[0] == "every request was sent" and lines[1] == "errors (not 429): 0; 429s: 0"
    assert lines[2] == ("time to first token, one request at a time (median of 4 and 4): 0.100 s with the prefix cache, "
                        "0.800 s without: 8.00x faster; 64 of 832 prompt tokens served from the cache (median)")
    assert lines[3] == ("8 concurrent clients sharing the 768-token prefix: 300.0 tokens/s with the prefix cache, 100.0 "
                        "without: 3.00x")
    off.together.seconds = 0.0  # no concurrent request finished: no rate, and no ratio over it (not a division by 0)
    assert _prefix_summary([on, off], 768, 64, 4)[3].endswith("300.0 tokens/s with the prefix cache, 0.0 without: n/a")
