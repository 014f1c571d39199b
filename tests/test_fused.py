"""The fused native decode step (gptlab.inference.fused) against the model's torch forward with the same KV cache.

Every comparison runs on parameters away from their initial values (at init every bias is 0 and every LayerNorm
gain 1, so ln_1 equals ln_2 and a kernel that skips a bias or a gain, or swaps the two norms, still matches), at
widths and head sizes that are not multiples of 16 (the kernel's masked tails). The checks themselves
(fp32_error, bf16_errors, bf16_cache_errors) are in tests/helpers.py, because tests/test_kernel_mutants.py holds
them to deliberately broken copies of the kernel: each must fail one of them.
"""

import copy
import os
import platform
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import (BF16_TOLERANCE, FP32_TOLERANCE, KERNEL_SHAPES, bf16_cache_errors, bf16_errors, fp32_error,
                     tiny_config, trained_like)

from gptlab import compiled
from gptlab.config import SampleConfig
from gptlab.engine import generate_batch, generate_uncached
from gptlab.inference import native
from gptlab.inference.loading import bf16_storage_possible, prepare_for_inference
from gptlab.inference.prefix_cache import prompt_pass
from gptlab.inference.prepared import TorchStep
from gptlab.inference.fused import FusedDecoder, fused_decoder
from gptlab.inference.weights import move_to_huge_pages
from gptlab.machine import X86_64, cpu_flags
from gptlab.model import GPT, Bigram
from gptlab.runtime import bf16_supported

pytestmark = [pytest.mark.device_path("fused decode (native)"), pytest.mark.usefixtures("fused_kernel")]


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_fused_step_equals_the_torch_forward_in_fp32(shape, rows):
    assert fp32_error(shape, rows) <= FP32_TOLERANCE


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_fused_bf16_step_stays_as_close_to_fp32_as_the_torch_bf16_path(shape):
    torch_error, fused_error = bf16_errors(shape)
    assert torch_error <= BF16_TOLERANCE and fused_error <= BF16_TOLERANCE


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_the_bf16_cache_holds_keys_and_values_rounded_to_nearest_even(shape):
    logits_error, wrongly_rounded = bf16_cache_errors(shape)
    assert logits_error <= BF16_TOLERANCE
    assert wrongly_rounded == 0


def test_the_engine_decodes_with_the_fused_step_and_gives_the_reference_ids():
    plain = trained_like(dict(n_layer=2, n_head=3, n_embd=60, vocab_size=50, block_size=24))
    fast = prepare_for_inference(copy.deepcopy(plain), "fp32")
    assert isinstance(fast.decoder, FusedDecoder) and fast.fused and fast.cache_dtype == torch.float32
    calls = []
    step = fast.decoder.step
    fast.decoder.step = lambda ids, cache: calls.append(len(ids)) or step(ids, cache)
    prompts = [torch.randint(0, 50, (n,)).tolist() for n in (3, 1, 20)]  # ragged, and past the 24-token window
    cfg = SampleConfig(max_new_tokens=60, temperature=0)
    assert list(generate_batch(fast, prompts, cfg)) == list(generate_uncached(plain, prompts, cfg))
    assert calls == [3] * 59  # every decode step after the prefill


def test_the_torch_path_stays_where_the_fused_step_cannot_run():
    unfused = prepare_for_inference(GPT(tiny_config()), "fp32", fused=False)
    assert isinstance(unfused.decoder, TorchStep) and not unfused.fused
    assert fused_decoder(Bigram(tiny_config(arch="bigram"))) is None
    assert fused_decoder(GPT(tiny_config(n_head=1, n_embd=272))) is None  # heads wider than 256
    model = GPT(tiny_config()).eval()
    assert not fused_decoder(model).accepts(model.new_kv_cache(2, dtype=torch.float16))  # fp32 or bf16 caches


