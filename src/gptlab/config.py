"""Typed settings for models, training, sampling and preparing data, the named presets, and their validation.

One source of truth: the CLI builds its flags from these dataclasses, run directories store them as JSON, settings
files (configfile.py) hold them, and Python callers construct them directly. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gptlab.errors import GptlabError
from gptlab.settings import build, check as _check, check_choice as _check_choice, check_types as _check_types
from gptlab.settings import field_help, field_types, from_dict, parse_value, setting, to_dict  # noqa: F401 (callers')

ATTENTION_PATHS = ("auto", "sdpa", "naive")
ACTIVATIONS = ("gelu", "gelu_tanh")
ARCHS = ("gpt", "bigram")
TRAIN_PRECISIONS = ("auto", "fp32", "bf16")  # train's --precision
# sample, eval, serve and bench serve's --precision: int8 is weight-only (gptlab.inference.int8)
INFERENCE_PRECISIONS = (*TRAIN_PRECISIONS, "int8")
PREPARED_PRECISIONS = tuple(p for p in INFERENCE_PRECISIONS if p != "auto")  # the choices once "auto" is resolved
DEVICES = ("auto", "cpu", "cuda", "mps")
TOKENIZERS = ("char", "bpe", "gpt2")
OPTIMIZERS = ("adamw", "muon")
PREFIX_CACHE_MB = 512  # chat's and serve's --prefix-cache-mb: some 200 blocks of GPT-2 small in fp32
ENGINES = ("torch", "reference", "fast")  # train's and sample's --engine
NATIVE_ENGINES = ("reference", "fast")  # the C++ engines: fp32 on the CPU, one process, AdamW, the GPT alone
# the layers LoRA may adapt, by GPT-2's module names; "c_proj" is attention's and the MLP's (as in PEFT)
LORA_TARGETS = ("c_attn", "c_proj", "c_fc", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
LOGGERS = ("tensorboard", "csv", "wandb", "mlflow")  # train's --log (gptlab.training.loggers)
PROBES = ("none", "induction")  # train's --probe (gptlab.heads)


SEED_LIMIT = 1 << 63


@dataclass
class ModelConfig:
    """The shape of a model. `vocab_size` 0 means "take it from the tokenizer"."""

    arch: str = setting("gpt", "the model: gpt (the GPT-2 decoder) or bigram (a V x V table, no context)", ARCHS)
    vocab_size: int = setting(0, "token ids the model knows (0: the tokenizer's size)")
    block_size: int = setting(64, "context length T: the positions the model attends over")
    n_layer: int = setting(4, "transformer blocks N")
    n_head: int = setting(4, "attention heads h per block (n_embd must be a multiple of it)")
    n_embd: int = setting(128, "embedding width C (each head is C / h wide)")
    dropout: float = setting(0.0, "dropout rate in training, in [0, 1) (never at inference)")
    bias: bool = setting(True, "biases in the linear layers and LayerNorms (GPT-2 has them)")
    attention: str = setting("auto", "attention path: naive (the equation written out), sdpa (torch's fused "
                                     "kernel) or auto (the faster one for this device and precision)",
                             ATTENTION_PATHS)
    activation: str = setting("gelu", "MLP activation: gelu (exact) or gelu_tanh (GPT-2's approximation)",
                              ACTIVATIONS)
    layer_norm_eps: float = setting(1e-5, "the epsilon of every LayerNorm")

    def __post_init__(self) -> None:
        _check_types(self)
        _check_choice("arch", self.arch, ARCHS)
        _check_choice("attention", self.attention, ATTENTION_PATHS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check(self.vocab_size >= 0, f"vocab_size must be >= 0, not {self.vocab_size}")
        for name in ("block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            _check(value > 0, f"{name} must be a positive integer, not {value}")
        _check(self.n_embd % self.n_head == 0,
               f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); change one of them")
        _check(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), not {self.dropout}")
        _check(self.layer_norm_eps > 0, f"layer_norm_eps must be > 0, not {self.layer_norm_eps}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def shape(self) -> dict[str, Any]:
        """The fields that decide the weights' shapes: two models with equal shapes can share a checkpoint."""
        keys = ("arch", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias")
        return {k: getattr(self, k) for k in keys}


@dataclass
class TrainConfig:
    """How to train. `lr_decay_steps` 0 means "decay over max_steps". `spike_factor` > 1 stops the run when the
    loss exceeds that multiple of its recent mean for `spike_patience` steps in a row (0: off)."""

    batch_size: int = setting(12, "sequences per micro-step B, over all processes")
    grad_accum: int = setting(1, "micro-steps per optimizer step (B x grad_accum sequences a step)")
    max_steps: int = setting(2000, "optimizer steps to train for")
    lr: float = setting(1e-3, "peak learning rate (after warm-up)")
    min_lr: float = setting(1e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = setting(100, "steps of linear learning-rate warm-up")
    lr_decay_steps: int = setting(0, "steps of cosine decay (0: over max_steps)")
    weight_decay: float = setting(0.1, "AdamW weight decay (matrices only)")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.99, "AdamW beta2")
    grad_clip: float = setting(1.0, "clip the gradient norm to this (0: no clipping)")
    eval_interval: int = setting(250, "steps between evaluations (each writes a checkpoint)")
    eval_batches: int = setting(20, "batches per split in each evaluation")
    log_interval: int = setting(10, "steps between log rows (metrics.jsonl, the progress bar)")
    seed: int = setting(1337, "seed of the initial weights and of every batch, in [0, 2**63)")
    precision: str = setting("auto", "fp32, bf16 (autocast over fp32 weights) or auto (bf16 where the hardware "
                                     "computes it natively)", TRAIN_PRECISIONS)
    device: str = setting("auto", "where to train (auto: cuda, then mps, then cpu)", DEVICES)
    compile: bool = setting(False, "torch.compile the model (eager, with a warning, where it cannot)")
    fsdp: bool = setting(False, "with several processes: shard weights, gradients and AdamW state (FSDP2)")
    activation_checkpointing: bool = setting(False, "keep only each block's input in the forward pass and "
                                                    "recompute the block in backward: less memory, more time")
    loss_chunk: int = setting(0, "compute the training loss over chunks of this many positions, each chunk's logits "
                                 "recomputed in backward instead of kept: less memory with a large vocabulary "
                                 "(e.g. 256 for GPT-2's; 0: every position's logits at once)")
    keep_last: int = setting(2, "valid step checkpoints to keep (at least 2)")
    spike_factor: float = setting(0.0, "stop when the loss stays above this multiple of its recent mean (0: off)")
    spike_patience: int = setting(3, "steps the loss must stay that high before the run stops")
    init_from: str = setting("", "start from this run's or Hugging Face GPT-2 folder's weights (fine-tuning)")
    lora_rank: int | None = setting(None, "LoRA: train adapters of this rank on the --init-from run's frozen weights "
                                          "(unset: fine-tune every weight)")
    lora_alpha: float = setting(8.0, "LoRA: the adapters' update is scaled by lora_alpha / lora_rank")
    lora_dropout: float = setting(0.0, "LoRA: dropout on the adapters' input")
    lora_targets: str = setting("c_attn", "LoRA: the layers adapted, comma-separated: c_attn, c_proj, c_fc (or "
                                          "attn.c_proj, mlp.c_proj, ...)")
    optimizer: str = setting("adamw", "adamw, or muon: Muon (orthogonalised momentum) for the blocks' matrices and "
                                      "AdamW for embeddings, gains and biases", OPTIMIZERS)
    muon_lr: float = setting(0.02, "peak learning rate of Muon's matrices (the schedule scales it like lr)")
    engine: str = setting("torch", "torch (autograd and every fast path), reference (the naive C++ engine: "
                                   "hand-written backward and AdamW, fp32, CPU, one process) or fast (the same "
                                   "computation made fast in C++: blocked, vectorised, threaded; the same limits)",
                          ENGINES)
    log: list[str] = setting([], "also log the metrics.jsonl rows, the settings and the loss curve to NAME under "
                                 "RUN/logs: tensorboard, csv, wandb (offline unless logged in) or mlflow (a local "
                                 "store); repeatable, or NAME,NAME", LOGGERS, metavar="NAME")
    probe: str = setting("none", "at each evaluation, also record into metrics.jsonl: induction (every attention "
                                 "head's induction score on random tokens repeated, drawn beside the loss in "
                                 "loss.png) or none", PROBES)

    def __post_init__(self) -> None:
        _check_types(self)
        _check(0 <= self.seed < SEED_LIMIT, f"seed must be in [0, 2**63), not {self.seed}")
        for name in ("batch_size", "grad_accum", "max_steps", "eval_interval", "eval_batches", "log_interval"):
            value = getattr(self, name)
            _check(value > 0, f"{name} must be a positive integer, not {value}")
        _check(self.lr > 0, f"lr (learning rate) must be > 0, not {self.lr}")
        _check(0 <= self.min_lr <= self.lr, f"min_lr must be in [0, lr={self.lr}], not {self.min_lr}")
        _check(self.warmup_steps >= 0, f"warmup_steps must be >= 0, not {self.warmup_steps}")
        _check(self.lr_decay_steps >= 0, f"lr_decay_steps must be >= 0, not {self.lr_decay_steps}")
        _check(self.weight_decay >= 0, f"weight_decay must be >= 0, not {self.weight_decay}")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "beta1 and beta2 must be in [0, 1)")
        _check(self.loss_chunk >= 0, f"loss_chunk must be >= 0 (0: the whole loss at once), not {self.loss_chunk}")
        _check(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 turns clipping off), not {self.grad_clip}")
        _check(self.keep_last >= 2, f"keep_last must be at least 2, not {self.keep_last}")
        _check(self.spike_factor == 0 or self.spike_factor > 1,
               f"spike_factor must be 0 (off) or > 1, not {self.spike_factor}")
        _check(self.spike_patience >= 1, f"spike_patience must be >= 1, not {self.spike_patience}")
        _check(self.precision != "int8", "precision int8 is for inference only (gptlab sample / eval --precision "
                                         "int8); train in fp32, bf16 or auto")
        _check_choice("precision", self.precision, TRAIN_PRECISIONS)
        _check_choice("device", self.device, DEVICES)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check(self.muon_lr > 0, f"muon_lr must be > 0, not {self.muon_lr}")
        _check(not (self.optimizer == "muon" and self.fsdp), "optimizer muon orthogonalises whole matrices, which "
               "FSDP splits across processes; use --optimizer adamw with --fsdp")
        _check_choice("engine", self.engine, ENGINES)
        _check_choice("probe", self.probe, PROBES)
        self._check_lora()
        self.log = list(dict.fromkeys(name for entry in self.log for name in entry.split(",") if name))
        for name in self.log:
            _check_choice("log", name, LOGGERS)
        if self.engine in NATIVE_ENGINES:
            _check_reference(self)

    @property
    def decay_steps(self) -> int:
        return self.lr_decay_steps or self.max_steps

    def _check_lora(self) -> None:
        _check(self.lora_rank is None or self.lora_rank >= 1, f"lora_rank must be at least 1, not {self.lora_rank} "
               "(leave it unset to fine-tune every weight)")
        _check(self.lora_alpha > 0, f"lora_alpha must be > 0, not {self.lora_alpha}")
        _check(0 <= self.lora_dropout < 1, f"lora_dropout must be in [0, 1), not {self.lora_dropout}")
        targets = [t.strip() for t in self.lora_targets.split(",")]
        unknown = [t for t in targets if t not in LORA_TARGETS]
        _check(not unknown, f"lora_targets: unknown layer {', '.join(map(repr, unknown))}; choose among "
                            f"{', '.join(LORA_TARGETS)} (comma-separated)")
        if self.lora_rank:
            _check(bool(self.init_from), "LoRA adapts a trained model: name it with --init-from RUN (a gptlab run; "
                                         "import a Hugging Face folder first with `gptlab import hf`)")
            _check(not self.fsdp, "--fsdp does not shard LoRA's frozen base yet; train the adapters with DDP (drop "
                                  "--fsdp: the adapters and their optimizer state are small)")
            _check(self.engine == "torch", f"the {self.engine} engine trains every weight; drop --lora-rank or use "
                                           "--engine torch")


