"""The guarded optimizer step: a step with a non-finite loss or gradient norm is never applied."""

import json

import pytest
import torch
from helpers import TINY, tiny_config, tree

from gptlab.optim import step_if_finite


@pytest.mark.parametrize("fused", [True, False])  # fused: decided on the device; otherwise on the host
def test_a_non_finite_step_changes_nothing_and_a_finite_one_steps(fused):
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([p], lr=0.1, fused=fused)
    p.grad = torch.ones(4)
    assert step_if_finite(optimizer, torch.tensor(1.0), torch.tensor(2.0))
    after_one = (p.detach().clone(), {k: v.clone() for k, v in optimizer.state[p].items()})
    for loss, norm in ((torch.tensor(float("nan")), torch.tensor(1.0)),
                       (torch.tensor(1.0), torch.tensor(float("inf")))):
        p.grad = torch.full((4,), float("nan"))
        assert not step_if_finite(optimizer, loss, norm)
        assert torch.equal(p, after_one[0])
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in after_one[1].items())  # moments, step count
    p.grad = torch.ones(4)
    step_if_finite(optimizer, torch.tensor(1.0), torch.tensor(1.0))
    assert (p < after_one[0]).all() and optimizer.state[p]["step"] == 2
    assert not hasattr(optimizer, "found_inf")


# ---- Muon (the blocks' matrices) with AdamW (the rest) ----------------------------------------------------------

def muon_model_and_grads(seed: int = 0):

    from gptlab.config import TrainConfig
    from gptlab.model import GPT
    from gptlab.optim import make_optimizer

    torch.manual_seed(seed)
    model = GPT(tiny_config(n_embd=24, n_head=3, bias=True))
    cfg = TrainConfig(optimizer="muon", lr=3e-3, muon_lr=0.05, weight_decay=0.1)
    optimizer = make_optimizer(model, cfg)
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * group["lr_scale"]
    return model, optimizer, cfg