@pytest.mark.skipif(not bf16_supported(torch.device("cpu")), reason="no native bf16 on this CPU")
def test_a_bf16_model_keeps_a_bf16_cache_only_where_the_fused_step_decodes():
    """The fused step reads a bf16 cache at half the bytes; torch ops on a CPU attend in fp32 (bf16 is slower)."""
    fast = prepare_for_inference(GPT(tiny_config()), "bf16")
    assert fast.fused and fast.cache_dtype == torch.bfloat16
    assert fast.new_kv_cache(2).k.dtype == torch.bfloat16
    assert prepare_for_inference(GPT(tiny_config()), "bf16", fused=False).cache_dtype == torch.float32


def _prompt_logits(prepared, tokens, attend):
    cache = prepared.new_kv_cache(1)
    cache.attend = attend
    with torch.inference_mode():
        return prompt_pass(prepared.model, cache, tokens, None, "all")[0].float()


@pytest.mark.device_path("bf16 native")
@pytest.mark.skipif(not bf16_supported(torch.device("cpu")), reason="no native bf16 on this CPU")
def test_a_bf16_models_prompts_attend_in_bf16_where_the_cpu_multiplies_it_natively_at_bf16s_own_error():
    """Over its bf16 cache, a bf16 model's prompt pass attends in bf16 (no fp32 copies of the keys and values) where
    the CPU has native bf16 products: its logits are no further from the fp32 model's than with fp32 attention
    (1.5x that error + 1e-3), on an odd head size (15) and a prompt crossing chunks (77 tokens); fp32 elsewhere."""
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=2, n_head=4, n_embd=60, vocab_size=97, block_size=80)).eval()
    with torch.no_grad():
        for p in model.parameters():  # away from the init: biases and LayerNorms moved
            p.mul_(3.0) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    plain = copy.deepcopy(model)
    prepared = prepare_for_inference(model, "bf16")
    assert prepared.attend == torch.bfloat16 and prepared.new_kv_cache(1).attend == torch.bfloat16
    assert prepared.new_kv_cache(2).select_rows(torch.tensor([1])).attend == torch.bfloat16
    tokens = torch.randint(0, 97, (77,)).tolist()
    with torch.no_grad():
        expected = plain(torch.tensor([tokens]))[0][0]
    in_bf16, in_fp32 = _prompt_logits(prepared, tokens, torch.bfloat16), _prompt_logits(prepared, tokens, None)
    assert not torch.equal(in_bf16, in_fp32)  # the setting is what decides
    assert (in_bf16 - expected).abs().max() <= 1.5 * (in_fp32 - expected).abs().max() + 1e-3
    for precision in ("fp32", "int8"):
        assert prepare_for_inference(GPT(tiny_config()), precision).attend is None
    assert prepare_for_inference(GPT(tiny_config()), "bf16", fused=False).attend is None  # an fp32 cache


@pytest.mark.skipif(not bf16_storage_possible(torch.device("cpu")), reason="no g++ for the fused bf16 step")
def test_without_native_bf16_products_a_bf16_models_prompts_attend_in_fp32(monkeypatch):
    import gptlab.inference.loading as loading
    monkeypatch.setattr(loading, "bf16_supported", lambda device: False)
    prepared = prepare_for_inference(GPT(tiny_config()), "bf16")
    assert prepared.cache_dtype == torch.bfloat16 and prepared.attend is None
    assert prepared.new_kv_cache(1).attend is None