def _check_reference(cfg: TrainConfig) -> None:
    """The settings the C++ engines (reference, fast) do not implement, each refused in one line that names the
    engine chosen."""
    unsupported = {"optimizer muon": cfg.optimizer == "muon", f"precision {cfg.precision}": cfg.precision == "bf16",
                   "compile": cfg.compile, "fsdp": cfg.fsdp, f"device {cfg.device}": cfg.device in ("cuda", "mps"),
                   "activation checkpointing": cfg.activation_checkpointing, "loss_chunk": cfg.loss_chunk > 0,
                   f"probe {cfg.probe}": cfg.probe != "none"}
    for name, given in unsupported.items():
        _check(not given, f"the {cfg.engine} engine does not implement {name} (it trains with AdamW in fp32 on the "
                          "CPU, one process); drop that setting or use --engine torch")


SPECULATE = ("auto", "off")  # sampling's speculate: auto where the fused CPU step verifies exactly, or off


@dataclass
class SampleConfig:
    """How to sample. temperature 0 is greedy; top_k None (unset) and top_p 1 turn those filters off; generation
    stops at the first of the `stop` strings to appear in the generated text."""

    max_new_tokens: int = setting(500, "tokens to generate per sample")
    temperature: float = setting(0.8, "sampling temperature (0: greedy, always the most likely token)")
    top_k: int | None = setting(None, "sample only among the k most likely tokens (unset: all)")
    top_p: float = setting(1.0, "sample only among the most likely tokens whose mass reaches p, in (0, 1]")
    repetition_penalty: float = setting(1.0, "divide the logits of tokens already seen by this (1: off)")
    frequency_penalty: float = setting(0.0, "subtract this times a token's count so far from its logit")
    presence_penalty: float = setting(0.0, "subtract this from the logit of every token seen so far")
    seed: int = setting(1337, "seed of the sampling, in [0, 2**63)")
    stop: list[str] = setting([], "stop when the generated text contains TEXT (repeatable; \\n, \\t, \\r and "
                                  "\\\\ are read as escapes)", metavar="TEXT")
    speculate: str = setting("off", "propose tokens from n-grams already in the prompt and the output and check "
                                    "them in one step: the same tokens, sooner where text repeats (auto: where the "
                                    "fused CPU step runs; off)", choices=SPECULATE)

    def __post_init__(self) -> None:
        _check_types(self)
        _check(0 <= self.seed < SEED_LIMIT, f"seed must be in [0, 2**63), not {self.seed}")
        _check(self.max_new_tokens > 0, f"max_new_tokens must be a positive integer, not {self.max_new_tokens}")
        _check(self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), not {self.temperature}")
        _check(self.top_k is None or self.top_k >= 1,
               f"top_k must be >= 1 (leave it out to keep every token), not {self.top_k}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], not {self.top_p}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, not {self.repetition_penalty}")
        _check(all(self.stop), "a stop string must not be empty (it would stop before the first token)")
        _check(self.speculate in SPECULATE, f"speculate must be one of {', '.join(SPECULATE)}, not {self.speculate!r}")