def newton_schulz(g: torch.Tensor) -> torch.Tensor:
    """Muon's orthogonalisation as Keller Jordan's Muon publishes it, written out here: G scaled to norm 1 (in
    fp32), transposed to have no more rows than columns, then five steps X <- aX + (bA + cA^2)X with A = XX^T and
    (a, b, c) = (3.4445, -4.7750, 2.0315); the test's own copy, not gptlab's."""
    x = g.float() / (g.float().norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if tall else x


def test_zeropower_orthogonalises():
    """Muon's Newton-Schulz iteration brings every singular value near 1 and keeps the singular vectors: close
    to U V^T of the SVD, for tall and wide matrices."""
    from gptlab.optim import zeropower

    torch.manual_seed(0)
    for shape in ((24, 60), (60, 24), (32, 32)):
        u, _, vh = torch.linalg.svd(torch.randn(shape), full_matrices=False)
        g = u @ torch.diag(torch.logspace(-1, 1, min(shape))) @ vh  # singular values from 0.1 to 10
        x = zeropower(g)
        s = torch.linalg.svdvals(x)
        assert s.min() > 0.5 and s.max() < 1.25, s
        assert torch.nn.functional.cosine_similarity(x.flatten(), (u @ vh).flatten(), dim=0) > 0.95
        assert (x - newton_schulz(g)).abs().max() <= 1e-5  # the published iteration, step for step


def test_muon_updates_match_a_written_out_reference():
    """Two steps: the blocks' matrices follow Muon written out (Nesterov momentum 0.95, orthogonalised,
    sqrt(max(1, rows / cols)) scale, decoupled decay, muon_lr); everything else follows torch's AdamW."""
    model, optimizer, cfg = muon_model_and_grads()
    muon = {id(p) for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    assert len(muon) == 4 * 2  # c_attn, attn.c_proj, c_fc, mlp.c_proj of each block
    assert id(model.transformer.wte.weight) not in muon  # the embeddings (and the tied head) stay with AdamW
    reference = {}
    adam_params = [p for p in model.parameters() if id(p) not in muon]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in adam_params]
    decays = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    adamw = torch.optim.AdamW([{"params": [t], "weight_decay": decays[id(p)]} for p, t in zip(adam_params, twins)],
                              lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    for step in range(2):
        grads = {p: torch.randn_like(p) for p in model.parameters()}
        for p in model.parameters():
            if id(p) in muon:
                buf = reference.get(id(p), torch.zeros_like(p)) * 0.95 + grads[p]
                reference[id(p)] = buf
                update = newton_schulz(grads[p] + 0.95 * buf)
                expected = p.detach() * (1 - cfg.muon_lr * cfg.weight_decay) \
                    - cfg.muon_lr * max(1.0, p.size(0) / p.size(1)) ** 0.5 * update
                reference[("p", id(p))] = expected
            p.grad = grads[p]
        for p, t in zip(adam_params, twins):
            t.grad = grads[p]
        optimizer.step()
        adamw.step()
        for p in model.parameters():
            if id(p) in muon:
                assert (p.detach() - reference[("p", id(p))]).abs().max() <= 1e-6
        for p, t in zip(adam_params, twins):
            assert (p.detach() - t.detach()).abs().max() <= 1e-6


def test_muon_trains_and_resumes_exactly(tmp_path, char_data):

    from gptlab.checkpoint import find_checkpoint, load_run
    from gptlab.cli import main

    flags = [*TINY, "--optimizer", "muon", "--lr-decay-steps", "12", "--eval-interval", "6"]
    assert main(["train", "--data", str(char_data), "--run", str(tmp_path / "straight"), "--max-steps", "12",
                 *flags]) == 0
    assert main(["train", "--data", str(char_data), "--run", str(tmp_path / "split"), "--max-steps", "6",
                 *flags]) == 0
    assert main(["train", "--run", str(tmp_path / "split"), "--resume", "--max-steps", "12", "--quiet"]) == 0
    a, b = (load_run(tmp_path / r, which="last").model.state_dict() for r in ("straight", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    ckpt = find_checkpoint(tmp_path / "split")
    groups = json.loads((ckpt.path / "state.json").read_text())["optimizer"]["param_groups"]
    muon_lr, adam_lr = (next(g["lr"] for g in groups if g["muon"] == flag) for flag in (True, False))
    assert ckpt.step == 12 and muon_lr / adam_lr == pytest.approx(0.02 / 6e-3)  # the schedule scales both alike


@pytest.mark.parametrize("trained, asked", [("adamw", "muon"), ("muon", "adamw")])
def test_a_resume_with_the_other_optimizer_is_one_line_and_changes_nothing(tmp_path, char_data, capsys, trained,
                                                                         asked):

    from gptlab.cli import main

    run = tmp_path / "run"
    assert main(["train", "--data", str(char_data), "--run", str(run), "--max-steps", "5", *TINY, "--optimizer",
                 trained]) == 0
    before = tree(run)
    capsys.readouterr()
    assert main(["train", "--run", str(run), "--resume", "--max-steps", "10", "--optimizer", asked]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [(f"gptlab: error: cannot resume {run} with optimizer {asked}: it was trained with {trained}, "
                    f"whose state {asked} cannot take over; drop --optimizer, or start a new --run from its weights "
                    f"with --init-from {run} --data {char_data.resolve()}")]
    assert tree(run) == before


# ---- AdamW as made for training, Muon built directly, the schedule's edges -------------------------------------

def trained_looking_model(seed: int = 1):
    """A tiny GPT whose weights are far from their init (so decay and moments are visible), with names for
    telling the groups apart."""

    from gptlab.model import GPT

    torch.manual_seed(seed)
    model = GPT(tiny_config(n_embd=24, n_head=3, bias=True))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


def test_adamw_as_made_steps_like_torch_adamw_with_decay_on_matrices_only():
    """cfg's lr, betas and weight decay reach the optimizer: three steps match torch's own AdamW, built here with
    the groups told apart by name (biases and LayerNorm gains undecayed), and it is the fused kernel on CPU."""
    from gptlab.config import TrainConfig
    from gptlab.optim import make_optimizer

    model = trained_looking_model()
    cfg = TrainConfig(lr=0.01, beta1=0.8, beta2=0.95, weight_decay=0.2)
    optimizer = make_optimizer(model, cfg)
    assert all(g["fused"] is True for g in optimizer.param_groups)
    named = list(model.named_parameters())
    twins = [torch.nn.Parameter(p.detach().clone()) for _, p in named]
    plain = [n.endswith(".bias") or ".ln_" in n for n, _ in named]
    peer = torch.optim.AdamW([{"params": [t], "weight_decay": 0.0 if flat else 0.2} for t, flat in zip(twins, plain)],
                             lr=0.01, betas=(0.8, 0.95), eps=1e-8)
    for _ in range(3):
        for (_, p), t in zip(named, twins):
            p.grad = torch.randn_like(p)
            t.grad = p.grad.clone()
        optimizer.step()
        peer.step()
    for (name, p), t in zip(named, twins):
        assert (p.detach() - t.detach()).abs().max() <= 1e-5, name


def test_adamw_asks_for_the_fused_kernel_on_cuda(monkeypatch):
    """On a CUDA model make_optimizer asks torch for the fused AdamW (a stand-in model: no GPU needed)."""
    from types import SimpleNamespace

    from gptlab.config import TrainConfig
    from gptlab.optim import make_optimizer

    asked = []
    monkeypatch.setattr(torch.optim, "AdamW", lambda groups, **kwargs: asked.append(kwargs["fused"]))
    weight = SimpleNamespace(device=torch.device("cuda", 0), requires_grad=True, dim=lambda: 2)
    make_optimizer(SimpleNamespace(parameters=lambda: iter([weight])), TrainConfig())
    assert asked == [True]


def test_muon_built_directly_defaults_to_no_decay_and_its_own_lr():
    """Muon(groups, lr, betas) with groups that say nothing but their params (and `muon` for the matrix): no
    weight decay, momentum 0.95, eps 1e-8, lr as given and lr_scale 1; the AdamW group follows torch's AdamW,
    the matrix Muon written out (test's newton_schulz), over two steps."""
    from gptlab.optim import Muon

    torch.manual_seed(2)
    w, b = torch.nn.Parameter(torch.randn(12, 5)), torch.nn.Parameter(torch.randn(5))
    twin = torch.nn.Parameter(b.detach().clone())
    optimizer = Muon([{"params": [w], "muon": True}, {"params": [b]}], lr=0.03, betas=(0.8, 0.95))
    assert [(g["lr"], g["lr_scale"], g["weight_decay"]) for g in optimizer.param_groups] == [(0.03, 1.0, 0.0)] * 2
    peer = torch.optim.AdamW([twin], lr=0.03, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.0)
    buf, expected = torch.zeros_like(w), w.detach().clone()
    for _ in range(2):
        w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
        twin.grad = b.grad.clone()
        buf = 0.95 * buf + w.grad
        expected -= 0.03 * (12 / 5) ** 0.5 * newton_schulz(w.grad + 0.95 * buf)
        optimizer.step()
        peer.step()
        assert (w.detach() - expected).abs().max() <= 1e-5
        assert (b.detach() - twin.detach()).abs().max() <= 1e-6


def test_muon_as_made_steps_its_adamw_groups_at_cfg_lr_and_scales_only_the_matrices():
    """Before the schedule touches it, make_optimizer's Muon steps the embeddings, gains and biases like torch's
    AdamW at cfg.lr with cfg's betas; every group carries lr_scale, muon_lr / lr for the matrices, 1 for the rest."""
    from gptlab.config import TrainConfig
    from gptlab.optim import make_optimizer

    model = trained_looking_model()
    cfg = TrainConfig(optimizer="muon", lr=0.01, muon_lr=0.04, beta1=0.8, beta2=0.95, weight_decay=0.2)
    optimizer = make_optimizer(model, cfg)
    assert sorted((g["muon"], g["lr_scale"]) for g in optimizer.param_groups) == [(False, 1.0), (False, 1.0),
                                                                                  (True, pytest.approx(4.0))]
    adam = [(p, g["weight_decay"]) for g in optimizer.param_groups if not g["muon"] for p in g["params"]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p, _ in adam]
    peer = torch.optim.AdamW([{"params": [t], "weight_decay": wd} for t, (_, wd) in zip(twins, adam)], lr=0.01,
                             betas=(0.8, 0.95), eps=1e-8)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        for t, (p, _) in zip(twins, adam):
            t.grad = p.grad.clone()
        optimizer.step()
        peer.step()
    assert all((p.detach() - t.detach()).abs().max() <= 1e-6 for t, (p, _) in zip(twins, adam))


def test_lr_peaks_exactly_at_the_end_of_warm_up_and_never_above_it():
    """lr = 1, min 0.1, warm-up 4 over steps 0..3 (0.25, 0.5, 0.75, 1), then cosine: step 4 is the cosine's
    start, cos 0 = 1, so lr is 1 there too and below 1 after; never above lr anywhere."""
    from gptlab.config import TrainConfig
    from gptlab.optim import lr_at

    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=8)
    assert [lr_at(s, cfg) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    # step 6: progress (6 - 4) / (8 - 4) = 0.5, 0.1 + 0.5 * (1 + cos(pi / 2)) * 0.9 = 0.55
    assert lr_at(6, cfg) == pytest.approx(0.55)
    assert max(lr_at(s, cfg) for s in range(20)) == 1.0


@pytest.mark.parametrize("decay_steps", [4, 3])
def test_a_decay_that_ends_by_the_end_of_warm_up_drops_to_min_lr_at_once(decay_steps):
    """lr_decay_steps <= warmup_steps: warm-up to lr, then min_lr from the first step after it (no cosine)."""
    from gptlab.config import TrainConfig
    from gptlab.optim import lr_at

    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=10, lr_decay_steps=decay_steps)
    assert [lr_at(s, cfg) for s in range(8)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 0.1, 0.1, 0.1, 0.1])


def test_zeropower_of_a_gradient_below_its_norm_guard_still_points_along_it():
    """A gradient of norm 4e-8, under the 1e-7 added to the norm: still orthogonalised along the gradient (positive
    inner product with it), like the written-out iteration, not flipped."""
    from gptlab.optim import zeropower

    torch.manual_seed(3)
    g = torch.randn(24, 60) * 1e-9
    x = zeropower(g)
    assert (x * g).sum() > 0 and (x - newton_schulz(g)).abs().max() <= 1e-5


def test_muon_on_a_model_without_transformer_blocks_is_adamw_for_everything():
    """Nothing to orthogonalise (no model.transformer.h): every parameter steps like torch's AdamW, the matrix
    decayed, the bias and gain not."""
    from gptlab.config import TrainConfig
    from gptlab.optim import make_optimizer

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    optimizer = make_optimizer(model, TrainConfig(optimizer="muon", lr=0.01, beta1=0.8, beta2=0.95, weight_decay=0.2))
    assert not any(g["muon"] for g in optimizer.param_groups)
    params = list(model.parameters())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    peer = torch.optim.AdamW([{"params": [t], "weight_decay": 0.2 if t.dim() == 2 else 0.0} for t in twins], lr=0.01,
                             betas=(0.8, 0.95), eps=1e-8)
    for _ in range(2):
        for p, t in zip(params, twins):
            p.grad = torch.randn_like(p)
            t.grad = p.grad.clone()
        optimizer.step()
        peer.step()
    assert all((p.detach() - t.detach()).abs().max() <= 1e-6 for p, t in zip(params, twins))
