"""`LaunchGraphs`: a launch replayed from a CUDA graph once its key repeats equals the launch itself."""

from __future__ import annotations

import pytest
import torch
from hyspec_attn_backends import LaunchGraphs, tensor_key

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_on_the_cpu_every_call_runs_the_launch() -> None:
    graphs = LaunchGraphs(torch.device("cpu"))
    x = torch.arange(4.0)
    for _ in range(3):
        assert torch.equal(graphs(("k", tensor_key(x)), lambda: x * 2), x * 2)
    assert (graphs.num_eager, graphs.num_captures, graphs.num_replays) == (3, 0, 0)
    assert tensor_key(None) is None
    with pytest.raises(ValueError, match="capacity"):
        LaunchGraphs(torch.device("cpu"), capacity=0)


@pytest.mark.gpu
@gpu
def test_a_replay_reads_and_writes_what_the_launch_would() -> None:
    """Eager on a key's first call, captured on its second in a row, replayed after: the result follows the
    inputs' current contents (written in place between calls), in-place outputs land where the launch
    writes them, another key runs eagerly, and the least recently replayed graph goes past `capacity`."""
    dev = torch.device("cuda")
    graphs = LaunchGraphs(dev, capacity=2)
    a = torch.zeros(8, device=dev)
    side = torch.zeros(8, device=dev)

    def launch() -> torch.Tensor:
        side.copy_(a + 1)  # an in-place write, as a first block's x and root_index
        return a * 2  # allocated by the launch: the graph's static output

    key = ("double", tensor_key(a), tensor_key(side))
    for step in range(5):
        a.copy_(torch.arange(8.0, device=dev) + step)
        out = graphs(key, launch)
        assert torch.equal(out, 2 * a) and torch.equal(side, a + 1), step
    assert (graphs.num_eager, graphs.num_captures, graphs.num_replays) == (1, 1, 4)
    b = torch.ones(3, device=dev)
    assert torch.equal(graphs(("other", tensor_key(b)), lambda: b + 1), b + 1)  # a new key: eager
    assert graphs.num_eager == 2
    for name in ("k1", "k1", "k2", "k2", "k3", "k3"):  # three graphs through a capacity of two
        graphs((name, tensor_key(b)), lambda: b * 3)
    assert len(graphs._graphs) == 2 and key not in graphs._graphs
    torch.cuda.synchronize()


@pytest.mark.gpu
@gpu
def test_a_launch_that_cannot_be_captured_runs_eagerly() -> None:
    dev = torch.device("cuda")
    graphs = LaunchGraphs(dev)
    a = torch.arange(4.0, device=dev)

    def launch() -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("not capturable")  # as a launch that reads the device would fail
        return a + 1

    for _ in range(3):
        assert torch.equal(graphs(("k", tensor_key(a)), launch), a + 1)
    assert not graphs.enabled and graphs.num_eager == 3 and graphs.num_replays == 0
