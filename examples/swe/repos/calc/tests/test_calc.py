import pytest

from calc import mean, total


def test_total():
    assert total([1, 2, 3]) == 6


def test_mean():
    assert mean([2, 4, 6]) == 4


def test_mean_empty():
    with pytest.raises(ValueError):
        mean([])
