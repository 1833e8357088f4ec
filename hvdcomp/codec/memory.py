"""Error-feedback memory: what a worker did not send stays with it and is added to its next gradient."""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Per-tensor residuals, keyed by a stable tensor identity; updated in place (no per-step buffers)."""

    def __init__(self) -> None:
        self._residuals: dict[object, torch.Tensor] = {}

    def residual(self, key: object, like: torch.Tensor) -> torch.Tensor:
        """The residual for ``key`` (float32, flat, on ``like``'s device; zeros the first time)."""
        residual = self._residuals.get(key)
        if residual is None or residual.numel() != like.numel() or residual.device != like.device:
            residual = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
            self._residuals[key] = residual
        return residual

    def state_dict(self) -> dict[str, dict[object, torch.Tensor]]:
        return {"residuals": {key: value.clone() for key, value in self._residuals.items()}}

    def load_state_dict(self, state: dict[str, dict[object, torch.Tensor]]) -> None:
        self._residuals = {key: value.clone() for key, value in state["residuals"].items()}
