from intervals import length, overlaps


def test_disjoint():
    assert not overlaps((1, 2), (4, 5))


def test_nested():
    assert overlaps((1, 10), (3, 4))


def test_touching_ends_overlap():
    assert overlaps((1, 3), (3, 5))


def test_length():
    assert length((2, 2)) == 1
