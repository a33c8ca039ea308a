"""std_select's choice of the k largest against torch.topk's own, entry for entry, where many
entries tie at the cut (rounded values, bf16 variances, all equal), both of torch's paths
(a heap where k·64 ≤ n, else nth_element), and NaN."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.std_select import keys, top_k_mask


def _torchs(values: torch.Tensor, k: int) -> torch.Tensor:
    mask = torch.zeros(values.numel(), dtype=torch.bool)
    if k > 0:
        mask[torch.topk(values.reshape(-1), k, largest=True).indices] = True
    return mask


def _values(kind: str, n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator)
    if kind == "bf16-variances":  # few distinct values: thousands tie at any cut
        return (x.square() * 1e-3).to(torch.bfloat16)
    if kind == "rounded":
        return (x * 4).round()
    if kind == "equal":
        return torch.ones(n)
    if kind == "nan":
        x[::97] = float("nan")
        return (x * 2).round()
    if kind == "float64":
        return (x * 8).round().double()
    if kind == "float16":
        return (x * 8).half()
    return x


@pytest.mark.parametrize(
    "kind", ["bf16-variances", "rounded", "equal", "nan", "distinct", "float64", "float16"]
)
@pytest.mark.parametrize("n", [7, 4099, 200_003])
@pytest.mark.parametrize("density", [0.002, 0.1, 0.5, 0.97])
def test_the_entries_kept_are_torch_topks(kind: str, n: int, density: float) -> None:
    values = _values(kind, n, seed=n)
    k = int(n * density)
    expected = _torchs(values, k)
    got = torch.from_numpy(top_k_mask(keys(values), k))
    assert int(got.sum()) == k
    assert torch.equal(got, expected), int((got != expected).sum())


def test_another_order_of_ties_would_differ() -> None:
    """The kept tied entries are neither the first nor the last in flat order: equality above
    is not a property of a simple rule."""
    values = _values("bf16-variances", 200_003, seed=1)
    k = 200_003 // 2
    kept = torch.from_numpy(top_k_mask(keys(values), k))
    cut = torch.topk(values.float(), k).values[-1]
    tied = (values.float() == cut).nonzero().view(-1)
    above = int((values.float() > cut).sum())
    first_ones = torch.zeros_like(kept)
    first_ones[values.float() > cut] = True
    first_ones[tied[: k - above]] = True
    assert not torch.equal(kept, first_ones)