SHARD_TOKENS = 100_000_000  # token ids per token file, by default


@dataclass
class PrepareConfig:
    """How `prepare` turns text into token files: the tokenizer, the validation split, how the inputs are read, and
    how it is written. `tokenizer_from` "" builds a new tokenizer; `workers` None is one per core available."""

    tokenizer: str = setting("char", "char (one token per character), bpe (a byte-level BPE trained on the text) or "
                                     "gpt2 (GPT-2's 50,257 tokens)", TOKENIZERS)
    tokenizer_from: str = setting("", "encode with the tokenizer of this run or data folder instead of building one "
                                      "(to evaluate a run on new text, or fine-tune it)", metavar="RUN_OR_DATA")
    allow_special: bool = setting(False, "read <|endoftext|> in the text as the end-of-text token (without it: "
                                         "refuse such text)")
    vocab_size: int = setting(1024, "vocabulary size for --tokenizer bpe")
    val_fraction: float = setting(0.1, "share of the documents held out for validation, whole documents chosen at "
                                       "random by --seed, in (0, 1); a corpus of fewer than 1 / val-fraction "
                                       "documents (one book) is split by characters, its last val-fraction")
    seed: int = setting(0, "seed of the choice of validation documents")
    val: list[str] = setting([], "the validation corpus: files or folders read like the inputs (instead of "
                                 "--val-fraction); may be repeated", metavar="PATH")
    encoding: str = setting("utf-8", "text encoding of the inputs")
    text_field: str = setting("text", "the field of a JSON line or the Parquet column that holds the text")
    include: list[str] = setting([], "read only files matching GLOB (against the path below the folder named, or "
                                     "the bare name); may be repeated", metavar="GLOB")
    exclude: list[str] = setting([], "skip files matching GLOB; may be repeated", metavar="GLOB")
    strict: bool = setting(False, "refuse a file found in a folder that is not readable text (binary, another "
                                  "encoding, damaged) instead of skipping it")
    workers: int | None = setting(None, "processes that encode, with the same token files as one (default: the "
                                        "cores available)", metavar="N")
    shard_tokens: int = setting(SHARD_TOKENS, "token ids per token file: each split is written in shards of at most "
                                              "N, which training reads as one stream; an interrupted prepare resumes "
                                              "from its last checkpoint when run again", metavar="N")
    chat: bool = setting(False, "read the inputs as conversations (JSONL, one {\"messages\": [{\"role\", "
                                "\"content\"}, ...]} per line, OpenAI's format) and write a loss mask that trains on "
                                "the assistant's turns only; the tokenizer gets the chat template's role markers")
    context: int = setting(1024, "with --chat: the most tokens a training row holds (the block_size you will train "
                                 "with): longer conversations are split before a user turn, each piece keeping the "
                                 "system message", metavar="TOKENS")
    chat_loss: str = setting("assistant", "with --chat: the tokens training predicts: the assistant's (its turns and "
                                          "their end markers) or all of them", ("assistant", "all"))

    def __post_init__(self) -> None:
        _check_types(self)
        _check_choice("tokenizer", self.tokenizer, TOKENIZERS)
        _check(self.workers is None or self.workers >= 1, f"--workers must be at least 1, not {self.workers}")
        _check(self.shard_tokens >= 1, f"--shard-tokens must be at least 1, not {self.shard_tokens}")
        _check(self.context >= 8, f"--context must be at least 8 tokens, not {self.context}")
        _check_choice("chat_loss", self.chat_loss, ("assistant", "all"))
        _check(bool(self.val) or 0 < self.val_fraction < 1,
               f"val_fraction must be in (0, 1): training needs a validation split, not {self.val_fraction}")


