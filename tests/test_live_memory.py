"""The CPU peak measure (src/observe/live_memory.py): memory in use, resident set less
glibc's free heap, sampled at a step's moments."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from src.observe import live_memory
from src.observe.live_memory import LiveMemory
from src.observe.metrics import memory_metrics

pytestmark = pytest.mark.skipif(
    not LiveMemory().available, reason="needs glibc's mallinfo2 and /proc"
)

MIB = 2**20


def test_a_sample_sees_a_known_allocation_and_not_what_glibc_keeps():
    lm = LiveMemory()
    before, live_before = lm.in_use()
    x = torch.ones(64 * MIB // 4)  # 64 MiB, written: resident and live
    now, live = lm.in_use()
    assert 60 * MIB < now - before < 70 * MIB
    assert 60 * MIB < live - live_before < 70 * MIB
    del x
    after, _ = lm.in_use()
    assert after - before < 6 * MIB
    # blocks under the mmap threshold stay on the heap when freed: still resident,
    # not in use
    small = [torch.ones(256 * 1024 // 4) for _ in range(128)]  # 32 MiB in 256 KiB
    lm.reset()
    peak_with = lm.peak
    del small[:-1]
    lm.sample()
    assert lm.peak == peak_with  # freeing never raises the peak
    assert lm.in_use()[0] < peak_with - 24 * MIB


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
            for _ in range(2)
        )
        self.head = nn.Linear(512, 4096)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).logsumexp(-1).mean()


def test_the_hooks_sample_at_the_step_moments_and_see_the_saved_activations():
    net = _Net()
    opt = torch.optim.AdamW(net.parameters())
    x = torch.randn(2048, 512)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        lm = live_memory.watch(net, torch.device("cpu"))
        assert lm is live_memory.active()
        base = lm.peak
        lm.samples = 0
        net(x).backward()
        opt.step()
        # blocks and their children in forward and at their gradients, the root,
        # the head, the optimizer's pre and post
        assert lm.samples >= 10
        # the head's logits (2048 x 4096 fp32, 32 MiB) and their gradient are alive at
        # the head's gradient hook, with the blocks' saved activations (~50 MiB)
        assert lm.peak - base > 64 * MIB
        out = memory_metrics(torch.device("cpu"))
        assert out["peak_mem_gib"] == lm.peak / 2**30
        assert out["peak_rss_gib"] >= out["peak_mem_gib"] - 0.01
    finally:
        live_memory.stop()
    assert "peak_rss_gib" not in memory_metrics(torch.device("cpu"))
    # its /proc/self/statm closed: a process that trains again opens no more
    assert len(os.listdir("/proc/self/fd")) == fds and not lm.available


def test_a_checkpointed_blocks_children_sample_their_forward_too():
    """Backward's recomputation reruns a checkpointed block's children: their
    forward's end is a moment there, and only there."""
    from src.observe.live_memory import _moments

    net = _Net()
    plain = {id(m): fw for m, fw in _moments(net)}
    child = net.blocks[0][0]
    assert plain[id(net.blocks[0])] and not plain[id(child)]
    net.blocks[0].forward = net.blocks[0].forward  # as checkpointing replaces it
    ac = {id(m): fw for m, fw in _moments(net)}
    assert ac[id(child)] and not ac[id(net.blocks[1][0])]


class _Attend(nn.Module):
    """A block child whose backward peaks inside it: (rows x rows) scores."""

    def forward(self, x):
        return torch.softmax(x @ x.T, -1) @ x


def test_a_peak_inside_a_childs_backward_is_sampled_after_its_nodes():
    # the scores (2048 x 2048 fp32, 16 MiB) and their gradient live only inside the
    # child's backward: the module moments alone miss them (issue 56, CP attention)
    net = nn.ModuleList([nn.Sequential(nn.Linear(256, 256), _Attend())])
    x = torch.randn(2048, 256)
    peaks = {}
    for inside in (False, True):
        lm = LiveMemory()
        lm.inside = inside
        lm.attach(net)
        net[0](x).sum().backward()
        lm.reset()  # the next backward's peak only
        net[0](x).sum().backward()
        peaks[inside] = lm.peak
        lm.detach()
    assert peaks[True] - peaks[False] > 12 * MIB
