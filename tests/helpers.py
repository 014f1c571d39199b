"""What several test files share, in one place: a small corpus and tiny models and runs, the CLI run as a test
runs it, a folder's fingerprint, Hugging Face folders, the outside references the sampler and the engine are held
to, and the fused decode step's parity checks. Fixtures stay in conftest.py; nothing here is a test. Test files
import these from here, never from conftest.py or from one another (tests/test_house.py checks it)."""

import contextlib
import copy
import hashlib
import json
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from gptlab.cli import main
from gptlab.config import ModelConfig, SampleConfig
from gptlab.inference import native
from gptlab.inference.fused import FusedDecoder, fused_decoder
from gptlab.inference.int8 import quantize_model
from gptlab.inference.loading import prepare_for_inference
from gptlab.model import GPT

# ---- a corpus, tiny models, tiny runs ----------------------------------------------------------------------------

CORPUS = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\n"
    "All:\nResolved. resolved.\n\n"
) * 40
SMALL = dict(n_layer=1, n_head=2, n_embd=16, block_size=16)
QUICK = dict(batch_size=4, eval_interval=5, eval_batches=2, log_interval=5, precision="fp32", max_steps=5)
# train's flags for a tiny run
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-interval", "5", "--eval-batches", "2", "--log-interval", "5", "--precision", "fp32", "--quiet"]


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    return ModelConfig(**{**base, **overrides})


def tiny_run(root, steps: int, flags: list[str]):
    """A run trained for `steps` steps on CORPUS in `root`/run (its data in `root`/data), with `flags`."""
    from gptlab.cli import main

    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    assert main(["prepare", str(root / "corpus.txt"), "--out", str(root / "data"), "--quiet"]) == 0
    assert main(["train", "--data", str(root / "data"), "--run", str(root / "run"), "--max-steps", str(steps),
                 *flags]) == 0
    return root / "run"


def evaluated_run(root, name, data, losses):
    """A run folder trained on `data` whose metrics hold an evaluation (step, val_loss) per pair of `losses`."""
    run = root / name
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {}, "train": {"max_steps": 10}, "data": str(data),
                                                 "preset": "char-quick"}))
    shutil.copy(data / "tokenizer.json", run / "tokenizer.json")
    rows = [{"kind": "eval", "step": step, "val_loss": loss, "elapsed_s": step / 10} for step, loss in losses]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run


def interruptible() -> None:
    """preexec_fn of a child process a test interrupts with SIGINT: SIGINT back to its default action, so that
    Python turns it into KeyboardInterrupt even where the test run itself ignores SIGINT (a shell starts background
    jobs, `make test &`, with SIGINT ignored, children inherit that, and Python then leaves it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# ---- the CLI and the folders it leaves ---------------------------------------------------------------------------

def run_ok(capsys, *argv):
    """`gptlab ARGV` in this process; asserts exit code 0 and returns what it printed."""
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def run_bad(capsys, *argv):
    """`gptlab ARGV` in this process; asserts exit code 2 and one error line (warnings aside), and returns it."""
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2
    lines = [line for line in err.splitlines() if not line.startswith("gptlab: warning")]
    assert len(lines) == 1 and lines[0].startswith("gptlab: error: "), err
    return lines[0]


def tree(root):
    """Every folder and every file's sha256 under `root`: the state a refused command must leave alone."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(root.rglob("*"))}


def inject_nan_at(monkeypatch, step):
    """Make the training forward pass of `step` (1-based) return a NaN loss; remember the model."""
    forward, calls, seen = GPT.forward, [0], {}

    def poisoned(self, idx, targets=None, **kwargs):
        logits, loss = forward(self, idx, targets, **kwargs)
        if self.training and targets is not None:
            calls[0] += 1
            seen["model"] = self
            if calls[0] == step:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    return seen


# ---- Hugging Face GPT-2 folders ----------------------------------------------------------------------------------

