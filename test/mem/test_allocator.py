import pytest

from pdserve.mem.allocator import PageAllocator


def test_alloc_hands_out_low_ids_first_and_never_partial():
    a = PageAllocator(8)
    assert a.num_free == 8
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(0) == []
    assert a.alloc(6) is None  # only 5 left: nothing is taken
    assert a.num_free == 5
    assert a.alloc(5) == [3, 4, 5, 6, 7]
    assert a.num_free == 0
    assert a.alloc(1) is None
    assert a.alloc(0) == []


def test_free_returns_pages_and_they_are_reused():
    a = PageAllocator(4)
    pages = a.alloc(4)
    a.free([2, 1])
    assert a.num_free == 2
    assert sorted(a.alloc(2)) == [1, 2]
    a.free(pages)
    assert a.num_free == 4
    assert sorted(a.alloc(4)) == [0, 1, 2, 3]


def test_double_free_raises_and_changes_nothing():
    a = PageAllocator(4)
    a.alloc(2)
    a.free([0])
    with pytest.raises(RuntimeError, match="double free"):
        a.free([1, 0])  # 1 is valid, 0 is already free: the whole call is rejected
    assert a.num_free == 3
    assert not a.is_free(1)
    with pytest.raises(RuntimeError, match="double free"):
        a.free([1, 1])
    assert a.num_free == 3
    a.free([1])
    assert a.num_free == 4


def test_free_of_never_allocated_page_is_a_double_free():
    a = PageAllocator(4)
    with pytest.raises(RuntimeError, match="double free"):
        a.free([3])


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_out_of_range_free_raises(bad):
    a = PageAllocator(4)
    a.alloc(4)
    with pytest.raises(RuntimeError, match="out of range"):
        a.free([bad])
    assert a.num_free == 0


def test_negative_alloc_and_non_integer_ids_rejected():
    a = PageAllocator(4)
    with pytest.raises(ValueError):
        a.alloc(-1)
    a.alloc(1)
    with pytest.raises(TypeError):
        a.free([0.0])


def test_reset_frees_everything():
    a = PageAllocator(5)
    a.alloc(3)
    a.reset()
    assert a.num_free == 5
    assert a.alloc(5) == [0, 1, 2, 3, 4]


def test_accepts_tensor_ids():
    import torch

    a = PageAllocator(4)
    pages = a.alloc(2)
    a.free(torch.tensor(pages))
    assert a.num_free == 4


def test_zero_pages():
    a = PageAllocator(0)
    assert a.num_free == 0
    assert a.alloc(0) == []
    assert a.alloc(1) is None


def test_first_free_names_the_first_free_page_and_checks_range():
    a = PageAllocator(8)
    held = a.alloc(5)
    assert a.first_free(held) is None and a.first_free([]) is None
    a.free([held[3]])
    assert a.first_free(held) == 3
    assert a.first_free([held[0], 7, held[3]]) == 1  # 7 was never taken
    with pytest.raises(RuntimeError, match="out of range"):
        a.first_free([held[0], 8])
