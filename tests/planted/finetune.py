"""Planted bugs of fine-tuning's memory (issue 26): the training loss over chunks of positions (--loss-chunk) and a
LoRA run's frozen matrices stored in bf16."""

from planted import Planted

MODEL = "src/gptlab/model.py"
OPS = "src/gptlab/ops.py"
LORA = "src/gptlab/lora.py"
C = "tests/test_chunked_loss.py"
BF16_RUN = "tests/test_lora.py::test_a_bf16_lora_run_stores_its_frozen_matrices_in_bf16_and_trains_the_same_bits"
BENCH = "tests/test_lora.py::test_bench_train_sets_lora_beside_full_fine_tuning_with_memory_split"
BENCH_CLI = "tests/test_lora.py::test_bench_train_lora_rank_runs_the_three_variants_with_memory"


def model(name: str, function: str, old: str, new: str, path: str = OPS) -> Planted:
    return Planted(f"finetune: chunked loss, {name}", path, function, [(old, new)], C)


PLANTED = [
    model("ignored targets counted", "_ChunkedLoss.forward",
          "total += ((torch.logsumexp(logits, dim=1) - picked) * (t != -1)).sum()",
          "total += (torch.logsumexp(logits, dim=1) - picked).sum()"),
    model("the mean over every position, ignored ones too", "_ChunkedLoss.forward",
          "return total / (targets != -1).sum()",
          "return total / targets.numel()"),
    model("the target's logit given half its gradient", "_ChunkedLoss.backward", "d.new_full((t.size(0), 1), -1.0)",
          "d.new_full((t.size(0), 1), -0.5)"),
    model("the head's gradient from the last chunk only", "_ChunkedLoss.backward",
          "grad_w += (d.t() @ xs).to(grad_w.dtype)",
          "grad_w = (d.t() @ xs).to(grad_w.dtype)"),
    model("evaluation gets no logits", "GPT.forward",
          "if self.loss_chunk and targets is not None and torch.is_grad_enabled() and not last_only:",
          "if self.loss_chunk and targets is not None and not last_only:", MODEL),
    model("products in fp32 under bf16 autocast", "chunked_loss",
          "dtype = torch.get_autocast_dtype(device) if autocast else x.dtype",
          "dtype = x.dtype"),
    model("an fp64 model's loss in fp32", "chunked_loss",
          "exact = torch.float64 if dtype == torch.float64 else torch.float32",
          "exact = torch.float32"),
    model("an fp64 model rounded by autocast", "chunked_loss",
          "autocast = torch.is_autocast_enabled(device) and x.dtype == torch.float32",
          "autocast = torch.is_autocast_enabled(device)"),
    model("no gradient for the tied head", "_ChunkedLoss.backward", "need_x, need_w = ctx.needs_input_grad[:2]",
          "need_x, need_w = ctx.needs_input_grad[0], False"),
    model("ignored positions given gradients", "_ChunkedLoss.backward",
          "d = (d * ((t != -1).unsqueeze(1) * scale)).to(dtype)",
          "d = (d * scale).to(dtype)"),
    model("the incoming gradient ignored (a step of several micro-batches)", "_ChunkedLoss.backward",
          "w, scale = weight.to(dtype), grad / (targets != -1).sum()",
          "w, scale = weight.to(dtype), 1 / (targets != -1).sum()"),
    model("the softmax in bf16", "_ChunkedLoss.backward", "d = torch.softmax((xs @ w.t()).to(ctx.exact), dim=1)",
          "d = torch.softmax((xs @ w.t()), dim=1)"),
    Planted("finetune: chunked loss, the LoRA head's own rows left out", LORA, "TrainableTokensHead.tied_weight",
            [("return self.weight.index_copy(0, tokens.token_ids, tokens.token_values.to(self.weight.dtype))",
              "return self.weight")], C),
    Planted("finetune: bf16 base, the adapters stored in bf16 too", LORA, "store_frozen_matrices",
            [("isinstance(module, nn.Linear) and not weight.requires_grad:", "isinstance(module, nn.Linear):")], C),
    Planted("finetune: bf16 base, the tied head and embedding stored in bf16", LORA, "store_frozen_matrices",
            [('if name.startswith("transformer.h.") and isinstance(module, nn.Linear)',
              "if isinstance(module, nn.Linear)")], C),
    Planted("finetune: bf16 base, the bytes saved miscounted", LORA, "store_frozen_matrices",
            [("saved += weight.nbytes - module.weight.nbytes", "saved += weight.nbytes")], C),
    Planted("finetune: bf16 base, stored for an fp32 run", LORA, "adapt",
            [('if precision == "bf16":', 'if precision != "bf16":')],
            [BF16_RUN, "tests/test_lora.py::test_a_resumed_lora_run_ends_exactly_where_one_straight_run_does"]),
    Planted("finetune: --loss-chunk not passed to the model", "src/gptlab/training/train.py", "_train_locked",
            [("model.checkpoint_blocks, model.loss_chunk = cfg.activation_checkpointing, cfg.loss_chunk",
              "model.checkpoint_blocks = cfg.activation_checkpointing")], C),
    Planted("finetune: a logger's sample drawn in fp32 from a bf16 base", "src/gptlab/training/train.py",
            "Trainer.sample",
            [("with autocast(self.ctx.device, self.ctx.precision):", 'with autocast(self.ctx.device, "fp32"):')],
            BF16_RUN),
    Planted("finetune: bench train, --loss-chunk not passed to the variants", "src/gptlab/bench/train_speed.py",
            "build_contender", [("eager.checkpoint_blocks, eager.loss_chunk = variant.checkpointing, cfg.loss_chunk",
              "eager.checkpoint_blocks = variant.checkpointing")], BENCH),
    Planted("finetune: bench train, LoRA's base kept in fp32", "src/gptlab/bench/train_speed.py", "build_contender",
            [('if variant.precision == "bf16":  # as training', 'if variant.precision == "fp32":  # as training')],
            BENCH),
    Planted("finetune: bench train, --loss-chunk dropped by the command line", "src/gptlab/cli/bench_verbs.py",
            "bench_train", [("loss_chunk=args.loss_chunk)", "loss_chunk=0)")], BENCH_CLI),
    Planted("finetune: --loss-chunk accepted for a bigram", "src/gptlab/training/preflight.py", "check_checkpointing",
            [('if cfg.loss_chunk and model_cfg.arch != "gpt":', "if False:")], C),
    Planted("finetune: a negative --loss-chunk accepted", "src/gptlab/config.py", "TrainConfig.__post_init__",
            [("_check(self.loss_chunk >= 0,", "_check(self.loss_chunk >= -5,")], C),
    Planted("finetune: --loss-chunk accepted by the reference engine", "src/gptlab/config.py", "_check_reference",
            [('"loss_chunk": cfg.loss_chunk > 0,', '"loss_chunk": False,')], C),
    Planted("finetune: the memory check counts a bf16 run's frozen matrices at 4 bytes", "src/gptlab/training/preflight.py",
            "check_memory", [('if adapters and precision == "bf16" else 0', "if False else 0")],
            "tests/test_lora.py::test_the_memory_check_counts_the_frozen_base_at_its_own_bytes"),
    Planted("finetune: the memory check counts every logit with --loss-chunk", "src/gptlab/training/preflight.py",
            "check_memory", [("logits = min(positions, cfg.loss_chunk or positions) * model_cfg.vocab_size * 8",
              "logits = positions * model_cfg.vocab_size * 8")],
            "tests/test_nothing_lost.py::test_a_micro_batch_whose_logits_exceed_memory_is_refused"),
    Planted("finetune: the memory check given no precision", "src/gptlab/training/train.py", "train",
            [("check_memory(model_cfg, cfg, device, parallel.world_size, precision)",
              "check_memory(model_cfg, cfg, device, parallel.world_size)")], BF16_RUN),
]
