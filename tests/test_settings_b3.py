"""More settings at non-default values, each checked against what the documentation says it does (docs/design.md,
"Boundaries"; tests/boundaries.toml names these tests): a training preset's own settings under the flags given,
the server's flags where the server takes them, and a bench's repeats."""

import socket

import pytest
import torch
from helpers import CORPUS, chat_run, torch_ops_on_one_thread

from gptlab.cli import main


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_ops_on_one_thread():
        yield


class Started(Exception):
    """Raised in place of a training: the spec it was given is what the test looks at."""


def test_a_preset_gives_its_documented_settings_and_a_flag_overrides_one(tmp_path, monkeypatch):
    """--preset char-race: "2 layers 192 wide, Muon at 0.04 for 250 steps" (its description, docs/benchmarks.md),
    context 64 and batches of 32; with --n-layer 1 one layer and the rest as the preset has it; --seed 7 the seed."""
    import gptlab.runs

    (tmp_path / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    assert main(["prepare", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "data"), "--quiet"]) == 0
    specs = []

    def start(spec, quiet=False):
        specs.append(spec)
        raise Started

    monkeypatch.setattr(gptlab.runs, "start", start)
    for flags in ([], ["--n-layer", "1", "--seed", "7"]):
        with pytest.raises(Started):
            main(["train", "--preset", "char-race", "--data", str(tmp_path / "data"), "--run", str(tmp_path / "r"),
                  *flags])
    for spec, layers in zip(specs, (2, 1)):
        assert spec.preset == "char-race"
        assert (spec.model.n_layer, spec.model.n_embd, spec.model.n_head, spec.model.block_size) == (layers, 192, 4, 64)
        assert (spec.train.optimizer, spec.train.muon_lr, spec.train.max_steps, spec.train.batch_size) == (
            "muon", 0.04, 250, 32)
    assert specs[1].train.seed == 7 and specs[0].train.seed != 7


def test_the_server_listens_on_the_port_asked_for_with_the_queue_asked_for(tmp_path, monkeypatch, capsys):
    """--port P: the socket the server is handed listens on P; --queue 3 and --run reach its limits and its model
    (the queue's effect, 429s past it: tests/test_bench_serve.py and tests/test_serve.py)."""
    run = chat_run(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    seen = []
    monkeypatch.setattr("gptlab.serve.server.serve_run", lambda served, sock, limits, key: seen.append(
        (served.name, sock.getsockname()[1], limits.queue)))
    assert main(["serve", "--run", str(run), "--port", str(port), "--queue", "3", "--precision", "fp32"]) == 0
    assert seen == [("chat-run", port, 3)]


def test_a_bench_time_is_the_fastest_of_the_repeats_asked_for(monkeypatch, capsys):
    """`bench matmul --repeats 3`: every product timed as the fastest of 3 calls after 2 warm-ups, worked out on a
    clock whose calls last 5, 2, 4 (and whose warm-ups are not timed)."""
    from gptlab.bench import matmul

    repeats, real = [], matmul.best
    monkeypatch.setattr(matmul, "best", lambda fn, n=10: repeats.append(n) or real(fn, n))
    assert main(["bench", "matmul", "--preset", "char-quick", "--batch-size", "1", "--repeats", "3"]) == 0
    assert repeats and set(repeats) == {3}
    assert "best of 3" in capsys.readouterr().out
    clock, calls = iter([0.0, 5.0, 10.0, 12.0, 20.0, 24.0]), []
    monkeypatch.setattr(matmul.time, "perf_counter", lambda: next(clock))
    assert real(lambda: calls.append(1), 3) == 2.0 and len(calls) == 2 + 3


def test_the_servers_prefix_cache_has_the_budget_asked_for_and_none_at_0(tmp_path, monkeypatch):
    """serve --prefix-cache-mb 0.25: the engine the app decodes with keeps a prefix cache of 0.25 MiB (262144
    bytes); --prefix-cache-mb 0: none; left out: 512 MiB (its help's default). What the cache does at these budgets,
    byte for byte against none: tests/test_serve_prefix.py."""
    from gptlab.serve.app import make_app

    run = chat_run(tmp_path)
    apps = []
    monkeypatch.setattr("gptlab.serve.server.serve_run", lambda served, sock, limits, key: apps.append(
        make_app(served, limits)))
    for flags in (["--prefix-cache-mb", "0.25"], ["--prefix-cache-mb", "0"], []):
        assert main(["serve", "--run", str(run), "--port", "0", "--precision", "fp32", *flags]) == 0
    caches = [app.state.scheduler.batch.prefix_cache for app in apps]
    assert caches[0].budget == 262144 and caches[0].stats().budget_bytes == 262144
    assert caches[1] is None and caches[2].budget == 512 * 2 ** 20
