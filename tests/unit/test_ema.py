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


def test_a_resume_continues_from_the_saved_average_and_refuses_a_checkpoint_without_one():
    import pytest

    from dschat.utils.errors import UserError

    lin = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, -2.0]]))
    ema = EMA(lin, decay=0.5)  # built from the weights the run resumes with
    ema.restore(lambda: {"weight": torch.tensor([[3.0, 0.0]], dtype=torch.bfloat16)}, "checkpoint step3")
    ema.update(lin)  # 0.5 * [3, 0] + 0.5 * [1, -2]
    assert torch.equal(ema.state["weight"], torch.tensor([[2.0, -1.0]]))
    for saved in (None, {"other": torch.zeros(1, 2)}):
        with pytest.raises(UserError, match=r"--resume: checkpoint step3 holds no EMA of this actor"):
            ema.restore(lambda saved=saved: saved, "checkpoint step3")


def test_a_rank_that_keeps_no_average_does_not_read_the_checkpoints_copy():
    import pytest

    ema = EMA.__new__(EMA)  # a rank other than the writer: gather_full_state_dict gave it nothing
    ema.decay, ema.state = 0.5, None
    ema.restore(lambda: pytest.fail("a rank without an average loaded the whole model"), "checkpoint step3")
    assert ema.state is None
