"""multislerp and karcher in torch: means of whole tensors taken as points on a hypersphere.

Both need statistics of the whole tensor (norms, angles) before any output element. A tensor
whose every input fits in a chunk is read whole and merged with mergekit 0.1.5's own sequence
of float32 operations (float64 for F64 inputs) on tensors of its shapes, so the bytes equal its
output: the inputs, their unit vectors and a few temporaries of the tensor's size are held at
once. A larger tensor is read a chunk at a time. multislerp's few whole-tensor sums (norms, dot
products) are taken piece by piece in torch's own order (torch_order.py): its output is then
mergekit's to the bit. Otherwise (karcher; multislerp where torch_order does not reproduce the
order) the tensor is read twice: first for the Gram matrix of its inputs (Σ xᵢ·xⱼ, float64),
from which the method's whole arithmetic follows in float64, since every vector it makes is a
linear combination of the inputs; then for the output, Σ cᵢ·xᵢ with those coefficients rounded
to float32. mergekit reduces such a tensor in float32, so there outputs differ from its by a
few ulps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, cast

import torch

from engine.errors import RecipeError
from engine.kernels.interpolation_torch import Read, ReadInto
from engine.kernels.torch_threads import using_threads
from engine.plan.model import TensorPlan

if TYPE_CHECKING:
    from engine.kernels.multislerp_pieces import InPieces

Vectors = list[torch.Tensor]


class Spherical:
    """One tensor's output, chunk by chunk in order: whole, or by its Gram matrix."""

    # torch's threads for a tensor merged whole: the process's default, as mergekit runs with
    # (0: as they are), so that its sums are ordered as mergekit's (torch_threads.py)
    threads = 0

    def __init__(self, read: Read, tensor: TensorPlan, *, chunk: int) -> None:
        self.read, self.tensor, self.step = read, tensor, chunk
        self.shape = tensor.shape
        self.numel = math.prod(tensor.shape)
        self.scalars = dict(tensor.scalars)
        self.whole = self.numel <= chunk
        self._output: torch.Tensor | None = None
        self._coefficients: torch.Tensor | None = None  # float64, one per input read

    @property
    def sources(self) -> list[int]:
        return [term.source for term in self.tensor.terms]

    def chunk(self, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the output, in the arithmetic dtype."""
        if self.whole:
            if self._output is None:
                xs = [self.read(s, 0, self.numel).view(self.shape) for s in self.sources]
                with using_threads(self.threads):
                    self._output = self.merge_whole(xs).reshape(-1)
            return self._output[start : start + count]
        if self._coefficients is None:
            self._coefficients = self.coefficients(self._gram())
        return self.combine(self._coefficients, start, count)

    def _gram(self) -> torch.Tensor:
        """Σ vᵢ·vⱼ of the vectors the method measures, each product and sum in float64."""
        gram: torch.Tensor | None = None
        for start in range(0, self.numel, self.step):
            count = min(self.step, self.numel - start)
            vs = self.vectors([self.read(s, start, count) for s in self.sources])
            wide = [v.double() for v in vs]
            # dot products, not wide @ wide.T: a matmul over a chunk-long inner dimension
            # made the heap grow by ~90 MB over a merge of 1.7B parameters (measured)
            part = torch.stack([torch.stack([torch.dot(a, b) for b in wide]) for a in wide])
            gram = part if gram is None else gram.add_(part)
        assert gram is not None
        return gram.cpu()

    def merge_whole(self, xs: Vectors) -> torch.Tensor:
        raise NotImplementedError

    def vectors(self, xs: Vectors) -> Vectors:
        raise NotImplementedError

    def coefficients(self, gram: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def combine(self, coefficients: torch.Tensor, start: int, count: int) -> torch.Tensor:
        raise NotImplementedError


def _weighted_sum(coefficients: torch.Tensor, vs: Vectors) -> torch.Tensor:
    """Σ cᵢ·vᵢ in the vectors' dtype, in order."""
    c: list[float] = coefficients.to(vs[0].dtype).tolist()
    total = vs[0] * c[0]
    for v, ci in zip(vs[1:], c[1:], strict=True):
        total.add_(v * ci)
    return total


def _norm(gram: torch.Tensor, c: torch.Tensor) -> float:
    """‖Σ cᵢ·vᵢ‖ from the Gram matrix of the vᵢ."""
    return math.sqrt(max(float(c @ gram @ c), 0.0))


def _mean(units: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (units * w.view(-1, 1)).sum(0)


def _tangent(
    units: torch.Tensor, mean: torch.Tensor, dots: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """The weighted mean of the unit vectors' projections on the tangent space at `mean`."""
    return ((units - dots * mean) * w.view(-1, 1)).sum(0)


def _mapped(
    mean: torch.Tensor, tangent: torch.Tensor, length: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """The tangent mapped back to the sphere at `mean`, scaled."""
    out: torch.Tensor = mean * torch.cos(length) + tangent * (torch.sin(length) / length)
    return out * scale


def _linear(flat: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ wᵢ·vᵢ, in order (where the directions cancel)."""
    out = flat[0] * w[0]
    for i in range(1, len(w)):
        out = out + flat[i] * w[i]
    return out


class MultiSlerp(Spherical):
    """mergekit's multislerp: terms (model, weight)… and the base last when
    scalars["base"]; the models' (or their task vectors') directions averaged on the unit
    sphere by the weights, mapped back from the tangent space at their mean, scaled by the
    weighted mean of their norms. Where the weighted mean of the directions is zero, two
    vectors are interpolated linearly, Σ wᵢ·vᵢ, as by mergekit; more are refused, as by
    mergekit, unless every vector is zero (a tensor no model changed from the base: then the
    base, where mergekit refuses)."""

    def __init__(
        self, read: Read, tensor: TensorPlan, *, chunk: int, read_into: ReadInto | None = None
    ) -> None:
        super().__init__(read, tensor, chunk=chunk)
        # where given, a tensor over a chunk is read straight into the passes' buffer
        self.read_into = read_into or (lambda s, start, out: out.copy_(read(s, start, len(out))))
        self.with_base = bool(self.scalars.get("base", 0.0))
        self.normalize = bool(self.scalars.get("normalize_weights", 1.0))
        self.eps = self.scalars.get("eps", 1e-8)
        models = tensor.terms[:-1] if self.with_base else tensor.terms
        self.weights = [term.coefficient for term in models]
        self._measured: InPieces | torch.Tensor | Literal[False] | None = None

    def vectors(self, xs: Vectors) -> Vectors:
        if not self.with_base:
            return list(xs)
        return [x - xs[-1] for x in xs[:-1]]

    def _refuse(self) -> RecipeError:
        return RecipeError.for_field(
            "params.weights",
            f"{self.tensor.name}: the weighted mean of the models' directions is zero "
            "(opposite directions whose weights cancel); choose other weights",
        )

    def chunk(self, start: int, count: int) -> torch.Tensor:
        if self.whole:
            return super().chunk(start, count)
        if self._measured is None:
            self._measured = self._measure()
        if self._measured is False:  # by the Gram matrix instead: within ulps of mergekit
            return super().chunk(start, count)
        if isinstance(self._measured, torch.Tensor):  # directions that cancel: linearly
            xs = [self.read(s, start, count) for s in self.sources]
            out = _linear(torch.stack(self.vectors(xs)), self._measured)
            return out + xs[-1] if self.with_base else out
        return self._measured.chunk(start, count)

    def _weights(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        w = torch.tensor(self.weights, dtype=dtype, device=device)
        return w / w.sum() if self.normalize else w

    def merge_whole(self, xs: Vectors) -> torch.Tensor:
        stacked = torch.stack(xs[:-1] if self.with_base else xs)
        if self.with_base:
            stacked -= xs[-1]
        flat = stacked.view(stacked.shape[0], -1)
        w = self._weights(flat.dtype, flat.device)
        norms = torch.norm(flat, dim=-1, keepdim=True)
        units = flat / (norms + self.eps)
        mean = _mean(units, w)
        mean_norm = torch.norm(mean)
        if mean_norm < self.eps:  # directions that cancel: linearly, Σ wᵢ·vᵢ
            if len(self.weights) != 2 and bool(norms.any()):
                raise self._refuse()
            out = _linear(flat, w)
        else:
            mean = mean / mean_norm
            dots = (units * mean).sum(-1, keepdim=True)
            tangent = _tangent(units, mean, dots, w)
            length = torch.norm(tangent) + self.eps
            out = _mapped(mean, tangent, length, (norms.squeeze(-1) * w).sum())
        out = out.view(stacked.shape[1:])
        return out + xs[-1] if self.with_base else out

    def _measure(self) -> InPieces | torch.Tensor | Literal[False]:
        """merge_whole's statistics of the whole tensor, a piece at a time in torch's order
        (multislerp_pieces.py); the weights alone where the directions cancel; False where
        torch's order is not reproduced."""
        from engine.kernels import multislerp_pieces, torch_order  # numba: for tensors over a chunk

        first = self.read(self.sources[0], 0, 1)
        if not torch_order.exact_here(first.dtype, first.device):
            return False
        w = self._weights(first.dtype, first.device)
        pieces = multislerp_pieces.InPieces(
            self.read_into, self.sources, self.numel, step=self.step, with_base=self.with_base,
            eps=self.eps, weights=w,
        )  # fmt: skip
        if pieces.measure():
            return pieces
        if len(self.weights) != 2 and bool(pieces.norms.any()):
            raise self._refuse()
        return w

    def coefficients(self, gram: torch.Tensor) -> torch.Tensor:
        """The output as Σ cᵢ·vᵢ (vᵢ the models or their task vectors), in float64."""
        w = torch.tensor(self.weights, dtype=torch.float64)
        if self.normalize:
            w = w / w.sum()
        norms = gram.diagonal().clamp_min(0.0).sqrt()
        scaled = w / (norms + self.eps)  # the weighted mean of the unit vectors
        mean_norm = _norm(gram, scaled)
        if mean_norm < self.eps:
            if len(self.weights) != 2 and bool(norms.any()):
                raise self._refuse()
            return w
        mean = scaled / mean_norm
        dots = (gram @ mean) / (norms + self.eps)
        tangent = scaled - float(w @ dots) * mean
        length = _norm(gram, tangent) + self.eps
        out = mean * math.cos(length) + tangent * (math.sin(length) / length)
        return out * float(norms @ w)

    def combine(self, coefficients: torch.Tensor, start: int, count: int) -> torch.Tensor:
        xs = [self.read(s, start, count) for s in self.sources]
        out = _weighted_sum(coefficients, self.vectors(xs))
        return out.add_(xs[-1]) if self.with_base else out


class Karcher(Spherical):
    """mergekit's karcher: terms (input, 1/N) for every input; the weighted Karcher mean of
    their directions on the unit sphere (at most scalars["max_iter"] steps of gradient
    descent, stopping below scalars["tol"]), scaled by the weighted mean of their norms."""

    def __init__(
        self, read: Read, tensor: TensorPlan, *, chunk: int,
        check_cancel: Callable[[], None] = lambda: None,
    ) -> None:  # fmt: skip
        super().__init__(read, tensor, chunk=chunk)
        self.check_cancel = check_cancel  # asked at each step: max_iter may be thousands
        self.alphas = [term.coefficient for term in tensor.terms]
        self.tol = self.scalars.get("tol", 1e-5)
        self.max_iter = int(self.scalars.get("max_iter", 10))

    def vectors(self, xs: Vectors) -> Vectors:
        return list(xs)

    def merge_whole(self, xs: Vectors) -> torch.Tensor:
        norms = [_wide_norm(x) for x in xs]
        units = [
            torch.zeros_like(x) if n.item() == 0.0 else (x / n).to(x.dtype)
            for x, n in zip(xs, norms, strict=True)
        ]
        valid = [i for i, n in enumerate(norms) if n.item() > self.tol]
        if not valid:  # every input (about) zero: zeros, as mergekit's sum of x·0
            return sum((x * 0 for x in xs), torch.zeros_like(xs[0]))
        total = sum(self.alphas[i] for i in valid)
        alphas = [self.alphas[i] / total for i in valid]
        points = [units[i] for i in valid]
        mean = torch.zeros_like(points[0])
        for alpha, unit in zip(alphas, points, strict=True):
            mean += alpha * unit
        mean_norm = _wide_norm(mean)
        if mean_norm.item() < self.tol:
            mean = points[0].clone()
        else:
            mean = (mean / mean_norm).to(mean.dtype)
        for _ in range(self.max_iter):
            self.check_cancel()
            mean, done = self._step(mean, alphas, points)
            if done:
                break
        scale = cast(torch.Tensor, sum(a * n for a, n in zip(self.alphas, norms, strict=True)))
        return scale * mean

    def _step(
        self, mean: torch.Tensor, alphas: list[float], points: Vectors
    ) -> tuple[torch.Tensor, bool]:
        """One step of the descent: the mean moved along the weighted log map of the points;
        done when that step is shorter than tol."""
        tangent = torch.zeros_like(mean)
        for alpha, unit in zip(alphas, points, strict=True):
            dot = torch.clamp(torch.dot(mean.flatten(), unit.flatten()), -1.0, 1.0)
            theta = torch.arccos(dot)
            if theta.item() < self.tol:
                continue
            tangent += alpha * (theta / torch.sin(theta)) * (unit - dot * mean)
        length = _wide_norm(tangent)
        if length.item() < self.tol:
            return mean, True
        moved = torch.cos(length) * mean + torch.sin(length) * (tangent / length)
        mean = moved.to(mean.dtype)
        unit_norm = _wide_norm(mean)
        if unit_norm.item() > self.tol:
            mean = (mean / unit_norm).to(mean.dtype)
        return mean, False

    def coefficients(self, gram: torch.Tensor) -> torch.Tensor:
        """The output as Σ kᵢ·xᵢ, the descent run on coefficients of the unit vectors."""
        norms = gram.diagonal().clamp_min(0.0).sqrt()
        valid = [i for i in range(len(norms)) if float(norms[i]) > self.tol]
        found = torch.zeros(len(norms), dtype=torch.float64)
        if not valid:
            return found
        index = torch.tensor(valid)
        inverse = 1.0 / norms[index]
        units = gram[index][:, index] * inverse[:, None] * inverse[None, :]
        alphas = torch.tensor([self.alphas[i] for i in valid], dtype=torch.float64)
        alphas = alphas / alphas.sum()
        mean = _descend(units, alphas, self.tol, self.max_iter)
        scale = float(torch.tensor(self.alphas, dtype=torch.float64) @ norms)
        found[index] = scale * mean * inverse
        return found

    def combine(self, coefficients: torch.Tensor, start: int, count: int) -> torch.Tensor:
        return _weighted_sum(coefficients, [self.read(s, start, count) for s in self.sources])


def _wide_norm(x: torch.Tensor) -> torch.Tensor:
    """‖x‖ as mergekit's karcher takes it: in float32 (float64 for float64) whatever x's dtype
    (bf16 where mergekit computes in it), while the vectors themselves stay in theirs."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    norm: torch.Tensor = torch.linalg.vector_norm(x.to(wide))
    return norm


def _descend(units: torch.Tensor, alphas: torch.Tensor, tol: float, steps: int) -> torch.Tensor:
    """Karcher.merge_whole's descent on c, the mean as Σ cᵢ·uᵢ, given the Gram matrix of the
    unit vectors uᵢ (float64)."""
    count = len(alphas)
    mean = alphas.clone()
    mean_norm = _norm(units, mean)
    mean = torch.eye(count, dtype=torch.float64)[0] if mean_norm < tol else mean / mean_norm
    for _ in range(steps):
        dots = (units @ mean).clamp(-1.0, 1.0)
        tangent = torch.zeros(count, dtype=torch.float64)
        for j in range(count):
            theta = math.acos(float(dots[j]))
            if theta < tol:
                continue
            toward = -float(dots[j]) * mean
            toward[j] += 1.0
            tangent += float(alphas[j]) * (theta / math.sin(theta)) * toward
        length = _norm(units, tangent)
        if length < tol:
            break
        mean = math.cos(length) * mean + math.sin(length) * (tangent / length)
        unit_norm = _norm(units, mean)
        if unit_norm > tol:
            mean = mean / unit_norm
    return mean