# Shapes chosen to catch layout bugs: an odd number of heads, widths that are not powers of two, a context
# shorter than 64, both activations, a non-default LayerNorm epsilon.
HF_SHAPES = {
    "5-heads-60-wide": dict(n_embd=60, n_head=5, n_layer=2, n_positions=128),
    "3-heads-context-40-exact-gelu": dict(n_embd=48, n_head=3, n_layer=3, n_positions=40,
                                          activation_function="gelu", layer_norm_epsilon=1e-6),
    "4-heads-96-wide": dict(n_embd=96, n_head=4, n_layer=2, n_positions=96),
}
HF_VOCAB = 300


def hf_folder(path, seed=0, **shape):
    """A random GPT2LMHeadModel saved with save_pretrained; wide init so greedy choices are not near-ties."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(**{"vocab_size": HF_VOCAB, "bos_token_id": None, "eos_token_id": None,
                           "initializer_range": 0.1, **shape})
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


# ---- outside references: the sampler's distribution, the engine's window, the end-of-text model -----------------

def reference_probs(logits, counts, cfg: SampleConfig) -> tuple[np.ndarray, float]:
    """The distribution next_token draws from for one row, worked out in float64 numpy from the docstrings, and how
    far the nearest top-p boundary is (a cumulative mass that close to p may round either way in float32)."""
    x, c = np.asarray(logits, np.float64), np.asarray(counts, np.float64)
    seen = c > 0
    rep = cfg.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x) - cfg.frequency_penalty * c - cfg.presence_penalty * seen
    x = x / cfg.temperature
    kept = np.argsort(-x, kind="stable")  # most likely first; equal logits: the lower id first
    if cfg.top_k is not None:
        kept = kept[:cfg.top_k]
    p = np.exp(x[kept] - x[kept].max())
    p /= p.sum()
    before = np.cumsum(p) - p  # mass of the tokens ahead of each
    margin = float(np.abs(before - cfg.top_p).min()) if cfg.top_p < 1 else 1.0
    if cfg.top_p < 1:
        kept = kept[before < cfg.top_p]
    probs = np.zeros(len(x))
    probs[kept] = np.exp(x[kept] - x[kept].max())
    return probs / probs.sum(), margin


def perturbed(model):
    """`model` with every weight moved off its init (LayerNorm gains off 1, biases off 0): fresh init hides a
    LayerNorm or bias bug, and its greedy text soon repeats one token, which hides a window bug."""
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.1)
    return model


def pair(**shape):
    """A plain fp32 model (perturbed) and its inference-prepared (packed) twin, an InferenceModel."""
    plain = perturbed(GPT(tiny_config(**shape))).eval()
    return plain, prepare_for_inference(copy.deepcopy(plain), "fp32")


def rows_of(stream):
    """Yields per position -> one list of ids per row."""
    return [list(row) for row in zip(*stream)]


KEEPS = {1: 1, 2: 1, 3: 2, 4: 3, 9: 6, 16: 12, 24: 18, 64: 48}  # the documented window: a row sees its last block_size
# tokens; one more slides it to its last 3/4 (rounded down, at least 1), worked out by hand


def reference_window(prompt, generated, block):
    """The documented window after `generated`, step by step, in plain Python."""
    window = list(prompt[-block:])
    for token in generated:
        window.append(token)
        if len(window) > block:
            window = window[-KEEPS[block]:]
    return window


def reference_greedy(logits, prompt, generated, cfg, block) -> int:
    """The greedy choice from plain-forward logits (V,), with cfg's penalties over the row's context (the prompt's
    window and every generated token), worked out in numpy (reference_probs)."""
    counts = np.bincount(list(prompt[-block:]) + list(generated), minlength=len(logits))
    one = replace(cfg, temperature=1.0, top_k=1, top_p=1.0)
    return int(reference_probs(logits.double().numpy(), counts, one)[0].argmax())


@torch.no_grad()
def reference_continuation(plain, prompt, cfg) -> list[int]:
    """cfg.max_new_tokens greedy ids after `prompt`: each step the plain forward (no cache) over the documented
    window, penalties by hand."""
    block, generated = plain.config.block_size, []
    for _ in range(cfg.max_new_tokens):
        logits = plain(torch.tensor([reference_window(prompt, generated, block)]))[0][0, -1]
        generated.append(reference_greedy(logits, prompt, generated, cfg, block))
    return generated


def chat_run(root, seed: int = 0, end_logit: float = 4.0, chars: str | None = None):
    """A run folder `root`/chat-run holding a random 1-layer model over a char vocabulary with the chat markers
    (ChatTokenizer), block_size 64, whose end-of-turn logit is raised by about `end_logit` (so that answers end by
    themselves, after ~10 tokens at temperature 1), as a run trained on conversations would be laid out."""
    from gptlab import rundir
    from gptlab.checkpoint import save_checkpoint
    from gptlab.config import TrainConfig, to_dict
    from gptlab.tokenizer import CharTokenizer, ChatTokenizer

    tokenizer = ChatTokenizer(CharTokenizer(chars or "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                                            ".,!?'\néü-+=:"))
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32, dropout=0.0)
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        direction = torch.nn.functional.normalize(torch.randn(32), dim=0)
        model.transformer.ln_f.bias.add_(direction)
        model.transformer.wte.weight[tokenizer.end_id] += end_logit * direction
    run = root / "chat-run"
    train_cfg = TrainConfig(max_steps=1)
    rundir.init_run(run, cfg, train_cfg, tokenizer, {"preset": "char-quick"})
    state = rundir.TrainingState(model=to_dict(cfg), train=to_dict(train_cfg), best_val_loss=1.0, val_loss=1.0)
    save_checkpoint(run, "best", 1, model, state, extra_files={"tokenizer.json": (run / "tokenizer.json").read_bytes()})
    return run


def eot_model(tokenizer) -> GPT:
    """A 1-layer model over GPT-2's vocabulary whose end-of-text logit is 10 above zero at every position (the final
    LayerNorm's gain zeroed, its bias along the end-of-text embedding): drawn at temperature 1, about a third of the
    tokens end the text."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=50257, block_size=32, n_layer=1, n_head=2, n_embd=32, dropout=0.0)).eval()
    with torch.no_grad():
        direction = torch.nn.functional.normalize(torch.randn(32), dim=0)
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(direction)
        model.transformer.wte.weight[tokenizer.eot_id] = 10 * direction
    return model


