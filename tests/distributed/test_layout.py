"""The ring's sequence layout (distributed/layout.py), in this process.

test_ring.py runs shard/unshard/positions inside spawned gloo workers, where only their
agreement with each other is visible (and where mutation testing sees no coverage). Here each
rank's view is taken in turn by standing in for the process group: ``rank_and_size`` says
which rank we are, and ``all_gather`` hands over the shards every rank would hold. The
expected layout is written from the docstring: 2P equal chunks, zigzag rank r holds chunks r
and 2P-1-r, contiguous rank r holds [r·T/P, (r+1)·T/P).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from causalattn.distributed import layout


def _documented(T, P, r, name):
    """Global positions rank r holds under the docstring's layout (T a multiple of 2P)."""
    c = T // (2 * P)
    if name == "zigzag":
        chunks = [r, 2 * P - 1 - r]
    else:
        chunks = [2 * r, 2 * r + 1]
    return [pos for k in chunks for pos in range(k * c, (k + 1) * c)]


def _as_rank(monkeypatch, r, P):
    monkeypatch.setattr(layout, "rank_and_size", lambda group=None: (r, P))


@pytest.mark.parametrize("name", ["zigzag", "contiguous"])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_each_rank_holds_the_documented_chunks_in_order(monkeypatch, name, P):
    T = 2 * P * 3
    x = torch.arange(T)
    for r in range(P):
        _as_rank(monkeypatch, r, P)
        assert layout.shard(x, layout=name, dim=0).tolist() == _documented(T, P, r, name)
        assert layout.positions(T // P, layout=name).tolist() == _documented(T, P, r, name)


def test_zigzag_is_the_default_layout_and_sequence_axis_two_the_default_dim(monkeypatch):
    P, T = 2, 8
    x = torch.arange(T, dtype=torch.float32).reshape(1, 1, T, 1).expand(2, 3, T, 5)
    _as_rank(monkeypatch, 0, P)
    local = layout.shard(x)
    assert local.shape == (2, 3, T // P, 5)
    assert local[1, 2, :, 4].tolist() == [0.0, 1.0, 6.0, 7.0]
    assert layout.positions(T // P).tolist() == [0, 1, 6, 7]
    assert torch.equal(layout.shard(x, dim=-2), local)  # a negative dim counts from the end


@pytest.mark.parametrize("name", ["zigzag", "contiguous"])
def test_a_sequence_that_does_not_divide_is_padded_with_zeros_at_the_end(monkeypatch, name):
    P, T = 2, 7  # zigzag pads to 8 (2P = 4), contiguous to 8 (P = 2)
    x = torch.arange(1, T + 1).reshape(1, 1, T, 1)
    padded = torch.cat([torch.arange(1, T + 1), torch.zeros(1, dtype=torch.long)])
    for r in range(P):
        _as_rank(monkeypatch, r, P)
        local = layout.shard(x, layout=name)
        assert local.shape == (1, 1, 4, 1)
        assert local.flatten().tolist() == padded[_documented(8, P, r, name)].tolist()


def test_only_the_missing_tail_is_padded(monkeypatch):
    P, T = 3, 8  # 2P = 6: pad to 12, four zeros, nothing more
    _as_rank(monkeypatch, 2, P)
    local = layout.shard(torch.arange(1, T + 1), dim=0)  # rank 2 holds chunks 2 and 3
    assert local.tolist() == [5, 6, 7, 8]
    _as_rank(monkeypatch, 0, P)
    assert layout.shard(torch.arange(1, T + 1), dim=0).tolist() == [1, 2, 0, 0]  # chunks 0, 5


def _gather_from(shards):
    def all_gather(parts, x, group=None):
        for part, s in zip(parts, shards):
            part.copy_(s)

    return all_gather


@pytest.mark.parametrize("name", ["zigzag", "contiguous"])
@pytest.mark.parametrize("P", [1, 2, 4])
def test_unshard_puts_every_rank_back_in_global_order(monkeypatch, name, P):
    T = 2 * P * 2 + 1  # padded by shard, dropped again by length
    x = torch.randn(2, 3, T, 4)
    shards = []
    for r in range(P):
        _as_rank(monkeypatch, r, P)
        shards.append(layout.shard(x, layout=name))
    monkeypatch.setattr(layout.dist, "all_gather", _gather_from(shards))
    for r in range(P):
        _as_rank(monkeypatch, r, P)
        assert torch.equal(layout.unshard(shards[r], layout=name, length=T), x)
        full = layout.unshard(shards[r], layout=name)
        assert full.shape[2] == -(-T // layout.multiple(P, name)) * layout.multiple(P, name)
        assert torch.equal(full[:, :, :T], x) and not full[:, :, T:].any()


def test_unshard_gathers_along_the_given_dim(monkeypatch):
    P, T = 2, 8
    x = torch.randn(T, 3)
    shards = []
    for r in range(P):
        _as_rank(monkeypatch, r, P)
        shards.append(layout.shard(x, dim=0))
    monkeypatch.setattr(layout.dist, "all_gather", _gather_from(shards))
    assert torch.equal(layout.unshard(shards[1], dim=0), x)
    assert torch.equal(layout.unshard(shards[0], dim=-2, length=0), x[:0])


@pytest.mark.parametrize("length", [-1, 9])
def test_unshard_refuses_a_length_outside_the_gathered_sequence(monkeypatch, length):
    _as_rank(monkeypatch, 0, 1)
    monkeypatch.setattr(layout.dist, "all_gather", _gather_from([torch.zeros(1, 1, 8, 2)]))
    with pytest.raises(ValueError, match=rf"unshard: length={length} must lie in \[0, T=8\]"):
        layout.unshard(torch.zeros(1, 1, 8, 2), length=length)


def test_shards_come_in_multiples_of_2P_for_zigzag_and_P_for_contiguous():
    assert [layout.multiple(P, "zigzag") for P in (1, 2, 3)] == [2, 4, 6]
    assert [layout.multiple(P, "contiguous") for P in (1, 2, 3)] == [1, 2, 3]


def test_an_unknown_layout_is_refused_by_name():
    for call in (
        lambda: layout.multiple(2, "striped"),
        lambda: layout.segments(0, 2, 4, "striped"),
    ):
        with pytest.raises(ValueError, match=r"layout: expected one of \['zigzag', 'contiguous'\]"):
            call()


def test_zigzag_refuses_an_odd_shard_and_says_what_to_do():
    with pytest.raises(ValueError, match=r"T = 6 into 2P = 4 chunks.*T/P = 3 positions \(odd\)"):
        layout.segments(0, 2, 3, "zigzag")
    assert layout.segments(1, 2, 3, "contiguous") == [(3, 3)]


def test_without_a_process_group_the_layout_asks_for_one():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        layout.rank_and_size()
    with pytest.raises(
        ValueError,
        match=r"^ring attention needs torch.distributed: call torch.distributed.init_process_group "
        r"first \(gloo on CPU, nccl on GPU\), e.g. under torchrun$",
    ):
        layout.rank_and_size()


def test_a_subgroup_is_asked_for_its_own_rank_and_size_and_gathered_over(monkeypatch):
    """group= reaches torch.distributed everywhere: rank 1 of a pair inside a world of 4."""
    pair = object()
    monkeypatch.setattr(layout.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(layout.dist, "get_rank", lambda group=None: 1 if group is pair else 3)
    monkeypatch.setattr(layout.dist, "get_world_size", lambda group=None: 2 if group is pair else 4)
    assert layout.rank_and_size(pair) == (1, 2) and layout.rank_and_size() == (3, 4)
    x = torch.arange(8)
    local = layout.shard(x, group=pair, dim=0)
    assert local.tolist() == _documented(8, 2, 1, "zigzag")
    assert layout.positions(4, group=pair).tolist() == _documented(8, 2, 1, "zigzag")
    shards = [torch.tensor(_documented(8, 2, r, "zigzag")) for r in range(2)]

    def all_gather(parts, x_local, group=None):
        assert group is pair
        _gather_from(shards)(parts, x_local)

    monkeypatch.setattr(layout.dist, "all_gather", all_gather)
    assert torch.equal(layout.unshard(local, group=pair, dim=0), x)


def test_positions_are_made_on_the_device_asked_for(monkeypatch):
    _as_rank(monkeypatch, 1, 2)
    got = layout.positions(4, device="meta")
    assert got.device.type == "meta" and got.shape == (4,)


def test_a_one_process_group_holds_the_whole_sequence():
    """A real gloo group of one: rank_and_size, shard, positions and unshard, no stand-ins."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert layout.rank_and_size() == (0, 1)
        x = torch.randn(1, 2, 5, 3)
        local = layout.shard(x)
        assert local.shape == (1, 2, 6, 3) and torch.equal(local[:, :, :5], x)
        assert layout.positions(6).tolist() == list(range(6))
        assert torch.equal(layout.unshard(local, length=5), x)
    finally:
        dist.destroy_process_group()
