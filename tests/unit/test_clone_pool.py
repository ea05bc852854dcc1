"""The driver's clone pool (adapter driver-clone-pool) without an engine: clones are exact, plain,
independent tensors with their own storage; regions are reused once their clones are gone."""

from __future__ import annotations

import gc
import io
import mmap
import pickle
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from spec_compat import clone_pool  # noqa: E402

ROWS = (5, 17, 3)
HIDDEN = 8
LAYERS = 2


def segment_views(fill: float = 0.0) -> tuple[Any, list[list[Any]]]:
    """A shared mapping and per-request lists of per-layer views into it, as transfer.py rebuilds a reply."""
    total = sum(ROWS) * HIDDEN * LAYERS * 2
    mapping = mmap.mmap(-1, total, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    base.view(torch.bfloat16).copy_(torch.arange(total // 2, dtype=torch.float32).add_(fill).to(torch.bfloat16))
    views, offset = [], 0
    for rows in ROWS:
        per_layer = []
        for _ in range(LAYERS):
            size = rows * HIDDEN * 2
            per_layer.append(base[offset : offset + size].view(torch.bfloat16).view(rows, HIDDEN))
            offset += size
        views.append(per_layer)
    return base, views


def test_clones_are_exact_plain_tensors_with_their_own_storage() -> None:
    pool = clone_pool.ClonePool()
    base, views = segment_views()
    expected = [[h.clone() for h in row] for row in views]
    sources = clone_pool.as_clone_sources(views, pool)
    assert all(type(h) is clone_pool.CloneSource for row in sources for h in row)
    clones = [[h.clone().cpu() for h in row] for row in sources]  # as speculators 0.4.x
    for row, want in zip(clones, expected, strict=True):
        for clone, ref in zip(row, want, strict=True):
            assert type(clone) is torch.Tensor
            assert torch.equal(clone, ref) and clone.dtype == ref.dtype and clone.shape == ref.shape
            assert clone.untyped_storage().nbytes() == clone.numel() * clone.element_size()
    assert pool.made == 1
    base.fill_(0)  # the segment reused by the worker: the clones keep their values
    assert all(
        torch.equal(c, r) for row, want in zip(clones, expected, strict=True) for c, r in zip(row, want, strict=True)
    )
    saved = io.BytesIO()
    torch.save(clones[0][0], saved)  # one clone's bytes, not the region's
    assert saved.tell() < 4096 + clones[0][0].numel() * 2


def test_sliced_sources_clone_through_the_pool() -> None:
    """speculators 0.3.0 slices one request's rows out of a batch tensor, then clones."""
    pool = clone_pool.ClonePool()
    _, views = segment_views()
    layer = clone_pool.as_clone_sources([views[1][0]], pool)[0]
    part = layer[2:9]
    assert type(part) is clone_pool.CloneSource
    clone = part.clone().cpu()
    assert type(clone) is torch.Tensor and torch.equal(clone, views[1][0][2:9])
    region = part._sc_target.use.region
    region_start = torch.frombuffer(region.map, dtype=torch.uint8).data_ptr()
    assert region_start <= clone.data_ptr() < region_start + region.size
    # Anything that is not a view of the segment comes back plain.
    assert type(layer.float()) is torch.Tensor and type(layer + 1) is torch.Tensor
    assert type(layer.sum()) is torch.Tensor


def test_second_clone_of_the_same_bytes_is_an_ordinary_independent_copy() -> None:
    pool = clone_pool.ClonePool()
    _, views = segment_views()
    source = clone_pool.as_clone_sources([views[0][0]], pool)[0]
    first, second = source.clone(), source.clone()
    overlapping = source[1:3].clone()
    assert torch.equal(first, second) and torch.equal(first[1:3], overlapping)
    first.fill_(7)
    assert not torch.equal(first, second) and torch.equal(second, views[0][0])
    assert torch.equal(overlapping, views[0][0][1:3])


def test_non_contiguous_source_and_clone_options_fall_back() -> None:
    pool = clone_pool.ClonePool()
    _, views = segment_views()
    source = clone_pool.as_clone_sources([views[1][1]], pool)[0]
    transposed = source.t()
    assert type(transposed) is clone_pool.CloneSource
    copy = transposed.clone()
    assert type(copy) is torch.Tensor and torch.equal(copy, views[1][1].t())
    channels_last = source.view(1, 17, HIDDEN, 1).clone(memory_format=torch.channels_last)
    assert torch.equal(channels_last, views[1][1].view(1, 17, HIDDEN, 1))


def test_regions_are_reused_once_their_clones_are_gone() -> None:
    pool = clone_pool.ClonePool()
    _, views = segment_views()
    kept = [[h.clone() for h in row] for row in clone_pool.as_clone_sources(views, pool)]
    assert pool.made == 1
    held = [[h.clone() for h in row] for row in clone_pool.as_clone_sources(views, pool)]
    assert pool.made == 2  # the first region's clones are alive
    del kept
    gc.collect()
    for _ in range(3):
        again = [[h.clone() for h in row] for row in clone_pool.as_clone_sources(views, pool)]
        assert torch.equal(again[2][1], views[2][1])
        del again
    assert pool.made == 2
    # Released from another thread (a writer thread dropping its batch): reused as well.
    thread = threading.Thread(target=held.clear)
    thread.start()
    thread.join()
    gc.collect()
    both = [clone_pool.as_clone_sources(views, pool), clone_pool.as_clone_sources(views, pool)]
    assert pool.made == 2 and len(both) == 2
    del both
    gc.collect()
    pool.close()
    assert pool.regions == 0


def test_a_source_pickles_as_the_plain_tensor_it_views() -> None:
    pool = clone_pool.ClonePool()
    _, views = segment_views()
    source = clone_pool.as_clone_sources([views[0][1]], pool)[0]
    copy = pickle.loads(pickle.dumps(source))
    assert type(copy) is torch.Tensor and torch.equal(copy, views[0][1])
