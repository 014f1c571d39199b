"""`gptlab bench eval`: items per second of `gptlab eval --task`'s scoring beside lm-evaluation-harness's own `hf`
model, on the same multiple-choice items and the same GPT-2-shaped model (random weights: the time does not depend
on them), in one run; both sides' acc is printed too, and must agree."""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch

from gptlab.bench.timing import LoadWatch
from gptlab.runtime import device_name, set_threads
from gptlab.tasks.items import MULTIPLE_CHOICE, Item

SHAPES = {"gpt2": dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024),  # GPT-2 124M
          "tiny": dict(n_embd=48, n_layer=2, n_head=3, n_positions=128)}  # tests
WORDS = ("the a man woman dog runs walks slowly then after before house garden river kitchen opens closes takes "
         "gives water bread small large red green bright dark into out of and but while because every quietly "
         "begins finishes paints sings reads writes over under").split()


def synthetic_items(n: int, seed: int = 0, context_words: int = 40, choice_words: int = 15) -> list[Item]:
    """HellaSwag-shaped items (a context of about 50 GPT-2 tokens, 4 endings of about 20) of seeded random words."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [Item(MULTIPLE_CHOICE, (words(context_words).capitalize() + ".",),
                 tuple(words(choice_words + rng.randrange(-3, 4)) + "." for _ in range(4)), rng.randrange(4), i + 1)
            for i in range(n)]


def write_model(folder: Path, shape: str) -> None:
    """A random GPT-2 of `shape` with GPT-2's tokenizer files, as transformers saves it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gptlab.hf.hf_tokenizer import write_tokenizer_files
    from gptlab.tokenizer import GPT2Tokenizer

    torch.manual_seed(0)
    tokenizer = GPT2Tokenizer()
    config = GPT2Config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.eot_id,
                        eos_token_id=tokenizer.eot_id, **SHAPES[shape])
    GPT2LMHeadModel(config).save_pretrained(folder)
    write_tokenizer_files(folder, tokenizer, SHAPES[shape]["n_positions"])


def time_gptlab(folder: Path, items: list[Item]) -> tuple[float, float]:
    """(seconds, acc) of gptlab's task scoring (fp32) over `items`, after one warm-up item."""
    from gptlab.hf.gpt2_folders import load_hf_model
    from gptlab.tasks.measure import evaluate_items
    from gptlab.tokenizer import GPT2Tokenizer

    model, tokenizer = load_hf_model(folder), GPT2Tokenizer()
    evaluate_items(model, tokenizer, items[:1])
    start = time.perf_counter()
    scores = evaluate_items(model, tokenizer, items)
    return time.perf_counter() - start, scores.measures["acc"].value


def time_harness(folder: Path, items: list[Item], batch_size: int) -> tuple[float, float]:
    """(seconds, acc) of the harness's hf model (fp32, `batch_size`) on the same requests, after one warm-up."""
    import numpy as np
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(folder), device="cpu", batch_size=batch_size, dtype="float32")
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=option, idx=i)
                for item in items for i, option in enumerate(item.options)]
    lm.loglikelihood(requests[:4], disable_tqdm=True)
    start = time.perf_counter()
    results = lm.loglikelihood(requests, disable_tqdm=True)
    seconds = time.perf_counter() - start
    right, k = 0, 0
    for item in items:
        lls = [ll for ll, _ in results[k:k + len(item.options)]]
        right += int(np.argmax(lls)) == item.label
        k += len(item.options)
    return seconds, right / len(items)


def run_eval_bench(items: int = 40, shape: str = "gpt2", batch_sizes: tuple[int, ...] = (1, 16),
                   as_json: bool = False) -> dict:
    """Time both sides on `items` synthetic items; print a table (or JSON) whose last line is the ratio of gptlab's
    items/s over the harness's fastest; return the report."""
    set_threads()
    chosen = synthetic_items(items)
    watch = LoadWatch()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_model(folder, shape)
        rows = [("gptlab eval --task (fp32, KV-cached, one prefill per context)", *time_gptlab(folder, chosen))]
        for b in batch_sizes:
            rows.append((f"lm-evaluation-harness hf model (fp32, batch {b})", *time_harness(folder, chosen, b)))
    load = watch.stop()
    best_harness = min(seconds for _, seconds, _ in rows[1:])
    report = {"device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(), "shape": shape,
              "items": items, "load": load.line(), "busy": load.busy,
              "rows": [{"contender": name, "seconds": s, "items_per_s": items / s, "acc": acc} for name, s, acc in rows],
              "speedup": best_harness / rows[0][1]}
    if as_json:
        print(json.dumps(report, indent=2))
        return report
    print(f"{report['device']}, {report['threads']} threads; {items} HellaSwag-shaped items (4 endings) on a random "
          f"{shape}-shaped GPT-2")
    print(f"{'contender':<64} {'seconds':>8} {'items/s':>8} {'acc':>6}")
    for name, seconds, acc in rows:
        print(f"{name:<64} {seconds:>8.2f} {items / seconds:>8.2f} {acc:>6.3f}")
    print(load.report())
    print(f"gptlab eval --task vs the harness's fastest hf run: {report['speedup']:.2f}x the items/s")
    return report
