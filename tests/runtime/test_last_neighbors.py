"""``fastopt.runtime.LastNeighborLoader``: PyG's ``LastNeighborLoader`` outputs, bit for bit, over
a stream of batches (nodes with more events in a batch than slots, repeats, self-loops)."""

from __future__ import annotations

import pytest
import torch

from fastopt.errors import SamplerError
from fastopt.runtime import LastNeighborLoader

NODES, SIZE = 30, 4


def _stream(count=25, batch=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        src = torch.randint(0, NODES, (batch,), generator=g)
        dst = torch.randint(0, NODES // 3, (batch,), generator=g)  # hot destinations: > SIZE events
        src[0] = dst[0]                                            # a self-loop
        yield src, dst, torch.randint(0, NODES, (batch,), generator=g)


def test_same_outputs_as_pygs_over_a_stream():
    tgn = pytest.importorskip("torch_geometric.nn.models.tgn")
    theirs = tgn.LastNeighborLoader(NODES, size=SIZE)
    mine = LastNeighborLoader(NODES, size=SIZE)
    for step, (src, dst, extra) in enumerate(_stream()):
        if step == 15:
            theirs.reset_state()
            mine.reset_state()
        n_id = torch.cat([src, dst, extra]).unique()
        for a, b in zip(mine(n_id), theirs(n_id)):
            assert torch.equal(a, b), step
        theirs.insert(src, dst)
        mine.insert(src, dst)
        assert torch.equal(mine.e_id, theirs.e_id)
        valid = theirs.e_id >= 0  # free slots hold whatever was there
        assert torch.equal(mine.neighbors[valid], theirs.neighbors[valid])
    assert mine.cur_e_id == theirs.cur_e_id


def test_neighbors_are_the_latest_events_newest_first():
    loader = LastNeighborLoader(5, size=2)
    loader.insert(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3]))
    loader.insert(torch.tensor([4]), torch.tensor([0]))
    n_id, edge_index, e_id = loader(torch.tensor([0]))
    assert n_id.tolist() == [0, 3, 4]
    assert e_id.tolist() == [3, 2]                       # event 3 (4 -> 0), then event 2 (0 -> 3)
    assert n_id[edge_index[0]].tolist() == [4, 3] and n_id[edge_index[1]].tolist() == [0, 0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_nodes=0, size=2), r"num_nodes must be a positive int \(got 0\)"),
    (dict(num_nodes=3, size=1.5), r"size must be a positive int \(got 1.5\)"),
])
def test_bad_sizes_are_refused(kwargs, match):
    with pytest.raises(SamplerError, match=match):
        LastNeighborLoader(**kwargs)


def test_mismatched_events_are_refused():
    with pytest.raises(SamplerError, match=r"src and dst must be 1-d of one length \(got \(2,\) and \(3,\)\)"):
        LastNeighborLoader(4, 2).insert(torch.tensor([0, 1]), torch.tensor([1, 2, 3]))
