"""End-to-end: the `gptlab` verbs as a user runs them, and one clear line for each bad input."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY, evaluated_run, run_bad, run_ok

import gptlab.plots
from gptlab.cli import main
from gptlab.data.prepare import prepare
from gptlab.runtime import bf16_supported


@pytest.fixture
def workdir(tmp_path, monkeypatch, corpus_file):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_prepare_train_sample_eval_end_to_end(workdir, capsys, corpus_file):
    assert "prepared data" in run_ok(capsys, "prepare", str(corpus_file), "--out", "data", "--quiet")
    out = run_ok(capsys, "train", "--data", "data", "--run", "runs/tiny", "--max-steps", "10", *TINY)
    assert "10 steps" in out and "val loss" in out
    assert (workdir / "runs" / "tiny" / "loss.png").exists()
    sample = run_ok(capsys, "sample", "--run", "runs/tiny", "--prompt", "All:", "--max-new-tokens", "30",
                    "--seed", "5")
    assert sample.startswith("All:") and len(sample) > 30
    assert sample == run_ok(capsys, "sample", "--run", "runs/tiny", "--prompt", "All:", "--max-new-tokens",
                            "30", "--seed", "5")
    assert run_ok(capsys, "sample", "--max-new-tokens", "5")  # the latest run by default
    table = run_ok(capsys, "eval", "--run", "runs/tiny")
    assert "bits/char" in table and "(val)" in table
    assert "corpus.txt" in run_ok(capsys, "eval", "--run", "runs/tiny", str(corpus_file))
    out = run_ok(capsys, "train", "--data", "data", "--run", "runs/tiny", "--max-steps", "15", "--resume", *TINY)
    assert "5 steps (10 to 15)" in out  # this session's steps, with this session's seconds


def test_default_run_dir_never_overwrites_an_earlier_run(workdir, capsys, corpus_file):
    run_ok(capsys, "prepare", str(corpus_file), "--out", "data", "--quiet")
    run_ok(capsys, "train", "--data", "data", "--max-steps", "5", *TINY)
    out = run_ok(capsys, "train", "--data", "data", "--max-steps", "5", *TINY)
    assert "runs/char-quick-2" in out


@pytest.fixture
def prepared(workdir, capsys, corpus_file):
    run_ok(capsys, "prepare", str(corpus_file), "--out", "data", "--quiet")
    run_ok(capsys, "train", "--data", "data", "--run", "runs/r", "--max-steps", "5", *TINY)
    return workdir


def test_bad_corpus_inputs(workdir, capsys):
    (workdir / "empty.txt").write_text("")
    assert "is empty" in run_bad(capsys, "prepare", "empty.txt", "--out", "d")
    (workdir / "latin.txt").write_bytes(b"caf\xe9\n")
    line = run_bad(capsys, "prepare", "latin.txt", "--out", "d")
    assert "latin.txt" in line and "offset 3" in line and "--encoding" in line
    assert "does not exist" in run_bad(capsys, "prepare", "missing.txt")
    (workdir / "short.txt").write_text("too short\n" * 3)
    run_ok(capsys, "prepare", "short.txt", "--out", "short", "--quiet")
    assert "fewer than block_size + 1" in run_bad(capsys, "train", "--data", "short", "--run", "x", *TINY)


def test_bad_settings(prepared, capsys):
    assert "invalid choice: 'huge'" in run_bad(capsys, "train", "--data", "data", "--preset", "huge")
    assert "unrecognized arguments: --n-layers" in run_bad(capsys, "train", "--data", "data", "--n-layers", "3")
    for flag, value, words in [("--batch-size", "0", "batch_size must be a positive"),
                               ("--lr", "-0.1", "learning rate"), ("--max-steps", "0", "max_steps must be"),
                               ("--n-layer", "x", "n_layer must be an integer")]:
        assert words in run_bad(capsys, "train", "--data", "data", "--run", "new", flag, value)
    line = run_bad(capsys, "train", "--data", "data", "--run", "runs/r", "--resume", "--n-embd", "32")
    assert "cannot resume" in line and "n_embd=16 (now 32)" in line


def test_bad_runs_and_prompts(prepared, capsys):
    assert "does not exist" in run_bad(capsys, "sample", "--run", "nowhere")
    (prepared / "notarun").mkdir()
    assert "is not a gptlab run" in run_bad(capsys, "sample", "--run", "notarun")
    assert "is not a gptlab run" in run_bad(capsys, "eval", "--run", "notarun")
    line = run_bad(capsys, "sample", "--run", "runs/r", "--prompt", "Zebra ☃")
    assert "never seen" in line and "'Z'" in line and "'☃'" in line
    assert "prompt is empty" in run_bad(capsys, "sample", "--run", "runs/r", "--prompt", "")
    assert "temperature" in run_bad(capsys, "sample", "--run", "runs/r", "--temperature", "-1")
    assert "max_new_tokens" in run_bad(capsys, "sample", "--run", "runs/r", "--max-new-tokens", "0")


def test_python_m_gptlab_exits_2_with_one_line_and_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "gptlab", "sample", "--run", str(tmp_path / "none")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr



# ---- starting up: no torch for help and argument errors, and Ctrl-C at any moment is one line ------------------

NO_TORCH = """import sys
from gptlab.cli import main
for argv in {argvs!r}:
    try:
        code = main(argv)
    except SystemExit as exc:  # --help, --version
        code = exc.code
    assert code in (0, 2), (argv, code)
    assert "torch" not in sys.modules, f"gptlab {{' '.join(argv)}} imported torch"
