"""torch_order's norms, sums and means, fed a piece at a time, against torch's own reductions of the
whole rows: equal bits for every dtype it reproduces, at lengths around the cascade's steps
and levels and with pieces of several sizes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.kernels import torch_order

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
# a row shorter than one vector, ones around a step of four vectors, around the cascade's
# first carry (16 steps) and its second level, a long one, and one more than torch's grain
LENGTHS = [5, 63, 64, 65, 1023, 1024, 1025, 16 * 64 * 16 + 7, 70_001, 250_000]


def _rows(count: int, length: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 3, count, dtype=torch.float64).view(-1, 1)
    values = torch.randn(count, length, dtype=torch.float64, generator=generator) * scale
    return values.to(dtype)


def _fed(
    reduction: torch_order.RowNorms | torch_order.RowSums, rows: torch.Tensor, piece: int
) -> torch.Tensor:
    for start in range(0, rows.shape[1], piece):
        reduction.add(rows[:, start : start + piece])
    return reduction.result()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", LENGTHS)
def test_norms_and_sums_in_pieces_equal_torchs_of_the_whole_rows(
    dtype: torch.dtype, length: int
) -> None:
    for count, piece in [(1, torch_order.ALIGN), (2, 3 * torch_order.ALIGN), (3, 1 << 20)]:
        rows = _rows(count, length, dtype, seed=length + count)
        norms = _fed(torch_order.RowNorms(count, length, dtype), rows, piece)
        assert norms.dtype == dtype
        assert torch.equal(norms, torch.norm(rows, dim=-1)), (count, piece)
        if count > 1:  # one row's sum is split between torch's threads
            sums = torch_order.RowSums(count, length, dtype)
            assert torch.equal(_fed(sums, rows, piece), rows.sum(-1)), (count, piece)
            assert torch.equal(sums.mean(), rows.mean(-1)), (count, piece)


def test_the_sum_of_a_tensor_is_not_reproduced_by_float64_arithmetic() -> None:
    """The order matters: the same rows summed exactly and rounded once differ from torch's
    in the last bits, so equality above is not a property of any careful sum."""
    rows = _rows(2, 250_000, torch.float32, seed=3)
    exact = rows.double().sum(-1).float()
    assert not torch.equal(exact, rows.sum(-1))
    assert torch.equal(_fed(torch_order.RowSums(2, 250_000, torch.float32), rows, 4096),
                       rows.sum(-1))  # fmt: skip


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: torch_order.RowSums(1, 10, torch.float32), "single row"),
        (lambda: torch_order.RowNorms(2, 10, torch.float16), "not reproduced"),
    ],
    ids=["one-row-sum", "float16"],
)
def test_what_is_not_reproduced_is_refused(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_a_piece_out_of_alignment_or_past_the_end_is_refused() -> None:
    norms = torch_order.RowNorms(2, 4 * torch_order.ALIGN, torch.float32)
    norms.add(torch.ones(2, 100))
    with pytest.raises(ValueError, match="a piece of"):
        norms.add(torch.ones(2, 100))
    sums = torch_order.RowSums(2, 100, torch.float32)
    with pytest.raises(ValueError, match="a piece of"):
        sums.add(torch.ones(2, 101))


def test_a_result_before_every_element_is_added_is_refused() -> None:
    norms = torch_order.RowNorms(2, 2 * torch_order.ALIGN, torch.float32)
    norms.add(torch.ones(2, torch_order.ALIGN))
    with pytest.raises(ValueError, match="of 1024 elements were added"):
        norms.result()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_measured_order_is_the_one_candidate_torch_agrees_with(dtype: torch.dtype) -> None:
    """The lanes and the norm's tail are measured at first use: of the candidates, torch here
    agrees with one alone, so the measurement tells them apart."""
    order = torch_order.order_here(dtype)
    assert order is not None
    candidates = torch_order.candidates(dtype)
    assert [o for o in candidates if torch_order.agrees(o, dtype)] == [order]
