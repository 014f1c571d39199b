"""The guarded optimizer step: a step with a non-finite loss or gradient norm is never applied."""

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
    for loss, norm in ((torch.tensor(float("nan")), torch.tensor(1.0)), (torch.tensor(1.0), torch.tensor(float("inf")))):
        p.grad = torch.full((4,), float("nan"))
        assert not step_if_finite(optimizer, loss, norm)
        assert torch.equal(p, after_one[0])
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in after_one[1].items())  # moments, step count
    p.grad = torch.ones(4)
    step_if_finite(optimizer, torch.tensor(1.0), torch.tensor(1.0))
    assert (p < after_one[0]).all() and optimizer.state[p]["step"] == 2
    assert not hasattr(optimizer, "found_inf")
