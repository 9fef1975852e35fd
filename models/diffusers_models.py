"""``--model diffusers:NAME``: a diffusers model checked with no factory.

Built tiny and random from the class's own constructor (two resolutions, 8 and 16
channels, one layer per block, attention where the architecture has it, dropout on
where it takes it), with a noised-sample batch (latents, timesteps, and text states or
class labels where the model is conditioned on them) and the denoising loss (the
output's mean squared error against the noise). The segments are the modules diffusers'
own ``enable_gradient_checkpointing()`` checkpoints, found by asking it: one forward with
a recording checkpointing function names every module handed to it. ``--impl diffusers``
then turns the library's checkpointing on as its users do.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gradequiv.harness.errors import InvalidArgument
from gradequiv.models.library_import import import_library
from gradequiv.models.user_model import UserModel

__all__ = ["ARCHITECTURES", "checkpointed_modules", "diffusers_model"]

BATCH, SIZE, TOKENS = 2, 8, 4

_UNET = {"sample_size": SIZE, "layers_per_block": 1, "block_out_channels": (8, 16),
         "norm_num_groups": 4}

#: NAME -> the tiny constructor arguments, and the conditioning its forward takes
#: ("" none, "text" encoder states, "class" class labels).
ARCHITECTURES: dict[str, tuple[dict[str, Any], str]] = {
    "UNet2DModel": (_UNET | {
        "in_channels": 3, "out_channels": 3, "dropout": 0.1, "attention_head_dim": 8,
        "down_block_types": ("DownBlock2D", "AttnDownBlock2D"),
        "up_block_types": ("AttnUpBlock2D", "UpBlock2D")}, ""),
    "UNet2DConditionModel": (_UNET | {
        "in_channels": 4, "out_channels": 4, "dropout": 0.1, "cross_attention_dim": 16,
        "attention_head_dim": 4,
        "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D")}, "text"),
    "DiTTransformer2DModel": ({
        "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4,
        "out_channels": 4, "num_layers": 2, "dropout": 0.1, "norm_num_groups": 4,
        "sample_size": SIZE, "patch_size": 2, "num_embeds_ada_norm": 10}, "class"),
}


def _batch(name: str, config: Any, conditioning: str, seed: int
           ) -> tuple[dict[str, Tensor | None], Tensor]:
    """A noised sample, its timesteps and conditioning, and the noise to predict."""
    gen = torch.Generator().manual_seed(seed)
    sample = torch.randn(BATCH, config.in_channels, SIZE, SIZE, generator=gen)
    noise = torch.randn(BATCH, config.out_channels, SIZE, SIZE, generator=gen)
    steps = torch.randint(0, 1000, (BATCH,), generator=gen)
    main = "hidden_states" if name.endswith("Transformer2DModel") else "sample"
    inputs: dict[str, Tensor | None] = {main: sample, "timestep": steps}
    if conditioning == "text":
        inputs["encoder_hidden_states"] = torch.randn(BATCH, TOKENS, config.cross_attention_dim,
                                                      generator=gen)
    elif conditioning == "class":
        inputs["class_labels"] = torch.randint(0, 10, (BATCH,), generator=gen)
    return inputs, noise


def _denoising_loss(outputs: Any, noise: Tensor) -> Tensor:
    return F.mse_loss(outputs.sample.float(), noise)


def checkpointed_modules(model: nn.Module, inputs: dict[str, Tensor | None]) -> list[str]:
    """The dotted names of the modules ``model.enable_gradient_checkpointing()`` checkpoints:
    one forward under a checkpointing function that records what it is handed and runs it
    plainly; the library's checkpointing is off again afterwards."""
    by_id = {id(m): name for name, m in model.named_modules()}
    seen: dict[str, None] = {}

    def record(module: nn.Module, *args: Any) -> Any:
        seen.setdefault(by_id.get(id(getattr(module, "__self__", module)), ""), None)
        return module(*args)

    model.enable_gradient_checkpointing(gradient_checkpointing_func=record)  # type: ignore[operator]
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            model(**inputs)
    finally:
        model.disable_gradient_checkpointing()  # type: ignore[operator]
    return [name for name in seen if name]


def diffusers_model(name: str, seed: int) -> UserModel:
    """``diffusers:NAME``: the diffusers class ``NAME``, tiny, its denoising loss, and the
    modules its own checkpointing wraps as segments."""
    diffusers = import_library("diffusers", "--model diffusers:...", "diffusers")
    if name not in ARCHITECTURES:
        cls = getattr(diffusers, name, None)
        known = ", ".join(ARCHITECTURES)
        what = ("is not a diffusers model class" if not isinstance(cls, type) else
                "has no tiny configuration in gradequiv yet")
        raise InvalidArgument(
            f"--model='diffusers:{name}': {name} {what}; the diffusers route builds {known}; "
            f"for another, write a factory (docs/reference.md, 'Your own model')")
    knobs, conditioning = ARCHITECTURES[name]
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(diffusers, name)(**knobs)
    model.train()
    inputs, noise = _batch(name, model.config, conditioning, seed)
    segments = checkpointed_modules(model, inputs)
    if not segments:
        raise InvalidArgument(
            f"--model='diffusers:{name}': diffusers' enable_gradient_checkpointing() "
            f"checkpoints no module of it in a forward: there is nothing of its own to check")
    loss: Callable[[Any, Tensor], Tensor] = _denoising_loss
    return UserModel(model, inputs, noise, loss, segments=segments,
                     regimes=("fp32", "bf16-autocast"))
