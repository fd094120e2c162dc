"""``--report-memory``'s activation meter on real autograd graphs (no processes); the
per-rank report beside the planner is shown by ``elastor train --report-memory``."""

import torch

from elastor_mcore.runtime.memory import SavedTensorMeter, measure


def test_meter_counts_each_saved_storage_once_and_sees_it_freed():
    model = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(32, 64, requires_grad=True)
    meter = SavedTensorMeter(model)
    with meter:
        y = model(x).sigmoid()   # saves x (the weight is a parameter) and sigmoid's output
        loss = (y * y).sum()     # saves y twice: one storage
    assert meter.peak == meter.current == 2 * 32 * 64 * 4
    loss.backward()
    assert meter.current == 0 and meter.peak == 2 * 32 * 64 * 4


def test_optimizer_bytes_leave_out_the_weights_it_updates():
    model = torch.nn.Linear(8, 4, bias=False)
    adamw = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    adamw.step()
    m = measure(model, adamw, [p.grad for p in model.parameters()], activations_peak=7)
    assert (m.weights, m.gradients, m.optimizer, m.activations) == (128, 128, 256, 7)
