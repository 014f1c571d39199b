"""The guarded optimizer step: a step with a non-finite loss or gradient norm is never applied."""

import json

import pytest
import torch

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
    from conftest import tiny_config
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
    from test_sweep import TINY

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
    from test_sweep import TINY, tree

    run = tmp_path / "run"
    assert main(["train", "--data", str(char_data), "--run", str(run), "--max-steps", "5", *TINY, "--optimizer",
                 trained]) == 0
    before = tree(run)
    capsys.readouterr()
    assert main(["train", "--run", str(run), "--resume", "--max-steps", "10", "--optimizer", asked]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gptlab: error: cannot resume {run} with optimizer {asked}: it was trained with {trained}, whose "
                   f"state {asked} cannot take over; drop --optimizer, or start a new --run from its weights with "
                   f"--init-from {run} --data {char_data.resolve()}"]
    assert tree(run) == before