def test_a_refused_step_raises_and_changes_nothing():
    """Arguments that would take the kernel outside its memory raise ValueError, also under python -O (see the
    next test), and the cache stays as it was."""
    model = GPT(tiny_config()).eval()  # vocab_size 50, block_size 16
    fused, cache = fused_decoder(model), model.new_kv_cache(2, max_len=8)
    with torch.inference_mode():
        model(torch.randint(0, 50, (2, 5)), kv_cache=cache)
    before = [t.clone() for t in (cache.k, cache.v, cache.pos)]
    for ids in ([3, 50], [-1, 3]):
        with pytest.raises(ValueError, match="refused row"):
            fused.step(torch.tensor(ids), cache)
    with pytest.raises(ValueError, match="does not fit 3 rows"):
        fused.step(torch.tensor([1, 2, 3]), cache)
    for other in (GPT(tiny_config(n_layer=1)).new_kv_cache(2), GPT(tiny_config(n_head=4)).new_kv_cache(2)):
        with pytest.raises(ValueError, match="does not fit 2 rows of this model"):
            fused.step(torch.tensor([1, 2]), other)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        fused.step(torch.tensor([1, 2]), model.new_kv_cache(2, dtype=torch.float16))
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.k, cache.v, cache.pos)))
    cache.pos[1] = 8  # full
    with pytest.raises(ValueError, match="refused row 1: .* at position 8 \\(cache 8"):
        fused.step(torch.tensor([1, 2]), cache)
    assert torch.equal(cache.pos, torch.tensor([5, 8]))


