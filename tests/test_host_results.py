"""HostResults: a learner step's results reach host callbacks (agents/runtime/host_results.py)."""

import pytest
import torch
from moolib.agents.runtime.host_results import HostResults


def test_on_a_cpu_results_are_handed_over_at_once():
    host = HostResults(torch.device("cpu"))
    got = []
    x = torch.arange(4.0, requires_grad=True) * 2
    host.add({"x": x}, got.append)
    assert len(got) == 1, "a CPU step's results are ready when it returns"
    assert torch.equal(got[0]["x"], torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert not got[0]["x"].requires_grad
    host.hand_over()
    assert len(got) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_results_wait_for_the_next_hand_over_in_order():
    host = HostResults(torch.device("cuda"))
    got = []
    a = torch.randn(512, 512, device="cuda")
    for i in range(3):
        a = a @ a / 512  # queued work that the copies follow
        host.add({"sum": a.sum(), "i": torch.tensor(i, device="cuda")}, got.append)
    assert got == []
    expected = float(a.sum())
    host.hand_over()
    assert [int(r["i"]) for r in got] == [0, 1, 2]
    assert all(r["sum"].device.type == "cpu" for r in got)
    assert float(got[-1]["sum"]) == pytest.approx(expected)
    host.hand_over()
    assert len(got) == 3