# ---- the fused decode step's parity checks (test_fused, test_int8, test_kernel_mutants) -------------------------

# widths 60, 75 and 100 and head sizes 12 and 25 (the products' and the attention's masked tails; the bf16 dot
# products take 32 at a time), odd head counts, GPT-2's head size 64, no biases, GPT-2's tanh GELU
KERNEL_SHAPES = [dict(n_layer=2, n_head=5, n_embd=60, vocab_size=101, block_size=40, activation="gelu_tanh"),
                 dict(n_layer=2, n_head=3, n_embd=75, vocab_size=67, block_size=40, bias=False),
                 dict(n_layer=3, n_head=4, n_embd=100, vocab_size=65, block_size=64, layer_norm_eps=1e-6),
                 dict(n_layer=2, n_head=3, n_embd=192, vocab_size=70, block_size=40)]
FP32_TOLERANCE = 1e-5  # max abs difference of logits and cached keys/values; measured: up to 1e-6
# bf16 weights and activations (logits of these models are ~0.1-1): measured against fp32 on the same weights,
# torch path 0.0049, fused 0.0020; fused over a bf16 cache against the torch path over one, 0.005. No logits
# tolerance tells a bf16 cache written by truncation instead of rounding (measured: 0.0048) from a right one, so
# bf16_cache_errors checks the rounding itself, exactly.
BF16_TOLERANCE = 0.02
# n_embd 75 (heads of 25) and 200 (heads of 50, no biases, tanh GELU): K tails of 11 and 8 under 64 (75 is not a
# multiple of 4 either: VNNI's packing pads the inputs of each group of 4), 200 = 3 x 64 + 8; vocabularies 97 and 1001
INT8_SHAPES = [dict(n_layer=2, n_head=3, n_embd=75, vocab_size=97, block_size=40),
               dict(n_layer=2, n_head=4, n_embd=200, vocab_size=1001, block_size=40, activation="gelu_tanh",
                    bias=False)]
