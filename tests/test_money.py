"""Money shown as people read it: rounded half up, exactly, from integer micro-dollars."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

import pytest

from bothy.money import format_usd


def _by_decimal(micros: int, places: int) -> str:
    quantum = Decimal(1).scaleb(-places)
    value = (Decimal(micros) / 1_000_000).quantize(quantum, rounding=ROUND_HALF_UP)
    return f"{value:.{places}f}"


@pytest.mark.parametrize("places", range(9))
def test_format_usd_rounds_as_decimal_half_up(places: int) -> None:
    """Every amount at and around each rounding step shows as Decimal's half-up would."""
    amounts = list(range(-2_000, 2_000))
    for exponent in range(1, 13):
        for digit in range(-12, 13):
            for nudge in (-1, 0, 1, -5 * 10 ** (exponent - 1), 5 * 10 ** (exponent - 1)):
                amounts.append(digit * 10**exponent + nudge)
    assert [format_usd(a, places) for a in amounts] == [_by_decimal(a, places) for a in amounts]


def test_format_usd_examples() -> None:
    """The forms the register and the answers use."""
    assert format_usd(52_000_000) == "52.00"
    assert format_usd(19_900, 4) == "0.0199"
    assert format_usd(15_250, 4) == "0.0153"
    assert format_usd(-1, 2) == "-0.00"
    assert format_usd(1, 6) == "0.000001"
