"""The fused decode step: one new token per row through the whole GPT in one native call (csrc/decode.cpp).

Decoding reads every weight once per token, so memory bandwidth sets its pace; launched op by op from Python, a
12-layer model pays hundreds of dispatches per token, and the library kernels for a single row stop well short of
the memory bus (docs/benchmarks.md). `FusedDecoder.step` runs embeddings, every block (LayerNorm, QKV, attention
over the KV cache, W_O, residual adds, the GELU feed-forward) and the LM head for R rows at once, streaming each
weight row a single time for all rows, in fp32 activations over fp32, bf16 or int8 weights (int8: by AVX512-VNNI
where the CPU has it, else widened to fp32; gptlab.inference.int8 is the reference).

The library is built, loaded and its structs checked by gptlab.inference.native. Where it cannot run
`fused_decoder` returns None, and where a cache is neither fp32 nor bf16 `accepts` says no: the engine then
decodes with the torch step (gptlab.inference.prepared.TorchStep), which stays the reference (tests/test_fused.py
holds the two together; tests/test_kernel_mutants.py checks that those tests catch a broken kernel).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptlab.inference.int8 import Int8Linear
from gptlab.inference.native import WEIGHTS, Layer, Model, Step, has_int8_vnni, load_library
from gptlab.inference.weights import move_to_huge_pages
from gptlab.model import GPT, KVCache, is_gpt


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecoder:
    """Runs `GPT.forward(ids[:, None], kv_cache=cache, last_only=True)` for one new token per row, natively.

    Holds the model's weights as they are (fp32, bf16 or int8 matrices, shared, not copied; int8 ones for VNNI are
    copied into its layout, see below) and fp32 copies of the small vectors (LayerNorm, biases). The model must not
    change afterwards: this is for inference only. `lib` is the library from gptlab.inference.native
    (`load_library` or `build_library`), whose structs it has checked. For an int8 model (its Linears are
    Int8Linears) `vnni` picks the product: by AVX512-VNNI (x quantized per row to 16 bits, two bytes of products
    each; the weights copied into the kernel's blocked layout, `vnni_pack`, in 2 MB pages) or by fp32 FMAs over
    the weights widened as they are (x as it is); None: VNNI where `lib` has it. `weights` names the format and
    product chosen (a key of gptlab.inference.native.WEIGHTS)."""

    def __init__(self, model: GPT, lib: ctypes.CDLL, vnni: bool | None = None, huge_pages: bool = True):
        self.config = c = model.config
        self.weights = _weights_format(model, lib, vnni)
        self._keep: list[torch.Tensor] = []
        int8_operands = _int8_operands(model, self.weights == "int8 vnni", huge_pages)  # Int8Linear -> (w, s, sums)
        self._int8_operands = int8_operands  # the kernel points into these

        def matrix(linear: torch.nn.Module) -> int:
            w = int8_operands[linear][0] if linear in int8_operands else linear.weight.detach().contiguous()
            self._keep.append(w)
            return w.data_ptr()

        def int8(linear: torch.nn.Module, name: str) -> int | None:  # an Int8Linear's scales or sums; else NULL
            return _ptr(int8_operands[linear][1 if name == "scale" else 2]) if linear in int8_operands else None

        def vector(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().float().contiguous()
            self._keep.append(t)
            return t.data_ptr()

        layers = (Layer * c.n_layer)()
        for i, block in enumerate(model.transformer.h):
            attn, mlp = block.attn, block.mlp
            layers[i] = Layer(matrix(attn.c_attn), matrix(attn.c_proj), matrix(mlp.c_fc), matrix(mlp.c_proj),
                              vector(block.ln_1.weight), vector(block.ln_1.bias), vector(attn.c_attn.bias),
                              vector(attn.c_proj.bias), vector(block.ln_2.weight), vector(block.ln_2.bias),
                              vector(mlp.c_fc.bias), vector(mlp.c_proj.bias),
                              *(int8(m, "scale") for m in (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)),
                              *(int8(m, "sums") for m in (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)))
        t = model.transformer
        self._layers = layers  # the struct below points into it
        self._model = Model(c.n_layer, c.n_head, c.head_dim, c.n_embd, c.vocab_size, c.block_size,
                            WEIGHTS[self.weights], int(c.activation == "gelu_tanh"), c.layer_norm_eps,
                            matrix(t.wte), matrix(t.wpe), matrix(model.lm_head), vector(t.ln_f.weight),
                            vector(t.ln_f.bias), layers, int8(model.lm_head, "scale"), int8(model.lm_head, "sums"))
        self._call, self._model_ref = lib.gptlab_decode_step, ctypes.byref(self._model)
        self._plan: _Plan | None = None  # the last step's
        self._verify_plan: _Plan | None = None  # the last verify's

    def accepts(self, cache: KVCache) -> bool:
        """Whether `cache` has the layout the kernel reads: fp32 or bf16, contiguous, on the CPU."""
        return (cache.k.dtype in (torch.float32, torch.bfloat16) and cache.k.device.type == "cpu"
                and cache.k.is_contiguous() and cache.v.is_contiguous() and cache.pos.is_contiguous())

    def step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (R,) the new token of each row -> next-token logits (R, V) in fp32, valid until the next step
        (they live in the decoder's buffer); writes the rows' keys and values at cache.pos and advances cache.pos
        by one, like the model's forward. Raises ValueError, and changes nothing, for a cache the kernel cannot
        read (`accepts`), one of another shape or number of rows, a token id outside the vocabulary, or a
        position past the cache or block_size."""
        plan = self._plan
        threads = torch.get_num_threads()
        if plan is None or not plan.serves(cache, ids.numel(), threads):
            self._check(cache, ids.numel())
            plan = self._plan = _Plan.make(self.config, cache, ids.numel(), threads)
        plan.ids.copy_(ids)
        return self._run(plan, threads, cache.pos)

    def verify(self, ids: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Step rows r = 0..R-1 (any number), each the token ids[r] at position pos[r] of cache row slot[r] ->
        each one's next-token logits (R, V), valid until the next verify. Rows of one cache row at consecutive
        positions are several tokens of one sequence in one step (a speculative proposal checked): each row sees
        the keys and values of the rows before it, and each row's logits have the bits of a `step` that decoded
        that token at that position (the same products, whatever the rows beside it). Writes the rows' keys and
        values; cache.pos is left as it is (the caller sets it to what it keeps). ValueError, and nothing changed,
        where `step` raises it, or for a slot outside the cache's rows."""
        plan, threads, R = self._verify_plan, torch.get_num_threads(), ids.numel()
        if plan is None or not plan.serves(cache, R, threads):
            self._check(cache, cache.k.shape[1])
            plan = self._verify_plan = _Plan.make(self.config, cache, R, threads, verify=True)
        plan.ids.copy_(ids)
        plan.pos.copy_(pos)
        plan.slot.copy_(slot)
        return self._run(plan, threads, pos)

    def _run(self, plan: _Plan, threads: int, pos: torch.Tensor) -> torch.Tensor:
        plan.args.n_threads = threads
        status = self._call(self._model_ref, ctypes.byref(plan.args))
        if status != 0:  # the kernel checks every row before it touches memory
            r, c = status - 1, self.config
            raise ValueError(f"fused decode refused row {r}: token id {int(plan.ids[r])} (vocabulary {c.vocab_size}) "
                             f"at position {int(pos[r])} (cache {plan.args.max_len}, block_size {c.block_size}"
                             f"{'' if plan.slot is None else f', row {int(plan.slot[r])} of {plan.args.cache_rows}'})")
        return plan.logits

    def _check(self, cache: KVCache, R: int) -> None:
        """Raises ValueError unless the kernel can read and write `cache` for R rows of this model."""
        c = self.config
        shape = (c.n_layer, R, c.n_head, cache.max_len, c.head_dim)
        if not self.accepts(cache):
            raise ValueError("the fused step reads fp32 or bf16 caches, contiguous, on the CPU")
        if (tuple(cache.k.shape) != shape or cache.v.shape != cache.k.shape or cache.v.dtype != cache.k.dtype
                or tuple(cache.pos.shape) != (R,) or cache.pos.dtype != torch.int64
                or cache.v.device != cache.k.device or cache.pos.device != cache.k.device):
            raise ValueError(f"a cache of k, v {tuple(cache.k.shape)} and pos {tuple(cache.pos.shape)} does not fit "
                             f"{R} rows of this model: k and v {shape}, pos ({R},) int64, all on the CPU")


def vnni_pack(linear: Int8Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """decode.cpp's VNNI operands of `linear`: q (N, K) laid out as [N/16][K/4][16][4] int8 (each 64 bytes: 16 rows'
    weights for 4 inputs), rows and inputs padded with zeros to multiples of 16 and 4; its scales and sums padded
    with zeros to the same rows."""
    N, K = linear.q.shape
    NP, KP = -(-N // 16) * 16, -(-K // 4) * 4
    q = torch.zeros(NP, KP, dtype=torch.int8)
    q[:N, :K] = linear.q
    packed = q.view(NP // 16, 16, KP // 4, 4).permute(0, 2, 1, 3).contiguous()  # (NP/16, KP/4, 16, 4)
    return packed, F.pad(linear.scale.detach(), (0, NP - N)), F.pad(linear.sums.detach(), (0, NP - N))


def _int8_operands(model: GPT, vnni: bool, huge_pages: bool = True) -> dict:
    """Each Int8Linear of `model` -> the (weights, scales, sums) the kernel reads: as they are for the FMA product;
    for VNNI, copies in its layout (`vnni_pack`), moved into 2 MB pages (unless `huge_pages` is false) as the
    model's own weights are."""
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    if not vnni:
        return {m: (m.q.detach(), m.scale.detach(), m.sums.detach()) for m in linears}
    holder = torch.nn.Module()  # the copies as parameters, so that move_to_huge_pages moves them
    for i, m in enumerate(linears):
        for name, t in zip(("w", "scale", "sums"), vnni_pack(m)):
            holder.register_parameter(f"{name}{i}", torch.nn.Parameter(t, requires_grad=False))
    if huge_pages:
        move_to_huge_pages(holder)
    return {m: tuple(getattr(holder, f"{name}{i}") for name in ("w", "scale", "sums")) for i, m in enumerate(linears)}


def _weights_format(model: GPT, lib: ctypes.CDLL, vnni: bool | None) -> str:
    """The kernel's weight format for `model` (a key of WEIGHTS); ValueError for VNNI asked of a library without
    it, or a model whose matrices are not all of one kind."""
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    if not any(isinstance(m, Int8Linear) for m in linears):
        return "bf16" if model.transformer.wte.weight.dtype == torch.bfloat16 else "fp32"
    if not all(isinstance(m, Int8Linear) for m in linears):
        raise ValueError("the fused step runs a model whose matrices are all int8 or none")
    if vnni and not has_int8_vnni(lib):
        raise ValueError("this decode library was built without AVX512-VNNI")
    return "int8 vnni" if (has_int8_vnni(lib) if vnni is None else vnni) else "int8 fma"


@dataclass
class _Plan:
    """Everything a step of R rows over one cache passes to the kernel, built once per cache (a few dozen
    microseconds a token otherwise): the kernel's arguments and the buffers they point to."""

    tensors: tuple[torch.Tensor, ...]  # the cache's k, v and pos, which the pointers below point into
    ids: torch.Tensor  # (R,) int64, the step's tokens are copied here
    logits: torch.Tensor  # (R, V) fp32, written by the kernel
    threads: int  # the most threads the scratch serves
    args: Step
    scratch: tuple[torch.Tensor, ...]  # x, h, qkv, att, fc, and a row of scores per thread
    pos: torch.Tensor | None = None  # a verify's: (R,) int64, each row's position, copied here (else cache.pos)
    slot: torch.Tensor | None = None  # a verify's: (R,) int64, each row's cache row

    def serves(self, cache: KVCache, R: int, threads: int) -> bool:
        """Whether this plan's pointers are still those of `cache` (not reallocated since) for R rows."""
        same = all(a is b for a, b in zip(self.tensors, (cache.k, cache.v, cache.pos)))
        return same and self.ids.numel() == R and self.threads >= threads

    @classmethod
    def make(cls, config, cache: KVCache, R: int, threads: int, verify: bool = False) -> _Plan:
        """A step's plan (row r is cache row r, at cache.pos[r]) or, with `verify`, a verify's (rows at the
        positions and cache rows copied into its own `pos` and `slot`)."""
        C, V = config.n_embd, config.vocab_size
        ids, logits = torch.zeros(R, dtype=torch.int64), torch.empty(R, V)
        pos, slot = (torch.zeros(R, dtype=torch.int64), torch.zeros(R, dtype=torch.int64)) if verify else (None, None)
        scratch = tuple(torch.empty(n) for n in (R * C, R * C, R * 3 * C, R * C, R * 4 * C, threads * cache.max_len))
        args = Step(R, cache.max_len, threads, int(cache.k.dtype == torch.bfloat16), cache.k.shape[1], *(
            _ptr(t) for t in (ids, cache.pos if pos is None else pos, slot, cache.k, cache.v, *scratch[:5], logits,
                              scratch[5])))
        return cls((cache.k, cache.v, cache.pos), ids, logits, threads, args, scratch, pos, slot)


def fused_decoder(model: torch.nn.Module, huge_pages: bool = True) -> FusedDecoder | None:
    """A FusedDecoder for `model`, or None where the native step cannot run it (not a GPT, not on the CPU,
    embeddings neither fp32 nor bf16 (an int8 model keeps its own in fp32), heads wider than 256, no compiler).
    Every CPU has a build (gptlab.inference.native.BUILDS: the plain one at least)."""
    if not is_gpt(model):
        return None
    weight = model.transformer.wte.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if model.config.head_dim > 256:  # the kernel holds a head's query and output in registers
        return None
    lib = load_library()
    return None if lib is None else FusedDecoder(model, lib, huge_pages=huge_pages)