# the FMA product computes what the torch path computes, in another order: measured up to 1e-6
FMA_TOLERANCE = 1e-5
# VNNI rounds x to 16 bits per row as well: measured up to 9e-5 on logits of magnitude ~1.8 (the int8 weights
# themselves move these logits by up to 0.019 from fp32's; x rounded to 8 bits, as a first version did, by 0.022);
# a scale, an offset or a byte gone wrong moves them by far more
VNNI_TOLERANCE = 5e-4


def trained_like(shape: dict, dtype=torch.float32, seed: int = 0) -> GPT:
    """A GPT of `shape` whose every vector (LayerNorm gains and biases, linear biases) is moved off its initial
    value by seeded noise of 0.3, as training moves it, then cast to `dtype`."""
    model = GPT(ModelConfig(**shape)).eval()
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=noise))
    return model.to(dtype)


def decoder(model: GPT, lib=None) -> FusedDecoder:
    """The fused step for `model`, on the kernel `lib` (a ctypes library; default: the package's kernel)."""
    return fused_decoder(model) if lib is None else FusedDecoder(model, lib)


def run_both(model: GPT, fused: FusedDecoder, rows: int, steps: int, cache_dtype=torch.float32):
    """Prefill `rows` ragged rows, then feed the same random tokens to the torch forward and to the fused step,
    each with its own cache; returns the logits and caches of both."""
    config = model.config
    prompts = torch.randint(0, config.vocab_size, (rows, 7))
    caches = [model.new_kv_cache(rows, dtype=cache_dtype) for _ in range(2)]
    torch_logits, fused_logits = [], []
    with torch.inference_mode():
        for cache in caches:
            model(prompts, kv_cache=cache)
            cache.pos -= torch.arange(rows) % 3  # rows at different positions
        for _ in range(steps):
            ids = torch.randint(0, config.vocab_size, (rows,))
            torch_logits.append(model(ids[:, None], kv_cache=caches[0], last_only=True)[0][:, -1].float())
            fused_logits.append(fused.step(ids, caches[1]).clone())  # valid until the next step
    return torch.stack(torch_logits), torch.stack(fused_logits), caches


def fp32_error(shape: dict, rows: int, lib=None) -> float:
    """The largest difference of logits, keys and values between the fused step and the torch forward over 12
    steps of `rows` rows in fp32; inf where the fused step advanced the positions otherwise."""
    model = trained_like(shape)
    expected, got, (ref, fused) = run_both(model, decoder(model, lib), rows, steps=12)
    if not torch.equal(fused.pos, ref.pos):  # advanced by one per step, row by row
        return float("inf")
    return max((got - expected).abs().max(), (fused.k - ref.k).abs().max(), (fused.v - ref.v).abs().max()).item()


def bf16_errors(shape: dict, lib=None) -> tuple[float, float]:
    """Logits of the torch forward and of the fused step with bf16 weights, each against the same (bf16-rounded)
    weights computed in fp32: the largest differences (torch's, fused's) over 8 steps of 4 rows."""
    model = trained_like(shape, torch.bfloat16)
    exact = copy.deepcopy(model).float()
    torch.manual_seed(1)  # the same prompts and tokens for both runs
    reference, _, _ = run_both(exact, decoder(exact, lib), 4, steps=8)
    torch.manual_seed(1)
    torch_bf16, fused_bf16, _ = run_both(model, decoder(model, lib), 4, steps=8)
    return (torch_bf16 - reference).abs().max().item(), (fused_bf16 - reference).abs().max().item()


