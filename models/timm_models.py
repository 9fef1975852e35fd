"""``--model timm:NAME``: a timm model checked with no factory.

Built tiny and random by timm's own ``create_model`` (the architecture's depth, width and
image size set small through the keyword arguments its constructor takes; dropout and
drop-path on), with a batch of 32-pixel images and class labels, and the classification
loss. The segments are the modules timm's own ``set_grad_checkpointing()`` checkpoints,
found by asking it: one forward with its checkpointing on, under a checkpoint function
that records the outermost modules each call runs. ``--impl timm`` then turns the
library's checkpointing on as its users do.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gradequiv.harness.errors import InvalidArgument
from gradequiv.models.library_import import import_library
from gradequiv.models.user_model import UserModel

__all__ = ["ARCHITECTURES", "checkpointed_modules", "timm_model"]

BATCH, IMAGE, CLASSES = 2, 32, 10

_VIT = {"img_size": IMAGE, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}

#: NAME -> the constructor arguments that make it tiny (timm's own names for them).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "vit_tiny_patch16_224": _VIT,
    "deit_tiny_patch16_224": _VIT,
    "convnext_atto": {"depths": (1, 1, 1, 1), "dims": (8, 16, 32, 64)},
    "resnet18": {"layers": (1, 1, 1, 1)},
}


def _classification_loss(outputs: Any, labels: Tensor) -> Tensor:
    return F.cross_entropy(outputs.float(), labels)


@contextlib.contextmanager
def _recording_checkpoint(model: nn.Module, seen: dict[str, None]) -> Iterator[None]:
    """torch's checkpoint, for the block, as a plain call that records the outermost
    modules each call runs (timm hands it a function over a run of modules, not a module)."""
    names = {id(m): name for name, m in model.named_modules()}
    depth = [0]  # module calls open now
    outer = [-1]  # the depth the checkpoint call is at (-1: outside one)

    def before(module: nn.Module, args: Any) -> None:
        if depth[0] == outer[0]:
            seen.setdefault(names.get(id(module), ""), None)
        depth[0] += 1

    def after(module: nn.Module, args: Any, output: Any) -> None:
        depth[0] -= 1

    def record(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        outer[0] = depth[0]
        try:
            return function(*args)
        finally:
            outer[0] = -1

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(before),
                                                    m.register_forward_hook(after))]
    original = torch.utils.checkpoint.checkpoint
    torch.utils.checkpoint.checkpoint = record
    try:
        yield
    finally:
        torch.utils.checkpoint.checkpoint = original
        for handle in handles:
            handle.remove()


def checkpointed_modules(model: nn.Module, images: Tensor) -> list[str]:
    """The dotted names of the modules ``model.set_grad_checkpointing()`` checkpoints: one
    forward with it on, under a checkpoint function that runs what it is handed plainly
    and records the modules; the library's checkpointing is off again afterwards."""
    seen: dict[str, None] = {}
    model.set_grad_checkpointing(True)  # type: ignore[operator]
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]), \
                _recording_checkpoint(model, seen):
            model(images)
    finally:
        model.set_grad_checkpointing(False)  # type: ignore[operator]
    return [name for name in seen if name]


def timm_model(name: str, seed: int) -> UserModel:
    """``timm:NAME``: timm's model ``NAME``, tiny, its classification loss, and the modules
    its own checkpointing wraps as segments."""
    timm = import_library("timm", "--model timm:...", "timm")
    if name not in ARCHITECTURES:
        listed = name in timm.list_models()
        known = ", ".join(ARCHITECTURES)
        what = "has no tiny configuration in gradequiv yet" if listed else \
            "is not a timm model name"
        raise InvalidArgument(
            f"--model='timm:{name}': {name} {what}; the timm route builds {known}; for "
            f"another, write a factory (docs/reference.md, 'Your own model')")
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = timm.create_model(name, pretrained=False, num_classes=CLASSES, drop_rate=0.1,
                                  drop_path_rate=0.1, **ARCHITECTURES[name])
    model.train()
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    segments = checkpointed_modules(model, images)
    if not segments:
        raise InvalidArgument(
            f"--model='timm:{name}': timm's set_grad_checkpointing() checkpoints no module "
            f"of it in a forward: there is nothing of its own to check")
    loss: Callable[[Any, Tensor], Tensor] = _classification_loss
    return UserModel(model, (images,), labels, loss, segments=segments,
                     regimes=("fp32", "bf16-autocast"))