print("no torch")
"""
# serve's and bench chat's flags take their defaults from the modules that run them, which import torch
def every_verb() -> list[str]:
    """Every verb and subcommand of `gptlab` ("train", "bench chat", "inspect lens"), from its parser."""
    from boundaries import verbs
    from gptlab.cli import make_parser

    return [" ".join(path) for path, _ in verbs(make_parser())]


HELPED = every_verb()


def test_help_and_argument_errors_never_import_torch():
    """`gptlab --help`, each verb's --help and a refused argument are answered without importing torch (seconds
    of imports before the first line)."""
    argvs = [["--help"], ["--version"], [], ["nonsense"], ["train", "--bogus"], ["train", "--n-layer"],
             ["sample", "--temperature", "x", "--max-new-tokens"], ["bench", "train", "--steps"],
             *[[*verb.split(), "--help"] for verb in HELPED]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", NO_TORCH.format(argvs=argvs)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.endswith("no torch\n"), done.stderr[-2000:]


INTERRUPTED = """import os, signal, sys
class Interrupt:  # SIGINT to this process as the module named first is imported
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, Interrupt())
from gptlab.cli import main
sys.exit(main(sys.argv[2:]))
"""


def in_a_shell(inherited):
    """preexec_fn: SIGINT's default (a command in the foreground), or SIGINT ignored, as `bash -c 'cmd &'` and every
    shell without job control start a background job."""
    return lambda: signal.signal(signal.SIGINT, inherited)


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["foreground", "background job"])
@pytest.mark.parametrize("module", ["gptlab.cli.verbs", "torch", "gptlab.training.train"])
def test_ctrl_c_while_a_command_starts_is_one_line(char_data, tmp_path, inherited, module):
    """Ctrl-C as `gptlab train` builds its parser, imports torch, or imports the loop: `gptlab: interrupted`
    and exit 130, never a traceback, and never ignored (the run is not started)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = ["train", "--data", str(char_data), "--run", str(tmp_path / "run"), "--max-steps", "5", *TINY]
    done = subprocess.run([sys.executable, "-c", INTERRUPTED, module, *argv], capture_output=True, text=True, env=env,
                          timeout=300, preexec_fn=in_a_shell(inherited))
    assert (done.returncode, done.stderr) == (130, "gptlab: interrupted\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc to see torch being loaded")