def test_a_refused_step_raises_under_python_O_too():
    """python -O drops assert statements: the previous test, run there, still sees every refusal raise."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_fused as t; "
            "t.test_a_refused_step_raises_and_changes_nothing(); print('optimize', sys.flags.optimize)")
    out = subprocess.run([sys.executable, "-O", "-c", code, str(Path(__file__).parent)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("optimize 1")


def test_builds_are_named_by_their_target_and_share_a_folder(tmp_path, monkeypatch):
    """Each build names its target (never -march=native): two builds of this CPU live side by side in one folder,
    each loads its own file, and building one prunes only its own earlier sources' files and the files named before
    builds had names (by CPU, or by nothing)."""
    O0 = ("-O0", *native.FLAGS[1:])  # the layout and the names are checked here, not the numbers
    monkeypatch.delenv("GPTLAB_KERNEL_BUILD", raising=False)
    folder = tmp_path / "kernels"
    folder.mkdir()
    best, plain = native.build_for_cpu(), native.BUILDS["plain"]
    assert best.name == native.runnable_builds()[0] and "plain" in native.runnable_builds()
    code = compiled.source_key(native.SOURCE)  # the source and the headers it includes
    old_source = folder / f"decode-plain-{native._flags_key(native._compiler(), (*O0, *plain.target))}-{'0' * 12}.so"
    other_flags = folder / f"decode-plain-{'1' * 12}-{code}.so"  # -O3, say: another file, kept
    by_cpu, unnamed = folder / f"decode-{'2' * 12}-{code}.so", folder / "decode-0123456789abcdef.so"
    for stale in (old_source, other_flags, by_cpu, unnamed):
        stale.write_bytes(b"not a library: loading this fails")
    lib = native.build_library(native.SOURCE, folder, "plain", O0)
    assert native.describe(lib) == "plain (generic, 8 lanes)"  # compiler vectors, no ISA's own products
    key = native._flags_key(native._compiler(), (*O0, *plain.target))
    assert sorted(folder.iterdir()) == sorted([other_flags, folder / f"decode-plain-{key}-{code}.so"])
    mine = native.build_library(native.SOURCE, folder, best, O0)
    assert native.describe(mine).startswith(best.name) and len(list(folder.iterdir())) == 3  # both builds kept
    products = {"bf16 dot products": "avx512_bf16", "int8 by VNNI": "avx512_vnni", "int8 by sdot": "asimddp"}
    isa = next(v for flag, v in [("avx512f", ("avx512", 16)), ("avx2", ("avx2", 8)), ("asimd", ("neon", 4)),
                                 ("", ("generic", 8))] if flag in best.needs or not flag)
    assert native.describe(mine) == f"{best.name} ({isa[0]}, {isa[1]} lanes" + "".join(  # each product where the
        f", {name}" for name, flag in products.items() if flag in best.needs) + ")"  # build has it, in this order

    monkeypatch.setenv("GPTLAB_KERNEL_BUILD", "plain")
    assert native.build_for_cpu() is plain
    foreign = "armv8-a" if platform.machine() in X86_64 else "x86-64-v3"
    monkeypatch.setenv("GPTLAB_KERNEL_BUILD", foreign)
    with pytest.raises(native.UnknownBuild) as refused:
        native.build_for_cpu()
    lacks = "an aarch64/arm64 CPU" if foreign == "armv8-a" else ", ".join(sorted(set(native.BUILDS[foreign].needs)
                                                                                 - cpu_flags()))
    assert str(refused.value) == (f"the {foreign} kernel build needs {lacks}, which this CPU lacks: pick one of "
                                  + ", ".join(b.name for b in native.BUILDS.values() if b.runs_here()))
    with pytest.raises(native.UnknownBuild) as refused:
        native.build_for_cpu("avx9")
    assert str(refused.value) == ("no kernel build named 'avx9' (GPTLAB_KERNEL_BUILD): the builds are "
                                  "x86-64-v4+vnni+bf16, x86-64-v4+vnni, x86-64-v4+bf16, x86-64-v4, x86-64-v3, "
                                  "armv8.2-a+dotprod, armv8-a, plain")
    assert native.cpu_has_int8_vnni() == ({"avx512_vnni", "avx512f"} <= cpu_flags())  # /proc/cpuinfo's name
    if platform.machine() in X86_64:  # an AVX2-only CPU: the AVX-512 build names just the flags it lacks
        monkeypatch.setattr(compiled, "cpu_flags", lambda: frozenset(["avx", "avx2", "bmi1", "bmi2", "f16c", "fma",
                                                                     "abm", "movbe", "xsave", "avx512f"]))
        with pytest.raises(native.UnknownBuild) as refused:
            native.build_for_cpu("x86-64-v4")
        assert str(refused.value) == ("the x86-64-v4 kernel build needs avx512bw, avx512cd, avx512dq, avx512vl, "
                                      "which this CPU lacks: pick one of x86-64-v3, plain")


def test_a_stale_file_another_build_deletes_first_is_no_error(tmp_path, monkeypatch):
    """Two processes building the same kernel folder each prune the stale files they list: the one whose listing
    is older finds a file already gone, and must build and load all the same."""
    O0 = ("-O0", *native.FLAGS[1:])
    plain = native.BUILDS["plain"]
    key = native._flags_key(native._compiler(), (*O0, *plain.target))
    stale = tmp_path / f"decode-plain-{key}-{'0' * 12}.so"
    stale.write_bytes(b"an earlier source's library")
    listing, pruned = Path.glob, []

    def listed_then_deleted(self, pattern):
        found = list(listing(self, pattern))
        if pattern == "decode-*.so":  # the pruning's listing: the other process prunes the file right after it
            pruned.extend(found)
            stale.unlink(missing_ok=True)
        return iter(found)

    monkeypatch.setattr(Path, "glob", listed_then_deleted)
    lib = native.build_library(native.SOURCE, tmp_path, "plain", O0)
    assert native.describe(lib) == "plain (generic, 8 lanes)" and not stale.exists() and stale in pruned


def test_describe_names_the_build_its_vectors_and_its_products_in_one_line():
    """An ARM dot-product build as its library reports itself (this machine may not load one): the line `bench` and
    `sample --verbose` print. A library that does not say which build it is shows "?"."""
    arm = types.SimpleNamespace(gptlab_bf16_dot=lambda: 0, gptlab_int8_vnni=lambda: 0, gptlab_int8_sdot=lambda: 1,
                                gptlab_simd=lambda: b"neon", gptlab_lanes=lambda: 4, gptlab_build="armv8.2-a+dotprod")
    assert native.describe(arm) == "armv8.2-a+dotprod (neon, 4 lanes, int8 by sdot)"
    del arm.gptlab_build
    arm.gptlab_int8_sdot, arm.gptlab_int8_vnni, arm.gptlab_bf16_dot = (lambda: 0), (lambda: 1), (lambda: 1)
    assert native.describe(arm) == "? (neon, 4 lanes, bf16 dot products, int8 by VNNI)"


def test_a_source_that_does_not_compile_fails_with_the_compilers_own_message(tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("int gptlab_decode_step( { return 0; }\n")
    with pytest.raises(native.KernelBuildError) as failed:
        native.build_library(broken, tmp_path / "kernels", "plain", ("-O0",))
    first, _, rest = str(failed.value).partition("\n")
    assert first.startswith(f"{native._compiler()} ") and str(broken) in first and first.endswith(" failed:"), first
    assert "broken.cpp" in rest and "error" in rest  # the compiler's message, all of it
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_collecting_the_tests_builds_nothing_and_writes_nothing_into_the_users_cache(tmp_path):
    """`make test` points the kernel folder at a temporary one before collecting, and collecting builds nothing:
    the user's ~/.cache/gptlab/kernels is neither written nor pruned."""
    code = ("import sys, pytest; pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', sys.argv[1]]); "
            "from gptlab.inference import native; print('builds', native.load_library.cache_info().misses)")
    env = {k: v for k, v in os.environ.items() if k not in ("GPTLAB_KERNELS", "GPTLAB_CACHE")}
    env.update(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"))
    tests = Path(__file__).parent
    out = subprocess.run([sys.executable, "-c", code, str(tests)], capture_output=True, text=True, env=env,
                         cwd=tests.parent, timeout=300)
    assert out.stdout.strip().endswith("builds 0"), out.stdout[-2000:] + out.stderr[-2000:]
    assert not list(tmp_path.rglob("decode-*"))


def test_weights_moved_to_huge_pages_compute_the_same_and_stay_tied():
    model = GPT(tiny_config(n_head=3, n_embd=48)).eval()
    x = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        expected = model(x)[0]
        assert move_to_huge_pages(model)
        assert torch.equal(model(x)[0], expected)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(p.data_ptr() % 64 == 0 for p in model.parameters())  # each on its own cache lines


def test_a_thread_count_raised_between_steps_still_gives_the_reference_logits():
    model = trained_like(dict(n_layer=2, n_head=3, n_embd=60, vocab_size=50, block_size=24))
    fused, threads = fused_decoder(model), torch.get_num_threads()
    caches = [model.new_kv_cache(2) for _ in range(2)]  # torch's, fused's
    first, second = torch.tensor([1, 2]), torch.tensor([3, 4])
    try:
        with torch.inference_mode():
            for cache in caches:
                model(torch.randint(0, 50, (2, 5)).fill_(7), kv_cache=cache)
            torch.set_num_threads(1)
            fused.step(first, caches[1])  # planned for one thread
            model(first[:, None], kv_cache=caches[0])
            torch.set_num_threads(2)
            got = fused.step(second, caches[1])  # two now: a scores row each
            expected = model(second[:, None], kv_cache=caches[0], last_only=True)[0][:, -1]
    finally:
        torch.set_num_threads(threads)
    assert (got - expected).abs().max() <= FP32_TOLERANCE and torch.equal(caches[1].pos, torch.tensor([7, 7]))


def test_an_arm_cpu_picks_its_builds_from_the_features_it_reports(monkeypatch):
    """/proc/cpuinfo of an ARM64 CPU with the dot product (its "Features" line), and of one without it (a Cortex-A53),
    as an x86 machine cannot report them: the builds each may run, best first, written out by hand."""
    from gptlab import machine

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(machine, "cpu_info", lambda: {"Features": "fp asimd evtstrm aes crc32 asimddp"})
    assert native.runnable_builds() == ["armv8.2-a+dotprod", "armv8-a", "plain"]
    monkeypatch.setattr(machine, "cpu_info", lambda: {"Features": "fp asimd evtstrm crc32"})
    assert native.runnable_builds() == ["armv8-a", "plain"]
