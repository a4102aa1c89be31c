"""dschat.engine.ema on an unpartitioned module: the average follows ema <- d * ema + (1 - d) * w."""

from __future__ import annotations

import torch

from dschat.engine.ema import EMA


def test_ema_is_the_decayed_average_of_the_updates_in_fp32():
    lin = torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, -2.0]]))
    ema = EMA(lin, decay=0.75)
    assert ema.state["weight"].dtype == torch.float32  # kept in fp32 whatever the training dtype
    for w in ([[3.0, 2.0]], [[-1.0, 0.0]]):
        with torch.no_grad():
            lin.weight.copy_(torch.tensor(w))
        ema.update(lin)
    # by hand: 0.75 * [1, -2] + 0.25 * [3, 2] = [1.5, -1]; then 0.75 * [1.5, -1] + 0.25 * [-1, 0]
    assert torch.equal(ema.state["weight"], torch.tensor([[0.875, -0.75]]))
