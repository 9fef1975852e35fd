"""What the harness runs: a reference model (or a user's) built from a seed, and its batch.

``build(model_config, batch_config, seed)`` returns a :class:`Workload`: the
model with freshly initialised weights, one fixed batch, and its loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gradequiv.harness.errors import InvalidArgument
from gradequiv.models.batchnorm import BatchNormConfig, BatchNormNet
from gradequiv.models.external import ExternalConfig, ExternalModel, seeded_user_model
from gradequiv.models.granularity import Granularity
from gradequiv.models.segments import RoutedModel, Segment
from gradequiv.models.transformer import Transformer, TransformerConfig

__all__ = ["BatchConfig", "ModelConfig", "Workload", "build", "make_batch"]

ModelConfig = TransformerConfig | BatchNormConfig | ExternalConfig


@dataclass(frozen=True)
class BatchConfig:
    batch_size: int = 2
    seq_len: int = 16  # tokens per sequence (the batchnorm model ignores it)
    padding: bool = True  # right-pad sequences to random lengths; the mask goes to every layer

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name}={value!r}: must be a whole number >= 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Workload:
    """What the harness needs: a model, one fixed batch, and how to score it.

    ``inputs`` are the positional arguments of ``model.forward``; float inputs
    that require grad get their gradient observed. ``loss_fn`` takes what the
    model returns (a tensor, or a tuple whose first element is the output).
    """

    model: RoutedModel
    inputs: tuple[Tensor | None, ...]
    targets: Tensor
    loss_fn: Callable[[Any, Tensor], Tensor]

    def segments(self, granularity: Granularity) -> list[Segment]:
        return self.model.segments(granularity)


def make_batch(
    config: TransformerConfig, batch: BatchConfig, seed: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Token ids, padding mask (True = real token) and targets, all from ``seed``.

    Padded positions hold token 0 and target -100 (ignored by the loss); every
    sequence keeps at least one real token.
    """
    if batch.seq_len > config.max_seq_len:
        raise InvalidArgument(
            f"seq_len={batch.seq_len} exceeds max_seq_len={config.max_seq_len}; "
            f"raise max_seq_len or lower seq_len"
        )
    gen = torch.Generator().manual_seed(seed)
    B, T = batch.batch_size, batch.seq_len
    stream = torch.randint(0, config.vocab_size, (B, T + 1), generator=gen)
    tokens, targets = stream[:, :-1].clone(), stream[:, 1:].clone()
    mask = None
    if batch.padding:
        lengths = torch.randint(1, T + 1, (B,), generator=gen)
        lengths[0] = T  # one full-length row keeps shapes honest
        mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
        tokens[~mask] = 0
        targets[~mask] = -100
        mask = mask.to(device)
    return tokens.to(device), mask, targets.to(device)


def _token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100
    )


def _token_and_aux_loss(outputs: tuple[Tensor, Tensor], targets: Tensor) -> Tensor:
    """The token loss plus the model's aux loss (``aux_loss``), so both outputs get a gradient."""
    logits, aux = outputs
    return _token_loss(logits, targets) + aux.float()


def build(
    model_config: ModelConfig,
    batch: BatchConfig,
    seed: int,
    device: torch.device | str = "cpu",
) -> Workload:
    """Initialise the model from ``seed`` and draw its fixed batch from ``seed`` too."""
    if isinstance(model_config, ExternalConfig):
        return _build_external(model_config, seed, device)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # weights are made on the CPU
        if isinstance(model_config, TransformerConfig):
            model: RoutedModel = Transformer(model_config)
        elif isinstance(model_config, BatchNormConfig):
            if batch.batch_size < 2:
                raise InvalidArgument(
                    f"batch_size={batch.batch_size}: BatchNorm needs at least 2 samples"
                )
            model = BatchNormNet(model_config)
        else:
            raise InvalidArgument(f"model config {model_config!r} is not a known model")
    model.to(device)
    if isinstance(model_config, TransformerConfig):
        tokens, mask, targets = make_batch(model_config, batch, seed, device)
        loss_fn = _token_and_aux_loss if model_config.aux_loss else _token_loss
        return Workload(model, (tokens, mask), targets, loss_fn)
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(batch.batch_size, model_config.width, generator=gen).to(device)
    labels = torch.randint(0, model_config.n_classes, (batch.batch_size,), generator=gen)
    return Workload(model, (features.requires_grad_(),), labels.to(device), F.cross_entropy)


def _build_external(config: ExternalConfig, seed: int, device: torch.device | str) -> Workload:
    """A user's model from its factory (``--model``); the factory decides the batch."""
    user = seeded_user_model(config, seed)
    # draws nothing: only routes segments; keyword inputs ride at the end of the inputs
    model = ExternalModel(user.model, user.segments, input_keys=list(user.keywords))
    model.to(device)
    inputs = tuple(t.to(device) if t is not None else None for t in user.flat_inputs())
    return Workload(model, inputs, user.targets.to(device), user.loss_fn)