def bf16_cache_errors(shape: dict, lib=None) -> tuple[float, int]:
    """A bf16 model over a bf16 cache, 8 steps of 3 rows: the largest difference of the fused step's logits from
    the torch forward's (inf where the positions differ), and how many keys and values the fused step wrote into
    layer 0 of a bf16 cache differ from those it wrote into an fp32 one, rounded to nearest even (torch's
    .to(torch.bfloat16)). Layer 0's are exactly comparable: they depend on the token and position only."""
    model = trained_like(shape, torch.bfloat16)
    expected, got, (ref, fused) = run_both(model, decoder(model, lib), 3, steps=8, cache_dtype=torch.bfloat16)
    same_pos = fused.k.dtype == torch.bfloat16 and torch.equal(fused.pos, ref.pos)
    logits_error = (got - expected).abs().max().item() if same_pos else float("inf")
    caches = [model.new_kv_cache(3, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)]
    step = decoder(model, lib).step
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (3, 5)), kv_cache=caches[0])
        for name in ("k", "v", "pos"):
            getattr(caches[1], name).copy_(getattr(caches[0], name))  # the prefill, rounded to nearest even
        for _ in range(8):
            ids = torch.randint(0, model.config.vocab_size, (3,))
            for cache in caches:
                step(ids, cache)
    wrong = sum(int((getattr(caches[1], n)[0] != getattr(caches[0], n)[0].to(torch.bfloat16)).sum()) for n in "kv")
    return logits_error, wrong


def int8_model(shape: dict) -> nn.Module:
    """A trained_like GPT of `shape` with every matrix in weight-only int8."""
    model = trained_like(shape)
    quantize_model(model)
    return model


def int8_error(shape: dict, rows: int, lib=None, vnni: bool | None = False) -> float:
    """The largest difference of logits and cached keys/values between the fused int8 step (on `lib`, default the
    package's kernel; `vnni` as FusedDecoder takes it) and the torch int8 path over 6 steps of `rows` rows; inf
    where the positions advanced otherwise."""
    model = int8_model(shape)
    fused = FusedDecoder(model, lib or native.load_library(), vnni=vnni)
    expected, got, (ref, out) = run_both(model, fused, rows, steps=6)
    if not torch.equal(out.pos, ref.pos):
        return float("inf")
    return max((got - expected).abs().max(), (out.k - ref.k).abs().max(), (out.v - ref.v).abs().max()).item()


@contextlib.contextmanager
def torch_ops_on_one_thread():
    """Decoding by torch ops (no kernel build) on one torch thread, for tests whose models are tiny: on a loaded
    machine threads wait for one another far longer than they compute. OMP_NUM_THREADS keeps set_threads at one."""
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as m:
        m.setenv("OMP_NUM_THREADS", "1")
        m.setattr("gptlab.inference.fused.load_library", lambda: None)
        torch.set_num_threads(1)
        yield
    torch.set_num_threads(before)



@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Imported into a test module: its tiny models on one torch thread for the module's duration (see
    torch_ops_on_one_thread; TransformerLens's patching alone runs hundreds of tiny forwards)."""
    with torch_ops_on_one_thread():
        yield


# ---- GGUF: a run holding a given model, for the llama.cpp bridge's tests ----------------------------------------

GGUF_TEXT = "First Citizen:\nBefore we proceed — café naïve, 3.14 don't\tstop\\ 日本\n" * 3


def model_run(path, model: GPT, tokenizer):
    """A run at `path` whose one checkpoint holds `model` (as `gptlab import` writes one), with `tokenizer`."""
    from gptlab import rundir
    from gptlab.config import TrainConfig, to_dict
    from gptlab.hf.gpt2_folders import write_imported_run

    write_imported_run(path, model, TrainConfig(), tokenizer, {}, rundir.TrainingState(to_dict(model.config)))
    return path


# ---- the fast engine (tests/test_fast.py, tests/test_fast_arm.py) ----

FAST_TOLERANCE = 1e-5  # the fast engine against the naive one: fp32 against fp32, per tensor: max |a - b| / max |b|
STEP_LOSS_TOLERANCE = 1e-4  # 20 training steps: each step's loss, absolute
ODD = dict(n_layer=2, n_head=3, n_embd=21, vocab_size=67, block_size=8)  # D = 7: no lane or tile is whole
PAST_BLOCKS = dict(n_layer=1, n_head=4, n_embd=64, vocab_size=300, block_size=70)  # T = 70: one past 64-key blocks


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in b's precision (fp32 differences near 1e-6 of the scale are exact enough there)."""
    gap = (a.to(b.dtype) - b).abs_().max().item()  # abs_ on the difference: one temporary, not two
    scale = b.abs().max().item()
    return gap / scale if scale else gap


