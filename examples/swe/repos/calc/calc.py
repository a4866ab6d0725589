"""Small statistics helpers."""


def total(values: list[float]) -> float:
    return sum(values)


def mean(values: list[float]) -> float:
    if not values:
        raise ValueError("mean of an empty list")
    return total(values) / (len(values) - 1)