@dataclass(frozen=True)
class Preset:
    """A named starting point: model shape, training settings and the tokenizer it expects."""

    description: str
    model: dict[str, Any]
    train: dict[str, Any]
    tokenizer: str = "char"


_GPT2_TRAIN = dict(batch_size=8, grad_accum=8, lr=6e-4, min_lr=6e-5, warmup_steps=700, max_steps=60000,
                   beta2=0.95, eval_interval=1000, eval_batches=50)

PRESETS: dict[str, Preset] = {
    "bigram": Preset(
        "bigram baseline: a V x V table of next-token logits, no context beyond the current token",
        dict(arch="bigram", block_size=64, n_layer=1, n_head=1, n_embd=1),
        dict(batch_size=32, max_steps=3000, lr=1e-1, min_lr=1e-2, warmup_steps=0, weight_decay=0.0,
             eval_interval=500)),
    "char-quick": Preset(
        "the default: a small char-level GPT tuned to beat the nanoGPT CPU recipe's validation loss on Tiny "
        "Shakespeare in a short run on a CPU (docs/benchmarks.md, `make run`)",
        dict(block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0),
        dict(batch_size=32, max_steps=600, lr=6e-3, min_lr=6e-4, warmup_steps=50, beta2=0.99,
             weight_decay=0.1, eval_interval=300, eval_batches=20)),
    "char-race": Preset(
        "the race preset, tuned for the shortest time to the nanoGPT CPU recipe's validation loss in fp32 "
        "(`gptlab bench race --presets char-race`): 2 layers 192 wide, Muon at 0.04 for 250 steps "
        "(docs/benchmarks.md)",
        dict(block_size=64, n_layer=2, n_head=4, n_embd=192, dropout=0.0),
        dict(batch_size=32, max_steps=250, lr=6e-3, min_lr=6e-4, warmup_steps=50, beta2=0.99, weight_decay=0.1,
             optimizer="muon", muon_lr=0.04, eval_interval=25, eval_batches=20)),
    "char-small": Preset(
        "nanoGPT's Shakespeare char model: 6 layers, 6 heads, 384 wide, context 256, dropout 0.2",
        dict(block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.2),
        dict(batch_size=64, max_steps=5000, lr=1e-3, min_lr=1e-4, warmup_steps=100, beta2=0.99,
             eval_interval=250, eval_batches=200)),
    "gpt2": Preset("GPT-2 small, 124M parameters",
                   dict(block_size=1024, n_layer=12, n_head=12, n_embd=768, vocab_size=50257), _GPT2_TRAIN, "gpt2"),
    "gpt2-medium": Preset("GPT-2 medium, 350M parameters",
                          dict(block_size=1024, n_layer=24, n_head=16, n_embd=1024, vocab_size=50257),
                          _GPT2_TRAIN, "gpt2"),
    "gpt2-large": Preset("GPT-2 large, 774M parameters",
                         dict(block_size=1024, n_layer=36, n_head=20, n_embd=1280, vocab_size=50257),
                         _GPT2_TRAIN, "gpt2"),
    "gpt2-xl": Preset("GPT-2 XL, 1558M parameters",
                      dict(block_size=1024, n_layer=48, n_head=25, n_embd=1600, vocab_size=50257),
                      _GPT2_TRAIN, "gpt2"),
    "finetune": Preset(
        "continue training a model given with --init-from (a gptlab run or a Hugging Face GPT-2 folder) on your "
        "text: its shape comes from there; a small, nearly constant learning rate, a short run, dropout 0.1",
        dict(dropout=0.1),
        dict(batch_size=8, grad_accum=4, max_steps=200, lr=3e-5, min_lr=3e-5, warmup_steps=10, beta2=0.95,
             weight_decay=0.1, eval_interval=50, eval_batches=20), "gpt2"),
}
DEFAULT_PRESET = "char-quick"
FINETUNE_PRESET = "finetune"


def check_prepared(precision: str) -> None:
    """GptlabError unless `precision` is one a model is made ready in (PREPARED_PRECISIONS: "auto" resolved)."""
    if precision not in PREPARED_PRECISIONS:
        raise GptlabError(f"precision must be one of {', '.join(PREPARED_PRECISIONS)}, not {precision!r}")


def get_preset(name: str) -> Preset:
    """The preset called `name`; raises GptlabError naming the known presets."""
    if name not in PRESETS:
        raise GptlabError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]
