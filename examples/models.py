"""Model factories for ``dasktrain train`` configs (``factory = "models.py:mlp"``).

A factory returns a fresh ``torch.nn.Module``. It is called once on the parameter holder,
whose parameters every worker then starts from, and once per worker. The file is sent to
the workers by value, so it should import only packages the workers have.
"""

from __future__ import annotations

import torch


def mlp(features: int = 64, hidden: int = 128, classes: int = 10, dropout: float = 0.0,
        seed: int = 0) -> torch.nn.Module:
    """A small multilayer perceptron: ``features`` -> ``hidden`` (ReLU) -> ``classes``
    logits. The defaults fit the bundled ``digits`` dataset (8x8 images, 10 classes)."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(features, hidden), torch.nn.ReLU()]
    if dropout:
        layers.append(torch.nn.Dropout(dropout))
    layers.append(torch.nn.Linear(hidden, classes))
    return torch.nn.Sequential(*layers)
