"""Closed integer intervals (start, end), both ends included."""


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def length(interval: tuple[int, int]) -> int:
    return interval[1] - interval[0] + 1