@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["foreground", "background job"])
def test_ctrl_c_to_a_real_gptlab_train_as_it_loads_torch_is_one_line(char_data, tmp_path, inherited):
    """SIGINT from outside, as a terminal's Ctrl-C comes, once torch's libraries are being loaded."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = ["train", "--data", str(char_data), "--run", str(tmp_path / "run"), "--max-steps", "5", *TINY]
    proc = subprocess.Popen([sys.executable, "-m", "gptlab", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=in_a_shell(inherited))
    try:
        deadline = time.time() + 120
        while "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text():
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert (proc.returncode, err) == (130, "gptlab: interrupted\n")


# ---- sample on the engine (issue 4) ----------------------------------------------------------------------------

def test_sample_streams_several_samples_with_stop_strings_and_precisions(prepared, capsys):
    out = run_ok(capsys, "sample", "--run", "runs/r", "--prompt", "All:", "--max-new-tokens", "40",
                 "--num-samples", "3", "--temperature", "1.0", "--top-k", "5", "--top-p", "0.9", "--seed", "2")
    samples = out.split("-" * 40 + "\n")
    assert len(samples) == 3 and all(s.startswith("All:") for s in samples)
    assert len(set(samples)) == 3
    alone = run_ok(capsys, "sample", "--run", "runs/r", "--prompt", "All:", "--max-new-tokens", "40",
                   "--temperature", "1.0", "--top-k", "5", "--top-p", "0.9", "--seed", "4")
    assert alone == samples[2]  # sample i draws with --seed + i, whether or not it shares a prefill
    stopped = run_ok(capsys, "sample", "--run", "runs/r", "--prompt", "All:", "--max-new-tokens", "200",
                     "--temperature", "1.0", "--stop", "e", "--stop", "a", "--no-echo", "--seed", "3")
    assert "e" not in stopped and "a" not in stopped and len(stopped) < 200
    if bf16_supported(torch.device("cpu")):
        assert run_ok(capsys, "sample", "--run", "runs/r", "--precision", "bf16", "--max-new-tokens", "20")


def test_bad_sampling_settings_get_one_line(prepared, capsys):
    for flags, words in [(["--max-new-tokens", "-3"], "max_new_tokens must be a positive"),
                         (["--temperature", "-0.5"], "temperature must be >= 0"),
                         (["--top-p", "0"], "top_p must be in (0, 1]"), (["--top-p", "1.5"], "top_p must be in"),
                         (["--top-k", "0"], "top_k must be >= 1"), (["--top-k", "x"], "top_k must be an integer"),
                         (["--num-samples", "0"], "--num-samples must be >= 1"),
                         (["--stop", ""], "stop string must not be empty"),
                         (["--precision", "fp16"], "invalid choice: 'fp16'")]:
        assert words in run_bad(capsys, "sample", "--run", "runs/r", "--prompt", "All:", *flags)


def test_bench_generate_refuses_bad_sizes(capsys):
    assert "--new-tokens must be >= 1" in run_bad(capsys, "bench", "generate", "--new-tokens", "0")
    assert "--char-tokens must be >= 0" in run_bad(capsys, "bench", "generate", "--char-tokens", "-1")


# ---- saying what happens (issue 10) ----------------------------------------------------------------------------

def test_version_and_which_run_sample_and_eval_picked(prepared, capsys):
    from gptlab import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"gptlab {__version__}"
    for verb in (["sample", "--max-new-tokens", "3"], ["eval"]):
        assert main(verb) == 0
        assert "gptlab: using runs/r/checkpoints/best-00000005 (best checkpoint, step 5)" in capsys.readouterr().err


def test_stop_strings_read_escapes_as_the_readme_writes_them(prepared, capsys):
    out = run_ok(capsys, "sample", "--run", "runs/r", "--prompt", "All:", "--max-new-tokens", "300",
                 "--temperature", "1.0", "--stop", "\\n", "--no-echo", "--seed", "4")  # the shell passes \ and n
    assert "\n" not in out.rstrip("\n") and len(out) < 300


def test_without_a_terminal_training_prints_plain_progress_lines(prepared, capsys, monkeypatch):
    import gptlab.training.train

    monkeypatch.setattr(gptlab.training.train, "PLAIN_LINE_SECONDS", 0.0)  # every log row, to see them in a short run
    flags = [f for f in TINY if f != "--quiet"]
    assert main(["train", "--data", "data", "--run", "runs/p", "--max-steps", "10", *flags]) == 0
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 5/10", "step 10/10"]
    assert "tokens/s" in lines[0]
    assert " s of training steps)" in out
    from gptlab.runs import resolve, start

    result = start(resolve(run="runs/q", data="data", model={"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16},
                           train={"max_steps": 10, "batch_size": 4, "eval_interval": 5, "eval_batches": 2}), quiet=True)
    assert 0 < result.train_seconds < result.seconds  # the evaluations and checkpoints are left out ...
    assert result.tokens_per_second == pytest.approx(10 * 4 * 16 / result.train_seconds)  # ... of tokens/s


# ---- issue 21: what a new user met -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, help_of", [
    (["train", "--bogus"], "gptlab train"),
    (["sample", "--run", "r", "extra"], "gptlab sample"),
    (["bench", "peak", "--bogus"], "gptlab bench peak"),
    (["inspect", "lens", "--prompt", "x", "--bogus"], "gptlab inspect lens"),
    (["--bogus", "train"], "gptlab"),
])
def test_an_unknown_flag_points_to_the_help_of_its_verb(capsys, argv, help_of):
    line = run_bad(capsys, *argv)
    assert f"unrecognized arguments: {argv[-1] if argv[0] != '--bogus' else '--bogus'}" in line
    assert line.endswith(f"(see `{help_of} --help`)"), line


@pytest.fixture
def drawn(monkeypatch):
    """What compare hands to plots.plot_runs (which still draws it)."""
    seen, draw = {}, gptlab.plots.plot_runs

    def spy(curves, out_png, *unit):
        seen.update(curves=curves, unit=unit[0] if unit else None)
        return draw(curves, out_png, *unit)
    monkeypatch.setattr(gptlab.plots, "plot_runs", spy)
    return seen


def test_compare_puts_runs_with_different_tokenizers_on_bits_per_byte(tmp_path, capsys, drawn):
    text = "First Citizen:\nhéllo wörld, naïve café — 日本語 😀\n" * 120  # bytes per character well above 1
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    for kind in ("char", "bpe"):
        prepare([str(tmp_path / "t.txt")], tmp_path / kind, kind, vocab_size=300, quiet=True)
    losses = {"char": [(5, 2.0), (10, 1.25)], "bpe": [(5, 3.5), (10, 2.75)]}
    runs = {kind: evaluated_run(tmp_path, f"run-{kind}", tmp_path / kind, losses[kind]) for kind in losses}
    out = run_ok(capsys, "compare", str(runs["char"]), str(runs["bpe"]), "--out", str(tmp_path / "c.png"))
    assert "bits per byte" in out and drawn["unit"] == "bits / byte"
    for kind in ("char", "bpe"):  # the validation split: the text's tail (BPE's end of text: a token, no bytes)
        meta = json.loads((tmp_path / kind / "meta.json").read_text())
        val_bytes = len(text[-meta["val_chars"]:].encode())
        expected = [loss * meta["val_tokens"] / val_bytes / math.log(2) for _, loss in losses[kind]]
        assert drawn["curves"][str(runs[kind])] == ([5, 10], pytest.approx(expected, rel=1e-9), [0.5, 1.0])
    twin = evaluated_run(tmp_path, "run-char-2", tmp_path / "char", [(5, 1.5)])
    out = run_ok(capsys, "compare", str(runs["char"]), str(twin), "--out", str(tmp_path / "same.png"))
    assert "bits per byte" not in out and drawn["unit"] == "nats / token"
    assert drawn["curves"][str(twin)] == ([5], [1.5], [0.5])  # one tokenizer: the losses as logged


@pytest.mark.parametrize("out", ["x.json", "x", "x.png.txt"])
def test_compare_refuses_a_picture_format_it_cannot_write_in_one_line(tmp_path, capsys, out, drawn):
    (tmp_path / "t.txt").write_text("héllo wörld\n" * 50, encoding="utf-8")
    prepare([str(tmp_path / "t.txt")], tmp_path / "d", "char", quiet=True)
    run = evaluated_run(tmp_path, "run", tmp_path / "d", [(5, 2.0)])
    line = run_bad(capsys, "compare", str(run), "--out", str(tmp_path / out))
    assert f"--out {tmp_path / out}" in line and ".png" in line and ".svg" in line
    assert not (tmp_path / out).exists() and not drawn


def test_a_config_files_data_path_is_relative_to_its_folder(tmp_path, monkeypatch, capsys):
    (tmp_path / "t.txt").write_text("héllo wörld\n" * 200, encoding="utf-8")
    prepare([str(tmp_path / "t.txt")], tmp_path / "exp" / "data", "char", quiet=True)
    (tmp_path / "exp" / "small.toml").write_text('data = "data"\nrun = "run"\n[train]\nmax_steps = 2\n')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    run_ok(capsys, "train", "--config", "../exp/small.toml", *TINY)
    saved = json.loads((tmp_path / "exp" / "run" / "config.json").read_text())
    assert saved["data"] == str((tmp_path / "exp" / "data").resolve()) and saved["train"]["max_steps"] == 2
    assert not any((tmp_path / "elsewhere").iterdir())


@pytest.mark.parametrize("name, text, words", [
    ("arrays.toml", "[[model]]\nn_layer = 2\n", "[model] must be a table of settings"),
    ("scalar.toml", "train = 3\n", "[train] must be a table of settings"),
    ("list.json", '{"model": [{"n_layer": 2}]}', "[model] must be a table of settings"),
    ("number.toml", "data = 5\n", "data must be text (a path), not 5"),
    ("top.json", "[1, 2]", "must hold named settings"),
])
def test_a_config_file_of_the_wrong_shape_is_one_line(tmp_path, monkeypatch, capsys, name, text, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    line = run_bad(capsys, "train", "--config", name, "--run", "r")
    assert f"config file {name}" in line and words in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_bf16_on_a_cpu_without_it_is_stored_for_decoding_refused_for_training_and_auto_follows(prepared, capsys,
                                                                                                monkeypatch):
    """Without native bf16 products, inference keeps bf16 weights where the native decode step widens them (any CPU
    with g++), and sample's auto picks that; eval's auto (torch's forward) stays fp32; training, which computes in
    bf16, and inference without a compiler are refused in one line."""
    fp32 = run_ok(capsys, "sample", "--run", "runs/r", "--prompt", "All:", "--max-new-tokens", "20",
                  "--precision", "fp32", "--temperature", "0")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # no AVX-512 BF16, no AMX
    assert not bf16_supported(torch.device("cpu"))
    before = sorted(p for p in prepared.rglob("*"))
    line = run_bad(capsys, "train", "--data", "data", "--run", "runs/b", *TINY, "--max-steps", "2", "--precision",
                   "bf16", "--device", "cpu")  # training computes in bf16: refused (inference stores it, below)
    assert "no native bf16 support (training computes in bf16); use --precision fp32" in line, line
    with monkeypatch.context() as m:
        m.setattr("gptlab.inference.native.missing", lambda: "no g++ on PATH")  # no native decode step either
        for argv in (["sample", "--run", "runs/r", "--prompt", "All:"], ["eval", "--run", "runs/r"],
                     ["serve", "--run", "runs/r", "--port", "0"]):
            line = run_bad(capsys, *argv, "--precision", "bf16", "--device", "cpu")
            assert "no native bf16 support and no g++ for the native decode step" in line, line
    assert sorted(p for p in prepared.rglob("*")) == before
    text = run_ok(capsys, "sample", "--run", "runs/r", "--prompt", "All:", "--max-new-tokens", "20",
                  "--precision", "bf16", "--temperature", "0")
    assert text.startswith("All:") and len(text) > len("All:")
    row = run_ok(capsys, "eval", "--run", "runs/r", "--precision", "bf16").splitlines()[1]
    assert row.split()[-1] == "bf16"
    assert run_ok(capsys, "eval", "--run", "runs/r").splitlines()[1].split()[-1] == "fp32"  # eval's auto
    import gptlab.inference.loading

    prepared_in, prepare = [], gptlab.inference.loading.prepare_for_inference  # the precision sample's weights are made in
    monkeypatch.setattr(gptlab.inference.loading, "prepare_for_inference",
                        lambda model, precision, *a, **kw: prepared_in.append(precision) or prepare(model, precision,
                                                                                                    *a, **kw))
    assert run_ok(capsys, "sample", "--run", "runs/r", "--prompt", "All:", "--max-new-tokens", "20",
                  "--precision", "auto", "--temperature", "0") == text
    with monkeypatch.context() as m:
        m.setattr("gptlab.inference.native.missing", lambda: "no g++ on PATH")
        assert run_ok(capsys, "sample", "--run", "runs/r", "--prompt", "All:", "--max-new-tokens", "20",
                      "--precision", "auto", "--temperature", "0") == fp32
    assert prepared_in == ["bf16", "fp32"]  # sample's auto: bf16 storage, fp32 without the native step


def test_sample_and_eval_default_to_auto_and_eval_names_the_precision_it_used(prepared, capsys, monkeypatch):
    from gptlab.cli import make_parser

    assert [make_parser().parse_args([verb]).precision for verb in ("sample", "eval")] == ["auto", "auto"]
    header, row = run_ok(capsys, "eval", "--run", "runs/r", "--precision", "int8").splitlines()
    assert header.split()[-1] == "precision" and row.split()[-1] == "int8"
    fp32_row = run_ok(capsys, "eval", "--run", "runs/r", "--precision", "fp32").splitlines()[1].split()
    val_tokens = json.loads((prepared / "data" / "meta.json").read_text())["val_tokens"]
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # auto: fp32
    report = json.loads(run_ok(capsys, "eval", "--run", "runs/r", "--json"))
    assert report["precision"] == "fp32" and report["run"] == "runs/r"
    assert report["checkpoint"] == "runs/r/checkpoints/best-00000005"
    [score] = report["scores"]
    tokens, loss = fp32_row[-7:-5]  # the name is "data (val)"; the precision is the last column
    assert score["tokens"] == val_tokens - 1 == int(tokens.replace(",", ""))  # every token but the first
    assert f"{score['loss']:.4f}" == loss and score["perplexity"] == pytest.approx(math.exp(score["loss"]))
    assert score["bits_per_token"] == pytest.approx(score["loss"] / math.log(2))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # auto: bf16
    assert json.loads(run_ok(capsys, "eval", "--run", "runs/r", "--json"))["precision"] == "bf16"
    assert run_ok(capsys, "eval", "--run", "runs/r").splitlines()[1].split()[-1] == "bf16"


def test_eval_of_a_non_ascii_file_prints_its_scores_per_token_character_and_byte(tmp_path, monkeypatch, capsys):
    from gptlab.checkpoint import load_run

    monkeypatch.chdir(tmp_path)
    text = "héllo wörld, ж ☃ naïve\nAll: speak.\n" * 60  # 2 or 3 bytes for some characters
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    run_ok(capsys, "prepare", "t.txt", "--out", "data", "--quiet")
    run_ok(capsys, "train", "--data", "data", "--run", "r", "--max-steps", "5", *TINY)
    scored = text[5:45]  # 40 characters: 39 predicted tokens in windows of block_size 16
    (tmp_path / "s.txt").write_text(scored, encoding="utf-8")
    row = run_ok(capsys, "eval", "--run", "r", "s.txt", "--precision", "fp32").splitlines()[1].split()
    assert row[-1] == "fp32"
    tokens, loss, ppl, bits_token, bits_char, bits_byte = int(row[1]), *map(float, row[2:-1])
    loaded = load_run("r")  # the reference: plain windows of 16 tokens, each predicting the next 16
    ids = torch.tensor(loaded.tokenizer.encode(scored))
    with torch.no_grad():
        nats = sum(torch.nn.functional.cross_entropy(loaded.model(ids[s:s + 16][None])[0][0, :len(ids[s + 1:s + 17])],
                                                     ids[s + 1:s + 17], reduction="sum").item()
                   for s in range(0, len(ids) - 1, 16))
    assert tokens == 39 and loss == pytest.approx(nats / 39, abs=1e-4)
    assert ppl == pytest.approx(math.exp(loss), rel=1e-3)
    assert bits_token == pytest.approx(nats / 39 / math.log(2), abs=1e-4)
    assert bits_char == pytest.approx(nats / math.log(2) / 40, abs=1e-4)
    assert bits_byte == pytest.approx(nats / math.log(2) / len(scored.encode()), abs=1e-4) and bits_byte < bits_char


def test_eval_shows_a_long_path_whole_in_its_column(prepared, capsys):
    """A path longer than the column's usual width is shown whole (not cut from the left, mid-word), and the
    figures stay under their headings."""
    folder = prepared / "a-rather-long-folder-name" / "another-long-folder-name"
    folder.mkdir(parents=True)
    path = str(folder / "the-text-to-score.txt")
    Path(path).write_text("All: speak, speak. First Citizen: you are all resolved.\n" * 3, encoding="utf-8")
    header, row, *_ = run_ok(capsys, "eval", "--run", "runs/r", path, "--precision", "fp32").splitlines()
    assert row.split()[0] == path and len(path) > 60
    tokens = row.split()[1]
    assert header.index("tokens") + len("tokens") == row.index(f" {tokens} ") + 1 + len(tokens)
    assert header.rstrip().endswith("precision") and len(header) == len(row)


def test_prepare_flags_keep_their_spellings_and_defaults_and_a_switch_takes_no_value():
    """prepare's settings flags are generated from PrepareConfig: the spellings, defaults and kinds it always had
    (switches stay switches, so the path after one is an input, and repeatable flags collect every value)."""
    from gptlab.cli import make_parser

    defaults = make_parser().parse_args(["prepare"])
    assert {k: v for k, v in vars(defaults).items() if k != "command"} == {
        "paths": [], "out": None, "overwrite": False, "quiet": False, "tokenizer": "char", "tokenizer_from": "",
        "allow_special": False, "vocab_size": 1024, "val_fraction": 0.1, "seed": 0, "val": None, "encoding": "utf-8",
        "text_field": "text", "include": None, "exclude": None, "strict": False, "workers": None,
        "shard_tokens": 100_000_000, "chat": False, "context": 1024, "chat_loss": "assistant"}
    args = make_parser().parse_args([
        "prepare", "--strict", "--allow-special", "a.txt", "--include", "*.py", "--include", "*.md", "--exclude",
        "tests/*", "--val", "v/", "--tokenizer", "bpe", "--tokenizer-from", "runs/x", "--vocab-size", "300",
        "--val-fraction", "0.2", "--seed", "7", "--encoding", "latin-1", "--text-field", "content", "--workers", "3",
        "--shard-tokens", "5000"])
    assert args.paths == ["a.txt"] and args.strict and args.allow_special
    assert (args.include, args.exclude, args.val) == (["*.py", "*.md"], ["tests/*"], ["v/"])
    assert (args.tokenizer, args.tokenizer_from, args.vocab_size, args.val_fraction, args.seed) == \
        ("bpe", "runs/x", 300, 0.2, 7)
    assert (args.encoding, args.text_field, args.workers, args.shard_tokens) == ("latin-1", "content", 3, 5000)
