"""The model's forward before the hook points (8cc8bab's model.py) and after (this checkout's), the same weights,
timed in alternation: `python scripts/hooks_before_after.py` (docs/benchmarks.md, `gptlab bench hooks`)."""
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

old_source = subprocess.run(["git", "show", "8cc8bab:src/gptlab/model.py"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[1]).stdout
old_path = Path(tempfile.mkdtemp()) / "old_model.py"
old_path.write_text(old_source)
spec = importlib.util.spec_from_file_location("old_model", old_path)
old_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old_model)
from gptlab.config import ModelConfig
from gptlab.model import GPT
from gptlab.machine import cpu_model
torch.manual_seed(0)
cfg = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257, dropout=0.0)
new = GPT(cfg).eval()
old = old_model.GPT(cfg).eval()
old.load_state_dict(new.state_dict())
print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
def run(m, ids, cache=None):
    with torch.no_grad():
        return m(ids, kv_cache=cache)[0]
for T in (64, 256):
    ids = torch.randint(0, 50257, (1, T))
    assert torch.equal(run(old, ids), run(new, ids))
    times = {"before (8cc8bab)": [], "after (hook points)": []}
    for r in range(12):
        for name, m in (("before (8cc8bab)", old), ("after (hook points)", new)):
            t = time.perf_counter(); run(m, ids); times[name].append(time.perf_counter() - t)
    b = statistics.median(times["before (8cc8bab)"])
    for name, v in times.items():
        print(f"forward T={T:<4} {name:<22} median {statistics.median(v)*1e3:8.2f} ms ({min(v)*1e3:.2f} .. {max(v)*1e3:.2f})  {statistics.median(v)/b:.3f}x")
# one-token decode through the KV cache at position 128 (the torch step the reference path runs)
prompt = torch.randint(0, 50257, (1, 128))
times = {"before (8cc8bab)": [], "after (hook points)": []}
caches = {}
for name, m in (("before (8cc8bab)", old), ("after (hook points)", new)):
    c = m.new_kv_cache(1); run(m, prompt, c); caches[name] = c
tok = torch.tensor([[7]])
for r in range(40):
    for name, m in (("before (8cc8bab)", old), ("after (hook points)", new)):
        c = caches[name]; c.pos -= 0
        t = time.perf_counter(); run(m, tok, c); times[name].append(time.perf_counter() - t)
        c.pos -= 1
b = statistics.median(times["before (8cc8bab)"])
for name, v in times.items():
    print(f"decode step at 128  {name:<22} median {statistics.median(v)*1e3:8.2f} ms ({min(v)*1e3:.2f} .. {max(v)*1e3:.2f})  {statistics.median(v)/b:.3f}x")
