from textutil import slugify


def test_spaces_become_dashes():
    assert slugify("a b  c") == "a-b-c"


def test_lowercase():
    assert slugify("Hello World!") == "hello-world"
