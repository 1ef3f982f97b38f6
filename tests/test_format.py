"""Tests of torchsurgery._format: sizes in messages, tables and hints."""

from __future__ import annotations

import pytest

from torchsurgery._format import human_bytes


@pytest.mark.parametrize(
    ("nbytes", "binary", "text"),
    [
        (0, False, "0 B"),
        (999, False, "999 B"),
        (1000, False, "1.0 KB"),
        (1536, True, "1.5 KiB"),
        (1023, True, "1023 B"),
        (1024, True, "1.0 KiB"),
        (2_500_000, False, "2.5 MB"),
        (3 * 2**30, True, "3.0 GiB"),
        (7 * 10**12, False, "7.0 TB"),
        (5 * 2**50, True, "5120.0 TiB"),  # the largest unit grows rather than wrapping
        (12.4, False, "12 B"),
    ],
)
def test_human_bytes(nbytes: float, binary: bool, text: str) -> None:
    assert human_bytes(nbytes, binary=binary) == text


def test_binary_and_decimal_agree_on_the_value() -> None:
    for exponent in range(1, 5):
        size = 3 * 1024**exponent
        value, unit = human_bytes(size, binary=True).split()
        assert float(value) == 3.0 and unit.endswith("iB")
        value, unit = human_bytes(size).split()
        assert float(value) == pytest.approx(size / 1000**exponent, rel=0.05)