def sharpened(model, factor: float = 6.0):
    """`model` with its query and key weights scaled by `factor`: scores spread over several units, as a trained
    model's do, so a later block of keys often raises a row's maximum (the online softmax's rescaling matters) and
    the softmax is far from uniform."""
    with torch.no_grad():
        for block in model.transformer.h:
            C = model.config.n_embd
            block.attn.c_attn.weight[:2 * C] *= factor
    return model


def fast_batch(V: int, B: int, T: int, ignored: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx, tgt = torch.randint(V, (B, T), generator=g), torch.randint(V, (B, T), generator=g)
    if ignored:
        tgt[0, T // 2] = -1
    return idx, tgt


# ---- the bench tests (test_bench_reference.py, test_bench_metal.py) ----

@pytest.fixture
def one_thread(monkeypatch):
    """One torch thread (set_threads keeps it: OMP_NUM_THREADS is set), the caller's count restored after."""
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def number(text: str) -> float:
    return float(text.replace(",", ""))


# ---- a real terminal (tmux) ----------------------------------------------------------------------------------

TMUX = shutil.which("tmux")


class Pane:
    """An interactive bash in a tmux pane of a tmux server of its own, as a user's terminal: keys in, screen out.
    Its prompt is SHELL; a command typed at it runs in the foreground, where Ctrl-C reaches it alone."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="chat-tmux-"))
        self.tmux = [TMUX, "-S", str(self.dir / "s"), "-f", "/dev/null"]
        subprocess.run(self.tmux + ["new-session", "-d", "-x", "150", "-y", "50", "-s", "chat",
                                    f"env PS1='{SHELL} ' HISTFILE= bash --norc --noprofile -i"], check=True)

    def type(self, line: str) -> None:
        """Type `line` and press Enter."""
        subprocess.run(self.tmux + ["send-keys", "-t", "chat", "-l", line], check=True)
        self.keys("Enter")

    def keys(self, *keys: str) -> None:
        subprocess.run(self.tmux + ["send-keys", "-t", "chat", *keys], check=True)

    def run(self, command: str) -> None:
        """Type a command that runs `command` (a file sourced by the shell: the screen shows a short line)."""
        (self.dir / "command").write_text(command + "\n")
        self.type(f". {self.dir / 'command'}")

    def screen(self) -> str:
        return subprocess.run(self.tmux + ["capture-pane", "-p", "-t", "chat", "-S", "-"], check=True,
                              capture_output=True, text=True).stdout

    def wait(self, done, what: str, deadline: float = 120.0) -> str:
        """Poll the screen until done(screen); the deadline only keeps a broken run from hanging the tests."""
        end = time.monotonic() + deadline
        while True:
            screen = self.screen()
            if done(screen):
                return screen
            if time.monotonic() > end:
                pytest.fail(f"the pane never showed {what}:\n{screen}")
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run(self.tmux + ["kill-server"], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


SHELL = "shell$"


def last_line(screen: str) -> str:
    return ([x.rstrip() for x in screen.splitlines() if x.strip()] or [""])[-1]


def prompts(screen: str) -> int:
    return len(re.findall(r"^you>", screen, re.M))


def unselectable_ids(ids) -> list[str]:
    """The explicit parametrize ids that pytest escapes (a backslash, a character outside printable ASCII): pytest
    escapes such an id again at each collection in one process, so a second collection (mutmut's workers collect
    once, then run the tests a mutant needs by their ids) cannot find the test by the id the first one gave; its
    mutants then end with pytest's usage error, which mutmut counts as a timeout (a false kill)."""
    return [i for i in ids if isinstance(i, str) and ("\\" in i or not (i.isascii() and i.isprintable()))]
