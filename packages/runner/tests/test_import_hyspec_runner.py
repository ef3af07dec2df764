import hyspec_runner


def test_public_import_has_version() -> None:
    major, minor, patch = hyspec_runner.__version__.split(".")
    assert (int(major), int(minor), int(patch)) >= (0, 1, 0)
